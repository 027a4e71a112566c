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

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache, hosts
from mlfabric.scheduler.core.native import _plan_native
from mlfabric.scheduler.core.records import init_fields, instances
from mlfabric.scheduler.core.schedule import Aggregate, Schedule, Transfer, Update, aggregate_id
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies.aggregation import EXHAUSTIVE_UP_TO, plan_aggregation_sync
from mlfabric.scheduler.policies.planning import collector_paused as _collector_paused
from mlfabric.scheduler.policies.tree_cost import Ingress
from mlfabric.scheduler.policies.tree_cost import estimate as _estimate
from mlfabric.scheduler.policies.tree_cost import reserve as _reserve
from mlfabric.scheduler.policies.tree_cost import trial_timelines as _trial_timelines
from mlfabric.scheduler.policies.tree_moves import Node as _Node
from mlfabric.scheduler.policies.tree_moves import improve_members
from mlfabric.scheduler.policies.tree_routes import RouteCache
from mlfabric.scheduler.policies.tree_same import Carry as _Carry
from mlfabric.scheduler.policies.tree_same import Key as _Key
from mlfabric.scheduler.policies.tree_same import carry as _carry
from mlfabric.scheduler.policies.tree_same import same_tree as _same_tree

__all__ = ["plan_tree"]

#: rounds of at most this many updates also try toggling each switch and bypassing (local search)
LOCAL_SEARCH_UP_TO = 256
#: local search: at most this many payloads of a point go on unsummed
BYPASS_UP_TO = 16
#: largest number of payloads one aggregate sums, tried besides no limit
FAN_INS = (2, 4, 8)
#: local search: this many best-estimated trees are reserved on the timelines, the best kept
FINALISTS = 4
#: rounds of at most this many updates also move single updates between aggregates, each
#: move scored by reserving the tree on a copy of the timelines (the fast estimate misleads it)
MOVES_UP_TO = 16


#: the fields of a tree node, which its __init__ only sets (the C build fills them itself)
_NODE_FIELDS = init_fields(_Node)
if _NODE_FIELDS != ("point", "aggregator", "members", "parent"):
    _NODE_FIELDS = None  # pragma: no cover - not this Node


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
    groups: Mapping[tuple[str, ...], list[str]]  # nodes between a source and the server -> its
    # updates (all sources with those nodes, in ready order)
    index: Mapping[str, int]  # update id -> its place in ready order
    host_of: Mapping[str, str]  # update id -> its source
    depth: Mapping[str, int]  # such a node -> nodes from it to the server (both counted)


def _tree(
    graph: nx.DiGraph,
    rc: RouteCache,
    order: Sequence[Update],
    eligible: frozenset[str],
    prefix: str,
    every: Sequence[str],
) -> _Tree:
    server_host = order[0].dst
    shape = rc.shape(server_host, eligible, frozenset(u.src for u in order), every)
    paths, below, rank = shape.paths, shape.below, shape.rank
    if _plan_native is not None and type(order) is list and type(paths) is dict and type(below) is dict:
        top_, groups_, depth_, index_, host_of_ = _plan_native.tree_tables(  # the loops below in C
            order, paths, dict(graph.adjacency()), eligible, below
        )
        return _Tree(order, paths, below, top_, rank, server_host, prefix, groups_, index_, host_of_, depth_)
    ingress: dict[str, float] = {}  # tree_cost.ingress of the hosts below a node: one pass over the links
    for nbrs in dict(graph.adjacency()).values():  # node -> its links out (attributes), read directly
        for h, d in nbrs.items():
            if h in paths and h in eligible:
                c = float(d["capacity"])
                got = ingress.get(h)
                if got is None or c > got:  # max()
                    ingress[h] = c
    top: dict[str, tuple[list[str], set[str]]] = {}
    get = ingress.get
    for x, hs in below.items():
        caps = [get(h, 0.0) for h in hs]  # 0: no link in
        fastest = max(caps)
        tier = [h for h, c in zip(hs, caps, strict=True) if c == fastest]
        top[x] = (tier, set(tier))
    groups: dict[tuple[str, ...], list[str]] = {}
    for u in order:
        groups.setdefault(paths[u.src][1:-1], []).append(u.update_id)
    depth = {x: len(on) + 1 - i for on in groups for i, x in enumerate(on)}
    index = {u.update_id: i for i, u in enumerate(order)}
    host_of = {u.update_id: u.src for u in order}
    return _Tree(order, paths, below, top, rank, server_host, prefix, groups, index, host_of, depth)


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
    local = {host_of[p] for p in members} & fastest
    if not local:
        agg = next((h for h in tier if h not in busy), tier[0])
    elif len(local) == 1:
        (agg,) = local
    else:
        ranked = sorted(local, key=tree.rank.__getitem__)
        agg = next((h for h in ranked if h not in busy), ranked[0])
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
    if _plan_native is not None and _NODE_FIELDS is not None and all(k >= 0 for k in bypass.values()):
        return _plan_native.build(  # the loops below in C
            tree.groups,
            tree.depth,
            tree.index,
            tree.below,
            tree.top,
            tree.rank,
            tree.host_of,
            points if type(points) is frozenset else frozenset(points),
            tree.prefix,
            bypass if type(bypass) is dict else dict(bypass),
            fan_in,
            _Node,
            _NODE_FIELDS,
        )
    carried: dict[str, list[str]] = {}  # payloads reaching each point
    up: dict[str, str | None] = {}
    depth: dict[str, int] = {}
    firsts: dict[str, list[list[str]]] = {}  # point -> the groups of updates it is the first of
    for on_path, uids in tree.groups.items():
        pts = [x for x in on_path if x in points]  # the points on their path, lowest first
        if not pts:
            continue
        for x in pts:
            if x not in carried:
                carried[x] = []
                depth[x] = tree.depth[x]
        for a, b in itertools.pairwise(pts):
            up[a] = b
        up.setdefault(pts[-1], None)
        firsts.setdefault(pts[0], []).append(uids)
    for x, lists in firsts.items():  # each point's updates in ready order
        carried[x] = (
            list(lists[0]) if len(lists) == 1 else sorted(itertools.chain(*lists), key=tree.index.__getitem__)
        )
    nodes: dict[str, _Node] = {}
    parent: dict[str, str] = {}
    host_of = dict(tree.host_of)
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


def _points_of(
    on_paths: Iterable[tuple[str, ...]], graph: nx.DiGraph
) -> tuple[list[frozenset[str]], set[str]]:
    """Candidate sets of aggregation points, and every switch a point may be.

    ``on_paths``: the nodes between each source and the server.
    """
    on_paths = list(on_paths)
    switches = {x for on in on_paths for x in on if graph.nodes[x].get("kind") != "host"}
    racks = {on[0] for on in on_paths if on and on[0] in switches}
    tops = {on[-1] for on in on_paths if on}
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
    rc: RouteCache,
    eligible: frozenset[str],
    now: float,
    prefix: str,
    local_search: bool,
    every: Sequence[str],
    nic_in: Mapping[str, float],
) -> tuple[Timelines, list[Transfer], list[Aggregate]]:
    tree = _tree(graph, rc, order, eligible, prefix, every)
    server_host = tree.server_host
    candidates, switches = _points_of(tree.groups, graph)
    routes = rc.routes(graph, server_host, tree.paths, tls)
    if _plan_native is not None and type(order) is list:
        updates = _plan_native.update_rows(order, now)[0]  # the list below in C
    else:
        updates = [(max(u.ready_at, now), u.bytes, u.update_id, u.src) for u in order]
    seen: dict[_Key, tuple[float, int]] = {}
    built: dict[_Key, tuple[dict[str, _Node], dict[str, str]]] = {}
    # trees by _same_tree's key: a bypass or fan-in that changes nothing is not built again
    same: dict[_Key, tuple[tuple[dict[str, _Node], dict[str, str]], tuple[float, int]]] = {}
    carries: dict[frozenset[str], _Carry] = {}

    def key_of(points: frozenset[str], bypass: Mapping[str, int], fan: int) -> _Key:
        return (points, tuple(sorted((x, k) for x, k in bypass.items() if k and x in points)), fan)

    def score(points: frozenset[str], bypass: Mapping[str, int], fan_in: int) -> tuple[float, int]:
        key = key_of(points, bypass, fan_in)
        if key not in seen:
            canon = key
            if local_search and (key[1] or fan_in):
                carry = carries.get(points)
                if carry is None:
                    carry = carries[points] = _carry(tree, points)
                canon = _same_tree(tree, points, bypass, fan_in, carry)
            got = same.get(canon)
            if got is None:
                nodes, parent = _build(tree, points, bypass, fan_in)
                makespan = _estimate(routes, updates, nodes, parent, server_host, now)
                # ties within rounding: fewer aggregates
                got = ((nodes, parent), (round(makespan, 9), len(nodes)))
                if local_search:
                    same[canon] = got
            built[key], seen[key] = got
            if not local_search and len(built) > 1:  # large rounds: keep only the best tree
                best = min(seen, key=seen.__getitem__)
                for k in [k for k in built if k != best]:
                    del built[k]
        return seen[key]

    none: dict[str, int] = {}
    # sending everything direct is never faster than the server's ingress takes it all
    ingress = sum(float(graph.edges[p, server_host]["capacity"]) for p in graph.predecessors(server_host))
    direct_bound = now + sum(u.bytes for u in order) / ingress
    scored = [(score(p, none, 0), p) for p in candidates if p]
    if not scored or direct_bound < min(scored)[0][0]:
        scored.append((score(frozenset(), none, 0), frozenset()))
    best_key, best_points = min(scored)
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
    finalist_keys = [key_of(best_points, best_bypass, best_fan)]
    if local_search:
        finalist_keys.append(key_of(*plain))
        finalist_keys += [k for k, _ in sorted(seen.items(), key=lambda kv: kv[1])[: FINALISTS - 2]]
    finalists = [built[k] for k in dict.fromkeys(finalist_keys)]
    if local_search and len(order) <= MOVES_UP_TO:
        # break the topology's shape: move single updates between aggregates (tree_moves.py),
        # scored by the reservation itself
        ingress_of = {h: nic_in[h] for h in tree.paths if h in eligible}
        idle = sorted(ingress_of, key=lambda h: (-ingress_of[h], tree.rank[h]))
        moved, _ = improve_members(
            finalists[0],
            [u.update_id for u in order],
            {u.update_id: u.src for u in order},
            idle,
            eligible,
            lambda nodes, parent: _reserve(
                _trial_timelines(tls, routes, order, nodes, parent, server_host),
                routes,
                order,
                nodes,
                parent,
                server_host,
                now,
            )[1],
            prefix,
        )
        finalists.append(moved)
    best_real: tuple[tuple[float, int], Timelines, list[Transfer], dict[str, _Node]] | None = None
    for nodes, parent in finalists:
        reserved = tls.copy() if len(finalists) > 1 else tls
        transfers, makespan = _reserve(reserved, routes, order, nodes, parent, server_host, now)
        key = (round(makespan, 9), len(nodes))
        if best_real is None or key < best_real[0]:
            best_real = (key, reserved, transfers, nodes)
    assert best_real is not None
    _, tls, transfers, nodes = best_real
    size = {t.payload_id: t.bytes for t in transfers}
    aggregates = instances(
        Aggregate, [(aid, n.aggregator, tuple(n.members), size[aid], server_host) for aid, n in nodes.items()]
    )
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
    routes: RouteCache | None = None,
    ingress: Ingress | None = None,
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
    routes : RouteCache, optional
        The trees' routes on ``graph``'s topology, kept by a caller across rounds (built on
        ``paths``, which defaults to its path cache); default: made for this call. Only
        the time taken depends on it, never the plan.
    ingress : tree_cost.Ingress, optional
        The widest link into each host on ``graph``, kept by a caller across rounds while
        ``graph``'s capacities stay the same; default: made for this call. Only the time
        taken depends on it, never the plan.

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
    summed in rack 1 (in pairs, then at ``h6``, whose own update needs no transfer; one
    payload crosses the uplink) while rack 0's are summed at ``h2``, the round takes 0.208 s
    (the tree alone 0.24 s; the moves of ``tree_moves.py`` found the pairs; bound 0.176 s).

    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> from mlfabric.scheduler.core.checker import check_schedule
    >>> g = two_tier(2, 6, 10e9, oversubscription=60)
    >>> us = [Update(f"u{i}", f"h{i}", "h0", 20e6) for i in range(1, 12)]
    >>> s = plan_tree(g, us)
    >>> round(s.makespan(), 3)
    0.208
    >>> crossing = [t.payload_id for t in s.transfers if ("tor1", "core") in t.links]
    >>> [(a.aggregator, len(a.members)) for a in s.aggregates if a.aggregate_id in crossing]
    [('h6', 2)]
    >>> _ = check_schedule(g, s, updates=us)
    """
    with _collector_paused():
        return _plan_tree(graph, updates, aggregators, now, paths, timelines, local_search, routes, ingress)


def _plan_tree(
    graph: nx.DiGraph,
    updates: Sequence[Update],
    aggregators: Sequence[str] | None,
    now: float,
    paths: PathCache | None,
    timelines: Timelines | None,
    local_search: bool | None,
    routes: RouteCache | None,
    ingress: Ingress | None = None,
) -> Schedule:
    if routes is not None and paths is not None and routes.pc is not paths:
        raise ValueError("plan_tree: routes were made on another path cache than paths")
    pc = paths if paths is not None else routes.pc if routes is not None else PathCache(graph)
    rc = routes if routes is not None else RouteCache(pc)
    tls = timelines if timelines is not None else Timelines(graph, start=now)
    if ingress is None or ingress.graph is not graph:
        ingress = Ingress(graph)
    servers = {u.dst for u in updates}
    every = hosts(graph)  # in graph order
    pool = aggregators if aggregators is not None else [h for h in every if h not in servers]
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
        rates = {
            dst: rc.bottlenecks(graph, dst, {u.src for u in by_server[server] if u.dst == dst})
            for dst in {u.dst for u in by_server[server]}
        }  # the rate of each update's own path (tree_cost.rate)
        own = {u.update_id: u.bytes / rates[u.dst][u.src] for u in by_server[server]}
        order = sorted(by_server[server], key=lambda u: (u.ready_at, -own[u.update_id], u.update_id))
        prefix = order[0].dst if len(by_server) == 1 else f"{order[0].dst}.{i}"
        tls, ts, aggs = _plan_server(graph, order, tls, rc, eligible, now, prefix, search, every, ingress)
        transfers.extend(ts)
        aggregates.extend(aggs)
    tree = Schedule.aggregated(transfers, aggregates)
    if timelines is None and len(by_server) == 1 and len(updates) <= EXHAUSTIVE_UP_TO and search:
        # a small round on an idle network: Fig. 6's groups (no topology) may still win
        groups = plan_aggregation_sync(graph, updates, aggregators=sorted(eligible), now=now, paths=pc)
        if groups.makespan() < tree.makespan() * (1 - 1e-9):
            return groups
    return tree
