"""Decide, adopt, release: the one decision pipeline of the service and the simulator.

The scheduler service (:class:`~mlfabric.scheduler.service.core.SchedulerCore`) and the
simulator (:class:`~mlfabric.scheduler.sim.engine.Simulator`) both hold a
:class:`DecisionRunner` and differ only in what they do around it (gRPC directives and
daemons; a fluid network and a simulated server). The runner

* calls ``policy.decide(snapshot, pending)`` with every update not yet released (but the
  ``resent`` ones: announced again after their server failed over, they may be applied
  there already, so they go whole to the server at once, ahead of the policy's sends: no
  policy may sum them into an aggregate or drop them; docs/replication.md) and
  adopts the decision: its sends replace the unreleased plan of the
  :class:`~mlfabric.scheduler.policies.dispatch.Dispatcher`, its aggregates join those
  being gathered (an earlier aggregate not listed again, none of whose members has been
  released, is replaced; one listed again with more members takes them in, which the
  policy sees in ``Snapshot.gathering``); executing the drops is the caller's;
* releases, given the clock and the transfers in flight, the sends whose ``after`` are
  (nearly) done, and the aggregates whose members are all in at their aggregator, whose
  ``after`` are done and whose ``hold_until`` (a synchronous round's wait for members
  expected later) has passed. An aggregate being gathered counts as a transfer in flight
  that will not end soon, so a send planned after it waits for it;
* says, through its :class:`~mlfabric.scheduler.policies.dispatch.ReplanTrigger`, when to
  decide again without a new ready update (bounded-horizon planning).

Pure: no I/O; the clock and the in-flight transfers are arguments.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from mlfabric.scheduler.core.graph import shortest_path
from mlfabric.scheduler.core.native import _plan_native
from mlfabric.scheduler.policies.base import (
    Decision,
    InFlight,
    PendingUpdate,
    PlannedAggregate,
    Policy,
    Send,
    Snapshot,
)
from mlfabric.scheduler.policies.dispatch import Dispatcher, Release, ReplanTrigger

__all__ = ["DecisionError", "DecisionRunner", "Released"]


_resent = operator.attrgetter("resent")
_update_id = operator.attrgetter("update_id")
_SEQ = operator.itemgetter(1)  # (aggregate id, seq) -> seq: the order the aggregates were adopted in


class DecisionError(ValueError):
    """A policy's decision cannot be executed (it names an update that is not pending)."""


@dataclass(frozen=True)
class Released:
    """What goes now: sends (in the plan's order) and aggregates to forward from their aggregator."""

    sends: tuple[Release, ...] = ()
    aggregates: tuple[PlannedAggregate, ...] = ()

    def __bool__(self) -> bool:
        """Whether anything was released."""
        return bool(self.sends or self.aggregates)


@dataclass
class _Gathering:
    planned: PlannedAggregate
    members: list[str]
    arrived: set[str] = field(default_factory=set)
    started: bool = False  # a member has been released
    seq: int = 0  # its place among the aggregates gathered (their order of adoption)
    blocker: str = ""  # the one of its ``after`` that held it back last (looked up first)

    def placeholder(self) -> InFlight:
        """The aggregate as a transfer in flight that ends at no known time."""
        return InFlight(self.planned.aggregate_id, "", "", (), int(self.planned.bytes), math.inf, math.inf)


class DecisionRunner:
    """One policy's decisions, adopted and released as the network moves.

    Parameters
    ----------
    policy : Policy
        Decides on every pending update (see :mod:`mlfabric.scheduler.policies.registry`).
    dispatcher : Dispatcher, optional
        Holds the unreleased sends (default: ``Dispatcher()``, the default margin).
    trigger : ReplanTrigger, optional
        When to decide again with no new ready update (default: low-water 0).

    Examples
    --------
    Two updates behind one 1 MB/s bottleneck under ``stf``: the small one goes first, the
    big one once the small one is (nearly) done.

    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.policies.registry import make_policy
    >>> setup = make_policy("stf")
    >>> r = DecisionRunner(setup.policy, dispatcher=Dispatcher(margin=0.0), trigger=setup.trigger)
    >>> mk = lambda uid, host, size: PendingUpdate(uid, "j", "s", host, host, "ps", size, 1.0, 0, 0.0)
    >>> d = r.decide(Snapshot(0.0, star(["ps", "a", "b"], 8e6)), [mk("big", "a", 3e6), mk("small", "b", 1e6)])
    >>> [x.send.update_id for x in r.release(0.0, {}).sends]
    ['small']
    >>> small = InFlight("small", "j", "s", ("b", "sw", "ps"), 10**6, 0.0, 1.0)
    >>> r.release(0.5, {"small": small}), [x.send.update_id for x in r.release(1.0, {}).sends]
    (Released(sends=(), aggregates=()), ['big'])
    """

    def __init__(
        self, policy: Policy, *, dispatcher: Dispatcher | None = None, trigger: ReplanTrigger | None = None
    ) -> None:
        self.policy = policy
        self.dispatcher = Dispatcher() if dispatcher is None else dispatcher
        self.trigger = ReplanTrigger() if trigger is None else trigger
        #: decisions made (calls of the policy)
        self.decisions = 0
        #: waits of kept aggregates for updates a newer plan sends after them, dropped (:meth:`adopt`)
        self.broken_waits = 0
        self._gathering: dict[str, _Gathering] = {}
        self._member_of: dict[str, str] = {}
        # the aggregates all of whose members are in (the only ones a release or a wake-up looks
        # at: kept as members come and go, issue 24), and the adoption counter of their order
        self._complete: dict[str, int] = {}  # aggregate id -> its seq: those with every member in
        self._seq = itertools.count()
        self._replanned = False  # the plan or an aggregate's members changed since wakeup_changed()
        # the last decision's pending list, its update ids (how many times each is listed) and how
        # many of it are resent: kept by the objects added and taken out since (issue 24)
        self._listed: list[PendingUpdate] | None = None
        self._listed_ids: dict[str, int] = {}
        self._listed_resent = 0

    # ------------------------------------------------------------------ deciding

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        """Run the policy on ``pending`` and adopt its decision (the caller executes the drops).

        Parameters
        ----------
        snapshot : Snapshot
            What the policy may look at.
        pending : sequence of PendingUpdate
            Every update not yet released.

        Returns
        -------
        Decision
            The policy's decision (empty, without calling the policy, if nothing is pending),
            after the sends of the ``resent`` updates (straight to their servers, at once).

        Raises
        ------
        DecisionError
            If a send names an update that is not in ``pending``.
        """
        decision = Decision()
        ids = self._index(pending)
        resent = self._listed_resent
        planned = list(itertools.filterfalse(_resent, pending)) if resent else list(pending)
        if planned:
            decision = self.policy.decide(replace(snapshot, gathering=self.gathering), planned)
            self.decisions += 1
        if len(planned) < len(pending):
            whole = tuple(
                Send(p.update_id, p.dst_host, tuple(shortest_path(snapshot.graph, p.src_host, p.dst_host)))
                for p in pending
                if p.resent
            )
            decision = replace(decision, sends=(*whole, *decision.sends))
        if not all(map(ids.__contains__, map(_update_id, decision.sends))):
            bad = next(s.update_id for s in decision.sends if s.update_id not in ids)
            raise DecisionError(f"policy {self.policy.name!r} sent '{bad}', which is not pending")
        self.trigger.decided()
        self.adopt(decision)
        return decision

    def _index(self, pending: Sequence[PendingUpdate]) -> Mapping[str, int]:
        """The update ids of ``pending`` (how many times each is listed); counts its resent ones.

        Kept from the last decision's list by the objects added and taken out since
        (``_plan_native.list_diff``: the new list is the last one less some plus some after
        them, as the simulator lists its pending updates), else counted over ``pending``
        (issue 24: two passes over ~1,000 pending updates per decision before).
        """
        last, self._listed = self._listed, None
        diff = None
        if last is not None and _plan_native is not None and type(pending) is list:
            diff = _plan_native.list_diff(last, pending)
        ids = self._listed_ids
        if diff is None:
            ids = self._listed_ids = {}
            for uid in map(_update_id, pending):
                ids[uid] = ids.get(uid, 0) + 1
            self._listed_resent = len(pending) - sum(1 for _ in itertools.filterfalse(_resent, pending))
        else:
            added, taken = diff
            for p in taken:
                n = ids[p.update_id]
                if n > 1:
                    ids[p.update_id] = n - 1
                else:
                    del ids[p.update_id]
                if p.resent:
                    self._listed_resent -= 1
            for p in added:
                ids[p.update_id] = ids.get(p.update_id, 0) + 1
                if p.resent:
                    self._listed_resent += 1
        self._listed = list(pending)
        return ids

    def adopt(self, decision: Decision) -> None:
        """Make ``decision`` the plan of every update not yet released."""
        self._replanned = True
        listed = {a.aggregate_id for a in decision.aggregates}
        for aid in [a for a, g in self._gathering.items() if a not in listed and not self._started(g)]:
            self._drop_aggregate(aid)
        for a in decision.aggregates:
            g = self._gathering.get(a.aggregate_id)
            if g is None:
                self._gathering[a.aggregate_id] = _Gathering(a, list(a.members), seq=next(self._seq))
                for m in a.members:
                    self._member_of[m] = a.aggregate_id
                self._recheck(a.aggregate_id)
                continue
            for m in a.members:  # listed again with more members: they join it before it leaves
                if m not in g.members and m not in self._member_of:
                    g.members.append(m)
                    self._member_of[m] = a.aggregate_id
            self._recheck(a.aggregate_id)
            if a.hold_until != g.planned.hold_until:  # the policy's latest word on how long it waits
                g.planned = replace(g.planned, hold_until=a.hold_until)
        self._break_cycles(decision.sends)
        self.dispatcher.adopt(decision)
        self.forget(d.update_id for d in decision.drops)

    def _break_cycles(self, sends: Sequence[Send]) -> None:
        """An aggregate no longer waits for an update the new plan sends after it.

        An aggregate kept from an earlier decision (a member already released) keeps the
        ``after`` of that decision; a later decision may plan one of those updates anew after
        the aggregate (it sees the aggregate as a transfer that will not end soon). Both would
        wait for each other until the round timed out (a synchronous round's stall on the
        racks testbed: an aggregate after a direct send, the send re-planned after the
        aggregate). The newer plan wins: the aggregate's wait for that update is dropped.
        Cycles through other sends and aggregates (``after`` and unreleased members) count.
        """
        if not self._gathering:
            return  # no aggregate waits for anything
        after = {s.update_id: s.after for s in sends}
        for g in self._gathering.values():
            waits = [x for x in g.planned.after if x in after]
            if not waits:
                continue
            aid = g.planned.aggregate_id
            cyclic = [x for x in waits if self._waits_for(x, aid, after)]
            if cyclic:
                self.broken_waits += len(cyclic)
                g.planned = replace(g.planned, after=tuple(x for x in g.planned.after if x not in cyclic))

    def _waits_for(self, start: str, target: str, after: Mapping[str, tuple[str, ...]]) -> bool:
        """Whether ``start`` (a send or an aggregate) waits, transitively, for aggregate ``target``."""
        seen: set[str] = set()
        todo = [start]
        while todo:
            x = todo.pop()
            if x == target:
                return True
            if x in seen:
                continue
            seen.add(x)
            todo.extend(after.get(x, ()))
            g = self._gathering.get(x)
            if g is not None:
                todo.extend(g.planned.after)
                todo.extend(m for m in g.members if m not in g.arrived)
        return False

    def forget(self, update_ids: Iterable[str]) -> None:
        """Updates that went away unreleased (dropped, their daemon left): out of the plan.

        An aggregate no longer waits for a member that went away; one left with no member
        is forgotten, and leaves the aggregate it was to be summed into (a deeper tree).
        """
        ids = list(update_ids)
        self._replanned = True
        self.dispatcher.forget(ids)
        while ids:
            uid = ids.pop(0)
            aid = self._member_of.pop(uid, None)
            g = self._gathering.get(aid) if aid is not None else None
            if g is None:
                continue
            g.members = [m for m in g.members if m != uid]
            g.arrived.discard(uid)
            self._recheck(g.planned.aggregate_id)
            if not g.members:
                self._drop_aggregate(g.planned.aggregate_id)
                if g.planned.aggregate_id in self._member_of:
                    ids.append(g.planned.aggregate_id)

    def _started(self, g: _Gathering) -> bool:
        """Whether a member of ``g`` was released, or (a deeper tree) a member aggregate started."""
        return g.started or any(m in self._gathering and self._started(self._gathering[m]) for m in g.members)

    def _recheck(self, aid: str) -> None:
        """Whether aggregate ``aid``, being gathered, has all its members in (:attr:`_complete`)."""
        g = self._gathering.get(aid)
        if g is not None and len(g.arrived) >= len(g.members):
            self._complete[aid] = g.seq
        else:
            self._complete.pop(aid, None)

    def _drop_aggregate(self, aid: str) -> None:
        g = self._gathering.pop(aid)
        self._complete.pop(aid, None)
        for m in g.members:
            if self._member_of.get(m) == aid:
                del self._member_of[m]

    # ----------------------------------------------------------------- releasing

    def arrived(self, member_id: str) -> None:
        """Member ``member_id`` is in at its aggregator (ignored if it belongs to no aggregate)."""
        aid = self._member_of.get(member_id)
        if aid is not None and aid in self._gathering:
            self._gathering[aid].arrived.add(member_id)
            self._recheck(aid)
            self._replanned = True

    def aggregate_of(self, update_id: str) -> PlannedAggregate | None:
        """The aggregate being gathered that ``update_id`` is a member of, if any."""
        aid = self._member_of.get(update_id)
        g = self._gathering.get(aid) if aid is not None else None
        return None if g is None else replace(g.planned, members=tuple(g.members))

    @property
    def gathering(self) -> tuple[PlannedAggregate, ...]:
        """Aggregates planned and not yet forwarded (members as they stand)."""
        return tuple(replace(g.planned, members=tuple(g.members)) for g in self._gathering.values())

    def release(self, now: float, in_flight: Mapping[str, InFlight]) -> Released:
        """Take out every aggregate and send that may go at ``now``.

        Parameters
        ----------
        now : float
            The current time, on the clock the plan's expected times use.
        in_flight : mapping
            id -> :class:`InFlight`, the transfers (updates and aggregates) released and not
            yet reported done.

        Returns
        -------
        Released
            Aggregates whose members are all in and whose ``after`` are done (neither in
            flight, nor planned, nor gathered), then sends whose ``after`` are (nearly) done
            (see :meth:`Dispatcher.release`).
        """
        # a transfer in flight past its expected end (less the margin) is nearly done: its report
        # may be held (a synchronous round ACKs once applied, which may need this aggregate)
        near = now + self.dispatcher.margin
        gathered = self._gathering
        gone: set[str] = set()  # forwarded by this call: they count as gathering for the others

        def busy(uid: str) -> bool:
            f = in_flight.get(uid)
            if f is not None and f.expected_end > near:
                return True
            return uid in gathered or uid in gone or uid in self.dispatcher

        forwarded: list[_Gathering] = []
        # those with every member in, in the order they were adopted (a member's arrival is rare
        # beside a release: no pass over every aggregate being gathered)
        for aid, _ in sorted(self._complete.items(), key=_SEQ):
            g = gathered[aid]
            if g.planned.hold_until > now:  # a synchronous round's members still expected
                continue
            if g.blocker and busy(g.blocker):
                continue
            g.blocker = next((a for a in g.planned.after if busy(a)), "")
            if g.blocker:
                continue
            forwarded.append(gathered.pop(aid))
            gone.add(aid)
            self._complete.pop(aid, None)
            up = self._gathering.get(self._member_of.get(aid, ""))
            if up is not None:  # an aggregate summed into another one: that one has started
                up.started = True
            for m in g.members:
                self._member_of.pop(m, None)
        flying = _Over(self._placeholders(forwarded), in_flight)
        sends = self.dispatcher.release(now, flying)
        for r in sends:
            of = self._member_of.get(r.send.update_id)
            if of is not None:
                self._gathering[of].started = True
        aggregates = tuple(replace(g.planned, members=tuple(g.members)) for g in forwarded)
        return Released(tuple(sends), aggregates)

    def wakeup_changed(self) -> bool:
        """Whether :meth:`next_wakeup` may have become earlier since this was last asked.

        Only a new plan, a forgotten update or a member's arrival can bring it forward (a
        transfer's report only takes a reason to wait away, which :meth:`release` acts on).
        Callers that keep a timer ask this before recomputing :meth:`next_wakeup`.
        """
        changed, self._replanned = self._replanned, False
        return changed

    def next_wakeup(self, in_flight: Mapping[str, InFlight]) -> float | None:
        """The earliest time a planned send or an aggregate may go by the clock alone (or ``None``).

        An aggregate counts once all its members are in: it may go at the end of its hold
        (``PlannedAggregate.hold_until``) and once the transfers of its ``after`` in flight are
        nearly done.
        """
        wakes = [self.dispatcher.next_wakeup(_Over(self._placeholders(), in_flight))]
        gathering, planned, margin = self._gathering, self.dispatcher, self.dispatcher.margin
        inf = math.inf
        for aid in self._complete:  # the others: their last member's arrival is an event of its own
            g = gathering[aid]
            b = g.blocker  # what held it back last time, likely still there: looked up first
            if b and (b in gathering or b in planned or _ends_never(in_flight.get(b), margin)):
                continue
            # held back by one of its ``after`` planned or gathering (reconsidered when that one is
            # released), or in flight with no expected end (a wake-up at inf: none); else in
            # flight: nearly done at its expected end less the margin, whether or not its report
            # comes (a synchronous round holds the reports of its direct sends until it is applied,
            # which may need this very aggregate: without this wake-up nothing would release it
            # before the transfer counts as stalled)
            at, b = g.planned.hold_until, ""
            for a in g.planned.after:
                if a in gathering or a in planned:
                    b = a
                    break
                f = in_flight.get(a)
                if f is not None:
                    end = f.expected_end - margin
                    if end == inf:
                        b = a
                        break
                    if end > at:  # max(hold_until, *ends)
                        at = end
            g.blocker = b
            if not b:
                wakes.append(at)
        wake = min((w for w in wakes if w is not None and w > 0), default=None)
        return None if wake is None or math.isinf(wake) else wake

    def _placeholders(self, extra: Iterable[_Gathering] = ()) -> Mapping[str, InFlight]:
        return _Placeholders(self._gathering, {g.planned.aggregate_id: g for g in extra})

    # -------------------------------------------------------------- re-planning

    def moved(self, pending: int) -> bool:
        """Something moved (a send released, a transfer ended, an update went away).

        Parameters
        ----------
        pending : int
            Updates not yet released (planned or not).

        Returns
        -------
        bool
            Whether a decision is due now (:meth:`ReplanTrigger.due`).
        """
        self.trigger.moved()
        planned = len(self.dispatcher)
        return self.trigger.due(planned, pending - planned)


def _ends_never(f: InFlight | None, margin: float) -> bool:
    """Whether ``f`` is a transfer in flight with no expected end (``inf``)."""
    return f is not None and f.expected_end - margin == math.inf


class _Placeholders(Mapping[str, InFlight]):
    """Aggregates still gathering (then ``extra``) as transfers in flight, by aggregate id.

    ``{a.aggregate_id: a.placeholder() for a in (*gathering.values(), *extra.values())}``,
    each placeholder made when it is looked up: a release or a wake-up looks up only the
    ``after`` of its sends, not every aggregate of the plan (issue 24).
    """

    __slots__ = ("extra", "gathering")

    def __init__(self, gathering: Mapping[str, _Gathering], extra: Mapping[str, _Gathering]) -> None:
        self.gathering, self.extra = gathering, extra

    def __getitem__(self, key: str) -> InFlight:
        g = self.extra.get(key) or self.gathering[key]
        return g.placeholder()

    def get(self, key: str, default: InFlight | None = None) -> InFlight | None:  # type: ignore[override]
        g = self.extra.get(key) or self.gathering.get(key)
        return default if g is None else g.placeholder()

    def __contains__(self, key: object) -> bool:
        return key in self.extra or key in self.gathering

    def __iter__(self) -> Iterator[str]:
        yield from dict.fromkeys([*self.gathering, *self.extra])

    def __len__(self) -> int:
        return len(self.gathering) + sum(1 for k in self.extra if k not in self.gathering)


class _Over(Mapping[str, InFlight]):
    """``{**base, **top}`` without the copy: ``top``'s entries, then ``base``'s."""

    __slots__ = ("base", "top")

    def __init__(self, top: Mapping[str, InFlight], base: Mapping[str, InFlight]) -> None:
        self.top, self.base = top, base

    def __getitem__(self, key: str) -> InFlight:
        f = self.top.get(key)
        return self.base[key] if f is None else f

    def __contains__(self, key: object) -> bool:
        return key in self.top or key in self.base

    def __iter__(self) -> Iterator[str]:
        yield from self.top
        yield from (k for k in self.base if k not in self.top)

    def __len__(self) -> int:
        return len(self.top) + sum(1 for k in self.base if k not in self.top)
