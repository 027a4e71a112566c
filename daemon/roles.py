"""The daemon's books on roles: a worker's pushes in flight and a server's hand-off (DESIGN §3, §10).

- :func:`check_update` compares a push's tensors with the server's model spec and names the
  first mismatch (tensor, both shapes and dtypes), so a bad push is refused at the worker's
  daemon and the model stays untouched.
- :class:`Directory` knows every job's servers (where they live, their model spec), from the
  scheduler's ``RoleAck`` and ``JobUpdate``.
- :class:`OutgoingPushes` holds the updates this daemon keeps in memory (their memfds) until
  each is resolved APPLIED or DROPPED — never silently lost.
- :class:`ServerHandoff` is the server side: each arriving update goes to the server
  process once; a retried update (same ``update_id``) gets the stored verdict and is never
  applied twice (de-duplication by ``update_id``).

Nothing here does I/O; the daemon passes in the functions that talk to processes.
"""

from __future__ import annotations

import collections
import itertools
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlfabric.daemon import payloadio
from mlfabric.proto.v1 import control_pb2
from mlfabric.tensors import Layout

__all__ = [
    "Directory",
    "ModelSnapshot",
    "OutgoingPushes",
    "PendingPush",
    "ServerHandoff",
    "ServerLocation",
    "Spec",
    "Verdict",
    "check_update",
    "new_incarnation",
]

#: Model spec: tensor name -> (dtype, shape).
Spec = dict[str, tuple[str, tuple[int, ...]]]


def check_update(
    spec: Mapping[str, tuple[str, tuple[int, ...]]], layouts: Sequence[Layout], where: str
) -> str | None:
    """The first way an update's tensors differ from a model spec, or None when they match.

    Parameters
    ----------
    spec : Mapping[str, (dtype, shape)]
        The server's model.
    layouts : sequence of Layout
        The update's tensors.
    where : str
        Names the server in messages (e.g. ``"server 'ps0' of job 'j'"``).

    Returns
    -------
    str or None
        A message naming the tensor and both shapes/dtypes, or None.

    Examples
    --------
    >>> spec = {"w": ("float32", (2, 3))}
    >>> check_update(spec, [Layout("w", "float32", (3, 2), 0, 24)], "server 'ps0'")
    "tensor 'w': update has shape (3, 2) float32 but server 'ps0' expects shape (2, 3) float32"
    >>> check_update(spec, [Layout("w", "float32", (2, 3), 0, 24)], "server 'ps0'") is None
    True
    """
    names = [x.name for x in layouts]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        return f"tensor {duplicates[0]!r} appears more than once in the update"
    for layout in layouts:
        expected = spec.get(layout.name)
        if expected is None:
            return f"tensor {layout.name!r}: not in the model of {where} (it has {sorted(spec)})"
        dtype, shape = expected
        if layout.dtype != dtype or tuple(layout.shape) != tuple(shape):
            return (
                f"tensor {layout.name!r}: update has shape {tuple(layout.shape)} {layout.dtype} "
                f"but {where} expects shape {tuple(shape)} {dtype}"
            )
    missing = sorted(set(spec) - set(names))
    if missing:
        return f"tensor {missing[0]!r}: missing from the update ({where} expects {sorted(spec)})"
    return None


def spec_from_pb(model: Iterable[Any]) -> Spec:
    """A :data:`Spec` from ``TensorSpec`` messages.

    Examples
    --------
    >>> spec_from_pb([control_pb2.TensorSpec(name="w", dtype="float64", shape=[2])])
    {'w': ('float64', (2,))}
    """
    return {t.name: (t.dtype, tuple(int(d) for d in t.shape)) for t in model}


@dataclass
class ServerLocation:
    """Where a job's server lives (from ``ServerInfo``)."""

    name: str
    host: str
    data_address: str
    spec: Spec
    version: int
    #: the server has a replica / the host it was on before its replica took over
    replicated: bool = False
    failed_over_from: str = ""


class Directory:
    """Every known job's servers, kept current from ``RoleAck`` and ``JobUpdate`` (thread-safe).

    Examples
    --------
    >>> d = Directory()
    >>> d.update("j", [control_pb2.ServerInfo(name="ps0", host="h1", data_address="1.2.3.4:5")])
    >>> d.lookup("j", "ps0").host
    'h1'
    >>> d.lookup("j", "ps9") is None
    True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, ServerLocation]] = {}
        self._changed = threading.Condition(self._lock)

    def update(self, job: str, servers: Iterable[Any], *, replace: bool = False) -> None:
        """Record ``ServerInfo`` messages for ``job`` (``replace``: forget servers not listed)."""
        with self._lock:
            known = {} if replace else dict(self._jobs.get(job, {}))
            for s in servers:
                known[s.name] = ServerLocation(
                    s.name,
                    s.host,
                    s.data_address,
                    spec_from_pb(s.model),
                    int(s.version),
                    s.replicated,
                    s.failed_over_from,
                )
            self._jobs[job] = known
            self._changed.notify_all()

    def add(self, job: str, location: ServerLocation) -> None:
        """Record one server (e.g. one registered on this host)."""
        with self._lock:
            self._jobs.setdefault(job, {})[location.name] = location
            self._changed.notify_all()

    def lookup(self, job: str, server: str) -> ServerLocation | None:
        """The server's location, or None."""
        with self._lock:
            return self._jobs.get(job, {}).get(server)

    def servers(self, job: str) -> list[str]:
        """Names of the job's known servers."""
        with self._lock:
            return sorted(self._jobs.get(job, {}))

    def wait_for_servers(self, job: str, timeout: float) -> bool:
        """Block until ``job`` has a server or ``timeout`` passes; True if it has one."""
        with self._lock:
            return self._changed.wait_for(lambda: bool(self._jobs.get(job)), timeout)


@dataclass
class PendingPush:
    """An update in this daemon's memory, from ``push`` until it resolves.

    ``fd`` is the memfd holding ``payload_bytes`` bytes laid out by ``layouts``; ``reply``
    sends a ``LocalEvent`` to the pushing process (it may have gone: then it does nothing).
    """

    update_id: str
    job: str
    server: str
    worker: str
    fd: int
    layouts: list[Layout]
    payload_bytes: int
    norm: float
    base_version: int
    ready_at: float
    request_id: int
    owner: int
    state: str = "ready"  # ready -> sending -> [held -> sending ->] (resolved: removed)
    #: CRC-32 of the payload as the pushing process computed it (None: computed while sending)
    crc32: int | None = None


def new_incarnation() -> str:
    """A random 64-bit daemon incarnation (16 hex digits), fresh at every daemon start.

    Examples
    --------
    >>> a, b = new_incarnation(), new_incarnation()
    >>> len(a), a != b
    (16, True)
    """
    return secrets.token_hex(8)


class OutgoingPushes:
    """The pushes this daemon holds until they resolve; assigns ``"<host>/<incarnation>/<seq>"`` ids.

    The incarnation makes ids unique across restarts of the daemon: a restarted daemon numbers
    its updates from 1 again, and without it the server's daemon would answer them from its
    de-duplication memory with the verdicts of the previous incarnation's updates.

    Parameters
    ----------
    host : str
        This daemon's host name.
    incarnation : str
        This daemon run's identity (:func:`new_incarnation`); empty: ids are ``"<host>/<seq>"``.

    Examples
    --------
    >>> book = OutgoingPushes("h1", "9f3a")
    >>> book.new_update_id(), book.new_update_id()
    ('h1/9f3a/1', 'h1/9f3a/2')
    >>> OutgoingPushes("h1").new_update_id()
    'h1/1'
    """

    def __init__(self, host: str, incarnation: str = "") -> None:
        self.host = host
        self.incarnation = incarnation
        self._prefix = f"{host}/{incarnation}/" if incarnation else f"{host}/"
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._pushes: dict[str, PendingPush] = {}

    def new_update_id(self) -> str:
        """A fresh update id, unique to this host and this daemon run."""
        return f"{self._prefix}{next(self._seq)}"

    def add(self, push: PendingPush) -> None:
        """Hold ``push`` (the book owns its fd from now on)."""
        with self._lock:
            self._pushes[push.update_id] = push

    def start_sending(self, update_id: str) -> PendingPush | None:
        """Mark a push as being sent (ready, or held after an aggregator); None if unknown or sending."""
        with self._lock:
            push = self._pushes.get(update_id)
            if push is None or push.state not in ("ready", "held"):
                return None
            push.state = "sending"
            return push

    def hold(self, update_id: str) -> bool:
        """Keep a push sent to an aggregator until a resolve or a new send (state ``held``)."""
        with self._lock:
            push = self._pushes.get(update_id)
            if push is not None:
                push.state = "held"
            return push is not None

    def unhold(self, job: str, worker: str) -> list[PendingPush]:
        """Make the pushes of a worker held after a send to an aggregator ready again; return them."""
        with self._lock:
            held = [
                p for p in self._pushes.values() if p.state == "held" and (p.job, p.worker) == (job, worker)
            ]
            for p in held:
                p.state = "ready"
            return held

    def requeue(self, update_id: str) -> PendingPush | None:
        """Make a push being sent ready again (to announce it anew); None if unknown."""
        with self._lock:
            push = self._pushes.get(update_id)
            if push is not None:
                push.state = "ready"
            return push

    def take(self, update_id: str) -> PendingPush | None:
        """Remove and return a push to resolve it (the caller closes its fd)."""
        with self._lock:
            return self._pushes.pop(update_id, None)

    def get(self, update_id: str) -> PendingPush | None:
        """The push with ``update_id`` (still held), or None."""
        with self._lock:
            return self._pushes.get(update_id)

    def waiting_ids(self) -> list[str]:
        """The ids of the pushes waiting for a directive (state ``ready``)."""
        with self._lock:
            return [u for u, p in self._pushes.items() if p.state == "ready"]

    def take_waiting(self) -> list[PendingPush]:
        """Remove and return every push still waiting for a directive (state ``ready``)."""
        with self._lock:
            waiting = [p for p in self._pushes.values() if p.state == "ready"]
            for p in waiting:
                del self._pushes[p.update_id]
            return waiting

    def take_expired(self, now: float, timeout: float) -> list[PendingPush]:
        """Remove and return the pushes still waiting for a directive ``timeout`` s after ``ready_at``."""
        with self._lock:
            expired = [p for p in self._pushes.values() if p.state == "ready" and now - p.ready_at >= timeout]
            for p in expired:
                del self._pushes[p.update_id]
            return expired

    def take_all(self) -> list[PendingPush]:
        """Remove and return every push (shutdown)."""
        with self._lock:
            pushes = list(self._pushes.values())
            self._pushes.clear()
            return pushes

    def __len__(self) -> int:
        with self._lock:
            return len(self._pushes)


@dataclass(frozen=True)
class Verdict:
    """The server's answer on one update (``UpdateVerdict`` / an ACK frame).

    ``handed_over`` is False for a DROPPED verdict on an update that never reached the
    server process (it was gone): certainly not applied, so it may go to a promoted replica.
    """

    outcome: int
    delay: int
    version: int
    reason: str
    handed_over: bool = True

    @classmethod
    def dropped(cls, reason: str, version: int = 0) -> Verdict:
        """A DROPPED verdict with ``reason``."""
        return cls(control_pb2.OUTCOME_DROPPED, 0, version, reason)

    @classmethod
    def unknown(cls, reason: str, version: int = 0) -> Verdict:
        """An UNKNOWN verdict: whether the update was applied cannot be known; ``reason`` says why."""
        return cls(control_pb2.OUTCOME_UNKNOWN, 0, version, reason)


@dataclass
class ModelSnapshot:
    """A model published by the server process: an immutable memfd and its mapping."""

    version: int
    layouts: list[Layout]
    payload_bytes: int
    fd: int
    mapping: mmap.mmap | None
    crc32: int | None = None

    def checksum(self) -> int:
        """The payload's CRC-32, computed on first use (a peer's GET) and kept."""
        if self.crc32 is None:
            self.crc32 = payloadio.crc32(self.mapping) if self.mapping is not None else 0
        return self.crc32

    def close(self) -> None:
        """Close the fd; the mapping lives on while a reply still sends from it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class _Delivery:
    done: threading.Event = field(default_factory=threading.Event)
    verdict: Verdict | None = None


class ServerHandoff:
    """A server role on this host: hands updates to its process, once each (thread-safe).

    Parameters
    ----------
    job, name : str
        The server.
    spec : Spec
        Its model.
    version : int
        Its model version at registration.
    deliver : callable
        ``deliver(update_id, header, fd)`` passes an update to the server process; raises
        ``OSError`` if the process is gone.
    max_verdicts : int
        How many past verdicts are remembered for de-duplication.

    Examples
    --------
    >>> sent = []
    >>> def deliver(update_id, header, fd):  # the process applies it and answers at once
    ...     sent.append(update_id)
    ...     h.resolve(update_id, Verdict(control_pb2.OUTCOME_APPLIED, 0, 1, ""))
    >>> h = ServerHandoff("j", "ps0", {}, 0, deliver)
    >>> h.handle("u1", None, -1, timeout=5).version
    1
    >>> h.handle("u1", None, -1, timeout=5).version, sent      # a retry: stored verdict, not re-delivered
    (1, ['u1'])
    """

    def __init__(
        self,
        job: str,
        name: str,
        spec: Spec,
        version: int,
        deliver: Callable[[str, Any, int], None],
        max_verdicts: int = 100_000,
    ) -> None:
        self.job = job
        self.name = name
        self.spec = spec
        self.version = version
        self._deliver = deliver
        self._max = max_verdicts
        self._lock = threading.Lock()
        self._verdicts: collections.OrderedDict[str, Verdict] = collections.OrderedDict()
        self._inflight: dict[str, _Delivery] = {}
        self._snapshot: ModelSnapshot | None = None
        self._closed_reason: str | None = None
        #: a replica's replicated entries and its re-sync take turns under it (replication.py)
        self.replicating = threading.Lock()

    def handle(self, update_id: str, header: Any, fd: int, timeout: float | None) -> Verdict:
        """The verdict on an arriving update: stored, awaited, or delivered now and awaited.

        ``timeout`` None waits until the process answers or disconnects. A timeout answers
        UNKNOWN (the process may still apply the update later), as does a process that
        disconnects after the update was handed to it; an update never handed over (the
        process was gone already) is DROPPED.

        The caller keeps ownership of ``fd`` (the process gets its own copy).
        """
        with self._lock:
            stored = self._verdicts.get(update_id)
            if stored is not None:
                return stored
            if self._closed_reason is not None:
                return Verdict(control_pb2.OUTCOME_DROPPED, 0, self.version, self._closed_reason, False)
            delivery = self._inflight.get(update_id)
            first = delivery is None
            if delivery is None:
                delivery = self._inflight[update_id] = _Delivery()
        if first:
            try:
                self._deliver(update_id, header, fd)
            except OSError as exc:
                reason = f"server process {self.name!r} unreachable: {exc}"
                self.resolve(update_id, Verdict(control_pb2.OUTCOME_DROPPED, 0, self.version, reason, False))
        if not delivery.done.wait(timeout):
            return Verdict.unknown(
                f"server process {self.name!r} gave no verdict on {update_id} within {timeout} s "
                "(it may still apply it)",
                self.version,
            )
        assert delivery.verdict is not None
        return delivery.verdict

    def stored(self, update_id: str) -> Verdict | None:
        """The verdict remembered for ``update_id`` (an update or an aggregate's member), or None."""
        with self._lock:
            return self._verdicts.get(update_id)

    def applied_ids(self, limit: int) -> list[str]:
        """The ids of the (at most ``limit``) latest updates and members remembered APPLIED."""
        with self._lock:
            ids = [u for u, v in reversed(self._verdicts.items()) if v.outcome == control_pb2.OUTCOME_APPLIED]
        return ids[:limit]

    def advance(self, version: int) -> None:
        """The process's model was replaced by one at ``version`` (a replica re-synced)."""
        with self._lock:
            self.version = max(self.version, version)

    def in_flight(self, update_id: str) -> bool:
        """Whether ``update_id`` was delivered and still awaits the process's verdict."""
        with self._lock:
            return update_id in self._inflight

    def resolve(self, update_id: str, verdict: Verdict) -> None:
        """Record the process's verdict and wake everyone waiting for it."""
        with self._lock:
            if verdict.outcome == control_pb2.OUTCOME_APPLIED:
                self.version = max(self.version, verdict.version)
            self._verdicts[update_id] = verdict
            while len(self._verdicts) > self._max:
                self._verdicts.popitem(last=False)
            delivery = self._inflight.pop(update_id, None)
        if delivery is not None:
            delivery.verdict = verdict
            delivery.done.set()

    def close(self, reason: str) -> None:
        """The process went away: every update handed to it without a verdict resolves UNKNOWN.

        It may have been applied just before the process went (its verdict lost), so neither
        APPLIED nor DROPPED would be true. Updates arriving later are DROPPED with ``reason``.
        """
        with self._lock:
            self._closed_reason = reason
            pending = list(self._inflight)
            snapshot, self._snapshot = self._snapshot, None
        for update_id in pending:
            self.resolve(
                update_id,
                Verdict.unknown(
                    f"{reason} after {update_id} was handed to it and before its verdict: "
                    "whether it was applied is unknown",
                    self.version,
                ),
            )
        if snapshot is not None:
            snapshot.close()

    def publish(self, snapshot: ModelSnapshot) -> None:
        """Replace the model ``get`` answers from (the old snapshot's fd is closed)."""
        with self._lock:
            old, self._snapshot = self._snapshot, snapshot
        if old is not None:
            old.close()

    def snapshot(self) -> ModelSnapshot | None:
        """The model last published, or None."""
        with self._lock:
            return self._snapshot

    def with_snapshot(self, fn: Callable[[ModelSnapshot | None], Any]) -> Any:
        """Call ``fn(snapshot)`` while no publish can close the snapshot's fd."""
        with self._lock:
            return fn(self._snapshot)
