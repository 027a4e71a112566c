"""Synchronous rounds planned as a whole, members still to come included (issue 23, docs/rounds.md).

A synchronous round's updates arrive one by one (each worker's compute time is its own).
Planned a few at a time, as they come, they never form the round's tree: the first
update of a rack crosses the uplink alone because nothing else of its rack is there yet.
:class:`RoundBook` plans a round once, at its first decision, with every member: those
still to come as *expected* updates (ready when the
:class:`~mlfabric.scheduler.policies.arrivals.ArrivalModel` expects them), and then
follows that plan as the real updates arrive:

* an update whose worker the plan expected in an aggregate is sent to that aggregate's
  aggregator and joins it (the aggregate is listed again with it:
  :class:`~mlfabric.scheduler.policies.runner.DecisionRunner` takes it in before it
  leaves); an aggregate is listed once it has a member that is really there;
* an aggregate still expecting members is *held* (``PlannedAggregate.hold_until``): it
  does not leave before its planned start plus a slack, even with every listed member
  in. The slack is what the arrival model says of the late members (four mean absolute
  deviations, at least 5 % of the cost below), and never more than the *cost of not
  waiting*: one more payload through the bottleneck between the aggregator and the
  server, which is what the late member will cross on its own. A worker never seen before has no spread:
  the slack is that cost. So a member late beyond it does not hold the round: the
  aggregate leaves with what it has, and the late update is planned afresh, on its own
  (``rest``), when it comes;
* an update the plan sent straight to the server, or whose aggregate already left, is
  planned afresh with the other pending updates;
* an update already in an aggregate being gathered that no round put there (a worker's
  second update computed from the same version, planned with the asynchronous ones) is
  never claimed by a round: one update, one aggregate.

The book is the state of one policy object; the planner is passed in (the tree policy's
:func:`~mlfabric.scheduler.policies.trees.plan_tree`), so the service and the simulator
run the same code (both through the decision runner).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.core.records import instances
from mlfabric.scheduler.core.schedule import Schedule, Update
from mlfabric.scheduler.policies.arrivals import ArrivalModel, LearnedArrivals
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, PlannedAggregate, Send, Snapshot
from mlfabric.scheduler.policies.planning import core_updates, server_key

__all__ = ["RoundBook", "expected_id"]

ServerKey = tuple[str, str]
RoundKey = tuple[str, str, int]  # job, server, version
#: plans ``updates`` (core updates, some ready in the future) from ``snapshot``: the schedule,
#: the planner's aggregate id -> decision id, and the decision that executes it
Planner = Callable[[Snapshot, Sequence[Update]], tuple[Schedule, Mapping[str, str], Decision]]

#: the smallest slack of a held aggregate, as a fraction of its cost of not waiting
MIN_SLACK = 0.05
#: mean absolute deviations of a member's offset a held aggregate waits past its planned start
SLACK_DEVIATIONS = 4.0


def expected_id(job: str, server: str, version: int, worker: str) -> str:
    """The id a round's plan gives the update ``worker`` has not pushed yet.

    Examples
    --------
    >>> expected_id("j", "ps", 3, "w1")
    '~j/ps#3:w1'
    """
    return f"~{job}/{server}#{version}:{worker}"


@dataclass
class _Round:
    """One round's plan as it is being followed."""

    aggregates: dict[str, PlannedAggregate]  # every aggregate of the plan, members as planned
    expected: dict[str, str]  # worker -> its expected id, still in an aggregate of the plan
    deadline: dict[str, float]  # aggregate id -> hold deadline
    assigned: dict[str, str] = field(default_factory=dict)  # real update id -> aggregate id
    listed: set[str] = field(default_factory=set)  # aggregates handed to the runner
    parents: dict[str, str] = field(default_factory=dict)  # member -> aggregate (rebuilt on change)
    worker_of: dict[str, str] = field(default_factory=dict)  # expected id -> its worker

    def parent_of(self, member: str) -> str | None:
        """The aggregate ``member`` (an update, expected update or aggregate id) is planned into."""
        if not self.parents:
            self.parents = {m: aid for aid, a in self.aggregates.items() for m in a.members}
        return self.parents.get(member)

    def forget(self, aid: str) -> None:
        """Aggregate ``aid`` left (or failed): what it expected is planned afresh when it comes."""
        a = self.aggregates.pop(aid, None)
        if a is None:
            return
        self.listed.discard(aid)
        self.parents = {}
        for m in a.members:
            if m in self.aggregates and m not in self.listed:
                self.forget(m)  # never listed: nothing of it is at the runner
        for m in a.members:
            w = self.worker_of.get(m)
            if w is not None and self.expected.get(w) == m:
                del self.expected[w]
            if self.assigned.get(m) == aid:
                del self.assigned[m]

    def finished(self) -> bool:
        return not self.listed and not self.assigned and not self.expected


class RoundBook:
    """The rounds of synchronous servers, each planned once with its expected members.

    Parameters
    ----------
    arrivals : ArrivalModel, optional
        When members are expected; default :class:`LearnedArrivals`.

    Examples
    --------
    Two racks of three behind 80 Mbit/s uplinks, 1 MB updates; the server ``h0`` waits for a
    round of all five workers. Only ``h3``'s update is there at the first decision: it goes
    to its rack's aggregator, which holds for ``h4`` and ``h5`` (never seen: expected now;
    their updates in at 0.2 s, sharing ``h3``'s NIC, then held up to one payload across
    the uplink, 0.1 s).

    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> from mlfabric.scheduler.policies.base import RoundSpec
    >>> from mlfabric.scheduler.policies.tree_policy import TreePolicy
    >>> g = two_tier(2, 3, 80e6, oversubscription=3)
    >>> spec = RoundSpec({f"w{i}": f"h{i}" for i in range(1, 6)})
    >>> mk = lambda i: PendingUpdate(f"u{i}", "j", "ps", f"w{i}", f"h{i}", "h0", 10**6, 1.0, 0, 0.0)
    >>> policy = TreePolicy()
    >>> d = policy.decide(Snapshot(0.0, g, rounds={("j", "ps"): spec}), [mk(3)])
    >>> [(s.update_id, s.next_hop) for s in d.sends]
    [('u3', 'h3')]
    >>> [(a.aggregator, a.members, round(a.hold_until, 3)) for a in d.aggregates]
    [('h3', ('u3',), 0.3)]
    """

    def __init__(self, arrivals: ArrivalModel | None = None) -> None:
        self.arrivals: ArrivalModel = LearnedArrivals() if arrivals is None else arrivals
        self._rounds: dict[RoundKey, _Round] = {}

    def __len__(self) -> int:
        """Rounds being followed."""
        return len(self._rounds)

    def decide(
        self, snapshot: Snapshot, pending: Sequence[PendingUpdate], paths: PathCache, plan: Planner
    ) -> tuple[list[Send], list[PlannedAggregate], list[PendingUpdate]]:
        """Follow (or make) the plans of the rounds ``pending``'s updates belong to.

        Parameters
        ----------
        snapshot : Snapshot
            ``rounds`` says which servers are synchronous and who their members are;
            ``gathering`` which aggregates are still at the runner.
        pending : sequence of PendingUpdate
            Updates not yet released (none dropped).
        paths : PathCache
            Paths on the snapshot's topology.
        plan : callable
            The planner (see :data:`Planner`).

        Returns
        -------
        tuple
            Sends of the rounds' updates to their aggregators, the rounds' aggregates as
            they stand (to list, with their holds), and the updates left to plan afresh.
        """
        gathering = {a.aggregate_id for a in snapshot.gathering}
        for r in self._rounds.values():
            for aid in [a for a in r.listed if a not in gathering]:
                r.forget(aid)  # it left (forwarded, held past its deadline) or failed
        # an update already in an aggregate at the runner that no round put there (a worker's
        # second update of a round, planned with the others) stays where it is: a round
        # started or followed now must not claim it too (its aggregate would wait for it in vain)
        ours = {u for r in self._rounds.values() for u in r.assigned}
        elsewhere = {m for a in snapshot.gathering for m in a.members} - ours
        rest: list[PendingUpdate] = []
        by_round: dict[RoundKey, list[PendingUpdate]] = {}
        for p in pending:
            if (p.job, p.server) in snapshot.rounds and p.update_id not in elsewhere:
                by_round.setdefault((p.job, p.server, p.base_version), []).append(p)
            else:
                rest.append(p)
        sends: list[Send] = []
        for rk, ps in by_round.items():
            for p in ps:
                self.arrivals.observe((p.job, p.server), p.base_version, p.worker, p.ready_at)
            if rk not in self._rounds:
                self._start(rk, ps, snapshot, paths, plan)
            rest += self._follow(self._rounds[rk], ps, paths, sends)
        aggregates = [a for r in self._rounds.values() for a in self._listing(r)]
        for rk in [k for k, r in self._rounds.items() if r.finished() and k not in by_round]:
            del self._rounds[rk]
        return sends, aggregates, rest

    def _start(
        self, rk: RoundKey, ps: Sequence[PendingUpdate], snapshot: Snapshot, paths: PathCache, plan: Planner
    ) -> None:
        job, server, version = rk
        key = (job, server)
        for (j, s, v), older in self._rounds.items():
            if (j, s) == key and v < version:
                older.expected.clear()  # a newer round began: whoever it still expects comes on its own
        here = {p.worker for p in ps}
        members = snapshot.rounds[key].members
        size = max(p.bytes for p in ps)
        dst = ps[0].dst_host
        expected: dict[str, tuple[str, float | None]] = {}
        updates = core_updates(ps)
        rows = []
        for w, host in members.items():
            if w in here:
                continue
            e = self.arrivals.expect(key, version, w, snapshot.now)
            xid = expected_id(job, server, version, w)
            expected[xid] = (w, e.spread)
            rows.append((xid, host, dst, size, e.at, 0.0, version, server_key(job, server)))
        updates += instances(Update, rows)
        schedule, ids, decision = plan(snapshot, updates)
        starts = {ids.get(t.payload_id, t.payload_id): t.start for t in schedule.transfers}
        r = _Round(aggregates={a.aggregate_id: a for a in decision.aggregates}, expected={}, deadline={})
        graph = snapshot.graph
        for a in decision.aggregates:
            for m in a.members:
                if m in expected:
                    r.expected[expected[m][0]] = m
                    r.worker_of[m] = expected[m][0]
        leaves: dict[str, list[str]] = {}  # aggregate -> its leaves (each aggregate's listed once)
        for aid, a in r.aggregates.items():
            spreads = [expected[m][1] for m in self._leaves(r, aid, leaves) if m in expected]
            if not spreads:
                continue
            cost = a.bytes / _bottleneck(graph, paths.path(a.aggregator, dst))  # the late one's way
            if any(s is None for s in spreads):
                slack = cost
            else:
                deviation = max(s for s in spreads if s is not None)
                slack = min(cost, max(SLACK_DEVIATIONS * deviation, MIN_SLACK * cost))
            r.deadline[aid] = starts.get(aid, snapshot.now) + slack
        for p in ps:  # the real updates the plan gathers; the others are planned afresh
            parent = r.parent_of(p.update_id)
            if parent is not None:
                r.assigned[p.update_id] = parent
        self._rounds[rk] = r

    def _follow(
        self, r: _Round, ps: Iterable[PendingUpdate], paths: PathCache, sends: list[Send]
    ) -> list[PendingUpdate]:
        """Put the round's real updates where its plan has them; the others back to planning."""
        rest = []
        for p in ps:
            aid = r.assigned.get(p.update_id)
            if aid is None:
                xid = r.expected.pop(p.worker, None)
                aid = r.parent_of(xid) if xid is not None else None
                if aid is None or xid is None:
                    rest.append(p)
                    continue
                a = r.aggregates[aid]
                members = tuple(p.update_id if m == xid else m for m in a.members)
                r.aggregates[aid] = replace(a, members=members)
                r.parents[p.update_id] = aid
                r.assigned[p.update_id] = aid
            aggregator = r.aggregates[aid].aggregator
            sends.append(Send(p.update_id, aggregator, paths.path(p.src_host, aggregator)))
        return rest

    def _listing(self, r: _Round) -> list[PlannedAggregate]:
        """The round's aggregates with a member really there, children first, holds set."""
        out: list[PlannedAggregate] = []
        listed: set[str] = set()
        done: set[str] = set()
        expected = set(r.expected.values())

        def visit(aid: str) -> None:
            done.add(aid)
            a = r.aggregates[aid]
            for m in a.members:
                if m in r.aggregates and m not in done:
                    visit(m)
            here = tuple(m for m in a.members if m in r.assigned or m in listed)
            if not here:
                return
            waits = any(m in expected or (m in r.aggregates and m not in listed) for m in a.members)
            hold = r.deadline.get(aid, 0.0) if waits else 0.0
            after = tuple(x for x in a.after if x in listed or x in r.assigned)
            out.append(replace(a, members=here, after=after, hold_until=hold))
            listed.add(aid)

        for aid in list(r.aggregates):
            if aid not in done:
                visit(aid)
        r.listed |= listed
        return out

    @staticmethod
    def _leaves(r: _Round, aid: str, known: dict[str, list[str]]) -> list[str]:
        """The updates summed into ``aid`` (itself for an update), depth first; ``known``: those listed."""
        got = known.get(aid)
        if got is None:
            a = r.aggregates.get(aid)
            got = [aid] if a is None else [x for m in a.members for x in RoundBook._leaves(r, m, known)]
            known[aid] = got
        return got


def _bottleneck(graph: nx.DiGraph, path: Sequence[str]) -> float:
    """The smallest capacity (bytes/s) along ``path``; infinite for a path of no link."""
    caps = [graph.edges[u, v]["capacity"] for u, v in itertools.pairwise(path)]
    return min(caps, default=float("inf"))
