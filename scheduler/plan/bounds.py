"""Lower bounds on the makespan of one round (synchronous SGD; DESIGN §4, paper §5).

A plan moves every update's content to the server, whole payloads along single paths,
summed only at aggregator hops (an aggregate is one update's size and leaves its
aggregator once its members are in). Whatever the plan, the last update cannot be in
before:

* **path** — each update's own time: ready time + bytes / the widest path's bottleneck
  from its worker to the server (every hop of a route is at most that fast);
* **cuts** — for every set ``C`` of nodes holding workers and not the server (the
  server's complement: its ingress; and each subtree of the shortest-path tree towards the
  server: a rack behind its uplink), the content of the ``n`` updates in ``C`` leaves ``C``
  in some ``k >= 1`` payloads (``k = n`` without an aggregator in ``C``). ``k`` payloads take
  ``k b / (sum of the capacities out of C)``; folding ``m`` worker hosts into ``k`` payloads
  takes at least ``m - k`` transfers into aggregator hosts of ``C``, all done one payload
  time (``b / max capacity out of C``) before the end. The bound of ``C`` is the smallest
  over ``k`` of the larger of the two, from the earliest ready time in ``C`` (``b`` the
  smallest update of ``C``). With ``C`` the server's complement and one payload, this is
  the server's ingress bytes with the best possible aggregation.

:func:`makespan_bound` returns the largest of them and which one it is.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.core.schedule import Update

__all__ = ["Bound", "cut_bound", "makespan_bound", "widest_rates"]


@dataclass(frozen=True)
class Bound:
    """A lower bound on a round's makespan (s) and where it comes from.

    Attributes
    ----------
    value : float
        The bound: the largest of :attr:`path`, :attr:`ingress` and :attr:`cut`.
    path : float
        Largest ready time + own widest-path time of an update.
    ingress : float
        The server's ingress (the cut around everything but the server).
    cut : float
        Largest bound over the subtrees towards the server (racks behind their uplinks).
    where : str
        What gives :attr:`value`: ``"path <update>"``, ``"ingress"`` or ``"cut <node>"``.
    """

    value: float
    path: float
    ingress: float
    cut: float
    where: str


def widest_rates(graph: nx.DiGraph, dst: str) -> dict[str, float]:
    """Node -> the bottleneck capacity of its widest path to ``dst`` (inf for ``dst`` itself).

    Examples
    --------
    >>> g = nx.DiGraph()
    >>> g.add_edge("a", "b", capacity=1.0)
    >>> g.add_edge("b", "s", capacity=5.0)
    >>> g.add_edge("a", "s", capacity=2.0)
    >>> widest_rates(g, "s")["a"]
    2.0
    """
    best = {dst: math.inf}
    heap = [(-math.inf, dst)]
    while heap:
        neg, v = heapq.heappop(heap)
        if -neg < best.get(v, -1.0):
            continue
        for u in graph.predecessors(v):
            rate = min(-neg, float(graph.edges[u, v]["capacity"]))
            if rate > best.get(u, 0.0):
                best[u] = rate
                heapq.heappush(heap, (-rate, u))
    return best


def cut_bound(
    graph: nx.DiGraph,
    inside: set[str],
    updates: Sequence[Update],
    aggregators: Iterable[str],
) -> float:
    """Lower bound for the content of ``updates`` (all ready inside ``inside``) to leave it.

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph (capacities in bytes/s).
    inside : set of str
        The node set ``C`` (not holding the server).
    updates : sequence of Update
        The updates whose worker is in ``C``.
    aggregators : iterable of str
        Hosts that may sum payloads (those in ``C`` count).

    Returns
    -------
    float
        Earliest ready time + the smallest over ``k`` of the larger of the crossing time of
        ``k`` payloads and the folding time of the worker hosts into ``k`` plus one payload
        time (0 without updates).

    Examples
    --------
    Six 20 MB updates behind a 1 Gbit/s uplink, 10 Gbit/s NICs, every host an aggregator:
    one payload crosses after the others are folded into it.

    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> g = two_tier(2, 6, 10e9, oversubscription=60)
    >>> rack = {"tor1", *(f"h{i}" for i in range(6, 12))}
    >>> us = [Update(f"u{i}", f"h{i}", "h0", 20e6) for i in range(6, 12)]
    >>> round(cut_bound(g, rack, us, [f"h{i}" for i in range(12)]), 4)
    0.176
    >>> round(cut_bound(g, rack, us, []), 4)                     # no aggregator: six crossings
    0.96
    """
    if not updates:
        return 0.0
    out = [
        float(graph.edges[a, b]["capacity"]) for a in inside for b in graph.successors(a) if b not in inside
    ]
    if not out:
        return math.inf
    total, widest = sum(out), max(out)
    ins = [
        max((float(graph.edges[p, h]["capacity"]) for p in graph.predecessors(h)), default=0.0)
        for h in set(aggregators) & inside
    ]
    b = min(u.bytes for u in updates)
    n = len(updates)
    m = len({u.src for u in updates})
    start = min(u.ready_at for u in updates)
    one = b / widest
    if not ins:
        return start + max(n * b / total, one)
    best = math.inf
    for k in range(1, n + 1):
        fold = 0.0 if m <= k else max((m - k) * b / sum(ins), b / max(ins))
        best = min(best, max(k * b / total, fold + one))
    return start + best


def _subtrees(pc: PathCache, sources: Iterable[str], server_host: str) -> dict[str, set[str]]:
    """Node -> the nodes whose path to the server crosses it (itself included), for path nodes."""
    below: dict[str, set[str]] = {}
    for s in sources:
        path = pc.path(s, server_host)
        for i, x in enumerate(path[:-1]):
            below.setdefault(x, set()).update(path[: i + 1])
    return below


def makespan_bound(
    graph: nx.DiGraph,
    updates: Sequence[Update],
    server_host: str,
    *,
    aggregators: Iterable[str] = (),
) -> Bound:
    """A lower bound on the makespan of one round of ``updates`` to ``server_host``.

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph.
    updates : sequence of Update
        The round's updates, all to ``server_host``.
    server_host : str
        The server's host.
    aggregators : iterable of str
        Hosts that may sum updates (the instance's aggregators).

    Returns
    -------
    Bound
        The largest of the path, ingress and cut bounds (see the module notes).

    Examples
    --------
    The issue's two racks of six hosts (server ``h0``, 1 Gbit/s uplinks, 20 MB): the ILP's
    0.32 s and the tree's 0.24 s against a bound of 0.176 s from rack 1's uplink.

    >>> from mlfabric.scheduler.core.graph import two_tier, hosts
    >>> g = two_tier(2, 6, 10e9, oversubscription=60)
    >>> us = [Update(f"u{i}", f"h{i}", "h0", 20e6) for i in range(1, 12)]
    >>> b = makespan_bound(g, us, "h0", aggregators=hosts(g)[1:])
    >>> round(b.value, 4), round(b.path, 4), b.where
    (0.176, 0.16, 'cut tor1')
    >>> round(makespan_bound(g, us, "h0").value, 4)                # no aggregator
    0.96
    """
    if not updates:
        return Bound(0.0, 0.0, 0.0, 0.0, "path")
    aggs = {a for a in aggregators if a != server_host}
    rates = widest_rates(graph, server_host)
    path, who = -math.inf, ""
    for u in updates:
        rate = rates.get(u.src, 0.0)
        t = u.ready_at + (u.bytes / rate if rate > 0 else math.inf)
        if t > path:
            path, who = t, u.update_id
    everything = set(graph.nodes) - {server_host}
    ingress = cut_bound(graph, everything, updates, aggs)
    pc = PathCache(graph)
    sources = {u.src for u in updates}
    cut, node = 0.0, ""
    for x, inside in sorted(_subtrees(pc, sources, server_host).items(), key=lambda kv: (len(kv[1]), kv[0])):
        if server_host in inside:
            continue
        mine = [u for u in updates if u.src in inside]
        value = cut_bound(graph, inside, mine, aggs)
        if value > cut:
            cut, node = value, x
    value, where = max((path, f"path {who}"), (ingress, "ingress"), (cut, f"cut {node}"), key=lambda p: p[0])
    return Bound(value, path, ingress, cut, where)
