"""What every broadcast plan must satisfy, and how fast any broadcast can be.

:func:`check_broadcast` is the one invariant checker of broadcast plans (every planner's plan,
every test); :func:`broadcast_bound` is the *relay limit*, a lower bound on the time of any
broadcast of the model in a given number of chunks. Re-exported by
:mod:`mlfabric.scheduler.policies.broadcast`; ``docs/broadcast.md`` explains both.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.policies.broadcast_model import BroadcastError, BroadcastPlan

__all__ = ["BroadcastBound", "broadcast_bound", "check_broadcast"]

#: relative slack when comparing a child's expected time with its parent's
_TIME_RTOL = 1e-9


def check_broadcast(graph: nx.DiGraph, plan: BroadcastPlan, source: str, receivers: Collection[str]) -> None:
    """Raise :class:`BroadcastError` unless ``plan`` broadcasts from ``source`` to ``receivers``.

    The invariants, checked in this order (the message names the first one broken):

    1. **source**: the plan starts at ``source``; ``chunks >= 1``; ``nbytes >= 0``.
    2. **once**: every edge joins two hosts of the graph; no host receives the model twice, the
       source never receives it, every receiver receives it, and a host that is not a receiver
       (a relay only) forwards it to someone.
    3. **no cycles**: following parents from any host reaches the source.
    4. **parents first**: each edge's parent is the source or the child of an earlier edge (it
       receives before it forwards), and its child is not expected to have the model before
       the parent; expected times are finite and >= 0.
    5. **paths**: each edge's path runs over links of the graph from its parent to its child,
       with no node twice.

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph.
    plan : BroadcastPlan
        The plan to check.
    source : str
        The host that has the model.
    receivers : collection of str
        The hosts that must get it.

    Raises
    ------
    BroadcastError
        Naming the invariant and the host or edge.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.policies.broadcast_model import BroadcastEdge
    >>> g = star(["s", "a", "b"], 8e9)
    >>> ok = BroadcastPlan("s", 1.0, 1, (BroadcastEdge("s", "a", ("s", "sw", "a"), 1.0),))
    >>> check_broadcast(g, ok, "s", ["a"])
    >>> check_broadcast(g, ok, "s", ["a", "b"])
    Traceback (most recent call last):
    ...
    mlfabric.scheduler.policies.broadcast_model.BroadcastError: once: receiver 'b' gets no copy
    """
    if plan.source != source:
        raise BroadcastError(f"source: the plan starts at '{plan.source}', not '{source}'")
    if plan.chunks < 1 or not plan.nbytes >= 0:
        raise BroadcastError(f"source: chunks {plan.chunks} (>= 1) and nbytes {plan.nbytes} (>= 0)")
    wanted = set(receivers)
    index: dict[str, int] = {}
    for i, e in enumerate(plan.edges):
        for h in (e.parent, e.child):
            if h not in graph or graph.nodes[h].get("kind") != "host":
                raise BroadcastError(f"once: '{h}' (edge {e.parent}->{e.child}) is not a host of the graph")
        if e.child == source:
            raise BroadcastError(f"once: the source '{source}' receives the model (from '{e.parent}')")
        if e.child in index:
            raise BroadcastError(f"once: '{e.child}' receives the model twice")
        index[e.child] = i
    for r in receivers:
        if r not in index:
            raise BroadcastError(f"once: receiver '{r}' gets no copy")
    forwarders = {e.parent for e in plan.edges}
    for h in index:
        if h not in wanted and h not in forwarders:
            raise BroadcastError(f"once: '{h}' is no receiver and forwards nothing")
    parent = {e.child: e.parent for e in plan.edges}
    for h in parent:
        seen = {h}
        a = parent[h]
        while a in parent:
            if a in seen:
                raise BroadcastError(f"no cycles: '{h}' is on a cycle of parents through '{a}'")
            seen.add(a)
            a = parent[a]
        if a != source:
            raise BroadcastError(f"parents first: '{a}' forwards the model but never receives it")
    expected = plan.expected()
    for i, e in enumerate(plan.edges):
        if e.parent != source and index[e.parent] > i:
            raise BroadcastError(f"parents first: '{e.parent}' forwards to '{e.child}' before it receives")
        if not (math.isfinite(e.expected) and e.expected >= 0):
            raise BroadcastError(f"parents first: '{e.child}' has expected time {e.expected}")
        if e.expected < expected[e.parent] * (1 - _TIME_RTOL):
            raise BroadcastError(
                f"parents first: '{e.child}' is expected to have the model at {e.expected:g} s, "
                f"before its parent '{e.parent}' ({expected[e.parent]:g} s)"
            )
    for e in plan.edges:
        p = e.path
        if len(p) < 2 or p[0] != e.parent or p[-1] != e.child:
            raise BroadcastError(f"paths: edge {e.parent}->{e.child} has path {p}")
        if len(set(p)) != len(p):
            raise BroadcastError(f"paths: edge {e.parent}->{e.child} visits a node twice: {p}")
        for link in itertools.pairwise(p):
            if not graph.has_edge(*link):
                raise BroadcastError(f"paths: edge {e.parent}->{e.child}: {link} is not a link of the graph")


@dataclass(frozen=True)
class BroadcastBound:
    """The relay limit and its parts (seconds).

    Attributes
    ----------
    value : float
        ``cut + fanout + latency``: no broadcast in ``chunks`` equal chunks is faster.
    cut : float
        One copy's time across the binding cut: the model's size over the cut's rate.
    fanout : float
        The fan-out term behind that cut: one chunk's hop inside it (0 with one receiver behind
        it, or where the receiver term binds).
    latency : float
        The receiver term's path latency (0 where a link term binds).
    where : str
        The binding cut: ``"link A->B"`` (a link every copy into a subtree must cross) or
        ``"receiver H"`` (the max-flow cut to ``H``).
    chunks : int
        The chunk count the bound is for.
    """

    value: float
    cut: float
    fanout: float
    latency: float
    where: str
    chunks: int


def broadcast_bound(
    graph: nx.DiGraph,
    source: str,
    receivers: Sequence[str],
    nbytes: float,
    *,
    chunks: int | None = None,
    paths: PathCache | None = None,
) -> BroadcastBound:
    """The relay limit: a lower bound on any broadcast of ``nbytes`` in ``chunks`` equal chunks.

    Two kinds of terms; the bound is the largest:

    * **receiver**: ``B / maxflow(source, r) + latency(source, r)`` for each receiver ``r`` (the
      model's bytes through the smallest cut between them, and the shortest path latency);
    * **link** (the relay limit proper): for each link ``l`` into a subtree of the hop-count
      tree from the source that is a *cut* (the receivers behind it reach the source only
      through ``l``: a rack's uplink, the source's NIC), with ``m`` receivers behind it:
      ``B / c_l``, plus, when ``m >= 2``, the fan-out of the last chunk
      ``(B / k) / max(c_l, r_in)``, ``r_in`` the fastest egress NIC behind ``l``. Why: if every
      chunk crosses ``l`` once, the last to cross is in at one host no earlier than ``B / c_l``
      and another receiver behind ``l`` gets it by one more hop of a whole chunk from a host
      behind ``l`` (chunks are forwarded once they are in); if some chunk crosses twice, ``l``
      carries ``B + B / k``.

    With pipelining a relay tree's fan-out overlaps the copy across the cut, so the relay
    limit is one copy across the slowest cut plus one chunk's in-rack hop; the planner's
    estimate adds the pipeline's fill (a chunk per hop) and the sharing of NICs.

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph.
    source : str
        The host that has the model.
    receivers : sequence of str
        The hosts that must get it.
    nbytes : float
        The model's size ``B``.
    chunks : int, optional
        ``k``; default: the count :func:`~mlfabric.scheduler.policies.broadcast.plan_broadcast`
        chooses for this broadcast.
    paths : PathCache, optional
        Cached paths of ``graph``.

    Returns
    -------
    BroadcastBound

    Examples
    --------
    Two racks of three behind 1 Gbit/s uplinks, 20 MB in 10 chunks: one copy across the uplink
    (0.16 s) plus a 2 MB chunk's hop at 10 Gbit/s inside the rack.

    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> g = two_tier(2, 3, 10e9, oversubscription=30)
    >>> b = broadcast_bound(g, "h0", ["h1", "h2", "h3", "h4", "h5"], 20e6, chunks=10)
    >>> b.where, round(b.cut, 4), round(b.fanout, 4), round(b.value, 4)
    ('link tor0->core', 0.16, 0.0016, 0.1616)
    """
    rs = list(receivers)
    if chunks is None:
        from mlfabric.scheduler.policies.broadcast import plan_broadcast

        chunks = plan_broadcast(graph, source, rs, nbytes, paths=paths).chunks
    if chunks < 1:
        raise BroadcastError(f"chunks must be >= 1, got {chunks}")
    best = BroadcastBound(0.0, 0.0, 0.0, 0.0, "", chunks)
    if not rs or nbytes <= 0:
        return best
    latency = nx.single_source_dijkstra_path_length(graph, source, weight="latency")
    for r in rs:
        flow = nx.maximum_flow_value(graph, source, r, capacity="capacity")
        cut = nbytes / flow if flow > 0 else math.inf
        value = cut + float(latency.get(r, math.inf))
        if value > best.value:
            best = BroadcastBound(value, cut, 0.0, value - cut, f"receiver {r}", chunks)
    pc = paths if paths is not None and paths.same_topology(graph) else PathCache(graph)
    wanted = set(rs)
    links: dict[tuple[str, str], None] = {}
    for r in rs:
        down = pc.path(r, source)[::-1]
        links.update(dict.fromkeys(itertools.pairwise(down)))
    for u, v in links:
        view = nx.restricted_view(graph, [], [(u, v)])
        inside = set(graph) - nx.descendants(view, source) - {source}
        m = len(wanted & inside)
        if not m:
            continue
        cap = float(graph.edges[u, v]["capacity"])
        r_in = max(
            (
                float(c)
                for h in inside
                if graph.nodes[h].get("kind") == "host"
                for _, _, c in graph.out_edges(h, data="capacity")
            ),
            default=0.0,
        )
        fanout = (nbytes / chunks) / max(cap, r_in) if m >= 2 else 0.0
        value = nbytes / cap + fanout
        if value > best.value:
            best = BroadcastBound(value, nbytes / cap, fanout, 0.0, f"link {u}->{v}", chunks)
    return best
