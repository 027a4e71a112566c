"""When a synchronous round's members are expected: arrival models (issue 23, docs/rounds.md).

A synchronous round's updates become ready one by one: each worker got the model at about
the same time, but computes for its own (jittered) time. A policy planning the round at
its first arrival needs to know when the others will come. An :class:`ArrivalModel`
answers, per round and worker, with an expected ready time and a spread:

* :class:`LearnedArrivals` (what the service and the simulator run): each worker's offset
  from its round's *anchor* (the first update of the round the scheduler saw), averaged
  over past rounds, and the mean absolute deviation of that offset. Nothing is known of a
  worker before its first round: it is expected now, with no spread.
* :class:`KnownArrivals` (the yardstick): the true offsets, given by the experiment, so
  the same planner plans every round as if it knew when each member comes.

Pure: no clock, no I/O; times are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ArrivalModel", "Expected", "KnownArrivals", "LearnedArrivals"]

ServerKey = tuple[str, str]  # (job, server)


@dataclass(frozen=True)
class Expected:
    """When a member is expected: ``at`` (s, on the caller's clock) and ``spread`` (s).

    ``spread`` is ``None`` when nothing is known of the worker (no earlier round).
    """

    at: float
    spread: float | None


class ArrivalModel(Protocol):
    """What a round planner asks about a synchronous round's members."""

    def observe(self, key: ServerKey, version: int, worker: str, ready_at: float) -> None:
        """``worker``'s update of round ``version`` of server ``key`` was ready at ``ready_at``."""
        ...

    def expect(self, key: ServerKey, version: int, worker: str, now: float) -> Expected:
        """When ``worker``'s update of that round is expected (never before ``now``)."""
        ...


class _Anchors:
    """Each round's anchor: the earliest ready time seen of its updates (bounded memory)."""

    def __init__(self, keep: int = 64) -> None:
        self._anchor: dict[tuple[ServerKey, int], float] = {}
        self._keep = keep

    def see(self, key: ServerKey, version: int, ready_at: float) -> float:
        at = self._anchor.get((key, version))
        if at is None or ready_at < at:
            self._anchor[(key, version)] = at = ready_at
            while len(self._anchor) > self._keep:
                del self._anchor[next(iter(self._anchor))]
        return at

    def get(self, key: ServerKey, version: int) -> float | None:
        return self._anchor.get((key, version))


class LearnedArrivals:
    """Each worker's offset from its round's first arrival, learned over rounds.

    Parameters
    ----------
    weight : float
        Weight of the newest round in the moving averages (exponentially weighted).

    Examples
    --------
    >>> m = LearnedArrivals(weight=0.5)
    >>> for v, (a, b) in enumerate([(1.0, 1.010), (2.0, 2.020)]):
    ...     m.observe(("j", "ps"), v, "w0", a)
    ...     m.observe(("j", "ps"), v, "w1", b)
    >>> m.observe(("j", "ps"), 2, "w0", 3.0)
    >>> e = m.expect(("j", "ps"), 2, "w1", now=3.001)
    >>> round(e.at, 4), round(e.spread, 4)
    (3.015, 0.005)
    >>> m.expect(("j", "ps"), 2, "w9", now=3.001)     # never seen: expected now
    Expected(at=3.001, spread=None)
    """

    def __init__(self, weight: float = 0.3) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._anchors = _Anchors()
        self._mean: dict[tuple[ServerKey, str], float] = {}
        self._dev: dict[tuple[ServerKey, str], float] = {}
        self._seen: set[tuple[ServerKey, int, str]] = set()

    def observe(self, key: ServerKey, version: int, worker: str, ready_at: float) -> None:
        """Count ``worker``'s arrival in round ``version`` (once per round and worker)."""
        if (key, version, worker) in self._seen:
            return
        self._seen.add((key, version, worker))
        if len(self._seen) > 1 << 16:
            self._seen.clear()
        offset = ready_at - self._anchors.see(key, version, ready_at)
        k = (key, worker)
        mean = self._mean.get(k)
        if mean is None:
            self._mean[k], self._dev[k] = offset, 0.0
            return
        w = self.weight
        self._dev[k] = (1 - w) * self._dev[k] + w * abs(offset - mean)
        self._mean[k] = (1 - w) * mean + w * offset

    def expect(self, key: ServerKey, version: int, worker: str, now: float) -> Expected:
        """The anchor plus the worker's mean offset, and its mean absolute deviation."""
        anchor = self._anchors.get(key, version)
        mean = self._mean.get((key, worker))
        if anchor is None or mean is None:
            return Expected(now, None)
        return Expected(max(now, anchor + mean), self._dev[(key, worker)])


class KnownArrivals:
    """The yardstick's arrival model: every member's true offset from its round's start.

    Parameters
    ----------
    offsets : callable
        ``offsets(version)`` -> worker -> seconds from the round's start (the model leaving
        the server) to the worker's update being ready; the round's first arrival is the
        smallest of them, which places the others on the caller's clock.

    Examples
    --------
    >>> m = KnownArrivals(lambda v: {"w0": 0.05, "w1": 0.06})
    >>> m.observe(("j", "ps"), 0, "w0", 10.05)
    >>> m.expect(("j", "ps"), 0, "w1", now=10.05)
    Expected(at=10.06, spread=0.0)
    """

    def __init__(self, offsets: Callable[[int], Mapping[str, float]]) -> None:
        self._offsets = offsets
        self._anchors = _Anchors()

    def observe(self, key: ServerKey, version: int, worker: str, ready_at: float) -> None:
        """Fix the round's start from its first arrival."""
        self._anchors.see(key, version, ready_at - self._offsets(version)[worker])

    def expect(self, key: ServerKey, version: int, worker: str, now: float) -> Expected:
        """The round's start plus the worker's true offset."""
        start = self._anchors.get(key, version)
        offsets = self._offsets(version)
        if start is None or worker not in offsets:
            return Expected(now, None)
        return Expected(max(now, round(start + offsets[worker], 12)), 0.0)
