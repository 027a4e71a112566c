"""Costing candidate aggregation trees (:mod:`~mlfabric.scheduler.policies.trees`).

The routes (paths and integer link ids) come from
:mod:`~mlfabric.scheduler.policies.tree_routes`; :func:`estimate` scores a tree with every link a first-come
queue at its capacity (no timelines: fast, optimistic where a transfer waits for a link in
full use); :func:`reserve` reserves a tree's payloads on the link timelines (the real plan).
Internal to the tree planner.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence

import networkx as nx

from mlfabric.scheduler.core.native import _plan_native
from mlfabric.scheduler.core.records import init_fields
from mlfabric.scheduler.core.schedule import Link, Reservation, Transfer, Update
from mlfabric.scheduler.core.timeline import EPS, LinkTimeline, Timelines
from mlfabric.scheduler.policies.tree_moves import Node
from mlfabric.scheduler.policies.tree_routes import Routes

__all__: list[str] = []


def rate(graph: nx.DiGraph, links: Sequence[Link]) -> float:
    """Bottleneck capacity of ``links`` (inf for none)."""
    succ = graph.succ
    return min((float(succ[a][b]["capacity"]) for a, b in links), default=math.inf)


def ingress(graph: nx.DiGraph, host: str) -> float:
    # the graph's own dict of the links into ``host`` (no view objects, issue 24)
    return max([float(d["capacity"]) for d in graph._pred[host].values()], default=0.0)


class Ingress(dict[str, float]):
    """host -> :func:`ingress` on ``graph``, each found when first looked up.

    A caller may keep one across decisions while ``graph``'s capacities stay the same (the
    tree planner looks up every eligible host per decision; issue 24).
    """

    def __init__(self, graph: nx.DiGraph) -> None:
        super().__init__()
        self.graph = graph

    def __missing__(self, host: str) -> float:
        self[host] = got = ingress(self.graph, host)
        return got


#: Transfer's fields, which its __init__ only sets (the C loop then fills each instance's
#: dict in this order itself, replica False); None: the C loop calls the class
_TRANSFER_FIELDS = init_fields(Transfer)
if _TRANSFER_FIELDS is None or _TRANSFER_FIELDS[-1] != "replica":
    _TRANSFER_FIELDS = None  # pragma: no cover - not this Transfer


def reserve(
    tls: Timelines,
    routes: Routes,
    order: Sequence[Update],
    nodes: Mapping[str, Node],
    parent: Mapping[str, str],
    server_host: str,
    now: float,
) -> tuple[list[Transfer], float]:
    """Reserve every payload of the tree on ``tls``; transfers and the makespan.

    Updates in ``order``, each aggregate once its members are reserved, as soon as it is
    ready (before the updates ready later).
    """
    if _plan_native is not None and type(order) is list:
        _, readies, size = _plan_native.update_rows(order, now)  # the two lines below in C
    else:
        size = {u.update_id: u.bytes for u in order}
        readies = [max(u.ready_at, now) for u in order]
    # an aggregate's size: its largest member (aggregates are made bottom-up, in id order)
    for aid in sorted(nodes, key=lambda a: int(a.rsplit(":", 1)[1])):
        size[aid] = max(size[m] for m in nodes[aid].members)
    if _plan_native is not None:  # the loop below in C, the same transfers
        return _plan_native.reserve_tree(
            tls,
            routes,
            order if isinstance(order, list) else list(order),
            nodes if type(nodes) is dict else dict(nodes),
            parent if type(parent) is dict else dict(parent),
            server_host,
            size,
            readies,
            now,
            Transfer,
            Reservation,
            _TRANSFER_FIELDS,
            LinkTimeline,
            EPS,
        )
    heap: list[tuple[float, int, str, str]] = []
    waiting = {aid: len(n.members) for aid, n in nodes.items()}
    ready_at = dict.fromkeys(nodes, -math.inf)
    transfers: list[Transfer] = []
    path, transfer, pop, push = routes.tree_path, tls.transfer, heapq.heappop, heapq.heappush
    makespan = now
    i, n, made = 0, len(order), 0
    while i < n or heap:
        if heap and (i >= n or heap[0][0] < readies[i]):
            ready, _, pid, src = pop(heap)
        else:
            u = order[i]
            ready, pid, src = readies[i], u.update_id, u.src
            i += 1
        to = parent.get(pid)
        hop = nodes[to].aggregator if to is not None else server_host
        t = transfer(pid, path(src, hop), size[pid], ready)
        transfers.append(t)
        end = t.end
        if to is None:
            if end > makespan:
                makespan = end
            continue
        waiting[to] -= 1
        if end > ready_at[to]:
            ready_at[to] = end
        if waiting[to] == 0:
            made += 1
            push(heap, (ready_at[to], made, to, nodes[to].aggregator))
    return transfers, makespan


def trial_timelines(
    tls: Timelines,
    routes: Routes,
    order: Sequence[Update],
    nodes: Mapping[str, Node],
    parent: Mapping[str, str],
    server_host: str,
) -> Timelines:
    """A copy of the timelines that :func:`reserve` of this tree reads and writes (no others).

    Each payload's path (an update or aggregate to its aggregate's host or the server);
    reserving the tree on it gives what reserving it on ``tls.copy()`` gives (issue 24: the
    member moves score every trial tree by a reservation).
    """
    links: set[Link] = set()
    path = routes.tree_path
    for u in order:
        to = parent.get(u.update_id)
        hops = path(u.src, nodes[to].aggregator if to is not None else server_host)
        links.update(itertools.pairwise(hops))
    for aid, node in nodes.items():
        to = parent.get(aid)
        hops = path(node.aggregator, nodes[to].aggregator if to is not None else server_host)
        links.update(itertools.pairwise(hops))
    return tls.copy(links)


def estimate(
    routes: Routes,
    updates: Sequence[tuple[float, float, str, str]],
    nodes: Mapping[str, Node],
    parent: Mapping[str, str],
    server_host: str,
    now: float,
    whole: bool = False,
) -> float:
    """The makespan of the tree with every link a first-come queue at its capacity (fast scoring).

    ``updates``: ``(ready, bytes, id, source)`` in the round's order; ``routes.free``: when
    each link is free of the transfers already reserved on the timelines. ``whole``: a
    payload holds every link of its path at once (from when all are free, at the path's
    bottleneck rate) instead of each link on its own (optimistic where links are shared).
    """
    if _plan_native is not None and not whole:  # the loop below in C, the same makespan
        return _plan_native.estimate(
            updates if isinstance(updates, list) else list(updates),
            nodes if type(nodes) is dict else dict(nodes),
            parent if type(parent) is dict else dict(parent),
            server_host,
            sorted(nodes),  # the heap's tie-break: aggregate ids in order
            routes,
            routes._shared,  # the in-tree routes' link ids, made there as pair_ids makes them
            now,
        )
    # each payload's links (resolved first: link ids are made on first use) and aggregate
    plan: dict[str, tuple[tuple[int, ...], str | None]] = {}
    ids = routes.tree_ids  # every payload moves between hosts of the tree
    for _, _, pid, src in updates:
        to = parent.get(pid)
        plan[pid] = (ids(src, nodes[to].aggregator if to is not None else server_host), to)
    for aid, node in nodes.items():
        to = node.parent
        plan[aid] = (
            ids(node.aggregator, nodes[to].aggregator if to is not None else server_host),
            parent.get(aid),
        )
    pop, push = heapq.heappop, heapq.heappush
    busy = routes.free.copy()
    per = routes.per
    # updates in their (sorted) order, merged with a heap of the aggregates as they are made
    heap: list[tuple[float, float, str, str]] = []
    waiting = {aid: len(n.members) for aid, n in nodes.items()}
    ready_at = dict.fromkeys(nodes, -math.inf)
    makespan = now
    i, n = 0, len(updates)
    while i < n or heap:
        if heap and (i >= n or heap[0][0] < updates[i][0]):
            ready, nbytes, pid, _ = pop(heap)
        else:
            ready, nbytes, pid, _ = updates[i]
            i += 1
        end = ready
        path, to = plan[pid]
        if whole:  # the path as one pipe: from when every link is free, at the slowest rate
            start, slow = ready, 0.0
            for link in path:
                if busy[link] > start:
                    start = busy[link]
                if per[link] > slow:
                    slow = per[link]
            end = start + nbytes * slow
            for link in path:
                busy[link] = end
        else:
            for link in path:
                at = busy[link]
                done = (ready if ready > at else at) + nbytes * per[link]
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
            push(heap, (ready_at[to], nbytes, to, ""))
    return makespan
