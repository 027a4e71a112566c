"""The ``stf+tree`` policy: aggregation trees planned online (paper §5, Fig. 6; DESIGN §4).

Every decision plans the pending updates with
:func:`~mlfabric.scheduler.policies.trees.plan_tree` (the transfers in flight reserved until
their expected end) and turns the plan into a decision with
:func:`~mlfabric.scheduler.policies.convert.schedule_to_decision`, so the simulator and the
service run it through the one pipeline (:class:`~mlfabric.scheduler.policies.runner.DecisionRunner`).
The service executes its nested aggregates through the daemons
(:mod:`mlfabric.scheduler.service.aggregates`), the simulator in its fluid network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.core.schedule import Link, Schedule, Update
from mlfabric.scheduler.policies.aggregation import _stale
from mlfabric.scheduler.policies.arrivals import ArrivalModel
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, PlannedAggregate, Send, Snapshot
from mlfabric.scheduler.policies.convert import schedule_to_decision
from mlfabric.scheduler.policies.pipelined import NoPipelinedTree, pipelined_schedule, plan_pipelined_round
from mlfabric.scheduler.policies.planning import (
    aggregator_pool,
    collector_paused,
    core_updates,
    name_aggregates,
    reserve_in_flight,
)
from mlfabric.scheduler.policies.round_plans import RoundBook
from mlfabric.scheduler.policies.tree_cost import Ingress
from mlfabric.scheduler.policies.tree_routes import RouteCache
from mlfabric.scheduler.policies.trees import plan_tree

__all__ = ["TreePolicy"]


class TreePolicy:
    """The ``stf+tree`` policy: every decision plans the pending updates as aggregation trees.

    An aggregate tree some of whose updates have been released is *committed*: its remaining
    updates keep going to their aggregators and its aggregates stay planned; the other
    pending updates are planned afresh (:func:`plan_tree`), the transfers in flight reserved
    until their expected end. A tree all of whose updates were released is forgotten (the
    runner follows its aggregates), so a long-running service keeps only the trees under way.

    Parameters
    ----------
    aggregators : sequence of str, optional
        Hosts that may aggregate; default every host but the servers (and only those the
        snapshot lists as able to, when it lists any).
    scope : str
        The run the aggregate ids belong to (``agg:<server>.<scope>:<n>``; see
        :class:`~mlfabric.scheduler.policies.aggregation.AggregationPolicy`).
    arrivals : ArrivalModel, optional
        When a synchronous round's members are expected (``Snapshot.rounds``): each round
        is planned once, with the members still to come, and followed as they arrive
        (:class:`~mlfabric.scheduler.policies.round_plans.RoundBook`); default: learned
        from the rounds seen (:class:`~mlfabric.scheduler.policies.arrivals.LearnedArrivals`).
    pipelined : bool
        Plan each synchronous round (``Snapshot.rounds``) as a *pipelined* aggregation tree
        (:func:`~mlfabric.scheduler.policies.pipelined.plan_pipelined_round`: aggregates that
        forward their sums chunk by chunk as their members arrive, ``PlannedAggregate.chunk_bytes``)
        instead of :func:`plan_tree`'s store-and-forward one; other updates are planned as before.
        For executors that pipeline (``--pipelined-aggregates`` of the simulator and the
        service); default off.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> g = two_tier(2, 3, 8e6, oversubscription=3)
    >>> mk = lambda i: PendingUpdate(f"u{i}", "j", "s", f"w{i}", f"h{i}", "h0", 10**6, 1.0, 0, 0.0)
    >>> d = TreePolicy().decide(Snapshot(0.0, g), [mk(i) for i in range(1, 6)])
    >>> [(s.update_id, s.next_hop) for s in d.sends]
    [('u1', 'h0'), ('u2', 'h0'), ('u3', 'h3'), ('u4', 'h3'), ('u5', 'h3')]
    >>> [(a.aggregate_id, a.aggregator, a.members) for a in d.aggregates]
    [('agg:h0:0', 'h3', ('u3', 'u4', 'u5'))]
    """

    name = "stf+tree"

    def __init__(
        self,
        *,
        aggregators: Sequence[str] | None = None,
        scope: str = "",
        arrivals: ArrivalModel | None = None,
        pipelined: bool = False,
    ) -> None:
        self.aggregators = tuple(aggregators) if aggregators is not None else None
        self.pipelined = pipelined
        self.scope = scope
        self.rounds = RoundBook(arrivals)
        self._committed: dict[str, PlannedAggregate] = {}
        self._count = 0
        self._paths: PathCache | None = None
        self._routes: RouteCache | None = None  # the trees' routes on self._paths' topology
        # the hosts' ingress on the graph last seen, kept while its graph_version stays the same
        self._ingress: Ingress | None = None
        self._graph_version: int | None = None

    def abandon(self, aggregate_id: str) -> None:
        """Forget aggregate ``aggregate_id`` (its aggregator failed)."""
        self._committed.pop(aggregate_id, None)

    def _pc(self, graph: nx.DiGraph) -> PathCache:
        if self._paths is None or not self._paths.same_topology(graph):
            self._paths = PathCache(graph)
            self._routes = RouteCache(self._paths)
        return self._paths

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        """Plan ``pending`` into sends to aggregators or servers, and aggregates.

        Returns
        -------
        Decision
            Aggregate ids unique across this policy object's decisions.
        """
        with collector_paused():  # the cyclic collector: see planning.collector_paused
            return self._decide(snapshot, pending)

    def _decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        pc = self._pc(snapshot.graph)
        everyone = {p.update_id for p in pending}
        by_id = {p.update_id: p for p in pending}
        drops = tuple(_stale(snapshot, by_id.values()))
        for d in drops:
            del by_id[d.update_id]
        rounds: tuple[list[Send], list[PlannedAggregate]] = ([], [])
        if snapshot.rounds or len(self.rounds):
            round_sends, round_aggregates, rest = self.rounds.decide(
                snapshot, list(by_id.values()), pc, lambda snap, updates: self._plan_round(snap, updates, pc)
            )
            rounds = (round_sends, round_aggregates)
            by_id = {p.update_id: p for p in rest}
        sends, kept = self._keep_started(snapshot, by_id, everyone, pc)
        sends = [*rounds[0], *sends]
        kept = (*rounds[1], *kept)
        if not by_id:
            return Decision(sends=tuple(sends), drops=drops, aggregates=kept)
        schedule, busy = self._plan(snapshot, core_updates(by_id.values()), pc)
        planned = self._named(schedule, busy)
        for a in planned.aggregates:
            self._committed[a.aggregate_id] = a
        return Decision(sends=(*sends, *planned.sends), drops=drops, aggregates=(*kept, *planned.aggregates))

    def _named(self, schedule: Schedule, busy: list[tuple[str, tuple[Link, ...], float]]) -> Decision:
        ids = name_aggregates(schedule, self.scope, self._count)
        self._count += len(schedule.aggregates)
        return schedule_to_decision(schedule, aggregate_ids=ids, busy=busy)

    def _plan_round(
        self, snapshot: Snapshot, updates: Sequence[Update], pc: PathCache
    ) -> tuple[Schedule, dict[str, str], Decision]:
        """A synchronous round's plan, its expected members included (the round book's planner)."""
        if self.pipelined:
            try:
                return self._plan_pipelined(snapshot, updates, pc)
            except NoPipelinedTree:  # a host with several updates may not sum them
                pass  # the round goes store-and-forward
        schedule, busy = self._plan(snapshot, updates, pc)
        ids = name_aggregates(schedule, self.scope, self._count)
        return schedule, ids, self._named(schedule, busy)

    def _plan_pipelined(
        self, snapshot: Snapshot, updates: Sequence[Update], pc: PathCache
    ) -> tuple[Schedule, dict[str, str], Decision]:
        """A synchronous round as a pipelined tree: its aggregates carry the plan's chunk size."""
        graph = snapshot.graph
        pool = aggregator_pool(graph, self.aggregators, {u.dst for u in updates}, snapshot.aggregators)
        tree = plan_pipelined_round(graph, updates, aggregators=pool, paths=pc)
        schedule = pipelined_schedule(tree, graph, updates, paths=pc)
        ids = name_aggregates(schedule, self.scope, self._count)
        decision = self._named(schedule, [])
        chunked = tuple(replace(a, chunk_bytes=tree.chunk_bytes) for a in decision.aggregates)
        return schedule, ids, replace(decision, aggregates=chunked)

    def _keep_started(
        self, snapshot: Snapshot, by_id: dict[str, PendingUpdate], everyone: set[str], pc: PathCache
    ) -> tuple[list[Send], tuple[PlannedAggregate, ...]]:
        """Keep every committed tree one of whose updates was released; sends of its others."""
        committed = self._committed
        parent = {m: aid for aid, a in committed.items() for m in a.members}

        def root(aid: str) -> str:
            while aid in parent:
                aid = parent[aid]
            return aid

        def leaves(aid: str) -> list[str]:
            a = committed.get(aid)
            return [aid] if a is None else [u for m in a.members for u in leaves(m)]

        trees: dict[str, list[str]] = {}
        for aid in committed:
            trees.setdefault(root(aid), []).append(aid)
        sends: list[Send] = []
        kept: dict[str, PlannedAggregate] = {}
        relist: list[PlannedAggregate] = []
        for top, members in trees.items():
            pending = [u in everyone for u in leaves(top)]
            if all(pending):
                continue  # nothing released: planned again
            if not any(pending):
                continue  # everything released: the runner and the book follow it, nothing to keep
            for aid in members:
                a = committed[aid]
                kept[aid] = a
                if all(u in everyone for u in leaves(aid)):
                    relist.append(a)  # not started: the runner would forget it otherwise
                for m in a.members:
                    p = by_id.pop(m, None)
                    if p is not None:
                        sends.append(Send(m, a.aggregator, pc.path(p.src_host, a.aggregator)))
        self._committed = kept
        return sends, tuple(relist)

    def _plan(
        self, snapshot: Snapshot, updates: Sequence[Update], pc: PathCache
    ) -> tuple[Schedule, list[tuple[str, tuple[Link, ...], float]]]:
        graph = snapshot.graph
        now = snapshot.now
        servers = {u.dst for u in updates}
        pool = aggregator_pool(graph, self.aggregators, servers, snapshot.aggregators)
        tls, busy, _ = reserve_in_flight(graph, snapshot.in_flight, now)
        idle = None if not busy else tls  # an idle network: plan_tree may also try Fig. 6's groups
        version = snapshot.graph_version
        ing = self._ingress
        if ing is None or ing.graph is not graph or version is None or version != self._graph_version:
            ing = self._ingress = Ingress(graph)  # the capacities may have changed
            self._graph_version = version
        schedule = plan_tree(
            graph,
            updates,
            aggregators=pool,
            now=now,
            paths=pc,
            timelines=idle,
            routes=self._routes,
            ingress=ing,
        )
        return schedule, busy
