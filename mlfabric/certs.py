"""``mlfabric certs``: a test CA, host and scheduler certificates, and the data plane's secret.

Writes, under ``--out DIR``::

    ca.pem, ca.key                    the cluster's CA (keep ca.key off the hosts)
    <host>.pem, <host>.key            one per --hosts name: CN and DNS SAN = the host name
    <scheduler>.pem, <scheduler>.key  the scheduler's (SANs: --scheduler names; an IP gets an IP SAN)
    admin.pem, admin.key              a client certificate for ``mlfabric status``/``trace``
    dataplane.secret                  32 random bytes, hex: the data plane's HMAC secret

Keys are ECDSA P-256, certificates valid ``--days`` (default 365); key and secret files are
mode 0600. Existing files are not overwritten unless ``--force``. Needs the optional
``cryptography`` package (``pip install 'mlfabric[auth]'``); nothing else in mlfabric does.
See docs/security.md for what each file is for and how to rotate them.

Example::

    mlfabric certs --out /etc/mlfabric/tls --hosts h0,h1,h2 --scheduler sched.lan,10.0.0.1
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
import sys
from pathlib import Path
from typing import Any

__all__ = ["configure", "make_certs", "require_cryptography", "run"]

#: the extra that brings ``cryptography``
EXTRA = "auth"


def require_cryptography() -> Any:
    """The ``cryptography`` package, or ImportError naming the extra that installs it."""
    try:
        import cryptography
    except ImportError as exc:
        raise ImportError(
            f"mlfabric certs needs the 'cryptography' package: pip install 'mlfabric[{EXTRA}]' ({exc})"
        ) from None
    return cryptography


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``mlfabric certs`` arguments to ``parser``."""
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write into (created)")
    parser.add_argument("--hosts", required=True, metavar="H0,H1,...", help="host names, as in the topology")
    parser.add_argument(
        "--scheduler",
        default="mlfabric-scheduler",
        metavar="NAME[,NAME...]",
        help="the scheduler's names: the first is its CN and file name; DNS names or IPs the daemons "
        "dial (default mlfabric-scheduler)",
    )
    parser.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "mlfabric"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _sans(names: list[str]) -> Any:
    from cryptography import x509

    out: list[Any] = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def _write(path: Path, data: bytes, private: bool, force: bool) -> None:
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists (use --force to overwrite)")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_certs(
    out: str | Path, hosts: list[str], scheduler: list[str], days: int = 365, force: bool = False
) -> list[Path]:
    """Write the CA, the host, scheduler and admin certificates and the data-plane secret.

    Parameters
    ----------
    out : path
        Directory (created).
    hosts : list of str
        Host names (each gets ``<host>.pem``/``<host>.key``).
    scheduler : list of str
        The scheduler's names; the first names its files.
    days : int
        Validity.
    force : bool
        Overwrite existing files.

    Returns
    -------
    list of Path
        The files written.

    Raises
    ------
    ImportError
        ``cryptography`` is not installed (names the extra).
    ValueError
        No hosts, a bad name, or a name used twice.
    FileExistsError
        A file exists and ``force`` is False.
    """
    require_cryptography()
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if not hosts:
        raise ValueError("--hosts names no host")
    if not scheduler:
        raise ValueError("--scheduler names nothing")
    subjects = [*hosts, scheduler[0], "admin", "ca"]
    for n in subjects:
        if not n or "/" in n or n.startswith("."):
            raise ValueError(f"bad certificate name {n!r}")
    if len(set(subjects)) != len(subjects):
        raise ValueError(f"names must differ from each other and from 'admin' and 'ca': {subjects}")
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))
    pem = serialization.Encoding.PEM
    key_format = (serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_key = _key()
    ca_name = _name("mlfabric test CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    written: list[Path] = []

    def save(stem: str, cert: Any, key: Any) -> None:
        for suffix, data, private in (
            (".pem", cert.public_bytes(pem), False),
            (".key", key.private_bytes(pem, *key_format), True),
        ):
            path = directory / f"{stem}{suffix}"
            _write(path, data, private, force)
            written.append(path)

    save("ca", ca, ca_key)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    for cn, names in [*((h, [h]) for h in hosts), (scheduler[0], scheduler), ("admin", ["admin"])]:
        key = _key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(validity[0])
            .not_valid_after(validity[1])
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_sans(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        save(cn, cert, key)
    secret = directory / "dataplane.secret"
    _write(secret, (secrets.token_hex(32) + "\n").encode(), True, force)
    written.append(secret)
    return written


def run(args: argparse.Namespace) -> int:
    """Write the files; 0 on success, 1 on an error (named), 2 on bad arguments."""
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    scheduler = [s.strip() for s in args.scheduler.split(",") if s.strip()]
    if args.days < 1:
        print(f"mlfabric certs: error: --days must be >= 1, got {args.days}", file=sys.stderr)
        return 2
    try:
        written = make_certs(args.out, hosts, scheduler, args.days, args.force)
    except (ImportError, ValueError, OSError) as exc:
        print(f"mlfabric certs: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, ImportError | OSError) else 2
    for path in written:
        print(path)
    return 0
