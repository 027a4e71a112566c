"""Aggregation groups as a policy the simulator can run (paper §5 Fig. 6, §7; DESIGN §4).

:mod:`mlfabric.scheduler.policies.aggregation` plans aggregation groups offline: a
:class:`~mlfabric.scheduler.core.schedule.Schedule` whose transfers carry some updates to
aggregator hops and whose ``aggregates`` say what each aggregator sums and forwards.
:class:`AggregationPolicy` turns such a plan into a decision for the simulator, the way
:class:`~mlfabric.scheduler.policies.stf.STFPolicy` turns an STF plan into one: each transfer
becomes a :class:`~mlfabric.scheduler.policies.base.Send` (to the server or to an aggregator)
whose ``after`` names the planned transfers that end on one of its links exactly when it
starts; each aggregate becomes a :class:`PlannedAggregate` with its own ``after``.

Re-planning: every call sees all pending updates. An aggregate some of whose members have
already been released is *committed*: its remaining members keep going to its aggregator.
The other pending updates are planned afresh (earlier uncommitted aggregates are replaced).

Limitations: the offline planners start from empty link timelines, so transfers already
in flight are not reserved (a new plan may overlap them; the fluid network then shares
the links fairly); and the planners do not drop (no ``tau_max``): this policy is meant for
synchronous SGD, where updates are never stale.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache, hosts
from mlfabric.scheduler.core.schedule import Link, Schedule, Transfer, Update
from mlfabric.scheduler.policies.aggregation import plan_aggregation, plan_aggregation_sync
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, PlannedAggregate, Send, Snapshot
from mlfabric.scheduler.policies.stf import plan_stf, server_key

__all__ = ["AggregatingDecision", "AggregationPolicy", "PlannedAggregate"]

#: above this many updates, only direct-group sizes 1, 2, 4, ... are tried
EXHAUSTIVE_UP_TO = 32


#: kept for callers of the old name; a Decision carries aggregates itself
AggregatingDecision: type[Decision] = Decision


def _plan_sync(
    graph: nx.DiGraph, updates: Sequence[Update], aggregators: Sequence[str], now: float
) -> Schedule:
    """Smallest-makespan grouping; exhaustive like ``plan_aggregation_sync`` for small batches."""
    pc = PathCache(graph)
    if len(updates) <= EXHAUSTIVE_UP_TO:
        return plan_aggregation_sync(graph, updates, aggregators=aggregators, now=now, paths=pc)
    best = plan_stf(graph, updates, now=now, paths=pc)
    best_key = (best.makespan(), 0, len(updates))
    sizes = [2**i for i in range(len(updates).bit_length())]
    for k in (k for k in sizes if k < len(updates)):
        plan = plan_aggregation(graph, updates, aggregators=aggregators, now=now, first_direct=k, paths=pc)
        key = (plan.makespan(), len(plan.aggregates), k)
        if key < best_key:
            best, best_key = plan, key
    return best


class AggregationPolicy:
    """STF order with aggregation groups (Fig. 6), as a policy for the simulator.

    Parameters
    ----------
    sync : bool
        Use the synchronous planner (smallest makespan over the number of updates sent
        directly first); otherwise the asynchronous one (shortest first group).
    aggregators : sequence of str, optional
        Hosts that may aggregate; default every host but the pending updates' servers.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> hs = ["ps", "w0", "w1", "w2", "w3", "x"]
    >>> g = star(hs, {"ps": 8e6, **{h: 32e6 for h in hs[1:]}})
    >>> mk = lambda i: PendingUpdate(f"u{i}", "j", "s", f"w{i}", f"w{i}", "ps", 10**6, 1.0, 0, 0.0)
    >>> d = AggregationPolicy(aggregators=["x"]).decide(Snapshot(0.0, g), [mk(i) for i in range(4)])
    >>> [(s.update_id, s.next_hop) for s in d.sends]
    [('u0', 'ps'), ('u1', 'x'), ('u2', 'x'), ('u3', 'x')]
    >>> [(a.aggregator, a.members, a.after) for a in d.aggregates]
    [('x', ('u1', 'u2', 'u3'), ('u0',))]
    """

    name = "stf+agg"

    def __init__(self, *, sync: bool = True, aggregators: Sequence[str] | None = None) -> None:
        self.sync = sync
        self.aggregators = tuple(aggregators) if aggregators is not None else None
        self._committed: dict[str, PlannedAggregate] = {}
        self._count = 0
        self._paths: PathCache | None = None

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        """Plan ``pending`` into direct sends, sends to aggregators and aggregates.

        Parameters
        ----------
        snapshot : Snapshot
            Time and graph (in-flight transfers are not reserved; see the module notes).
        pending : sequence of PendingUpdate
            Every update not yet released.

        Returns
        -------
        AggregatingDecision
        """
        by_id = {p.update_id: p for p in pending}
        sends: list[Send] = []
        kept: dict[str, PlannedAggregate] = {}
        for aid, agg in self._committed.items():
            waiting = [m for m in agg.members if m in by_id]
            if len(waiting) == len(agg.members):
                continue  # nothing released yet: plan its members again
            if waiting:
                kept[aid] = agg
            for m in waiting:
                p = by_id.pop(m)
                sends.append(Send(m, agg.aggregator, self._path(snapshot, p.src_host, agg.aggregator)))
        self._committed = kept
        if not by_id:
            return Decision(sends=tuple(sends))
        schedule = self._plan(snapshot, list(by_id.values()))
        new_sends, aggregates = self._convert(schedule)
        for a in aggregates:
            self._committed[a.aggregate_id] = a
        return Decision(sends=(*sends, *new_sends), aggregates=aggregates)

    # -- internals ---------------------------------------------------------------------
    def _path(self, snapshot: Snapshot, src: str, dst: str) -> tuple[str, ...]:
        if self._paths is None or not self._paths.same_topology(snapshot.graph):
            self._paths = PathCache(snapshot.graph)
        return self._paths.path(src, dst)

    def _plan(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Schedule:
        graph = snapshot.graph
        updates = [
            Update(
                p.update_id,
                p.src_host,
                p.dst_host,
                p.bytes,
                p.ready_at,
                p.norm,
                p.base_version,
                server_key(p.job, p.server),
            )
            for p in pending
        ]
        servers = {p.dst_host for p in pending}
        aggregators = self.aggregators or tuple(h for h in hosts(graph) if h not in servers)
        if self.sync:
            return _plan_sync(graph, updates, aggregators, snapshot.now)
        return plan_aggregation(graph, updates, aggregators=aggregators, now=snapshot.now)

    def _convert(self, schedule: Schedule) -> tuple[list[Send], tuple[PlannedAggregate, ...]]:
        ends: dict[Link, dict[float, list[str]]] = defaultdict(lambda: defaultdict(list))
        for t in schedule.transfers:
            for link in t.links:
                ends[link][t.end].append(t.payload_id)

        def after(t: Transfer) -> tuple[str, ...]:
            found = {p for link in t.links for p in ends[link].get(t.start, ()) if p != t.payload_id}
            return tuple(sorted(found))

        renamed: dict[str, str] = {}
        for a in schedule.aggregates:
            renamed[a.aggregate_id] = f"agg{self._count}"
            self._count += 1
        sends = []
        out: dict[str, Transfer] = {}
        for t in sorted(schedule.transfers, key=lambda t: (t.start, t.payload_id)):
            if t.payload_id in renamed:
                out[t.payload_id] = t
                continue
            deps = tuple(renamed.get(p, p) for p in after(t))
            sends.append(Send(t.payload_id, t.dst, t.path, deps, t.start, t.end))
        aggregates = tuple(
            PlannedAggregate(
                aggregate_id=renamed[a.aggregate_id],
                aggregator=a.aggregator,
                members=tuple(a.members),
                bytes=a.bytes,
                dst=out[a.aggregate_id].dst,
                after=tuple(renamed.get(p, p) for p in after(out[a.aggregate_id]) if p not in a.members),
                path=out[a.aggregate_id].path,
            )
            for a in schedule.aggregates
        )
        return sends, aggregates
