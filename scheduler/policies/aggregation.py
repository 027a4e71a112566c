"""Aggregation groups over the STF order (paper §5, Fig. 6; DESIGN §4).

Take the STF order of the updates to a server ``S``. The first group goes to ``S``
directly. While a group is on ``S``'s ingress, the next group is gathered at an aggregator
hop: it takes as many next updates, in order, as can reach the aggregator before the group
ahead of it finishes arriving at ``S``; their aggregate — one update's size — follows
straight after. ``S``'s ingress then carries one payload per group instead of one per
update (Fig. 2, Fig. 6: ``u6`` is left out of ``G2`` because it could not be summed in time).

The aggregator of a group is the candidate host that the group's first update would reach
soonest — the most residual bandwidth — among those whose path from the worker does not
cross ``S``'s bottleneck (its ingress links and the bottleneck of the first update's path);
ties go to the aggregate's earliest arrival at ``S``, then the host name. Candidates whose
path into ``S`` is no narrower than ``S``'s ingress come first: the aggregate carries the
whole group's bytes into ``S``, and forwarded over a slow aggregator's own uplink it holds
the ingress at that uplink's rate while every member waits (measured on the namespace
testbed: a worker with a 25 Mbit/s uplink chosen for a lone update of its own, then joined
by six others, forwarded the sum at 1.4 MB/s to a 12.5 MB/s ingress). Online
(``min_members`` 1), an update whose own path into ``S`` is narrower than the ingress is
gathered at such an aggregator even when it would otherwise go directly (the ingress idle):
sent directly it holds the ingress at its uplink's rate until it is in, so the ingress time
is the same, and the updates that reach the aggregator by then are summed with it.

:func:`plan_aggregation` is the asynchronous planner; :func:`plan_aggregation_sync` picks,
for one synchronous iteration, the number of updates sent directly first that minimises the
makespan (the time the last update is in), comparing with no aggregation at all.
Both return a :class:`~mlfabric.scheduler.core.schedule.Schedule` that passes the checker.

:class:`AggregationPolicy` (``stf+agg``) runs them online: every decision plans the pending
updates afresh into direct sends, sends to aggregators and aggregates. An aggregate some of
whose members have already been released is *committed*: its remaining members keep going
to its aggregator; earlier uncommitted aggregates are replaced.

Limitations of the policy: the planners start from empty link timelines, so transfers
already in flight are not reserved (a new plan may overlap them; the network then shares
the links). The policy drops a pending update whose delay at its server's current version
already exceeds ``tau_max`` (so no member beyond ``tau_max`` is ever summed); the planners
themselves do not predict delays.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.core.schedule import Aggregate, Link, Schedule, Transfer, Update, aggregate_id
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies.base import Decision, Drop, PendingUpdate, PlannedAggregate, Send, Snapshot
from mlfabric.scheduler.policies.convert import schedule_to_decision
from mlfabric.scheduler.policies.joining import join_open
from mlfabric.scheduler.policies.planning import (
    aggregator_pool,
    collector_paused,
    core_updates,
    name_aggregates,
    reserve_in_flight,
    run_scope,
    server_key,
)
from mlfabric.scheduler.policies.stf import plan_stf

__all__ = ["AggregationPolicy", "plan_aggregation", "plan_aggregation_sync", "run_scope", "send_aggregate"]

#: above this many updates, the policy tries only direct-group sizes 1, 2, 4, ...
EXHAUSTIVE_UP_TO = 32


def send_aggregate(
    tls: Timelines, path: Sequence[str], members: Sequence[Transfer], index: int
) -> tuple[Transfer, Aggregate]:
    """Reserve the aggregate of ``members`` (their transfers into ``path[0]``) along ``path``.

    It is one update's size, that of its largest member, and leaves once the last member is
    in; its id is ``aggregate_id(server, index)``, ``index`` counting the plan's aggregates.

    Examples
    --------
    >>> g = nx.DiGraph()
    >>> g.add_edge("w0", "x", capacity=1.0)
    >>> g.add_edge("w1", "x", capacity=1.0)
    >>> g.add_edge("x", "ps", capacity=1.0)
    >>> tls = Timelines(g)
    >>> ins = [tls.transfer("u0", ("w0", "x"), 1.0, 0.0), tls.transfer("u1", ("w1", "x"), 2.0, 0.0)]
    >>> out, agg = send_aggregate(tls, ("x", "ps"), ins, 0)
    >>> out.payload_id, out.start, out.end, agg.members, agg.bytes
    ('agg:ps:0', 2.0, 4.0, ('u0', 'u1'), 2.0)
    """
    server = path[-1]
    aid = aggregate_id(server, index)
    size = max(t.bytes for t in members)
    out = tls.transfer(aid, path, size, max(t.end for t in members))
    return out, Aggregate(aid, path[0], tuple(t.payload_id for t in members), size, server)


def _avoid(graph: nx.DiGraph, pc: PathCache, server_host: str, first: Update) -> set[Link]:
    """``S``'s bottleneck: its ingress links and the narrowest shared link towards it.

    The narrowest link of the first update's path after the worker's own NIC (a slow
    worker's NIC is its own bottleneck, not ``S``'s).
    """
    avoid: set[Link] = {(u, server_host) for u in graph.predecessors(server_host)}
    links = pc.links(first.src, first.dst)[1:]
    if links:
        avoid.add(min(links, key=lambda link: graph.edges[link]["capacity"]))
    return avoid


def _choose_aggregator(
    graph: nx.DiGraph,
    tls: Timelines,
    pc: PathCache,
    update: Update,
    aggregators: Sequence[str],
    avoid: set[Link],
    ready: float,
) -> str | None:
    """The aggregator for a group whose first update is ``update`` (see the module notes).

    Among the candidates whose path from ``update.src`` avoids ``avoid``: first those whose
    path into the server is as wide as its ingress (:func:`_feeds_ingress`), then the
    earliest arrival of ``update``, the aggregate's earliest arrival at the server, the name.

    Examples
    --------
    ``w7``'s own uplink (1 MB/s) is narrower than ``ps``'s ingress (2 MB/s): its update is
    gathered at ``w0`` (8 MB/s), although it would be at ``w7`` at once.

    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "w0", "w7"], {"ps": 16e6, "w0": 64e6, "w7": 8e6})
    >>> u = Update("u7", "w7", "ps", 1e6)
    >>> _choose_aggregator(g, Timelines(g), PathCache(g), u, ["w0", "w7"], {("sw", "ps")}, 0.0)
    'w0'
    """
    best: tuple[bool, float, float, str] | None = None
    for a in aggregators:
        if a == update.dst:
            continue
        to_a = pc.links(update.src, a)
        if avoid.intersection(to_a):
            continue
        try:
            onward_links = pc.links(a, update.dst)
        except ValueError:
            continue
        narrow = not _feeds_ingress(graph, onward_links)
        if best is not None and narrow > best[0]:
            continue  # loses on the first key whatever its times (issue 24: no walks)
        try:
            _, arrive = tls.ten(to_a, update.bytes, ready)
            if best is not None and narrow == best[0] and arrive > best[1]:
                continue  # loses on the second key
            _, onward = tls.ten(onward_links, update.bytes, arrive)
        except ValueError:
            continue
        key = (narrow, arrive, onward, a)
        if best is None or key < best:
            best = key
    return None if best is None else best[3]


def _feeds_ingress(graph: nx.DiGraph, links: Sequence[Link]) -> bool:
    """Whether a path into a server is no narrower than its last link (the server's ingress)."""
    if not links:
        return True
    succ = graph._succ  # graph.edges[u, v] without its view (a test per candidate aggregator, issue 24)
    last_u, last_v = links[-1]
    ingress = float(succ[last_u][last_v]["capacity"])
    return min(float(succ[u][v]["capacity"]) for u, v in links) >= ingress * (1 - 1e-9)


def _plan_server(
    graph: nx.DiGraph,
    order: Sequence[Update],
    tls: Timelines,
    pc: PathCache,
    aggregators: Sequence[str],
    now: float,
    first_direct: int | None,
    transfers: list[Transfer],
    aggregates: list[Aggregate],
    ahead_until: float | None = None,
    min_members: int = 2,
) -> Timelines:
    """Plan one server's STF ``order``; returns the timelines holding every reservation.

    ``ahead_until``: when the transfers already on their way into ``S`` end (a group is
    ahead, so the first update may be gathered at an aggregator meanwhile). ``min_members``:
    the fewest members of a group (1 online: a lone update gathered while ``S`` is busy opens
    an aggregate that later arrivals join, :mod:`~mlfabric.scheduler.policies.joining`).
    """
    if not order:
        return tls
    server_host = order[0].dst
    avoid = _avoid(graph, pc, server_host, order[0])
    ahead_end = now  # when the group ahead finishes arriving at S
    direct = 0
    if ahead_until is not None and ahead_until > now:
        ahead_end, direct = ahead_until, 1
    i = 0
    while i < len(order):
        u = order[i]
        must_go_direct = direct == 0 or (first_direct is not None and direct < first_direct)
        gather_until = ahead_end  # members must reach the aggregator by then
        slow = False
        if min_members <= 1 and first_direct is None:
            direct_links = pc.links(u.src, u.dst)
            if not _feeds_ingress(graph, direct_links):
                # online, an update whose own path is narrower than S's ingress: sent directly it
                # holds the ingress at that rate until it is in; gathered at an aggregator that
                # feeds the ingress it takes the same ingress time after that, and others join it
                _, alone = tls.ten(direct_links, u.bytes, max(u.ready_at, now))
                gather_until, must_go_direct, slow = max(ahead_end, alone), False, True
        members: list[Transfer] = []
        trial = tls
        agg = None
        if not must_go_direct:
            agg = _choose_aggregator(graph, tls, pc, u, aggregators, avoid, max(u.ready_at, now))
        if agg is not None and slow and not _feeds_ingress(graph, pc.links(agg, server_host)):
            # a slow aggregator forwards no faster than the update's own uplink: the usual rule
            gather_until = ahead_end
            if direct == 0 or (first_direct is not None and direct < first_direct):
                agg = None
        if agg is not None:
            trial = tls.copy()
            for v in order[i:]:
                links = pc.links(v.src, agg)
                _, arrive = trial.ten(links, v.bytes, max(v.ready_at, now))
                if arrive > gather_until:
                    break
                members.append(
                    trial.transfer(v.update_id, pc.path(v.src, agg), v.bytes, max(v.ready_at, now))
                )
        if agg is None or len(members) < max(1, min_members):
            t = tls.transfer(u.update_id, pc.path(u.src, u.dst), u.bytes, max(u.ready_at, now))
            transfers.append(t)
            ahead_end = max(ahead_end, t.end)
            direct += 1
            i += 1
            continue
        tls = trial
        out, made = send_aggregate(tls, pc.path(agg, server_host), members, len(aggregates))
        transfers.extend(members)
        transfers.append(out)
        aggregates.append(made)
        ahead_end = max(ahead_end, out.end)
        i += len(members)
    return tls


def plan_aggregation(
    graph: nx.DiGraph,
    updates: Sequence[Update],
    *,
    aggregators: Sequence[str],
    now: float = 0.0,
    first_direct: int | None = None,
    paths: PathCache | None = None,
    timelines: Timelines | None = None,
    ahead_until: Mapping[str, float] | None = None,
    min_members: int = 2,
) -> Schedule:
    """Group the STF order to each server into direct sends and aggregates (Fig. 6).

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph.
    updates : sequence of Update
        Updates to plan (one or more servers; each server's are planned in turn, in
        server-name order, on shared link timelines).
    aggregators : sequence of str
        Hosts that can act as aggregator hops.
    now : float
        Planning time.
    first_direct : int, optional
        Send at least this many updates directly before aggregating (default: one — the
        first group is as short as aggregation allows).
    paths : PathCache, optional
        Path cache for ``graph``.
    timelines : Timelines, optional
        Link timelines to plan on (holding the transfers already in flight); default empty.
    ahead_until : mapping, optional
        Server host -> when the transfers already in flight into it end: the next group to
        it may then be gathered at an aggregator at once (online planning).
    min_members : int
        The fewest updates in a group gathered at an aggregator (default 2; online, 1: a lone
        update gathered while the server is busy is an aggregate later arrivals may join).

    Returns
    -------
    Schedule
        Direct transfers, member transfers to aggregators and each aggregate's transfer to
        its server; ``aggregates`` lists what each aggregator sums and forwards.

    Examples
    --------
    Four equal updates to ``ps`` over a 1 MB/s server link, workers with 4 MB/s NICs: while
    ``u0`` is on the server's link, ``u1`` to ``u3`` reach aggregator ``x``; one aggregate
    follows, and the last update is in at t=2 instead of t=4.

    >>> from mlfabric.scheduler.core.graph import star
    >>> hosts = ["ps", "w0", "w1", "w2", "w3", "x"]
    >>> g = star(hosts, {"ps": 8e6, **{h: 32e6 for h in hosts[1:]}})
    >>> us = [Update(f"u{i}", f"w{i}", "ps", 1e6) for i in range(4)]
    >>> s = plan_aggregation(g, us, aggregators=["x"])
    >>> [(a.aggregator, a.members) for a in s.aggregates], s.makespan()
    ([('x', ('u1', 'u2', 'u3'))], 2.0)
    """
    pc = paths if paths is not None else PathCache(graph)
    tls = timelines if timelines is not None else Timelines(graph, start=now)
    until = ahead_until or {}
    transfers: list[Transfer] = []
    aggregates: list[Aggregate] = []
    by_server: dict[str, list[Update]] = {}
    for u in updates:
        by_server.setdefault(u.server, []).append(u)
    for server in sorted(by_server):
        group = by_server[server]
        stf = plan_stf(graph, group, now=now, paths=pc)
        if stf.drops:
            raise ValueError(f"cannot plan aggregation for server {server}: {stf.drops}")
        ids = {u.update_id: u for u in group}
        order = [ids[uid] for uid in stf.arrivals]
        host = order[0].dst if order else ""
        tls = _plan_server(
            graph,
            order,
            tls,
            pc,
            aggregators,
            now,
            first_direct,
            transfers,
            aggregates,
            until.get(host),
            min_members,
        )
    return Schedule.aggregated(transfers, aggregates)


def plan_aggregation_sync(
    graph: nx.DiGraph,
    updates: Sequence[Update],
    *,
    aggregators: Sequence[str],
    now: float = 0.0,
    paths: PathCache | None = None,
) -> Schedule:
    """One synchronous-SGD iteration: the grouping with the smallest makespan (DESIGN §4).

    Tries plain STF (no aggregation) and :func:`plan_aggregation` with every number of
    updates sent directly first, and returns the plan whose last arrival at a server is
    earliest (ties: fewer aggregates, then fewer direct sends).

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph.
    updates : sequence of Update
        The iteration's updates (all workers').
    aggregators : sequence of str
        Hosts that can aggregate.
    now : float
        Start of the communication phase.
    paths : PathCache, optional
        Path cache.

    Returns
    -------
    Schedule
        The plan with the smallest makespan.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> hosts = ["ps", "w0", "w1", "w2", "w3", "x"]
    >>> g = star(hosts, {"ps": 8e6, **{h: 32e6 for h in hosts[1:]}})
    >>> us = [Update(f"u{i}", f"w{i}", "ps", 1e6) for i in range(4)]
    >>> plan_aggregation_sync(g, us, aggregators=["x"]).makespan()
    2.0
    """
    pc = paths if paths is not None else PathCache(graph)
    best = plan_stf(graph, updates, now=now, paths=pc)
    best_key = (best.makespan(), 0, len(updates))
    for k in range(1, len(updates)):
        plan = plan_aggregation(graph, updates, aggregators=aggregators, now=now, first_direct=k, paths=pc)
        key = (plan.makespan(), len(plan.aggregates), k)
        if key < best_key:
            best, best_key = plan, key
    return best


def _plan_sync(
    graph: nx.DiGraph, updates: Sequence[Update], aggregators: Sequence[str], now: float, pc: PathCache
) -> Schedule:
    """Smallest-makespan grouping; exhaustive like ``plan_aggregation_sync`` for small batches."""
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


def _stale(snapshot: Snapshot, pending: Iterable[PendingUpdate]) -> list[Drop]:
    """Drops for the updates already staler than their job's ``tau_max`` at the server's version."""
    drops = []
    for p in pending:
        tau = snapshot.tau_max.get(p.job, -1)
        version = snapshot.server_versions.get((p.job, p.server))
        if tau < 0 or version is None or version - p.base_version <= tau:
            continue
        delay = version - p.base_version
        reason = f"delay {delay} > tau_max {tau} (server version {version}, base_version {p.base_version})"
        drops.append(Drop(p.update_id, reason))
    return drops


class AggregationPolicy:
    """The ``stf+agg`` policy: STF order with aggregation groups (Fig. 6).

    Parameters
    ----------
    sync : bool
        Use the synchronous planner (smallest makespan over the number of updates sent
        directly first); otherwise the asynchronous one (shortest first group).
    aggregators : sequence of str, optional
        Hosts that may aggregate; default every host but the pending updates' servers.
    join : bool
        Online (``sync=False``): a pending update joins an aggregate still being gathered
        when it reaches the aggregator in time (:mod:`~mlfabric.scheduler.policies.joining`),
        and a lone update gathered while its server is busy opens an aggregate (default).
        False: groups are only the updates pending at one decision (at least two).
    join_slack : float
        How long past the aggregate's ready time (its members in, the server's ingress free
        of what is ahead of it) a joining update may arrive, in update times on the
        aggregate's path into the server (:func:`join_open`'s ``slack``; 0: work-conserving,
        a join never makes the ingress wait for the aggregate; default 0.25).
    scope : str
        The run the aggregate ids belong to: ids are ``agg:<server>.<scope>:<n>``
        (``agg:<server>:<n>`` when empty, the default). The scheduler service passes a
        random incarnation per run, so a restarted scheduler's ``n`` counting from 0 again
        never names an aggregate the server daemon already applied (DESIGN §3).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> hs = ["ps", "w0", "w1", "w2", "w3", "x"]
    >>> g = star(hs, {"ps": 8e6, **{h: 32e6 for h in hs[1:]}})
    >>> mk = lambda i: PendingUpdate(f"u{i}", "j", "s", f"w{i}", f"w{i}", "ps", 10**6, 1.0, 0, 0.0)
    >>> d = AggregationPolicy(aggregators=["x"]).decide(Snapshot(0.0, g), [mk(i) for i in range(4)])
    >>> [(s.update_id, s.next_hop) for s in d.sends]
    [('u0', 'ps'), ('u1', 'x'), ('u2', 'x'), ('u3', 'x')]
    >>> [(a.aggregate_id, a.aggregator, a.members, a.after) for a in d.aggregates]
    [('agg:ps:0', 'x', ('u1', 'u2', 'u3'), ('u0',))]
    >>> p = AggregationPolicy(aggregators=["x"], scope="7f3a")
    >>> [a.aggregate_id for a in p.decide(Snapshot(0.0, g), [mk(i) for i in range(4)]).aggregates]
    ['agg:ps.7f3a:0']
    """

    name = "stf+agg"

    def __init__(
        self,
        *,
        sync: bool = True,
        aggregators: Sequence[str] | None = None,
        scope: str = "",
        join: bool = True,
        join_slack: float = 0.25,
    ) -> None:
        self.sync = sync
        self.aggregators = tuple(aggregators) if aggregators is not None else None
        self.scope = scope
        self.join = join
        self.join_slack = join_slack
        self._committed: dict[str, PlannedAggregate] = {}
        self._server_of: dict[str, str] = {}  # aggregate id -> its members' server key
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
        Decision
            Aggregate ids are unique across the decisions of this policy object.
        """
        with collector_paused():  # the cyclic collector: a fifth of a 1,024-worker run's CPU (issue 24)
            return self._decide(snapshot, pending)

    def _decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        by_id = {p.update_id: p for p in pending}
        drops = tuple(_stale(snapshot, by_id.values()))
        for d in drops:
            del by_id[d.update_id]
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
        joined: dict[str, PlannedAggregate] = {}
        if self.join and not self.sync and by_id:
            live = {a.aggregate_id for a in snapshot.gathering}
            self._server_of = {a: k for a, k in self._server_of.items() if a in live}
            joins, joined = join_open(
                snapshot, list(by_id.values()), self._server_of, self._pc(snapshot), self.join_slack
            )
            for j in joins:
                del by_id[j.update_id]
            sends.extend(joins)
        if not by_id:
            return Decision(sends=tuple(sends), drops=drops, aggregates=tuple(joined.values()))
        schedule, busy = self._plan(snapshot, list(by_id.values()))
        ids = name_aggregates(schedule, self.scope, self._count)
        self._count += len(schedule.aggregates)
        planned = schedule_to_decision(schedule, aggregate_ids=ids, busy=busy)
        servers = {p.update_id: server_key(p.job, p.server) for p in by_id.values()}
        for a in planned.aggregates:
            self._committed[a.aggregate_id] = a
            self._server_of[a.aggregate_id] = servers[a.members[0]]
        return Decision(
            sends=(*sends, *planned.sends),
            drops=drops,
            aggregates=(*joined.values(), *planned.aggregates),
        )

    def abandon(self, aggregate_id: str) -> None:
        """Forget aggregate ``aggregate_id`` (its aggregator failed): its members are planned afresh."""
        self._committed.pop(aggregate_id, None)

    # -- internals ---------------------------------------------------------------------
    def _pc(self, snapshot: Snapshot) -> PathCache:
        if self._paths is None or not self._paths.same_topology(snapshot.graph):
            self._paths = PathCache(snapshot.graph)
        return self._paths

    def _path(self, snapshot: Snapshot, src: str, dst: str) -> tuple[str, ...]:
        return self._pc(snapshot).path(src, dst)

    def _plan(
        self, snapshot: Snapshot, pending: Sequence[PendingUpdate]
    ) -> tuple[Schedule, list[tuple[str, tuple[Link, ...], float]]]:
        graph = snapshot.graph
        updates = core_updates(pending)
        servers = {p.dst_host for p in pending}
        aggregators = aggregator_pool(graph, self.aggregators, servers, snapshot.aggregators)
        if self.sync:
            return _plan_sync(graph, updates, aggregators, snapshot.now, self._pc(snapshot)), []
        # online: transfers in flight keep their links until their expected end, and a server
        # whose ingress is busy may have its next group gathered at an aggregator meanwhile
        now = snapshot.now
        tls, busy, until = reserve_in_flight(graph, snapshot.in_flight, now, servers)
        schedule = plan_aggregation(
            graph,
            updates,
            aggregators=aggregators,
            now=now,
            timelines=tls,
            ahead_until=until,
            min_members=1 if self.join else 2,
            paths=self._pc(snapshot),  # the policy's: paths to every candidate aggregator, kept (issue 24)
        )
        return schedule, busy
