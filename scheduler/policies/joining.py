"""Open aggregates that later arrivals join (online Fig. 6; DESIGN §4).

Online, the workers' updates become ready one by one, so the planner of
:mod:`~mlfabric.scheduler.policies.aggregation` rarely sees a whole group pending at once:
the group gathered while the server's ingress is busy closes with the updates pending at the
decision, and an update that becomes ready a moment later went straight to the server, behind
the group, one update's bytes more on the bottleneck. Here such an update *joins* an aggregate
still being gathered (planned, some member released, not yet forwarded) when it can reach the
aggregator in time; the policy lists the aggregate again with the new member, the runner and
the service re-issue its directive.

When joining pays (work-conserving): let ``d`` be the time one update takes on the
aggregate's path into the server (its narrowest link). The aggregate may leave once its
members on their way are in (``members_in``) and the server's ingress is free of what is
ahead of it (``free``: the transfers in flight into the server, then the forwards of the
aggregates to it opened earlier, each ``d`` long once its own members are in). An update
joins if it reaches the aggregator by ``max(free, members_in, now) + slack * d``. With
``slack`` 0 joining never makes the aggregate's forward late for the ingress: the aggregate
is ready when the ingress frees up (work-conserving). The default ``slack`` 0.25 lets a
joiner idle the ingress for at most a quarter of an update's time (in the simulator, the
testbed's setting: asynchronous as fast as 0, synchronous rounds as short as with 1 and
with 0.42 payloads per update instead of 0.54). ``slack`` 1 (the rule before) lets a
joiner be up to one update's time late: on the namespace testbed the ingress idled 1-3 s at
a time while aggregates waited for joiners whose uplinks were slower than estimated. The
bound does not grow with the joins.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.policies.base import PendingUpdate, PlannedAggregate, Send, Snapshot
from mlfabric.scheduler.policies.planning import reserve_in_flight, server_key

__all__ = ["join_open"]


def join_open(
    snapshot: Snapshot,
    pending: Sequence[PendingUpdate],
    server_of: Mapping[str, str],
    paths: PathCache,
    slack: float = 0.25,
) -> tuple[list[Send], dict[str, PlannedAggregate]]:
    """Let pending updates join the aggregates being gathered (see the module notes).

    Parameters
    ----------
    snapshot : Snapshot
        Time, graph, transfers in flight and ``gathering`` (the aggregates not yet forwarded).
    pending : sequence of PendingUpdate
        Updates not yet released and not planned into an aggregate already started.
    server_of : mapping
        Aggregate id -> the :func:`~mlfabric.scheduler.policies.planning.server_key` of its
        members; aggregates not in it (another run's) are never joined.
    paths : PathCache
        Paths of ``snapshot.graph``.
    slack : float
        How many update times ``d`` past the aggregate's ready time (its members in and the
        ingress free of what is ahead of it) an update may still reach the aggregator (0:
        join only when the aggregate would wait anyway, work-conserving; default 0.25; 1:
        joining never costs more than sending directly).

    Returns
    -------
    tuple
        The sends of the joining updates to their aggregators, and each aggregate joined with
        its members as they stand now (the old ones first).

    Examples
    --------
    ``ps``'s ingress (1 MB/s) is busy until t=4 with ``u0``; ``agg`` gathers ``u1`` at ``x``.
    ``u2`` (1 MB, a 4 MB/s uplink) reaches ``x`` at t=0.25, well before ``agg`` may leave.

    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.policies.base import InFlight
    >>> g = star(["ps", "w0", "w1", "w2", "x"], {"ps": 8e6, "w0": 32e6, "w1": 32e6, "w2": 32e6, "x": 32e6})
    >>> u0 = InFlight("u0", "j", "s", ("w0", "sw", "ps"), 4 * 10**6, 0.0, 4.0)
    >>> u1 = InFlight("u1", "j", "s", ("w1", "sw", "x"), 10**6, 0.0, 0.25)
    >>> agg = PlannedAggregate("agg", "x", ("u1",), 1e6, "ps", ("u0",))
    >>> snap = Snapshot(0.0, g, in_flight=(u0, u1), gathering=(agg,))
    >>> u2 = PendingUpdate("u2", "j", "s", "w2", "w2", "ps", 10**6, 1.0, 0, 0.0)
    >>> sends, joined = join_open(snap, [u2], {"agg": "j/s"}, PathCache(g))
    >>> [(s.update_id, s.next_hop) for s in sends], joined["agg"].members
    ([('u2', 'x')], ('u1', 'u2'))

    With ``ps`` idle and ``u2`` taking 2 s to reach ``x`` (``d`` = 1 s), it does not join.

    >>> slow = star(["ps", "w1", "w2", "x"], {"ps": 8e6, "w1": 32e6, "w2": 4e6, "x": 32e6})
    >>> snap = Snapshot(0.0, slow, in_flight=(u1,), gathering=(agg,))
    >>> join_open(snap, [u2], {"agg": "j/s"}, PathCache(slow))
    ([], {})

    Work-conserving: ``ps`` is idle and ``u1`` is in ``agg`` at t=0.25; ``u2`` would be in at
    t=1, within one update's time (1 s) but 0.75 s after ``agg`` could leave. By default it
    does not join; with ``slack=1`` it does.

    >>> mid = star(["ps", "w1", "w2", "x"], {"ps": 8e6, "w1": 32e6, "w2": 8e6, "x": 32e6})
    >>> snap = Snapshot(0.0, mid, in_flight=(u1,), gathering=(agg,))
    >>> join_open(snap, [u2], {"agg": "j/s"}, PathCache(mid))
    ([], {})
    >>> join_open(snap, [u2], {"agg": "j/s"}, PathCache(mid), slack=1.0)[1]["agg"].members
    ('u1', 'u2')
    """
    ids = {p.update_id for p in pending}
    open_aggs = [
        a for a in snapshot.gathering if a.aggregate_id in server_of and any(m not in ids for m in a.members)
    ]
    if not open_aggs or not pending:
        return [], {}
    graph, now = snapshot.graph, snapshot.now
    open_ids = {a.aggregate_id for a in open_aggs}
    others = [f for f in snapshot.in_flight if f.update_id not in open_ids]
    tls, _, _ = reserve_in_flight(graph, others, now)
    free: dict[str, float] = {}
    ends: dict[str, float] = {}
    for f in others:
        if not f.path or math.isinf(f.expected_end):
            continue
        free[f.path[-1]] = max(free.get(f.path[-1], now), f.expected_end)
        ends[f.update_id] = f.expected_end
    # ends.get(m, now) per member, called by map (an aggregate gathers hundreds, issue 24)
    members_in = {
        a.aggregate_id: max(map(ends.get, a.members, itertools.repeat(now, len(a.members))), default=now)
        for a in open_aggs
    }
    ready_at = _ready_times(open_aggs, graph, paths, free, members_in, now)
    sends: list[Send] = []
    joined: dict[str, PlannedAggregate] = {}
    succ = graph._succ  # graph.edges[u, v] without its view (per pending update and aggregate, issue 24)
    onward_rate: dict[str, float] = {}  # aggregate id -> its onward path's narrowest link (inf: none)
    for a in open_aggs:
        try:
            onward = paths.links(a.aggregator, a.dst)
        except (ValueError, KeyError):
            continue  # joins no update
        onward_rate[a.aggregate_id] = min(succ[u][v]["capacity"] for u, v in onward) if onward else math.inf
    for p in sorted(pending, key=lambda p: (p.ready_at, p.bytes, p.update_id)):
        key = server_key(p.job, p.server)
        best: tuple[float, str, tuple[str, ...]] | None = None
        for a in open_aggs:
            rate = onward_rate.get(a.aggregate_id)
            if rate is None or server_of[a.aggregate_id] != key or a.dst != p.dst_host:
                continue
            try:
                to_agg = paths.links(p.src_host, a.aggregator)
                _, arrive = tls.ten(to_agg, p.bytes, max(p.ready_at, now))
            except (ValueError, KeyError):
                continue
            d = p.bytes / rate  # 0 when the aggregator is the server
            bound = ready_at[a.aggregate_id] + slack * d
            if arrive <= bound and (best is None or (arrive, a.aggregate_id) < best[:2]):
                best = (arrive, a.aggregate_id, paths.path(p.src_host, a.aggregator))
        if best is None:
            continue
        _, aid, path = best
        t = tls.transfer(p.update_id, path, p.bytes, max(p.ready_at, now))
        agg = joined.get(aid) or next(a for a in open_aggs if a.aggregate_id == aid)
        joined[aid] = replace(agg, members=(*agg.members, p.update_id))
        sends.append(Send(p.update_id, agg.aggregator, path, (), t.start, t.end))
    return sends, joined


def _ready_times(
    open_aggs: Sequence[PlannedAggregate],
    graph: nx.DiGraph,
    paths: PathCache,
    free: Mapping[str, float],
    members_in: Mapping[str, float],
    now: float,
) -> dict[str, float]:
    """When each open aggregate could leave: its members in and its server's ingress free.

    The open aggregates to one server leave in the order they were opened, each taking the
    ingress for one update's time on its path once it leaves (the work its server has ahead).
    """
    out: dict[str, float] = {}
    ahead = dict(free)
    for a in open_aggs:
        leave = max(ahead.get(a.dst, now), members_in[a.aggregate_id], now)
        out[a.aggregate_id] = leave
        try:
            onward = paths.links(a.aggregator, a.dst)
        except (ValueError, KeyError):
            continue
        rate = min((graph.edges[link]["capacity"] for link in onward), default=math.inf)
        ahead[a.dst] = leave + (a.bytes / rate if onward else 0.0)
    return out
