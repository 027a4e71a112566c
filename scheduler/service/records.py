"""The scheduler state's records and errors: plain data the service, the wire and tests share.

The frozen records of what :class:`~mlfabric.scheduler.service.state.SchedulerState` holds
(a daemon, a job and its params, a server role and its model spec, an update's outcome, a
transfer report, what a departure removed) and :class:`SchedulerError`, whose subclasses name
the host, job, server, worker or update at fault and declare the wire ``ErrorCode`` a daemon
gets (DESIGN §3). Nothing here does I/O.
"""

from __future__ import annotations

import enum
import ipaddress
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from mlfabric.scheduler.policies.base import InFlight, PendingUpdate

__all__ = [
    "Cleanup",
    "DaemonInfo",
    "DuplicateServer",
    "DuplicateUpdate",
    "DuplicateWorker",
    "HostAlreadyConnected",
    "Job",
    "JobParams",
    "NoPath",
    "OutcomeKind",
    "OutcomeLog",
    "ParamsMismatch",
    "SchedulerError",
    "ServerRole",
    "TensorSpec",
    "TransferResult",
    "UnknownDaemon",
    "UnknownHost",
    "UnknownJob",
    "UnknownServer",
    "UnknownUpdate",
    "UnknownWorker",
    "UpdateOutcome",
    "address_problem",
    "model_bytes",
]


def address_problem(address: str) -> str | None:
    """What is wrong with a data-plane address ``"ip:port"`` (``"[ipv6]:port"``), or None.

    Examples
    --------
    >>> address_problem("127.0.0.1:9000") is None, address_problem("[::1]:9000") is None
    (True, True)
    >>> address_problem("127.0.0.1:0")
    'has port 0, not 1-65535'
    >>> address_problem("localhost:9000")
    "is not 'ip:port' (the host part 'localhost' is not an IP address)"
    """
    ip, sep, port = address.rpartition(":")
    if not sep or not ip:
        return "is not 'ip:port'"
    try:
        ipaddress.ip_address(ip[1:-1] if ip.startswith("[") and ip.endswith("]") else ip)
    except ValueError:
        return f"is not 'ip:port' (the host part {ip!r} is not an IP address)"
    if not port.isdigit():
        return f"is not 'ip:port' (the port {port!r} is not a number)"
    if not 1 <= int(port) <= 65535:
        return f"has port {int(port)}, not 1-65535"
    return None


#: Bytes per element of each tensor dtype (bfloat16 travels as 2-byte words).
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def model_bytes(model: Iterable[TensorSpec]) -> int:
    """The payload size of a model (and the largest an update to it may announce), in bytes.

    Examples
    --------
    >>> model_bytes([TensorSpec("w", "float32", (4, 4)), TensorSpec("b", "float64", (3,))])
    88
    """
    total = 0
    for t in model:
        count = 1
        for d in t.shape:
            count *= int(d)
        total += count * _DTYPE_BYTES.get(t.dtype, 8)
    return total


class SchedulerError(Exception):
    """A request the scheduler cannot honour; the message names the culprit."""

    #: the wire code (``mlfabric.v1.ErrorCode`` ``ERROR_CODE_<code>``) daemons switch on
    code: ClassVar[str] = "REFUSED"


class UnknownHost(SchedulerError):
    """A daemon said hello with a host name that is not a host of the bandwidth graph."""

    code = "UNKNOWN_HOST"


class HostAlreadyConnected(SchedulerError):
    """A second daemon said hello for a host that already has one."""

    code = "HOST_ALREADY_CONNECTED"


class UnknownDaemon(SchedulerError):
    """A message came for a host whose daemon is not (or no longer) connected."""

    code = "UNKNOWN_DAEMON"


class UnknownJob(SchedulerError):
    """A worker or update names a job that has no server."""

    code = "UNKNOWN_JOB"


class UnknownServer(SchedulerError):
    """An update names a server that its job does not have."""

    code = "UNKNOWN_SERVER"


class UnknownWorker(SchedulerError):
    """An update comes from a worker that did not register on that host."""

    code = "UNKNOWN_WORKER"


class DuplicateWorker(SchedulerError):
    """A worker registers with the name of a live worker of its job on another host."""

    code = "DUPLICATE_WORKER"


class DuplicateServer(SchedulerError):
    """A server registers with the name of a server its job already has."""

    code = "DUPLICATE_SERVER"


class ParamsMismatch(SchedulerError):
    """A server registers with job params different from its job's."""

    code = "PARAMS_MISMATCH"


class DuplicateReplica(SchedulerError):
    """A replica registers for a server that already has one."""

    code = "DUPLICATE_REPLICA"


class ModelMismatch(SchedulerError):
    """A replica declares a model spec different from its server's."""

    code = "MODEL_MISMATCH"


class FailedOver(SchedulerError):
    """A server registers a name whose server failed over to its replica on another host."""

    code = "FAILED_OVER"


class DuplicateUpdate(SchedulerError):
    """An update id is announced while the same id is still pending or in flight."""

    code = "DUPLICATE_UPDATE"


class UnknownUpdate(SchedulerError):
    """An operation names an update that is neither pending nor in flight."""

    code = "UNKNOWN_UPDATE"


class NoPath(SchedulerError):
    """The bandwidth graph has no path from a worker's host to its server's host."""

    code = "NO_PATH"


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a job's model."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class JobParams:
    """Delay and divergence bounds of a job (paper Table 1 ``params``).

    ``tau_max < 0`` and ``div_max <= 0`` mean unbounded. ``allow_non_finite``: servers apply
    updates holding NaN or inf (default: they refuse them). ``sync_workers``: worker updates
    per synchronous round (0: asynchronous). ``compression``: the codec workers push with by
    default (a spec string, ``""``: none; docs/compression.md), passed on to the job's workers.
    ``model_compression``: the codec the servers' models travel with (``""``, ``fp16``, ``bf16``).
    """

    tau_max: int = -1
    div_max: float = 0.0
    allow_non_finite: bool = False
    sync_workers: int = 0
    compression: str = ""
    model_compression: str = ""


@dataclass(frozen=True)
class DaemonInfo:
    """A connected daemon: its host and data-plane address ``ip:port``."""

    host: str
    data_address: str
    version: str = ""


@dataclass(frozen=True)
class ServerRole:
    """A server of a job: where it runs, its model spec and its model version."""

    job: str
    name: str
    host: str
    model: tuple[TensorSpec, ...]
    version: int


@dataclass
class Job:
    """A training job: its params, its servers (by name) and its workers (name -> host)."""

    name: str
    params: JobParams
    servers: dict[str, ServerRole] = field(default_factory=dict)
    workers: dict[str, str] = field(default_factory=dict)


class OutcomeKind(enum.Enum):
    """How an update's push resolved."""

    APPLIED = "applied"
    DROPPED = "dropped"
    #: whether it was applied cannot be known (e.g. the server's daemon went away after the
    #: update or its aggregate may have reached it); the reason says why
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class UpdateOutcome:
    """The resolution of one update (``delay``/``version`` only when the server reported them)."""

    update_id: str
    kind: OutcomeKind
    reason: str = ""
    delay: int | None = None
    version: int | None = None


class OutcomeLog(Mapping[str, UpdateOutcome]):
    """The latest outcomes, ``update id -> UpdateOutcome``; the oldest forgotten beyond ``capacity``.

    Kept for inspection only (nothing decides by them: a repeated announcement is refused by
    the pending and in-flight updates; the counters and the trace ring count every outcome).
    Each is held as a plain tuple of strings and numbers, which the cyclic garbage collector
    stops tracking, and made an :class:`UpdateOutcome` when read: a frozen dataclass per
    outcome kept 100,000 objects tracked, and the collector's full passes walked them all
    (issue 24). An update recorded again moves to the newest place.

    Parameters
    ----------
    capacity : int
        Outcomes kept.

    Examples
    --------
    >>> log = OutcomeLog(capacity=2)
    >>> for uid in ("a", "b", "c"):
    ...     log.record(UpdateOutcome(uid, OutcomeKind.APPLIED, delay=1, version=3))
    >>> list(log), "a" in log, log["c"].kind, log["c"].delay
    (['b', 'c'], False, <OutcomeKind.APPLIED: 'applied'>, 1)
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an outcome log keeps at least one outcome, not {capacity}")
        self.capacity = capacity
        self._rows: OrderedDict[str, tuple[str, str, int | None, int | None]] = OrderedDict()

    def record(self, outcome: UpdateOutcome) -> None:
        """Keep ``outcome`` as the newest (forgetting the oldest beyond the capacity)."""
        rows = self._rows
        uid = outcome.update_id
        rows[uid] = (outcome.kind.value, outcome.reason, outcome.delay, outcome.version)
        rows.move_to_end(uid)
        while len(rows) > self.capacity:
            rows.popitem(last=False)

    def __getitem__(self, update_id: str) -> UpdateOutcome:
        kind, reason, delay, version = self._rows[update_id]
        return UpdateOutcome(update_id, OutcomeKind(kind), reason, delay, version)

    def __contains__(self, update_id: object) -> bool:
        return update_id in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


@dataclass(frozen=True)
class TransferResult:
    """A daemon's report on one transfer (wire ``TransferReport`` as plain data).

    ``start``/``end`` are the sender's wall-clock seconds; ``outcome`` is set when the
    next hop was the server and says what happened to the update there.
    """

    update_id: str
    src_host: str
    dst_host: str
    bytes: int
    start: float
    end: float
    ok: bool = True
    error: str = ""
    outcome: OutcomeKind | None = None
    delay: int = 0
    server_version: int = 0
    reason: str = ""


@dataclass(frozen=True)
class Cleanup:
    """What a departure (daemon or role) removed.

    Attributes
    ----------
    dropped : tuple of (PendingUpdate, str)
        Pending updates dropped, with the reason; their source daemons are to be told
        (unless the source is the departed daemon).
    in_flight : tuple of InFlight
        Transfers forgotten because their sender or destination left.
    jobs_changed : tuple of str
        Jobs that lost a server (their workers' daemons get a new server list).
    """

    dropped: tuple[tuple[PendingUpdate, str], ...] = ()
    in_flight: tuple[InFlight, ...] = ()
    jobs_changed: tuple[str, ...] = ()
