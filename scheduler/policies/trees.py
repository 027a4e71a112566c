"""Bandwidth-aware multi-level aggregation trees (paper §5, Fig. 6; DESIGN §4).

Fig. 6's groups (:mod:`~mlfabric.scheduler.policies.aggregation`) sum updates at one
aggregator hop per group and send every aggregate straight to the server. On racks whose
uplinks are oversubscribed the payloads that matter are those crossing the uplinks, so the
sum should be made *inside* the rack, then again where the racks' aggregates meet.

:func:`plan_tree` plans one round of updates per server as a tree read off the bandwidth
graph. The hop-count shortest paths towards the server ``S`` form an in-tree (every node's
next hop towards ``S``); a switch ``x`` of that tree may be an *aggregation point*: every
payload whose path crosses ``x`` (an update, or the aggregate of a lower point) is sent to
one host below ``x`` — its aggregator — and one payload, the sum, goes on from there
towards ``S`` (to the aggregator of the next point on its path, or to ``S``). The aggregator
is a host with the fastest ingress NIC below ``x``, preferably a worker's own host (its own
update, or the aggregate it made one level down, needs no transfer), else one not summing
at ``x`` yet.

Where summing pays is chosen by search: candidate sets of points — none, the first switch
of every worker (its rack) except the server's, every rack, every switch — each also with a
*fan-in* limit (a point with more payloads sums them in groups of 2, 4 or 8 at several hosts
first, so no NIC takes every payload); for rounds of at most :data:`LOCAL_SEARCH_UP_TO`
updates, a local search then toggles single points, lets the first ``k`` payloads of a point
*bypass* its sum (Fig. 6's first group, sent on while the others are summed) and changes
the fan-in, while that shortens the round. Candidates are scored by a fast estimate (each
link a first-come queue at its capacity, payloads in order of ready time, an aggregate once
its members are in); the best few are reserved on the link timelines and the one whose
last payload reaches ``S`` earliest wins (ties: fewer aggregates). A small round (at most
:data:`~mlfabric.scheduler.policies.aggregation.EXHAUSTIVE_UP_TO` updates, one server, no
transfer in flight) is also planned as Fig. 6's groups, kept if faster. The result passes
:func:`~mlfabric.scheduler.core.checker.check_schedule`; an aggregate's members may be
aggregates (a deeper tree).

Limits: one tree per round and server; an aggregator sums each point's payloads once
(the ILP may spread one rack's updates over aggregators of other racks); the estimate
ignores that a transfer waits for a link in full use, which only the finalists' reservations
see.

:class:`~mlfabric.scheduler.policies.tree_policy.TreePolicy` (``stf+tree``) runs the planner
online through the decision pipeline. The daemons do not
forward an aggregate to another aggregator yet, so the service refuses this policy; the
simulator executes it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache, hosts
from mlfabric.scheduler.core.schedule import Aggregate, Link, Schedule, Transfer, Update, aggregate_id
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies.aggregation import EXHAUSTIVE_UP_TO, plan_aggregation_sync

__all__ = ["plan_tree"]

#: rounds of at most this many updates also try toggling each switch and bypassing (local search)
LOCAL_SEARCH_UP_TO = 256
#: local search: at most this many payloads of a point go on unsummed
BYPASS_UP_TO = 16
#: largest number of payloads one aggregate sums, tried besides no limit
FAN_INS = (2, 4, 8)
#: local search: this many best-estimated trees are reserved on the timelines, the best kept
FINALISTS = 4


@dataclass
class _Node:
    """One aggregate of a candidate tree: the point, its host and members (payload ids)."""

    point: str
    aggregator: str
    members: list[str]
    parent: str | None = None  # aggregate id of the next point up, or None: to the server


def _in_tree(pc: PathCache, sources: Iterable[str], server_host: str) -> dict[str, tuple[str, ...]]:
    """Source host -> its path to the server (consistent: the paths form an in-tree)."""
    return {s: pc.path(s, server_host) for s in sources}


class _Routes:
    """Paths between the hosts of one server's tree: up the in-tree to the meeting node, then down.

    Within a tree the route from a worker to an aggregator below the same point runs up
    the worker's path towards the server to where the aggregator's path joins it, then down
    the aggregator's path reversed (when those links exist; else the hop-count shortest).
    """

    def __init__(
        self, graph: nx.DiGraph, pc: PathCache, server_host: str, paths: Mapping[str, tuple[str, ...]]
    ):
        self.graph, self.pc, self.server_host, self.paths = graph, pc, server_host, paths
        self._routes: dict[tuple[str, str], tuple[str, ...]] = {}
        self._links: dict[tuple[str, str], tuple[Link, ...]] = {}

    def path(self, src: str, dst: str) -> tuple[str, ...]:
        key = (src, dst)
        route = self._routes.get(key)
        if route is None:
            route = self._route(src, dst)
            self._routes[key] = route
        return route

    def links(self, src: str, dst: str) -> tuple[Link, ...]:
        key = (src, dst)
        links = self._links.get(key)
        if links is None:
            links = tuple(itertools.pairwise(self.path(src, dst)))
            self._links[key] = links
        return links

    def _route(self, src: str, dst: str) -> tuple[str, ...]:
        if src == dst:
            return (src,)
        up, down = self.paths.get(src), self.paths.get(dst)
        if dst == self.server_host and up is not None:
            return up
        if up is None or down is None:
            return self.pc.path(src, dst)
        where = {x: j for j, x in enumerate(down)}
        for i, x in enumerate(up):
            if x in where:
                back = tuple(reversed(down[: where[x] + 1]))  # from the meeting node down
                if all(self.graph.has_edge(a, b) for a, b in itertools.pairwise(back)):
                    return up[:i] + back
                break
        return self.pc.path(src, dst)


def _rate(graph: nx.DiGraph, links: Sequence[Link]) -> float:
    """Bottleneck capacity of ``links`` (inf for none)."""
    return min((float(graph.edges[link]["capacity"]) for link in links), default=math.inf)


def _ingress(graph: nx.DiGraph, host: str) -> float:
    return max((float(graph.edges[p, host]["capacity"]) for p in graph.predecessors(host)), default=0.0)


@dataclass
class _Tree:
    """What every candidate tree of one server shares: paths, hosts below each node, NICs."""

    order: Sequence[Update]
    paths: Mapping[str, tuple[str, ...]]  # source or eligible host -> its path to the server
    below: Mapping[str, list[str]]  # node -> eligible hosts whose path crosses it (graph order)
    top: Mapping[str, tuple[list[str], set[str]]]  # node -> those of them with the fastest ingress
    rank: Mapping[str, int]  # host -> its place in graph order
    server_host: str
    prefix: str


def _tree(
    graph: nx.DiGraph, pc: PathCache, order: Sequence[Update], eligible: frozenset[str], prefix: str
) -> _Tree:
    server_host = order[0].dst
    sources = {u.src for u in order}
    paths = _in_tree(pc, sources, server_host)
    crossed = {x for p in paths.values() for x in p[1:-1]}
    below: dict[str, list[str]] = {}
    for h in hosts(graph):
        if h not in eligible or h == server_host:
            continue
        if h not in paths:
            try:
                path = pc.path(h, server_host)
            except ValueError:
                continue
            if not crossed.intersection(path):
                continue
            paths[h] = path
        for x in paths[h][1:-1]:
            below.setdefault(x, []).append(h)
    ingress = {h: _ingress(graph, h) for hs in below.values() for h in hs}
    top: dict[str, tuple[list[str], set[str]]] = {}
    for x, hs in below.items():
        fastest = max(ingress[h] for h in hs)
        tier = [h for h in hs if ingress[h] == fastest]
        top[x] = (tier, set(tier))
    rank = {h: i for i, h in enumerate(hosts(graph))}
    return _Tree(order, paths, below, top, rank, server_host, prefix)


def _sum(
    tree: _Tree,
    nodes: dict[str, _Node],
    parent: dict[str, str],
    host_of: dict[str, str],
    point: str,
    members: list[str],
    summing: dict[str, set[str]],
) -> str:
    """Add the aggregate of ``members`` at the best host below ``point``; its id.

    The fastest ingress NIC, then a host already holding a member (no transfer for it),
    then one not yet summing at this point, then the first in graph order.
    """
    tier, fastest = tree.top[point]
    busy = summing.setdefault(point, set())
    local = sorted({host_of[p] for p in members} & fastest, key=tree.rank.__getitem__)
    free = [h for h in local if h not in busy]
    agg = (free or local)[0] if local else next((h for h in tier if h not in busy), tier[0])
    busy.add(agg)
    aid = aggregate_id(tree.prefix, len(nodes))
    nodes[aid] = _Node(point, agg, list(members))
    for p in members:
        parent[p] = aid
    host_of[aid] = agg
    return aid


def _build(
    tree: _Tree, points: frozenset[str], bypass: Mapping[str, int], fan_in: int = 0
) -> tuple[dict[str, _Node], dict[str, str]]:
    """The aggregates of the tree aggregating at ``points``; and payload id -> its aggregate.

    At a point, the first ``bypass[x]`` payloads (in ready order, lower aggregates last) go
    on unsummed; points with fewer than two payloads left or no eligible host below pass
    their payloads on. With ``fan_in``, a point with more payloads sums them in groups of
    ``fan_in`` first (each at its own host when the groups hold payloads of different hosts),
    and so on up: no aggregator's NIC takes more than ``fan_in`` payloads per aggregate.
    """
    order, paths = tree.order, tree.paths
    chain: dict[str, list[str]] = {}  # source -> the points on its path, lowest first
    for u in order:
        if u.src not in chain:
            chain[u.src] = [x for x in paths[u.src][1:-1] if x in points]
    carried: dict[str, list[str]] = {}  # payloads reaching each point
    up: dict[str, str | None] = {}
    depth: dict[str, int] = {}
    for u in order:
        pts = chain[u.src]
        if not pts:
            continue
        carried.setdefault(pts[0], []).append(u.update_id)
        for x in pts:
            carried.setdefault(x, [])
            depth[x] = len(paths[u.src]) - paths[u.src].index(x)
        for a, b in itertools.pairwise(pts):
            up[a] = b
        up.setdefault(pts[-1], None)
    nodes: dict[str, _Node] = {}
    parent: dict[str, str] = {}
    host_of: dict[str, str] = {u.update_id: u.src for u in order}
    summing: dict[str, set[str]] = {}  # point -> hosts summing there already
    for x in sorted(carried, key=lambda x: (-depth[x], x)):
        payloads = carried[x]
        nxt = up.get(x)
        skip = min(bypass.get(x, 0), len(payloads))
        summed = payloads[skip:]
        candidates = tree.below.get(x, [])
        if len(summed) < 2 or not candidates:
            if nxt is not None:
                carried[nxt].extend(payloads)
            continue
        if nxt is not None:
            carried[nxt].extend(payloads[:skip])
        while fan_in and len(summed) > fan_in:  # too many for one NIC: sum in groups first
            groups = [summed[i : i + fan_in] for i in range(0, len(summed), fan_in)]
            summed = []
            for group in groups:
                if len(group) < 2:
                    summed.extend(group)
                    continue
                aid = _sum(tree, nodes, parent, host_of, x, group, summing)
                summed.append(aid)
        aid = _sum(tree, nodes, parent, host_of, x, summed, summing)
        if nxt is not None:
            carried[nxt].append(aid)
    for aid, node in nodes.items():
        node.parent = parent.get(aid)
    return nodes, parent


def _reserve(
    tls: Timelines,
    routes: _Routes,
    order: Sequence[Update],
    nodes: Mapping[str, _Node],
    parent: Mapping[str, str],
    server_host: str,
    now: float,
) -> tuple[list[Transfer], float]:
    """Reserve every payload of the tree on ``tls``; transfers and the makespan.

    Updates in ``order``, each aggregate once its members are reserved, as soon as it is
    ready (before the updates ready later).
    """
    size: dict[str, float] = {u.update_id: u.bytes for u in order}
    # an aggregate's size: its largest member (aggregates are made bottom-up, in id order)
    for aid in sorted(nodes, key=lambda a: int(a.rsplit(":", 1)[1])):
        size[aid] = max(size[m] for m in nodes[aid].members)
    heap: list[tuple[float, int, str, str]] = []
    waiting = {aid: len(n.members) for aid, n in nodes.items()}
    ready_at = dict.fromkeys(nodes, -math.inf)
    transfers: list[Transfer] = []
    makespan = now
    i, n, made = 0, len(order), 0
    while i < n or heap:
        if heap and (i >= n or heap[0][0] < max(order[i].ready_at, now)):
            ready, _, pid, src = heapq.heappop(heap)
        else:
            u = order[i]
            ready, pid, src = max(u.ready_at, now), u.update_id, u.src
            i += 1
        to = parent.get(pid)
        hop = nodes[to].aggregator if to is not None else server_host
        t = tls.transfer(pid, routes.path(src, hop), size[pid], ready)
        transfers.append(t)
        if to is None:
            makespan = max(makespan, t.end)
            continue
        waiting[to] -= 1
        ready_at[to] = max(ready_at[to], t.end)
        if waiting[to] == 0:
            made += 1
            heapq.heappush(heap, (ready_at[to], made, to, nodes[to].aggregator))
    return transfers, makespan


class _FreeAt(dict[Link, float]):
    """Link -> the end of its last reservation on ``tls`` (read on first use)."""

    def __init__(self, tls: Timelines) -> None:
        super().__init__()
        self._tls = tls

    def __missing__(self, link: Link) -> float:
        times = self._tls.link(link).times
        self[link] = value = times[-1] if len(times) > 1 else -math.inf
        return value


def _estimate(
    graph: nx.DiGraph,
    routes: _Routes,
    order: Sequence[Update],
    nodes: Mapping[str, _Node],
    parent: Mapping[str, str],
    server_host: str,
    now: float,
    free: _FreeAt,
) -> float:
    """The makespan of the tree with every link a first-come queue at its capacity (fast scoring).

    ``free``: when each link is free of the transfers already reserved on the timelines.
    """
    # updates in their (sorted) order, merged with a heap of the aggregates as they are made
    updates = [(max(u.ready_at, now), u.bytes, u.update_id, u.src) for u in order]
    heap: list[tuple[float, float, str, str]] = []
    waiting = {aid: len(n.members) for aid, n in nodes.items()}
    ready_at = dict.fromkeys(nodes, -math.inf)
    busy: dict[Link, float] = {}
    slow: dict[Link, float] = {}  # link -> seconds per byte
    edges = graph.edges
    makespan = now
    i, n = 0, len(updates)
    while i < n or heap:
        if heap and (i >= n or heap[0][0] < updates[i][0]):
            ready, nbytes, pid, src = heapq.heappop(heap)
        else:
            ready, nbytes, pid, src = updates[i]
            i += 1
        to = parent.get(pid)
        hop = nodes[to].aggregator if to is not None else server_host
        end = ready
        for link in routes.links(src, hop):
            at = busy.get(link)
            if at is None:
                at = free[link]
            per = slow.get(link)
            if per is None:
                per = slow[link] = 1.0 / edges[link]["capacity"]
            done = (ready if ready > at else at) + nbytes * per
            busy[link] = done
            if done > end:
                end = done
        if to is None:
            if end > makespan:
                makespan = end
            continue
        waiting[to] -= 1
        if end > ready_at[to]:
            ready_at[to] = end
        if waiting[to] == 0:
            heapq.heappush(heap, (ready_at[to], nbytes, to, nodes[to].aggregator))
    return makespan


def _points_of(
    paths: Mapping[str, tuple[str, ...]], graph: nx.DiGraph
) -> tuple[list[frozenset[str]], set[str]]:
    """Candidate sets of aggregation points, and every switch a point may be."""
    switches = {x for p in paths.values() for x in p[1:-1] if graph.nodes[x].get("kind") != "host"}
    racks = {p[1] for p in paths.values() if len(p) > 2 and p[1] in switches}
    tops = {p[-2] for p in paths.values() if len(p) > 2}
    candidates = [
        frozenset(),
        frozenset(racks - tops),
        frozenset(racks),
        frozenset(racks | tops),
        frozenset(switches),
    ]
    return list(dict.fromkeys(candidates)), switches


def _plan_server(
    graph: nx.DiGraph,
    order: Sequence[Update],
    tls: Timelines,
    pc: PathCache,
    eligible: frozenset[str],
    now: float,
    prefix: str,
    local_search: bool,
) -> tuple[Timelines, list[Transfer], list[Aggregate]]:
    tree = _tree(graph, pc, order, eligible, prefix)
    server_host = tree.server_host
    candidates, switches = _points_of({u.src: tree.paths[u.src] for u in order}, graph)
    routes = _Routes(graph, pc, server_host, tree.paths)
    free = _FreeAt(tls)
    seen: dict[tuple[frozenset[str], tuple[tuple[str, int], ...], int], tuple[float, int]] = {}

    def score(points: frozenset[str], bypass: Mapping[str, int], fan_in: int) -> tuple[float, int]:
        key = (points, tuple(sorted((x, k) for x, k in bypass.items() if k and x in points)), fan_in)
        if key not in seen:
            nodes, parent = _build(tree, points, bypass, fan_in)
            makespan = _estimate(graph, routes, order, nodes, parent, server_host, now, free)
            seen[key] = (round(makespan, 9), len(nodes))  # ties within rounding: fewer aggregates
        return seen[key]

    none: dict[str, int] = {}
    best_key, best_points = min((score(p, none, 0), p) for p in candidates)
    plain = (best_points, none, 0)  # the best tree with neither a bypass nor a fan-in limit
    best_bypass: dict[str, int] = {}
    best_fan = 0
    for points in candidates if local_search else [best_points]:
        for fan in FAN_INS if local_search else FAN_INS[1:]:
            key = score(points, none, fan)
            if key < best_key:
                best_key, best_points, best_fan = key, points, fan
    if local_search:
        improved = True
        while improved:
            improved = False
            for x in sorted(switches):
                points = best_points ^ {x}
                key = score(points, best_bypass, best_fan)
                if key < best_key:
                    best_key, best_points, improved = key, points, True
            for x in sorted(best_points):
                for k in range(1, min(len(order), BYPASS_UP_TO + 1)):
                    trial = {**best_bypass, x: k}
                    key = score(best_points, trial, best_fan)
                    if key < best_key:
                        best_key, best_bypass, improved = key, trial, True
            for fan in (0, *FAN_INS):
                key = score(best_points, best_bypass, fan)
                if key < best_key:
                    best_key, best_fan, improved = key, fan, True
    # the estimate ignores that a transfer waits for a link busy in full: reserve the best few
    chosen = (best_points, best_bypass, best_fan)
    finalists = [chosen]
    if local_search:
        finalists.append(plain)
        ranked = sorted(seen.items(), key=lambda kv: kv[1])
        finalists += [(p, dict(b), f) for (p, b, f), _ in ranked[: FINALISTS - 2]]
    best_real: tuple[tuple[float, int], Timelines, list[Transfer], dict[str, _Node]] | None = None
    for points, bypass, fan in finalists:
        nodes, parent = _build(tree, points, bypass, fan)
        trial = tls.copy() if len(finalists) > 1 else tls
        transfers, makespan = _reserve(trial, routes, order, nodes, parent, server_host, now)
        key = (round(makespan, 9), len(nodes))
        if best_real is None or key < best_real[0]:
            best_real = (key, trial, transfers, nodes)
    assert best_real is not None
    _, tls, transfers, nodes = best_real
    size = {t.payload_id: t.bytes for t in transfers}
    aggregates = [
        Aggregate(aid, n.aggregator, tuple(n.members), size[aid], server_host) for aid, n in nodes.items()
    ]
    return tls, transfers, aggregates


def plan_tree(
    graph: nx.DiGraph,
    updates: Sequence[Update],
    *,
    aggregators: Sequence[str] | None = None,
    now: float = 0.0,
    paths: PathCache | None = None,
    timelines: Timelines | None = None,
    local_search: bool | None = None,
) -> Schedule:
    """Plan ``updates`` as multi-level aggregation trees, one per server (DESIGN §4).

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph (capacities: the current estimates).
    updates : sequence of Update
        The round's updates (one or more servers; planned in server-name order on shared
        link timelines).
    aggregators : sequence of str, optional
        Hosts that may aggregate; default every host but the updates' servers.
    now : float
        Planning time.
    paths : PathCache, optional
        Path cache for ``graph``.
    timelines : Timelines, optional
        Link timelines holding the transfers already in flight; default empty.
    local_search : bool, optional
        Toggle single switches after the candidate sets; default for rounds of at most
        :data:`LOCAL_SEARCH_UP_TO` updates.

    Returns
    -------
    Schedule
        Transfers of updates (to an aggregator or the server; a zero-hop transfer when an
        update's own host aggregates it), of aggregates (to the next aggregator or the
        server), and the aggregates, whose members may be aggregates.

    Examples
    --------
    Two racks of six hosts with 10 Gbit/s NICs under 1 Gbit/s uplinks, the server ``h0``,
    20 MB per update: sent directly the six updates of rack 1 share its uplink (0.96 s);
    summed in rack 1 (at ``h6``, whose own update needs no transfer) while rack 0 sends
    directly, the round takes a quarter of that.

    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> from mlfabric.scheduler.core.checker import check_schedule
    >>> g = two_tier(2, 6, 10e9, oversubscription=60)
    >>> us = [Update(f"u{i}", f"h{i}", "h0", 20e6) for i in range(1, 12)]
    >>> s = plan_tree(g, us)
    >>> round(s.makespan(), 3), sorted((a.aggregator, len(a.members)) for a in s.aggregates)
    (0.24, [('h6', 6)])
    >>> _ = check_schedule(g, s, updates=us)
    """
    pc = paths if paths is not None else PathCache(graph)
    tls = timelines if timelines is not None else Timelines(graph, start=now)
    servers = {u.dst for u in updates}
    pool = aggregators if aggregators is not None else [h for h in hosts(graph) if h not in servers]
    eligible = frozenset(h for h in pool if h not in servers)
    by_server: dict[str, list[Update]] = {}
    for u in updates:
        by_server.setdefault(u.server, []).append(u)
    search = len(updates) <= LOCAL_SEARCH_UP_TO if local_search is None else local_search
    transfers: list[Transfer] = []
    aggregates: list[Aggregate] = []
    for i, server in enumerate(sorted(by_server)):
        # ready order; among updates ready together the longest own transfer first (a slow
        # NIC's update then shares the server's ingress from the start, as in a fair share)
        own = {u.update_id: u.bytes / _rate(graph, pc.links(u.src, u.dst)) for u in by_server[server]}
        order = sorted(by_server[server], key=lambda u: (u.ready_at, -own[u.update_id], u.update_id))
        prefix = order[0].dst if len(by_server) == 1 else f"{order[0].dst}.{i}"
        tls, ts, aggs = _plan_server(graph, order, tls, pc, eligible, now, prefix, search)
        transfers.extend(ts)
        aggregates.extend(aggs)
    tree = Schedule.aggregated(transfers, aggregates)
    if timelines is None and len(by_server) == 1 and len(updates) <= EXHAUSTIVE_UP_TO and search:
        # a small round on an idle network: Fig. 6's groups (no topology) may still win
        groups = plan_aggregation_sync(graph, updates, aggregators=sorted(eligible), now=now, paths=pc)
        if groups.makespan() < tree.makespan() * (1 - 1e-9):
            return groups
    return tree
