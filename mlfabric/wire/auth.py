"""Authentication of data-plane connections between daemons (docs/security.md).

:class:`DataPlaneAuth` runs once per TCP connection, before the first frame, in one of three
modes:

``none``
    No handshake (the default, as before authentication existed).
``hmac``
    A challenge/response over the cluster's shared secret ``K`` (``dataplane.secret``)::

        client -> server  "MLFA" 0x01 | len(host) host_c | nonce_c (32 random bytes)
        server -> client  "MLFA" 0x00 | nonce_s | len host_s | HMAC-SHA256(K, "server" | T)
        client -> server  HMAC-SHA256(K, "client" | T)
        server -> client  0x00 (welcome) | 0x01 len reason (refused, then closed)

    where ``T = nonce_c | nonce_s | len host_c | len host_s``. Each side proves it holds ``K``
    on a transcript with the other side's fresh nonce (no replay) and the claimed host names
    (a name cannot be changed in transit). Payloads then travel in the clear, with
    ``sendfile`` (zero copy). Every holder of ``K`` can claim any host name: the secret
    authenticates membership of the cluster, not which member (docs/security.md).
``tls``
    Mutual TLS with the hosts' certificates (:mod:`mlfabric.wire.tls`): encrypted, and the
    peer's host is its certificate's name. Payloads are copied through the TLS layer (no
    ``sendfile``).

:meth:`DataPlaneAuth.accept` (listener) returns the socket to use and the names the peer has
proved; the listener then refuses frames whose ``src_host`` is not one of them (a daemon may
speak only for its own host). Failures raise :class:`AuthFailed` naming why.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import secrets
import socket
import ssl
import struct
from dataclasses import dataclass, field
from pathlib import Path

from mlfabric.wire.tls import TlsFiles, cert_names, client_context, server_context

__all__ = [
    "MODES",
    "AuthFailed",
    "DataPlaneAuth",
    "beyond_loopback",
    "load_secret",
    "unauthenticated_warning",
]

#: data-plane authentication modes
MODES = ("none", "hmac", "tls")
MAGIC = b"MLFA"
VERSION = 1
NONCE = 32
_MAC = hashlib.sha256().digest_size
#: the first bytes of a data-plane frame (``mlfabric.daemon.channels.frames.MAGIC``): a peer that
#: sends them speaks frames without authenticating
_FRAME_MAGIC = b"MLF1"


def beyond_loopback(address: str) -> bool:
    """Whether ``"host:port"`` may be reached from other machines (not a loopback address).

    Examples
    --------
    >>> addresses = ("127.0.0.1:0", "[::1]:7077", "localhost:1", "0.0.0.0:7078", "10.0.0.5:1")
    >>> [beyond_loopback(a) for a in addresses]
    [False, False, False, True, True]
    """
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name (or "" for every interface): reachable as far as we know
        return True


def unauthenticated_warning(what: str, address: str, turn_on: str) -> str | None:
    """The warning for ``what`` at ``address`` without authentication, if it reaches beyond loopback.

    Authentication is off by default (a laptop demo on loopback needs none); on an address
    other machines can reach, anyone who reaches it can act as a daemon (docs/security.md).

    Examples
    --------
    >>> unauthenticated_warning("data plane", "127.0.0.1:0", "data_auth") is None
    True
    >>> unauthenticated_warning("data plane", "0.0.0.0:7078", "data_auth").split(":")[0]
    'data plane on 0.0.0.0'
    """
    if not beyond_loopback(address):
        return None
    return (
        f"{what} on {address} without authentication: anyone who reaches it is trusted as a cluster "
        f"member (turn on {turn_on}; docs/security.md)"
    )


class AuthFailed(ConnectionError):
    """A data-plane connection that did not authenticate; ``reason`` says why.

    ``speaks_frames`` is True when the peer sent a data-plane frame instead of a handshake
    (an unauthenticated daemon): it understands an ERROR frame.
    """

    def __init__(self, reason: str, *, speaks_frames: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.speaks_frames = speaks_frames


def load_secret(path: str) -> bytes:
    """The shared secret in ``path`` (hex, as ``mlfabric certs`` writes it; at least 16 bytes).

    Raises
    ------
    ValueError
        The file cannot be read or holds no usable secret (the message names the file).
    """
    try:
        text = Path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"data_secret {path}: cannot read: {exc}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"data_secret {path}: not hex") from None
    if len(key) < 16:
        raise ValueError(f"data_secret {path}: {len(key)} bytes, need at least 16")
    return key


def _recv(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthFailed(f"peer closed during the handshake ({what}: {len(buf)} of {n} bytes)")
        buf += chunk
    return bytes(buf)


def _name_field(name: str) -> bytes:
    raw = name.encode()
    if not raw or len(raw) > 255:
        raise AuthFailed(f"bad host name {name!r} (1..255 bytes)")
    return bytes([len(raw)]) + raw


def _mac(key: bytes, role: bytes, nonce_c: bytes, nonce_s: bytes, host_c: str, host_s: str) -> bytes:
    transcript = (
        b"mlfabric-dataplane-v1 " + role + nonce_c + nonce_s + _name_field(host_c) + _name_field(host_s)
    )
    return hmac.new(key, transcript, hashlib.sha256).digest()


@dataclass(frozen=True)
class DataPlaneAuth:
    """How this daemon's data-plane connections authenticate.

    Parameters
    ----------
    mode : str
        ``none``, ``hmac`` or ``tls`` (see the module docstring).
    host : str
        This daemon's host name (claimed in the handshake).
    secret : bytes, optional
        The shared secret (``hmac``).
    tls : TlsFiles, optional
        This host's certificate, key and the CA (``tls``).
    timeout : float
        Seconds the whole handshake may take.

    Examples
    --------
    >>> DataPlaneAuth("none", "h0").enabled
    False
    >>> DataPlaneAuth("hmac", "h0")
    Traceback (most recent call last):
    ...
    ValueError: data_auth = 'hmac' needs data_secret (the shared secret file)
    """

    mode: str
    host: str
    secret: bytes | None = None
    tls: TlsFiles | None = None
    timeout: float = 10.0
    _server_ctx: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)
    _client_ctx: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"data_auth: unknown mode {self.mode!r} (modes: {', '.join(MODES)})")
        if self.mode == "hmac" and not self.secret:
            raise ValueError("data_auth = 'hmac' needs data_secret (the shared secret file)")
        if self.mode == "tls":
            if self.tls is None:
                raise ValueError("data_auth = 'tls' needs tls_ca, tls_cert and tls_key")
            object.__setattr__(self, "_server_ctx", server_context(self.tls))
            object.__setattr__(self, "_client_ctx", client_context(self.tls))

    @property
    def enabled(self) -> bool:
        """Whether connections authenticate at all."""
        return self.mode != "none"

    def accept(self, sock: socket.socket) -> tuple[socket.socket, frozenset[str]]:
        """Authenticate an accepted connection (listener side).

        Returns
        -------
        (socket, frozenset of str)
            The socket to carry frames on (a TLS one for ``tls``) and the host names the peer
            proved (empty for ``none``: anything goes).

        Raises
        ------
        AuthFailed
            The peer did not authenticate; the caller closes ``sock`` (an ERROR frame first when
            ``speaks_frames``).
        """
        if self.mode == "none":
            return sock, frozenset()
        previous = sock.gettimeout()
        sock.settimeout(self.timeout)
        try:
            if self.mode == "tls":
                return self._accept_tls(sock, previous)
            names = self._accept_hmac(sock)
        except (TimeoutError, OSError) as exc:
            if isinstance(exc, AuthFailed):
                raise
            raise AuthFailed(f"handshake failed: {exc!r}") from None
        sock.settimeout(previous)
        return sock, names

    def connect(self, sock: socket.socket) -> socket.socket:
        """Authenticate a connection this daemon opened (sender side); the socket to use.

        Raises
        ------
        AuthFailed
            The peer refused this daemon or did not prove it belongs to the cluster.
        """
        if self.mode == "none":
            return sock
        previous = sock.gettimeout()
        sock.settimeout(self.timeout)
        try:
            if self.mode == "tls":
                assert self._client_ctx is not None
                ctx = self._client_ctx
                sock = ctx.wrap_socket(sock)
            else:
                self._connect_hmac(sock)
        except AuthFailed:
            raise
        except (TimeoutError, OSError) as exc:  # ssl.SSLError is an OSError
            raise AuthFailed(f"handshake failed: {exc!r}") from None
        sock.settimeout(previous)
        return sock

    # ------------------------------------------------------------------ the modes

    def _accept_tls(
        self, sock: socket.socket, previous: float | None
    ) -> tuple[socket.socket, frozenset[str]]:
        ctx = self._server_ctx
        assert ctx is not None
        head = sock.recv(4, socket.MSG_PEEK)
        if head == _FRAME_MAGIC:
            raise AuthFailed("the peer sent a frame without a TLS handshake", speaks_frames=True)
        tls = ctx.wrap_socket(sock, server_side=True)
        names = cert_names(tls.getpeercert())
        if not names:
            tls.close()
            raise AuthFailed("the peer's certificate names no host")
        tls.settimeout(previous)
        return tls, names

    def _accept_hmac(self, sock: socket.socket) -> frozenset[str]:
        assert self.secret is not None
        head = _recv(sock, 6, "hello")
        if head[:4] == _FRAME_MAGIC:
            raise AuthFailed("the peer sent a frame without authenticating", speaks_frames=True)
        if head[:4] != MAGIC:
            raise AuthFailed(f"not a data-plane handshake (first bytes {head[:4]!r})")
        if head[4] != VERSION:
            raise AuthFailed(f"handshake version {head[4]} (this daemon speaks {VERSION})")
        claimed = _recv(sock, head[5], "host name").decode("utf-8", "replace")
        nonce_c = _recv(sock, NONCE, "nonce")
        nonce_s = secrets.token_bytes(NONCE)
        sock.sendall(
            MAGIC
            + b"\x00"
            + nonce_s
            + _name_field(self.host)
            + _mac(self.secret, b"server", nonce_c, nonce_s, claimed, self.host)
        )
        proof = _recv(sock, _MAC, "proof")
        if not hmac.compare_digest(proof, _mac(self.secret, b"client", nonce_c, nonce_s, claimed, self.host)):
            self._refuse(sock, f"bad HMAC proof from a peer claiming host {claimed!r} (wrong data_secret?)")
        sock.sendall(b"\x00")
        return frozenset({claimed})

    def _refuse(self, sock: socket.socket, reason: str) -> None:
        raw = reason.encode()[:65535]
        with contextlib.suppress(OSError):  # the peer is gone; the caller logs the reason all the same
            sock.sendall(b"\x01" + struct.pack("!H", len(raw)) + raw)
        raise AuthFailed(reason)

    def _connect_hmac(self, sock: socket.socket) -> None:
        assert self.secret is not None
        nonce_c = secrets.token_bytes(NONCE)
        sock.sendall(MAGIC + bytes([VERSION]) + _name_field(self.host) + nonce_c)
        head = _recv(sock, 5, "reply")
        if head[:4] == _FRAME_MAGIC:
            raise AuthFailed("the peer does not authenticate its data plane (data_auth = 'none' there)")
        if head[:4] != MAGIC or head[4] != 0:
            raise AuthFailed(f"not a data-plane handshake reply (first bytes {head!r})")
        nonce_s = _recv(sock, NONCE, "nonce")
        server = _recv(sock, _recv(sock, 1, "name length")[0], "host name").decode("utf-8", "replace")
        proof = _recv(sock, _MAC, "proof")
        if not hmac.compare_digest(proof, _mac(self.secret, b"server", nonce_c, nonce_s, self.host, server)):
            raise AuthFailed(f"peer claiming host {server!r} failed its HMAC proof (wrong data_secret?)")
        sock.sendall(_mac(self.secret, b"client", nonce_c, nonce_s, self.host, server))
        verdict = _recv(sock, 1, "verdict")
        if verdict != b"\x00":
            (n,) = struct.unpack("!H", _recv(sock, 2, "reason length"))
            raise AuthFailed(
                f"refused by peer {server!r}: {_recv(sock, n, 'reason').decode('utf-8', 'replace')}"
            )
