"""The pushes a worker's daemon holds until each resolves, and their states (DESIGN §12, §10).

A push is in the book from ``push`` until its verdict (APPLIED, DROPPED or UNKNOWN — never
silently lost), in one :class:`PushState` at a time::

    push ──> READY ──send──> SENDING ──ACK, refusal or failure──> (resolved: out of the book)
               ▲                │  ▲
               │ new session /  │  │ send again
               │ failed over    ▼  │
               └──────────────── HELD  (summed or refused by an aggregator: waits for the
                                       aggregate's verdict, a ResolveDirective, or a new send)

The push deadline bounds both waits for the scheduler: a push READY ``push_timeout`` s after
it was pushed, or HELD that long after it was held, is taken out (:meth:`OutgoingPushes.take_expired`)
and resolved — DROPPED, or UNKNOWN if an aggregator may have summed it. A SENDING push is
bounded by its transfer (``send_attempts`` x ``io_timeout``).

:class:`OutgoingPushes` is the only place a push changes state (:data:`TRANSITIONS` lists the
moves it makes); everyone else asks it to. It also gives each push its id
``"<host>/<incarnation>/<seq>"``. Nothing here does I/O.
"""

from __future__ import annotations

import enum
import itertools
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from mlfabric.wire.tensors import Layout

__all__ = ["TRANSITIONS", "OutgoingPushes", "PendingPush", "PushOwner", "PushState", "new_incarnation"]


class PushState(enum.Enum):
    """Where a held push is between ``push`` and its verdict.

    Examples
    --------
    >>> PushState.HELD in TRANSITIONS[PushState.SENDING]
    True
    """

    #: waiting for a directive (announced to the scheduler, or kept for the fallback)
    READY = "ready"
    #: its transfer is under way (a ``SendDirective``, or a direct send while falling back)
    SENDING = "sending"
    #: sent to an aggregator: waits for the aggregate's verdict or a new send
    HELD = "held"


#: state -> the states a push may move to (resolving takes it out of the book, from any state)
TRANSITIONS: dict[PushState, frozenset[PushState]] = {
    PushState.READY: frozenset({PushState.SENDING}),
    PushState.SENDING: frozenset({PushState.HELD, PushState.READY}),
    PushState.HELD: frozenset({PushState.SENDING, PushState.READY}),
}


class PushOwner(Protocol):
    """The pushing process, as its push uses it.

    The daemon's is the process's :class:`~mlfabric.daemon.channels.localapi.LocalConnection`.

    Examples
    --------
    >>> class Printer:
    ...     def send(self, event):
    ...         print(event)
    >>> owner: PushOwner = Printer()
    >>> owner.send("push_result { outcome: OUTCOME_APPLIED }")
    push_result { outcome: OUTCOME_APPLIED }
    """

    def send(self, event: Any) -> object:
        """Send the process a ``LocalEvent`` (it may have gone: then it does nothing)."""


@dataclass
class PendingPush:
    """An update in this daemon's memory, from ``push`` until it resolves.

    ``fd`` is the memfd holding ``payload_bytes`` bytes laid out by ``layouts``; the push's
    verdict goes to ``owner``, the pushing process, as the answer to its ``request_id``.
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
    owner: PushOwner
    #: changed by :class:`OutgoingPushes` only
    state: PushState = PushState.READY
    #: CRC-32 of the payload as the pushing process computed it (None: computed while sending)
    crc32: int | None = None
    #: announced again after its server failed over: it may be applied there already, so it
    #: must reach the server whole (``UpdateReady.resent``; docs/replication.md)
    resent: bool = False
    #: the scheduler session whose directive sent it last (a held push waits for that session)
    session: int = 0
    #: when it was last held (``clock()``): the push deadline of a HELD push counts from here
    held_at: float = 0.0
    #: an aggregator summed it, or may have (a frame that got no answer): never DROPPED once held
    maybe_summed: bool = False


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

    def _move(self, push: PendingPush | None, to: PushState) -> bool:
        """With the lock held: move ``push`` to ``to`` if :data:`TRANSITIONS` allows it."""
        if push is None or to not in TRANSITIONS[push.state]:
            return False
        push.state = to
        return True

    def start_sending(self, update_id: str, session: int | None = None) -> PendingPush | None:
        """READY or HELD -> SENDING (a send directive, or a direct send); None if unknown or sending.

        ``session``: the scheduler session whose directive sends it (None: unchanged).
        """
        with self._lock:
            push = self._pushes.get(update_id)
            if push is None or not self._move(push, PushState.SENDING):
                return None
            if session is not None:
                push.session = session
            return push

    def hold(self, update_id: str, now: float, maybe_summed: bool = False) -> bool:
        """SENDING -> HELD at ``now``: sent to an aggregator, kept until a resolve or a new send.

        ``maybe_summed``: the aggregator summed it, or may have (it stays so for the push's
        life: a push that may be in an aggregate is never resolved DROPPED by the deadline).
        """
        with self._lock:
            push = self._pushes.get(update_id)
            if not self._move(push, PushState.HELD):
                return False
            assert push is not None
            push.held_at = now
            push.maybe_summed = push.maybe_summed or maybe_summed
            return True

    def unhold(self, job: str, worker: str) -> list[PendingPush]:
        """HELD -> READY for every push of ``worker`` of ``job`` (a new session never planned them)."""
        with self._lock:
            held = [
                p
                for p in self._pushes.values()
                if p.state is PushState.HELD and (p.job, p.worker) == (job, worker)
            ]
            for p in held:
                self._move(p, PushState.READY)
            return held

    def unhold_one(self, update_id: str) -> PendingPush | None:
        """HELD -> READY for one push (its session ended); None if it is not held (any more)."""
        with self._lock:
            push = self._pushes.get(update_id)
            if push is None or push.state is not PushState.HELD:
                return None
            self._move(push, PushState.READY)
            return push

    def requeue(self, update_id: str) -> PendingPush | None:
        """SENDING -> READY (to announce it anew, ``resent``: its server failed over); None if unknown."""
        with self._lock:
            push = self._pushes.get(update_id)
            self._move(push, PushState.READY)
            if push is not None:
                push.resent = True
            return push

    def waiting(self, update_id: str) -> PendingPush | None:
        """The push with ``update_id`` if it is READY (waiting for a directive), else None."""
        with self._lock:
            push = self._pushes.get(update_id)
            return push if push is not None and push.state is PushState.READY else None

    def take(self, update_id: str) -> PendingPush | None:
        """Remove and return a push to resolve it (the caller closes its fd)."""
        with self._lock:
            return self._pushes.pop(update_id, None)

    def get(self, update_id: str) -> PendingPush | None:
        """The push with ``update_id`` (still held), or None."""
        with self._lock:
            return self._pushes.get(update_id)

    def held_ids(self) -> list[str]:
        """The ids of the pushes held for an aggregate's verdict (HELD)."""
        with self._lock:
            return [u for u, p in self._pushes.items() if p.state is PushState.HELD]

    def waiting_ids(self) -> list[str]:
        """The ids of the pushes waiting for a directive (READY)."""
        with self._lock:
            return [u for u, p in self._pushes.items() if p.state is PushState.READY]

    def take_waiting(self) -> list[PendingPush]:
        """Remove and return every push still waiting for a directive (READY)."""
        with self._lock:
            waiting = [p for p in self._pushes.values() if p.state is PushState.READY]
            for p in waiting:
                del self._pushes[p.update_id]
            return waiting

    def take_expired(self, now: float, timeout: float) -> list[PendingPush]:
        """Remove and return the pushes past the push deadline (their state tells which wait ran out).

        A READY push waited ``timeout`` s since ``ready_at`` for a send directive; a HELD one
        ``timeout`` s since ``held_at`` for its aggregate's verdict (a ``ResolveDirective``) or
        a new send directive. A SENDING push is not taken: its transfer ends by itself
        (``send_attempts`` x ``io_timeout`` at most) and resolves or holds it.

        Examples
        --------
        >>> book = OutgoingPushes("h1")
        >>> for i, t in enumerate((0.0, 30.0)):
        ...     book.add(PendingPush(f"h1/{i}", "j", "ps0", "w0", -1, [], 0, 0.0, 0, t, i, None))
        >>> _ = book.start_sending("h1/0"); book.hold("h1/0", now=50.0)
        True
        >>> [p.update_id for p in book.take_expired(now=90.0, timeout=60.0)]   # READY since 30
        ['h1/1']
        >>> [(p.update_id, p.state.name) for p in book.take_expired(now=110.0, timeout=60.0)]
        [('h1/0', 'HELD')]
        """

        def expired(p: PendingPush) -> bool:
            if p.state is PushState.READY:
                return now - p.ready_at >= timeout
            return p.state is PushState.HELD and now - p.held_at >= timeout

        with self._lock:
            out = [p for p in self._pushes.values() if expired(p)]
            for p in out:
                del self._pushes[p.update_id]
            return out

    def sending(self) -> int:
        """How many pushes are being sent (SENDING: their transfers under way)."""
        with self._lock:
            return sum(p.state is PushState.SENDING for p in self._pushes.values())

    def take_all(self) -> list[PendingPush]:
        """Remove and return every push (shutdown)."""
        with self._lock:
            pushes = list(self._pushes.values())
            self._pushes.clear()
            return pushes

    def __len__(self) -> int:
        with self._lock:
            return len(self._pushes)
