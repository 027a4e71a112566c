"""A server's exactly-once memory on its daemon: the one verdict store (DESIGN §10).

Every way an update reaches a server — a plain update, an aggregate's members, a synchronous
round — is decided once and remembered here, one :class:`VerdictStore` per server role
(:class:`~mlfabric.daemon.roles.server.handoff.ServerHandoff` hands updates to the process
through it; :class:`~mlfabric.daemon.roles.server.rounds.ServerAggregation` sums aggregates and
rounds through it):

- **verdicts by update id** (updates, aggregates, members, rounds; the latest ``max_verdicts``):
  a re-sent update gets its stored verdict and is never applied twice;
- **deliveries in flight**: an update handed to the process and not answered yet; every copy
  arriving meanwhile waits for the same verdict;
- **members of each aggregate** (the latest ``max_aggregates``): a re-sent aggregate is answered
  from memory only for the members it was applied with;
- **claims**: which frame is applying which member right now, so that no member is applied
  twice at once by two frames that carry it;
- the server's **model version** as the verdicts tell it (an APPLIED one moves it forward).

Nothing here does I/O.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlfabric.daemon.roles.base import Verdict
from mlfabric.proto.v1 import control_pb2

__all__ = ["InFlight", "VerdictStore"]

_APPLIED = control_pb2.OUTCOME_APPLIED


@dataclass
class InFlight:
    """An update handed to the server process: set ``done`` once its ``verdict`` is in."""

    done: threading.Event = field(default_factory=threading.Event)
    verdict: Verdict | None = None


class VerdictStore:
    """What a server's daemon remembers so that each update is applied once (thread-safe).

    Parameters
    ----------
    version : int
        The server's model version at registration.
    max_verdicts : int
        How many past verdicts are remembered for de-duplication.
    max_aggregates : int
        How many aggregates' member verdicts are remembered for re-sent aggregates.

    Examples
    --------
    >>> store = VerdictStore(3)
    >>> stored, delivery, first = store.begin("u1")     # the first copy delivers it
    >>> stored is None, first
    (True, True)
    >>> store.begin("u1")[2]                            # a copy meanwhile waits for it
    False
    >>> store.resolve("u1", Verdict(_APPLIED, 0, 4, ""))
    >>> delivery.verdict.version, store.version, store.begin("u1")[0].version
    (4, 4, 4)
    >>> store.claim(["m1", "m2"], "agg:x:0")             # nothing stored: claimed
    {}
    >>> store.release(["m1", "m2"], "agg:x:0")
    """

    def __init__(self, version: int, max_verdicts: int = 100_000, max_aggregates: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._claimed = threading.Condition(self._lock)
        self._version = version
        self._max_verdicts = max_verdicts
        self._max_aggregates = max_aggregates
        self._verdicts: collections.OrderedDict[str, Verdict] = collections.OrderedDict()
        self._inflight: dict[str, InFlight] = {}
        self._members: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        self._owner: dict[str, str] = {}
        self._closed_reason: str | None = None

    @property
    def version(self) -> int:
        """The server's model version, as far as this daemon knows."""
        with self._lock:
            return self._version

    # ------------------------------------------------------------------ verdicts and deliveries

    def begin(self, update_id: str) -> tuple[Verdict | None, InFlight | None, bool]:
        """``(verdict, None, False)`` if ``update_id`` is decided (or the server is gone), else
        ``(None, delivery, first)``: ``first`` says this copy hands it to the process."""
        with self._lock:
            stored = self._verdicts.get(update_id)
            if stored is not None:
                return stored, None, False
            if self._closed_reason is not None:  # never handed over: certainly not applied
                return (
                    Verdict(control_pb2.OUTCOME_DROPPED, 0, self._version, self._closed_reason, False),
                    None,
                    False,
                )
            delivery = self._inflight.get(update_id)
            if delivery is not None:
                return None, delivery, False
            delivery = self._inflight[update_id] = InFlight()
            return None, delivery, True

    def stored(self, update_id: str) -> Verdict | None:
        """The verdict remembered for ``update_id`` (an update or an aggregate's member), or None."""
        with self._lock:
            return self._verdicts.get(update_id)

    def resolve(self, update_id: str, verdict: Verdict) -> None:
        """Remember ``verdict`` on ``update_id`` and wake every copy waiting for it."""
        with self._lock:
            if verdict.outcome == _APPLIED:
                self._version = max(self._version, verdict.version)
            self._verdicts[update_id] = verdict
            while len(self._verdicts) > self._max_verdicts:
                self._verdicts.popitem(last=False)
            delivery = self._inflight.pop(update_id, None)
        if delivery is not None:
            delivery.verdict = verdict
            delivery.done.set()

    def in_flight(self, update_id: str) -> bool:
        """Whether ``update_id`` was delivered and still awaits the process's verdict."""
        with self._lock:
            return update_id in self._inflight

    def applied_ids(self, limit: int) -> list[str]:
        """The ids of the (at most ``limit``) latest updates and members remembered APPLIED."""
        with self._lock:
            ids = [u for u, v in reversed(self._verdicts.items()) if v.outcome == _APPLIED]
        return ids[:limit]

    def advance(self, version: int) -> None:
        """The process's model was replaced by one at ``version`` (a replica re-synced)."""
        with self._lock:
            self._version = max(self._version, version)

    def close(self, reason: str) -> list[str]:
        """The server is gone: later updates are refused with ``reason``; the ids in flight."""
        with self._lock:
            self._closed_reason = reason
            return list(self._inflight)

    # ------------------------------------------------------------------ aggregates' members

    def keep_members(self, aggregate_id: str, verdicts: list[Any]) -> None:
        """Remember the ``MemberVerdict`` messages of an aggregate applied (or refused) here."""
        with self._lock:
            self._members[aggregate_id] = verdicts
            while len(self._members) > self._max_aggregates:
                self._members.popitem(last=False)

    def members(self, aggregate_id: str) -> list[Any]:
        """The member verdicts remembered for ``aggregate_id`` (empty if none)."""
        with self._lock:
            return list(self._members.get(aggregate_id, []))

    def claim(self, ids: Sequence[str], owner: str) -> dict[str, Verdict]:
        """Wait until no other frame holds any of ``ids``; their stored verdicts, else claim them all.

        ``owner`` names the claiming frame; :meth:`release` gives the claim back.
        """
        with self._claimed:
            self._claimed.wait_for(lambda: all(self._owner.get(i, owner) == owner for i in ids))
            done = {i: v for i in ids if (v := self._verdicts.get(i)) is not None}
            if not done:
                for i in ids:
                    self._owner[i] = owner
            return done

    def release(self, ids: Sequence[str], owner: str) -> None:
        """Give back the claim of ``owner`` on ``ids`` (those it holds)."""
        with self._claimed:
            for i in ids:
                if self._owner.get(i) == owner:
                    del self._owner[i]
            self._claimed.notify_all()
