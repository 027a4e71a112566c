"""TLS material of a cluster: gRPC credentials for the control plane, ``ssl`` contexts for the
data plane, and the names a peer's certificate proves (docs/security.md).

Every process is given three PEM files: the cluster's CA certificate, its own certificate and
its own key (``mlfabric certs`` makes a test set). Both ends of every connection present a
certificate signed by the CA (mutual TLS); a host's certificate names the host (CN and a DNS
subject alternative name), so the scheduler and the data plane can check that a daemon speaks
only for its own host (:func:`cert_names`, :func:`auth_context_names`).

Only the standard library and gRPC are used here; making certificates needs the optional
``cryptography`` package (:mod:`mlfabric.certs`).
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "TlsError",
    "TlsFiles",
    "add_client_arguments",
    "auth_context_names",
    "cert_names",
    "channel_credentials",
    "client_channel",
    "client_context",
    "client_error",
    "grpc_channel",
    "server_context",
    "server_credentials",
    "speaks_tls",
]


class TlsError(ValueError):
    """TLS settings that cannot be used (a missing file, a half-configured set); names the file."""


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of one process: the CA, its certificate and its key.

    Parameters
    ----------
    ca, cert, key : str
        Paths of the CA certificate, this process's certificate chain and its private key.

    Examples
    --------
    >>> TlsFiles.from_options(None, None, None) is None
    True
    >>> TlsFiles.from_options("ca.pem", None, None)
    Traceback (most recent call last):
    ...
    mlfabric.wire.tls.TlsError: TLS needs all of tls_ca, tls_cert and tls_key; missing: tls_cert, tls_key
    """

    ca: str
    cert: str
    key: str

    @classmethod
    def from_options(cls, ca: str | None, cert: str | None, key: str | None) -> TlsFiles | None:
        """The files of the ``tls_ca``/``tls_cert``/``tls_key`` options; None when none is set.

        Raises
        ------
        TlsError
            Some but not all are set.
        """
        given = {"tls_ca": ca, "tls_cert": cert, "tls_key": key}
        if not any(given.values()):
            return None
        missing = [k for k, v in given.items() if not v]
        if missing:
            raise TlsError(f"TLS needs all of tls_ca, tls_cert and tls_key; missing: {', '.join(missing)}")
        assert ca and cert and key
        return cls(ca, cert, key)

    def read(self) -> tuple[bytes, bytes, bytes]:
        """The CA, certificate and key bytes.

        Raises
        ------
        TlsError
            A file cannot be read (the message names it).
        """
        out = []
        for what, path in (("tls_ca", self.ca), ("tls_cert", self.cert), ("tls_key", self.key)):
            try:
                out.append(Path(path).read_bytes())
            except OSError as exc:
                raise TlsError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None
        return out[0], out[1], out[2]


# ------------------------------------------------------------------ gRPC (control plane)


def server_credentials(files: TlsFiles) -> Any:
    """gRPC server credentials requiring a client certificate signed by the CA (mTLS)."""
    import grpc

    ca, cert, key = files.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(files: TlsFiles) -> Any:
    """gRPC channel credentials: trust the CA, present this process's certificate."""
    import grpc

    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def grpc_channel(
    target: str,
    files: TlsFiles | None,
    server_name: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> Any:
    """A gRPC channel to ``target``: insecure without ``files``, else mTLS.

    Parameters
    ----------
    target : str
        ``host:port``.
    files : TlsFiles or None
        This process's TLS files (None: plaintext, as without authentication).
    server_name : str, optional
        The name the scheduler's certificate must carry (default: the host part of ``target``).
    options : sequence
        More channel options (keepalive).
    """
    import grpc

    opts = list(options)
    if files is None:
        return grpc.insecure_channel(target, options=opts)
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(target, channel_credentials(files), options=opts)


def auth_context_names(auth_context: Mapping[str, Sequence[bytes]]) -> frozenset[str]:
    """The names a gRPC peer's verified certificate carries (its CN and subject alternative names).

    Examples
    --------
    >>> sorted(auth_context_names({"x509_common_name": [b"h0"],
    ...                            "x509_subject_alternative_name": [b"h0", b"h0.lan"]}))
    ['h0', 'h0.lan']
    >>> auth_context_names({"transport_security_type": [b"insecure"]})
    frozenset()
    """
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names.update(v.decode("utf-8", "replace") for v in auth_context.get(key, ()))
    return frozenset(names)


# ------------------------------------------------------------------ ssl (data plane)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """An ``ssl`` server context requiring a client certificate signed by the CA.

    No TLS 1.3 session tickets are sent: a ticket arriving on an idle pooled connection would
    look like stray input and get the connection discarded (``Connection.is_stale``).

    Raises
    ------
    TlsError
        A file is missing or not a usable certificate/key.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.num_tickets = 0
    _load(ctx, files)
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """An ``ssl`` client context: verify the peer against the CA, present this host's certificate.

    Peers are reached by address, so the peer's name is not matched against the address here;
    who the peer is comes from its certificate (:func:`cert_names`), signed by the cluster's CA.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load(ctx, files)
    return ctx


def _load(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    for what, path in (("tls_ca", files.ca), ("tls_cert", files.cert), ("tls_key", files.key)):
        if not Path(path).is_file():
            raise TlsError(f"{what} {path}: no such file")
    try:
        ctx.load_verify_locations(cafile=files.ca)
        ctx.load_cert_chain(files.cert, files.key)
    except ssl.SSLError as exc:
        raise TlsError(f"tls_cert {files.cert} / tls_key {files.key} / tls_ca {files.ca}: {exc}") from None


def cert_names(cert: Mapping[str, Any] | None) -> frozenset[str]:
    """The names of a verified peer certificate (``SSLSocket.getpeercert()``): CN and DNS SANs.

    Examples
    --------
    >>> cert = {"subject": ((("commonName", "h1"),),), "subjectAltName": (("DNS", "h1"),)}
    >>> sorted(cert_names(cert))
    ['h1']
    >>> cert_names(None)
    frozenset()
    """
    if not cert:
        return frozenset()
    names = {v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"}
    names.update(v for k, v in cert.get("subjectAltName", ()) if k in ("DNS", "IP Address"))
    return frozenset(names)


def add_client_arguments(parser: Any) -> None:
    """``--tls-ca/--tls-cert/--tls-key/--tls-server-name`` of a command that asks the scheduler
    (``mlfabric status``, ``mlfabric trace``): a scheduler serving mTLS needs a client
    certificate signed by its CA (``mlfabric certs`` writes ``admin.pem``/``admin.key``)."""
    group = parser.add_argument_group("TLS (a scheduler serving mTLS)")
    group.add_argument("--tls-ca", metavar="PEM", help="the cluster's CA certificate")
    group.add_argument("--tls-cert", metavar="PEM", help="a client certificate signed by it (e.g. admin.pem)")
    group.add_argument("--tls-key", metavar="PEM", help="its private key")
    group.add_argument(
        "--tls-server-name", metavar="NAME", help="the scheduler certificate's name (default: its address)"
    )


def client_channel(args: Any) -> Any:
    """The gRPC channel to ``args.scheduler`` of :func:`add_client_arguments`' options.

    Raises
    ------
    TlsError
        Half the TLS options given, or a file that cannot be read.
    """
    files = TlsFiles.from_options(args.tls_ca, args.tls_cert, args.tls_key)
    return grpc_channel(args.scheduler, files, args.tls_server_name)


def speaks_tls(address: str, timeout: float = 5.0) -> bool:
    """Whether the server at ``host:port`` answers a TLS handshake (a scheduler serving mTLS).

    Nothing is verified: this only tells a plaintext client why the server closed its
    connection. A TLS 1.3 server completes the client's side of the handshake before it asks
    for the client's certificate, or answers with an alert; a plaintext HTTP/2 server does neither.

    Examples
    --------
    >>> speaks_tls("127.0.0.1:1", timeout=1.0)    # nothing listens there
    False
    """
    import socket

    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock,
            ctx.wrap_socket(sock) as tls,
        ):
            tls.do_handshake()
    except ssl.SSLError as exc:
        return "ALERT" in (exc.reason or "")
    except (OSError, ValueError):
        return False
    return True


def client_error(command: str, args: Any, exc: Any) -> str:
    """The message of a failed call of ``command`` (``status``, ``trace``) to ``args.scheduler``.

    Names the scheduler and the gRPC status; when the command gave no certificate and the
    scheduler serves TLS (it closes plaintext connections: "Socket closed"), says so and which
    options to give.
    """
    import grpc

    message = f"mlfabric {command}: error: scheduler {args.scheduler}: {exc.code().name}: {exc.details()}"
    plaintext = not (args.tls_ca or args.tls_cert or args.tls_key)
    if plaintext and exc.code() == grpc.StatusCode.UNAVAILABLE and speaks_tls(args.scheduler):
        message += (
            f"\nthe scheduler serves mutual TLS: it needs a client certificate; give --tls-ca, --tls-cert "
            f"and --tls-key (the admin.pem/admin.key of mlfabric certs; mlfabric {command} --help)"
        )
    return message
