"""Releasing a policy's sends at the right moment (network time-sharing, paper §3.1.1).

A policy's :class:`~mlfabric.scheduler.policies.base.Decision` is a plan: each
:class:`~mlfabric.scheduler.policies.base.Send` may wait for the transfers in its ``after``.
:class:`Dispatcher` holds the sends not yet released and, given the clock and the
transfers in flight, says which go now. A send is released when every transfer in its
``after`` is done — reported, dropped, or otherwise no longer known — or *nearly* done:
``now >= expected_end - margin``. Releasing a little early keeps the bottleneck busy
while the report and the next directive cross the control plane; the overlap is at most
``margin`` of shared bandwidth.

Re-planning: when new updates arrive the service calls the policy again with *every*
update not yet released (the dispatcher's unreleased sends are still pending in the
state), then :meth:`Dispatcher.adopt` replaces the plan. Released sends are never
revisited.

Bounded horizon: a policy may plan only the head of its order (``STFPolicy(horizon=N)``
plans the first N sends of the STF order, the same as in the full order) and leave the
other pending updates undecided. :class:`ReplanTrigger` says when the service must decide
again without a new ready notification: when the planned-but-unreleased sends have
fallen to a low-water mark while unplanned pending updates remain, and something moved
(a send was released or a transfer ended) since the last decision.

Batching: :class:`BatchWindow` is the adaptive batching rule of ready notifications (a
burst of pushes is decided together: DESIGN §3, paper §4): a batch closes ``window``
after its latest notification, at most ``max_wait`` after its first.

Pure: no I/O, the clock is an argument.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mlfabric.scheduler.core.native import _plan_native
from mlfabric.scheduler.policies.base import Decision, InFlight, Send

__all__ = [
    "DEFAULT_MARGIN",
    "DEFAULT_MAX_WAIT",
    "DEFAULT_WINDOW",
    "BatchWindow",
    "Dispatcher",
    "Release",
    "ReplanTrigger",
    "low_water_mark",
]

#: seconds before a predecessor's expected end at which its successor may be released
DEFAULT_MARGIN = 0.002


@dataclass(frozen=True)
class Release:
    """A send released at ``started_at``, expected to end at ``expected_end``.

    The expected end keeps the planned duration (``send.expected_end -
    send.expected_start``) counted from the release or, when released early (within the
    margin), from the expected end of its last predecessor: a chain released early stays
    a chain, so no more than about ``margin`` of transfers overlap on a bottleneck.
    """

    send: Send
    started_at: float
    expected_end: float


class Dispatcher:
    """The unreleased part of the current plan, released as predecessors (nearly) finish.

    Parameters
    ----------
    margin : float
        Seconds before a predecessor's expected end at which a successor may go.

    Examples
    --------
    >>> from mlfabric.scheduler.policies.base import Decision, Send
    >>> d = Dispatcher(margin=0.001)
    >>> d.adopt(Decision(sends=(Send("a", "h0", ("h1", "h0"), (), 0.0, 1.0),
    ...                         Send("b", "h0", ("h2", "h0"), ("a",), 1.0, 2.0))))
    >>> [r.send.update_id for r in d.release(now=0.0, in_flight={})]
    ['a']
    >>> inflight = {"a": InFlight("a", "j", "ps", ("h1", "h0"), 10, 0.0, 1.0)}
    >>> d.release(now=0.5, in_flight=inflight), d.next_wakeup(inflight)
    ([], 0.999)
    >>> [r.send.update_id for r in d.release(now=0.999, in_flight=inflight)]
    ['b']
    """

    def __init__(self, margin: float = DEFAULT_MARGIN) -> None:
        if margin < 0:
            raise ValueError(f"margin must be >= 0 seconds, got {margin}")
        self.margin = margin
        self._planned: dict[str, Send] = {}
        # kept with the plan (adopt, then each send taken out), so that a release or a wake-up
        # looks only at the sends no planned send holds back (issue 24): the place of each
        # planned send in the plan, how many of its ``after`` are planned, which planned sends
        # wait for it, and the sends none of whose ``after`` is planned
        self._pos: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._waiting: dict[str, str | list[str]] = {}  # one waiting: its id (no list to keep)
        self._free: set[str] = set()

    def __len__(self) -> int:
        """How many sends are planned and not yet released."""
        return len(self._planned)

    def __contains__(self, update_id: object) -> bool:
        """Whether ``update_id`` has a planned, unreleased send."""
        return update_id in self._planned

    @property
    def planned(self) -> tuple[Send, ...]:
        """The sends not yet released, in the policy's order."""
        return tuple(self._planned.values())

    def adopt(self, decision: Decision) -> None:
        """Make ``decision``'s sends the plan, replacing the unreleased sends of the last one.

        Parameters
        ----------
        decision : Decision
            The policy's answer for every pending update; its drops are the caller's.
        """
        sends = decision.sends
        if _plan_native is not None and type(sends) is tuple:  # the loops below in C (issue 24)
            made = _plan_native.dispatch_index(sends)
            if made is not None:  # (None: an id that is not a str, an `after` not a tuple)
                self._planned, self._pos, self._held, self._waiting, self._free = made
                return
        self._planned = planned = {s.update_id: s for s in sends}
        self._pos = dict(zip(planned, itertools.count()))
        held: dict[str, int] = {}
        waiting: dict[str, str | list[str]] = {}
        free: set[str] = set()
        self._held, self._waiting, self._free = held, waiting, free
        for uid, send in planned.items():
            n = 0
            for a in send.after:
                if a in planned:
                    n += 1
                    w = waiting.get(a)
                    if w is None:
                        waiting[a] = uid
                    elif isinstance(w, str):
                        waiting[a] = [w, uid]
                    else:
                        w.append(uid)
            if n:
                held[uid] = n
            else:
                free.add(uid)

    def forget(self, update_ids: Iterable[str]) -> None:
        """Remove sends from the plan (their updates were dropped or their daemon left)."""
        for uid in update_ids:
            if uid in self._planned:
                self._take(uid)

    def _take(self, uid: str) -> list[str]:
        """Take planned ``uid`` out of the plan; the sends that no planned send holds back now."""
        del self._planned[uid]
        self._free.discard(uid)
        self._held.pop(uid, None)
        freed: list[str] = []
        held = self._held
        waiting = self._waiting.pop(uid, ())
        for w in (waiting,) if isinstance(waiting, str) else waiting:
            n = held.get(w)
            if n is None:
                continue  # no longer planned
            if n > 1:
                held[w] = n - 1
            else:
                del held[w]
                self._free.add(w)
                freed.append(w)
        return freed

    def release(self, now: float, in_flight: Mapping[str, InFlight]) -> list[Release]:
        """Take out of the plan, in order, every send whose predecessors are (nearly) done.

        A predecessor is *done* when it is neither planned nor in flight; an in-flight
        predecessor is *nearly done* when ``now >= expected_end - margin``. A send
        released by this call counts as in flight for the sends after it, so a chain of
        short transfers can go in one call.

        Parameters
        ----------
        now : float
            The current time, on the clock the expected times use.
        in_flight : mapping
            update id -> :class:`InFlight`, the transfers released and not yet reported.

        Returns
        -------
        list of Release
            The sends to execute now, in the plan's order.
        """
        released: list[Release] = []
        # the ends of the transfers in flight, and of the sends released by this call (looked up
        # per predecessor: no copy of everything in flight per call)
        ends = _Ends(in_flight)
        pos = self._pos
        progress = True
        while progress and self._planned:
            progress = False
            # one pass over the plan in its order; a send held back by a planned one is blocked,
            # so only the free ones are looked at, each once: those freed by a release in this
            # pass when they come after it in the plan, the others in the next pass
            todo = [(pos[uid], uid) for uid in self._free]
            heapq.heapify(todo)
            while todo:
                at, uid = heapq.heappop(todo)
                send = self._planned[uid]
                if self._blocked(send, now, ends):
                    continue
                duration = max(0.0, send.expected_end - send.expected_start)
                start = max([now, *(e for e in map(ends.get, send.after) if e is not None)])
                r = Release(send, now, start + duration)
                released.append(r)
                ends[uid] = r.expected_end
                for w in self._take(uid):
                    if pos[w] > at:
                        heapq.heappush(todo, (pos[w], w))
                progress = True
        return released

    def next_wakeup(self, in_flight: Mapping[str, InFlight]) -> float | None:
        """The earliest time a planned send may become releasable by the clock alone.

        ``None`` when every planned send waits for a send that is itself still planned
        (it will be reconsidered when that one is released) or nothing is planned.
        """
        best: float | None = None
        for uid in sorted(self._free, key=self._pos.__getitem__):  # in the plan's order, as before
            send = self._planned[uid]
            ends = [in_flight[a].expected_end for a in send.after if a in in_flight]
            at = max(ends, default=float("-inf")) - self.margin
            best = at if best is None else min(best, at)
        return best

    def _blocked(self, send: Send, now: float, ends: _Ends) -> bool:
        for a in send.after:
            if a in self._planned:
                return True
            end = ends.get(a)
            if end is not None and now < end - self.margin:
                return True
        return False


class _Ends:
    """Expected ends by id: those set here, else those of the transfers in flight."""

    __slots__ = ("in_flight", "own")

    def __init__(self, in_flight: Mapping[str, InFlight]) -> None:
        self.in_flight = in_flight
        self.own: dict[str, float] = {}

    def get(self, uid: str) -> float | None:
        end = self.own.get(uid)
        if end is None:
            f = self.in_flight.get(uid)
            if f is not None:
                return f.expected_end
        return end

    def __setitem__(self, uid: str, end: float) -> None:
        self.own[uid] = end


def low_water_mark(horizon: int | None) -> int:
    """The default low-water mark for a policy planning ``horizon`` sends: a quarter of it.

    Parameters
    ----------
    horizon : int or None
        Sends planned per decision; ``None`` or 0: every pending update is planned.

    Returns
    -------
    int
        Re-decide once the planned sends fall to this many (0 without a horizon: only
        when nothing is planned at all).

    Examples
    --------
    >>> low_water_mark(256), low_water_mark(4), low_water_mark(1), low_water_mark(None)
    (64, 1, 0, 0)
    """
    return 0 if not horizon else horizon // 4


class ReplanTrigger:
    """When to decide again without a new ready notification (bounded-horizon planning).

    With a horizon the policy plans only the head of its order (paper §5's STF order is
    greedy, so the head does not change when the tail is planned later); the service
    must ask again before the planned sends run out, or the unplanned updates would wait
    for the next ready notification. A decision is due when

    * unplanned pending updates remain (pending but not in the dispatcher's plan),
    * the planned, unreleased sends are at most ``low_water`` — 0 covers "a transfer
      report freed a link and nothing is planned", and
    * something moved since the last decision (:meth:`moved`: a send released, a
      transfer reported or dropped), so a policy that leaves an update undecided
      cannot make the service spin.

    Parameters
    ----------
    low_water : int
        Planned sends at or below which a decision is due (see :func:`low_water_mark`).

    Examples
    --------
    >>> t = ReplanTrigger(low_water=1)
    >>> t.decided(); t.due(planned=1, unplanned=16)   # nothing moved yet
    False
    >>> t.moved(); t.due(planned=2, unplanned=16), t.due(planned=1, unplanned=16)
    (False, True)
    >>> t.due(planned=0, unplanned=0)                 # nothing left to plan
    False
    """

    def __init__(self, low_water: int = 0) -> None:
        if low_water < 0:
            raise ValueError(f"low_water must be >= 0 sends, got {low_water}")
        self.low_water = low_water
        self._moved = False

    def decided(self) -> None:
        """A decision has just been made (call before adopting and releasing its plan)."""
        self._moved = False

    def moved(self) -> None:
        """A send was released, or a transfer or pending update went away."""
        self._moved = True

    def due(self, planned: int, unplanned: int) -> bool:
        """Whether to decide again now.

        Parameters
        ----------
        planned : int
            Sends planned and not yet released (``len(dispatcher)``).
        unplanned : int
            Pending updates without a planned send.

        Returns
        -------
        bool
        """
        return self._moved and unplanned > 0 and planned <= self.low_water


#: seconds of quiet after the latest notification that close a batch
DEFAULT_WINDOW = 300e-6
#: seconds after the first notification at which a batch closes regardless
DEFAULT_MAX_WAIT = 5e-3


@dataclass
class BatchWindow:
    """The open batch: when it started, when its latest notification came, how many.

    Parameters
    ----------
    window : float
        Quiet time (s) after the latest arrival that closes the batch.
    max_wait : float
        Longest time (s) a batch stays open after its first arrival.

    Examples
    --------
    >>> w = BatchWindow(window=0.001, max_wait=0.005)
    >>> w.arrive(0.0); w.arrive(0.0008); w.deadline()
    0.0018
    >>> w.due(0.0017), w.due(0.0018)
    (False, True)
    """

    window: float = DEFAULT_WINDOW
    max_wait: float = DEFAULT_MAX_WAIT
    first: float | None = None
    last: float | None = None
    count: int = 0

    def __post_init__(self) -> None:
        if self.window < 0 or self.max_wait < 0:
            raise ValueError(f"window and max_wait must be >= 0, got {self.window}, {self.max_wait}")

    def arrive(self, now: float) -> None:
        """Count a notification arriving at ``now`` (opens the batch if none is open)."""
        if self.first is None:
            self.first = now
        self.last = now
        self.count += 1

    def deadline(self) -> float | None:
        """When the open batch closes if nothing else arrives (``None``: no batch open)."""
        if self.first is None or self.last is None:
            return None
        return min(self.last + self.window, self.first + self.max_wait)

    def due(self, now: float) -> bool:
        """Whether the open batch is to be decided at ``now``."""
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def close(self) -> int:
        """Close the batch; returns how many notifications it held."""
        count = self.count
        self.first = self.last = None
        self.count = 0
        return count
