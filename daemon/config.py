"""What a host daemon is told at start-up: :class:`DaemonConfig` (DESIGN §3).

Addresses, NIC rates, retry and timeout settings and memory limits of one
:class:`~mlfabric.daemon.host.Daemon`; ``mlfabric-daemon`` builds it from its command line.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlfabric.daemon.channels.budget import DEFAULT_MAX_INFLIGHT_BYTES
from mlfabric.daemon.roles.worker.fallback import DEFAULT_FALLBACK_AFTER
from mlfabric.wire.auth import DataPlaneAuth
from mlfabric.wire.peercred import LocalAccess
from mlfabric.wire.tls import TlsFiles

__all__ = ["DaemonConfig"]


@dataclass(frozen=True)
class DaemonConfig:
    """What a daemon is told at start-up.

    Parameters
    ----------
    host : str
        This host's name in the scheduler's bandwidth graph.
    scheduler : str
        The scheduler's ``"host:port"``.
    socket_path : str
        The local API's Unix socket.
    data_listen : str
        ``"ip:port"`` of the data-plane listener (port 0: any).
    egress_rate, ingress_rate : float, optional
        NIC rates to enforce in bytes per second (None: unlimited).
    send_attempts : int
        Tries per transfer before the push resolves DROPPED.
    retry_backoff : float
        Seconds before the first retry; doubles per retry.
    verdict_timeout : float or None
        Seconds a server's daemon waits for its process's verdict; None (default): until the
        process answers or disconnects — a timed-out update could still be applied later.
    connect_timeout, io_timeout : float
        Data-plane connect and per-call socket timeouts. ``io_timeout`` also bounds the wait for
        the server's verdict (a slow server makes the sender retry; retries are de-duplicated).
    max_payload_bytes : int
        Largest accepted data-plane payload.
    receive_pool_bytes : int
        Capacity of released data-plane receive buffers kept for reuse (``MemfdPool``; at most
        ``max_inflight_bytes``), freed after ``pool_idle_seconds``.
    aggregator : bool
        Whether this host may be an aggregator hop (announced as ``Hello.can_aggregate``).
    round_timeout : float
        Seconds a synchronous round of a server on this host waits for missing workers
        before it is applied with the updates it has.
    push_timeout : float
        The push deadline: seconds a push may wait for the scheduler's directive; then it
        resolves DROPPED naming the deadline (and the scheduler is told, ``UpdateResolved``).
        A push held for an aggregate's verdict waits as long after it was held; then it
        resolves UNKNOWN if the aggregator summed it (or may have), else DROPPED. A transfer
        once started is bounded by ``send_attempts`` x ``io_timeout``.
    fallback_after : float or None
        Seconds without the scheduler before pushes are sent directly to their servers
        (:mod:`mlfabric.daemon.roles.worker.fallback`); None: pushes waiting for it resolve DROPPED.
    max_inflight_bytes : int
        Payload bytes of pushes held, and of receives, at once (:mod:`mlfabric.daemon.channels.budget`);
        more waits, a single larger payload is refused.
    pool_idle_seconds : float or None
        Released receive buffers idle this long go back to the OS (None: kept).
    idle_timeout : float or None
        Seconds a peer's data-plane connection may stay between frames, and a new local
        connection before its first message, without sending a byte (None: forever).
    header_timeout : float or None
        Seconds from a data-plane frame's or local message's first byte until its header
        (local: the whole message) has arrived (None: no limit).
    max_connections : int or None
        Connections served at once, on the data plane and on the local socket each.
    tls : TlsFiles or None
        This host's certificate, key and the CA: the control stream to the scheduler is mTLS
        (None: plaintext, as without authentication; docs/security.md).
    tls_server_name : str or None
        The name the scheduler's certificate must carry (default: the host of ``scheduler``).
    data_auth : DataPlaneAuth or None
        How data-plane connections authenticate (None: they do not).
    local_access : LocalAccess or None
        Who may use the local socket (``SO_PEERCRED``; None: anyone the socket file lets in).
    """

    host: str
    scheduler: str
    socket_path: str
    data_listen: str = "127.0.0.1:0"
    egress_rate: float | None = None
    ingress_rate: float | None = None
    send_attempts: int = 3
    retry_backoff: float = 0.2
    verdict_timeout: float | None = None
    connect_timeout: float = 5.0
    io_timeout: float = 300.0
    max_payload_bytes: int = 4 << 30
    receive_pool_bytes: int = 1 << 30
    aggregator: bool = True
    round_timeout: float = 60.0
    push_timeout: float = 60.0
    fallback_after: float | None = DEFAULT_FALLBACK_AFTER
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    pool_idle_seconds: float | None = 10.0
    idle_timeout: float | None = 120.0
    header_timeout: float | None = 10.0
    max_connections: int | None = 1024
    tls: TlsFiles | None = None
    tls_server_name: str | None = None
    data_auth: DataPlaneAuth | None = None
    local_access: LocalAccess | None = None
