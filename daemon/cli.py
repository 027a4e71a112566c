"""Run a host daemon (one per host): the local API for training processes, the data plane
for peer daemons and the control stream to the scheduler (DESIGN §3).

Once the scheduler has welcomed it, the daemon writes ``--ready-file`` (JSON
``{"pid", "socket", "data_address", "host"}``, atomically). SIGTERM or SIGINT stops it
cleanly (exit 0): no new process is accepted, transfers under way get 2 s to bring their
verdicts (then they are cut: UNKNOWN where the update may have arrived), pushes never sent
resolve DROPPED with the reason, and only then are the training processes disconnected. With
``--report-file`` every transfer report the daemon sends to the scheduler is also appended
to that file as one JSON line, flushed per line.

Example::

    mlfabric daemon --host w0 --scheduler 127.0.0.1:7000 --socket /tmp/w0.sock \\
        --data-listen 127.0.0.1:0 --ready-file /tmp/w0.json
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

from mlfabric.config import add_config_argument
from mlfabric.readyfile import write_ready_file

__all__ = ["configure", "host_nic_rates", "run"]

_LOG = logging.getLogger("mlfabric.daemon")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``mlfabric daemon`` arguments to ``parser``."""
    parser.add_argument(
        "--host", help="this host's name in the scheduler's bandwidth graph (required: here or in --config)"
    )
    parser.add_argument(
        "--scheduler", metavar="HOST:PORT", help="the scheduler's address (required: here or in --config)"
    )
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="local API Unix socket (default: $MLFABRIC_DAEMON, else $TMPDIR/mlfabric-<uid>/daemon.sock, "
        "where training processes look for it)",
    )
    parser.add_argument(
        "--data-listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="data-plane listen address (port 0: any)",
    )
    parser.add_argument("--topology", metavar="FILE", help="topology TOML (for --enforce-nic-rates)")
    parser.add_argument(
        "--enforce-nic-rates",
        action="store_true",
        help="shape this daemon's data-plane traffic to its host's NIC rates in --topology (token buckets)",
    )
    parser.add_argument(
        "--ready-file", metavar="FILE", help="write JSON {pid, socket, data_address} here once registered"
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the scheduler's welcome (default 30)",
    )
    parser.add_argument(
        "--send-attempts", type=int, default=3, help="tries per transfer before DROPPED (default 3)"
    )
    parser.add_argument(
        "--report-file",
        metavar="PATH",
        help="append every transfer report sent to the scheduler here, one JSON object per line "
        "(update_id, src_host, dst_host, bytes, start, end, throughput, ok, error, outcome, delay, "
        "server_version, reason); off by default",
    )
    parser.add_argument(
        "--aggregator",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="whether this host may be an aggregator hop, summing other workers' updates (default: yes)",
    )
    parser.add_argument(
        "--round-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a synchronous round of a server on this host is applied with the updates it has this "
        "long after its first arrived (default 60)",
    )
    parser.add_argument(
        "--push-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="the push deadline: a push that got no directive from the scheduler this long after it "
        "was accepted resolves DROPPED naming the deadline; one held for an aggregate's verdict this "
        "long after it was held resolves UNKNOWN (DROPPED if it never reached the aggregator) (default 60)",
    )
    parser.add_argument(
        "--metrics-port", type=int, metavar="P", help="serve Prometheus /metrics on port P (0: any free port)"
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="close a peer's data-plane connection idle this long between frames, and a local "
        "connection that sent no message this long after connecting (0: never; default 120)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection whose data-plane frame header (or local message) is not complete "
        "this long after its first byte, e.g. one sent byte by byte (0: no limit; default 10)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        metavar="N",
        help="connections served at once on the data plane and on the local socket, each; one more "
        "is answered with an error naming the limit and closed (0: no limit; default 1024)",
    )
    parser.add_argument(
        "--fallback-after",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="when the scheduler is unreachable this long, send waiting and new pushes directly to "
        "their servers (plain fair sharing; tau_max still enforced by the server) until it is back "
        "(negative: never, pushes waiting for a lost scheduler resolve DROPPED; default 2)",
    )
    parser.add_argument(
        "--max-inflight-bytes",
        type=int,
        default=2 << 30,
        metavar="BYTES",
        help="payload bytes of pushes held, and of payloads received, at once (each); a push or a "
        "receive beyond it waits, a single larger payload is refused (default 2147483648)",
    )
    add_auth_arguments(parser)
    add_config_argument(parser, "daemon")


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    """The daemon's authentication options (docs/security.md); all off by default."""
    auth = parser.add_argument_group("authentication (docs/security.md; off by default)")
    auth.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="the cluster's CA certificate; with --tls-cert/--tls-key the control stream is mTLS",
    )
    auth.add_argument("--tls-cert", metavar="PEM", help="this host's certificate (its CN/SAN: --host)")
    auth.add_argument("--tls-key", metavar="PEM", help="this host's private key")
    auth.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="name the scheduler's certificate carries (default: the host of --scheduler)",
    )
    auth.add_argument(
        "--data-auth",
        choices=("none", "hmac", "tls"),
        default="none",
        help="data-plane connections: none (default), hmac (challenge/response over "
        "--data-secret; payloads in the clear, zero copy) or tls (mTLS with the host "
        "certificates; encrypted, no sendfile)",
    )
    auth.add_argument("--data-secret", metavar="FILE", help="the data plane's shared secret (hex), for hmac")
    auth.add_argument(
        "--local-peer-check",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="admit local clients only if their uid is this daemon's or root, or they "
        "are in --local-group (SO_PEERCRED; default: no check)",
    )
    auth.add_argument("--local-group", metavar="GROUP", help="group allowed on the local socket")


def auth_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``DaemonConfig`` fields of the authentication options.

    Raises
    ------
    ValueError
        Half-configured TLS, an unreadable file, a missing secret or an unknown group (named).
    """
    from mlfabric.wire.auth import DataPlaneAuth, load_secret
    from mlfabric.wire.peercred import LocalAccess
    from mlfabric.wire.tls import TlsFiles

    tls = TlsFiles.from_options(args.tls_ca, args.tls_cert, args.tls_key)
    if tls is not None:
        tls.read()  # a missing file fails here, named, not at the first connection
    secret = load_secret(args.data_secret) if args.data_secret else None
    data_auth = DataPlaneAuth(args.data_auth, args.host, secret, tls if args.data_auth == "tls" else None)
    if args.local_group and not args.local_peer_check:
        raise ValueError("local_group is set but local_peer_check is off (turn it on to check local clients)")
    access = LocalAccess.for_group(args.local_group) if args.local_peer_check else None
    return {
        "tls": tls,
        "tls_server_name": args.tls_server_name,
        "data_auth": data_auth,
        "local_access": access,
    }


def host_nic_rates(topology_path: str, host: str) -> tuple[float, float]:
    """The host's egress and ingress rates in bytes per second, from a topology file.

    Parameters
    ----------
    topology_path : str
        Topology TOML (see :mod:`mlfabric.scheduler.core.graph`).
    host : str
        A host of the topology.

    Returns
    -------
    egress, ingress : float
        Sum of the capacities of the host's outgoing and incoming links.

    Raises
    ------
    ValueError
        The host is not in the topology or has no links.
    """
    from mlfabric.scheduler.core.graph import load_topology

    graph = load_topology(topology_path)
    if host not in graph:
        raise ValueError(f"host {host!r} is not in topology {topology_path}")
    egress = sum(float(d["capacity"]) for _, _, d in graph.out_edges(host, data=True))
    ingress = sum(float(d["capacity"]) for _, _, d in graph.in_edges(host, data=True))
    if egress <= 0 or ingress <= 0:
        raise ValueError(f"host {host!r} has no links in topology {topology_path}")
    return egress, ingress


def unauthenticated_warnings(config: Any) -> list[str]:
    """What a daemon with ``config`` exposes without authentication beyond loopback (docs/security.md).

    Examples
    --------
    >>> from mlfabric.daemon.config import DaemonConfig
    >>> unauthenticated_warnings(DaemonConfig("h0", "127.0.0.1:7077", "/tmp/s"))
    []
    >>> [w.split(" without")[0] for w in unauthenticated_warnings(
    ...     DaemonConfig("h0", "10.0.0.1:7077", "/tmp/s", data_listen="0.0.0.0:7078"))]
    ['data plane on 0.0.0.0:7078', 'control stream to the scheduler on 10.0.0.1:7077']
    """
    from mlfabric.wire.auth import unauthenticated_warning

    warnings = []
    if config.data_auth is None or config.data_auth.mode == "none":
        warnings.append(unauthenticated_warning("data plane", config.data_listen, 'data_auth = "hmac"'))
    if config.tls is None:
        warnings.append(
            unauthenticated_warning(
                "control stream to the scheduler", config.scheduler, "tls_ca, tls_cert and tls_key"
            )
        )
    return [w for w in warnings if w is not None]


def _warn_unauthenticated(config: Any) -> None:
    for warning in unauthenticated_warnings(config):
        _LOG.warning("%s", warning)


def run(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT; 0 on a clean stop, 1 when it cannot start."""
    from mlfabric.daemon.config import DaemonConfig
    from mlfabric.daemon.host import Daemon
    from mlfabric.daemon.reports import TransferReportLog
    from mlfabric.daemon.service import DaemonService
    from mlfabric.wire.framing import default_socket_path

    for required in ("host", "scheduler"):
        if not getattr(args, required):
            _LOG.error("--%s is required (on the command line or as '%s' in --config)", required, required)
            return 2
    socket_path = default_socket_path(args.socket)
    if args.max_inflight_bytes <= 0:
        _LOG.error("--max-inflight-bytes must be > 0, got %d", args.max_inflight_bytes)
        return 2
    if args.push_timeout <= 0:
        _LOG.error("--push-timeout must be > 0, got %g", args.push_timeout)
        return 2

    egress = ingress = None
    if args.enforce_nic_rates:
        if not args.topology:
            _LOG.error("--enforce-nic-rates needs --topology")
            return 2
        try:
            egress, ingress = host_nic_rates(args.topology, args.host)
        except (OSError, ValueError) as exc:
            _LOG.error("cannot read NIC rates: %s", exc)
            return 2
    try:
        auth = auth_settings(args)
    except ValueError as exc:
        _LOG.error("daemon of host %r: %s", args.host, exc)
        return 2
    config = DaemonConfig(
        **auth,
        host=args.host,
        scheduler=args.scheduler,
        socket_path=socket_path,
        data_listen=args.data_listen,
        egress_rate=egress,
        ingress_rate=ingress,
        send_attempts=args.send_attempts,
        aggregator=args.aggregator,
        round_timeout=args.round_timeout,
        push_timeout=args.push_timeout,
        idle_timeout=args.idle_timeout or None,
        header_timeout=args.header_timeout or None,
        max_connections=args.max_connections or None,
        fallback_after=None if args.fallback_after < 0 else args.fallback_after,
        max_inflight_bytes=args.max_inflight_bytes,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    service = DaemonService(args)
    signal.signal(signal.SIGHUP, lambda *_: service.reload_requested.set())
    report_log = TransferReportLog(args.report_file) if args.report_file else None
    daemon = Daemon(config, report_log=report_log)
    try:
        daemon.start(timeout=args.connect_timeout)
    except (TimeoutError, OSError) as exc:
        _LOG.error("daemon of host %r could not start: %s", args.host, exc)
        return 1
    try:
        service.start_metrics(daemon)
    except OSError as exc:
        _LOG.error("daemon of host %r cannot serve metrics on port %s: %s", args.host, args.metrics_port, exc)
        daemon.stop()
        return 1
    try:
        if args.ready_file:
            write_ready_file(
                args.ready_file,
                {
                    "pid": os.getpid(),
                    "socket": socket_path,
                    "data_address": daemon.data_address,
                    "host": args.host,
                    **service.ready_info(),
                },
            )
        _LOG.info("daemon %s: socket %s, data plane %s", args.host, socket_path, daemon.data_address)
        _warn_unauthenticated(config)
        service.ready(daemon)
        while not stop.wait(service.tick):
            service.tick_once(daemon)
    finally:
        service.stopping()
        daemon.stop()
        service.stop()
    return 0
