"""The model down the trees: a broadcast planned as a relay tree over the bandwidth graph.

After a synchronous round the server sends the model to every worker. Sent as one copy per
worker, every copy crosses the server's NIC and, on an oversubscribed two-tier network, a rack's
uplink carries one copy per worker of the rack (issue 23; the reverse of the aggregation trees
of DESIGN §4, ``docs/broadcast.md``). :func:`plan_broadcast` chooses instead a *relay tree*:

* the hop-count paths from the source form a tree of switches; a switch ``x`` of it may be a
  *relay point*: one copy crosses the link into ``x``'s subtree, to one host below it (the
  *relay*: the fastest NIC, a receiver where one is as fast), which then serves the others
  below ``x`` — recursively, from the relay as a new source (deeper topologies: a relay
  point below a relay point);
* the receivers below no relay point, the *local* ones, get the model from the source in a
  *shape*: a star (one copy each from the source), a chain, a ``d``-ary heap (``d`` = 2, 3,
  4), or one copy to the fastest local host which is the root of a heap or a star of the rest
  (fast hosts inner, hosts that may not relay at the leaves); the relays of one level are fed
  from the source as a star, a chain or a binary heap (the subtrees with the slowest receivers
  first);
* the candidate relay-point sets are: none (a star of the source's direct copies is then one
  of the shapes), the switches at each depth of the tree, and the *bottleneck* switches (the
  link into them slower than the fastest NIC below them: a copy across costs more than a copy
  inside). Every candidate — each relay-point set with each shape — is scored by
  :func:`estimate_arrivals`, and the one whose last receiver has the model earliest is kept.

The model moves in ``chunks`` equal chunks, pipelined: a relay forwards chunk ``i`` to its
children once it has chunk ``i``; each tree edge carries one chunk at a time (chunk ``i + 1``
leaves the parent once chunk ``i`` is in at the child). Every tree edge is a stream over its
path; concurrent streams share links max-min fairly (the relay's egress NIC is shared by its
children).

**Chunk rule** (:func:`pipeline_chunks`). A chain of streams of rates ``r_1 .. r_h`` moving
``B`` bytes in ``k`` chunks ends about ``B / min r + (B / k) * S + k * o`` after it starts,
where ``S = sum(1 / r_j) - max(1 / r_j)`` (seconds per byte of every hop but the bottleneck:
the pipeline's fill) and ``o`` the cost of one more chunk on the bottleneck (the executor's
per-chunk cost :data:`~mlfabric.scheduler.policies.allreduce_model.CHUNK_OVERHEAD_SECONDS` plus
the hop's latency: a chunk waits for the previous one to be in). That is smallest at
``k = sqrt(B * S / o)``, rounded and kept within ``1 .. min(MAX_CHUNKS, B // MIN_CHUNK_BYTES)``.
``S`` is taken on the planned tree's slowest root-to-leaf path (its edges' estimated rates);
the tree is first chosen with ``S`` guessed as two hops at the receivers' median NIC rate,
then chosen again with the rule's ``k``. ``chunks=`` overrides it.

:func:`check_broadcast` (every plan must pass it) and :func:`broadcast_bound` (the relay limit,
a lower bound) live in :mod:`mlfabric.scheduler.policies.broadcast_check` and are re-exported.

Pure: no I/O, no clock.

Examples
--------
Two racks of three behind 1 Gbit/s uplinks, the server on the core switch: one copy per rack.

>>> from mlfabric.scheduler.core.graph import two_tier
>>> g = two_tier(2, 3, 10e9, oversubscription=30)
>>> g.add_node("ps", kind="host"); g.add_edge("ps", "core", capacity=1.25e9, latency=0.0)
>>> g.add_edge("core", "ps", capacity=1.25e9, latency=0.0)
>>> plan = plan_broadcast(g, "ps", ["h0", "h1", "h2", "h3", "h4", "h5"], 20e6)
>>> plan.children("ps")
['h0', 'h3']
>>> check_broadcast(g, plan, "ps", ["h0", "h1", "h2", "h3", "h4", "h5"])
>>> round(plan.makespan, 3), plan.chunks
(0.165, 7)
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import networkx as nx

from mlfabric.scheduler.core.fairshare import max_min_rates
from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.policies.allreduce_model import CHUNK_OVERHEAD_SECONDS
from mlfabric.scheduler.policies.broadcast_check import BroadcastBound, broadcast_bound, check_broadcast
from mlfabric.scheduler.policies.broadcast_model import (
    MAX_CHUNKS,
    MIN_CHUNK_BYTES,
    BroadcastEdge,
    BroadcastError,
    BroadcastPlan,
    Edge,
    LinkView,
    estimate_arrivals,
    pipeline_chunks,
    tree_arrivals,
)

__all__ = [
    "MAX_CHUNKS",
    "MIN_CHUNK_BYTES",
    "BroadcastBound",
    "BroadcastEdge",
    "BroadcastError",
    "BroadcastPlan",
    "broadcast_bound",
    "check_broadcast",
    "estimate_arrivals",
    "pipeline_chunks",
    "plan_broadcast",
]


@dataclass
class _Trie:
    """The hop-count tree from a source over some hosts: parents, children, hosts below."""

    parent: dict[str, str]
    children: dict[str, list[str]]
    depth: dict[str, int]
    below: dict[str, list[str]]  # switch -> hosts below it, in the order given
    order: dict[str, int]  # host -> position in a depth-first walk (locality)


def _trie(net: LinkView, src: str, hosts: Iterable[str]) -> _Trie:
    parent: dict[str, str] = {}
    children: dict[str, list[str]] = {src: []}
    depth = {src: 0}
    below: dict[str, list[str]] = {}
    for h in hosts:
        down = net.paths.path(h, src)[::-1]  # src .. h
        for a, b in itertools.pairwise(down):
            if b not in parent:
                parent[b] = a
                depth[b] = depth[a] + 1
                children.setdefault(a, []).append(b)
                children.setdefault(b, [])
        for node in down[1:-1]:
            below.setdefault(node, []).append(h)
    order: dict[str, int] = {}
    stack = [src]
    while stack:
        node = stack.pop()
        order[node] = len(order)
        stack.extend(reversed(children.get(node, [])))
    return _Trie(parent, children, depth, below, order)


@dataclass(frozen=True)
class _Choice:
    edges: tuple[Edge, ...]
    label: str


class _Planner:
    """The recursive relay-tree search for one plan (memoized per subproblem)."""

    def __init__(
        self,
        net: LinkView,
        source: str,
        receivers: Sequence[str],
        relays: Collection[str],
        nbytes: float,
        chunks: int,
    ) -> None:
        self.net = net
        self.source = source
        self.receivers = frozenset(receivers)
        self.relays = frozenset(relays)
        self.nbytes = nbytes
        self.chunks = chunks
        self._memo: dict[tuple[str, frozenset[str], frozenset[str], float], _Choice] = {}

    def _is_switch(self, node: str) -> bool:
        return self.net.graph.nodes[node].get("kind") != "host"

    def fan(self, src: str, members: Sequence[str], spare: Sequence[str], feed: float) -> _Choice:
        """The best tree from ``src`` (fed at ``feed``) to ``members``, maybe through ``spare`` hosts."""
        key = (src, frozenset(members), frozenset(spare), feed)
        best = self._memo.get(key)
        if best is None:
            best = self._memo[key] = self._search(src, list(members), list(spare), feed)
        return best

    def _candidates(
        self, src: str, trie: _Trie, members: Sequence[str], spare: Sequence[str]
    ) -> list[list[str]]:
        """Relay-point sets (topmost switches only), without duplicates; the empty set first."""
        mset = set(members)
        eligible = []
        for v, hs in trie.below.items():
            if not self._is_switch(v):
                continue
            kids = trie.children[v]
            if trie.depth[v] == 1 and (src != self.source or not any(self._is_switch(k) for k in kids)):
                # one copy out of a relay's own switch (or the source's leaf switch) is a shape
                continue
            if sum(h in mset for h in hs) >= 2 and any(self._may_relay(h, mset) for h in hs):
                eligible.append(v)
        sets: list[list[str]] = [[]]
        for d in sorted({trie.depth[v] for v in eligible}):
            sets.append([v for v in eligible if trie.depth[v] == d])
        sets.append([v for v in eligible if self._bottleneck(trie, v, mset)])
        out: list[list[str]] = []
        seen: set[frozenset[str]] = set()
        for s in sets:
            top = self._topmost(trie, s)
            key = frozenset(top)
            if key not in seen and (top or not out):
                seen.add(key)
                out.append(sorted(top, key=lambda v: (trie.depth[v], trie.order[v])))
        return out

    def _may_relay(self, host: str, members: Collection[str]) -> bool:
        return host in self.relays and (host in members or host not in self.receivers)

    def _bottleneck(self, trie: _Trie, v: str, members: Collection[str]) -> bool:
        inner = max((self.net.nic(h) for h in trie.below[v] if self._may_relay(h, members)), default=0.0)
        return self.net.capacity[(trie.parent[v], v)] < inner

    @staticmethod
    def _topmost(trie: _Trie, points: Iterable[str]) -> list[str]:
        chosen = set(points)
        out = []
        for v in dict.fromkeys(points):
            a = trie.parent.get(v)
            while a is not None and a not in chosen:
                a = trie.parent.get(a)
            if a is None:
                out.append(v)
        return out

    def _relay(self, trie: _Trie, x: str, members: Collection[str]) -> str:
        """The relay of point ``x``: the fastest NIC below it, a member on ties, then locality."""
        hosts = [h for h in trie.below[x] if self._may_relay(h, members)]
        return min(hosts, key=lambda h: (-self.net.nic(h), h not in members, trie.order[h]))

    def _search(self, src: str, members: list[str], spare: list[str], feed: float) -> _Choice:
        if not members:
            return _Choice((), "")
        trie = _trie(self.net, src, [*members, *spare])
        mset = set(members)
        best: tuple[tuple[float, float, int], _Choice] | None = None
        for points in self._candidates(src, trie, members, spare):
            grouped: set[str] = set()
            relays: list[str] = []
            slowest: dict[str, float] = {}  # relay -> the slowest NIC it serves
            sub_edges: list[Edge] = []
            labels = []
            for x in points:
                relay = self._relay(trie, x, mset)
                group = [h for h in trie.below[x] if h in mset and h != relay]
                extra = [h for h in trie.below[x] if h in spare and h != relay]
                grouped.update(trie.below[x])
                rate = min(feed, self.net.path_rate(src, relay))
                sub = self.fan(relay, group, extra, rate)
                relays.append(relay)
                slowest[relay] = min(self.net.nic(h) for h in [*group, relay] if h in mset or h == relay)
                sub_edges.extend(sub.edges)
                labels.append(f"{x}:{relay}" + (f"[{sub.label}]" if sub.label else ""))
            local = [h for h in members if h not in grouped]
            local.sort(key=lambda h: (not self._may_relay(h, mset), -self.net.nic(h), trie.order[h]))
            # the relays themselves: each straight from the source, or a chain or a binary heap of
            # relays (a relay forwards to the next subtrees' relays besides its own subtree)
            # subtrees with the slowest receivers (the longest own stream) first, near the source
            relays.sort(key=lambda h: slowest[h])
            relay_shapes = [(n, e) for n, e in _shapes(src, relays, _anyone) if n in _RELAY_SHAPES]
            for (rshape, relay_edges), (shape, shape_edges) in itertools.product(
                relay_shapes, _shapes(src, local, lambda h: self._may_relay(h, mset))
            ):
                edges = (*shape_edges, *relay_edges, *sub_edges)
                arr = tree_arrivals(self.net, src, edges, self.nbytes, self.chunks, feed)
                ends = [float(arr[h][-1]) for h in members]
                score = (max(ends), sum(ends), sum(len(self.net.links(p, c)) for p, c in edges))
                if best is None or score < best[0]:
                    label = ", ".join(labels)
                    if len(relays) > 2 and rshape != "star":
                        label = f"{rshape} of {label}"
                    label = f"{shape}" + (f"; relays {label}" if label else "") if local else label
                    best = (score, _Choice(edges, label))
        assert best is not None
        return best[1]


#: how a level's relays are fed (:func:`_shapes` names)
_RELAY_SHAPES = frozenset({"none", "star", "chain", "heap2"})


def _anyone(host: str) -> bool:
    return True


def _shapes(
    src: str, hosts: Sequence[str], relay: Callable[[str], bool]
) -> list[tuple[str, tuple[Edge, ...]]]:
    """Fan-out shapes from ``src`` over ``hosts`` (relay-capable and fastest first)."""
    n = len(hosts)
    if n == 0:
        return [("none", ())]
    out: list[tuple[str, tuple[Edge, ...]]] = [("star", tuple((src, h) for h in hosts))]

    def heap(root: str, rest: Sequence[str], d: int) -> tuple[Edge, ...] | None:
        nodes = [root, *rest]
        edges = []
        for i in range(1, len(nodes)):
            p = nodes[(i - 1) // d]
            if p != root and not relay(p):
                return None
            edges.append((p, nodes[i]))
        return tuple(edges)

    for name, d in (("chain", 1), ("heap2", 2), ("heap3", 3), ("heap4", 4)):
        edges = heap(src, hosts, d)
        if edges is not None:
            out.append((name, edges))
    if n > 2 and relay(hosts[0]):
        for d in (2, 3, 4, n - 1):
            rest = heap(hosts[0], hosts[1:], d)
            if rest is not None:
                out.append((f"one+heap{d}" if d < n - 1 else "one+star", ((src, hosts[0]), *rest)))
    unique: dict[tuple[Edge, ...], str] = {}
    for name, edges in out:
        unique.setdefault(edges, name)
    return [(name, edges) for edges, name in unique.items()]


def _fill(net: LinkView, source: str, edges: Sequence[Edge]) -> tuple[float, float]:
    """``S`` and the latency of the slowest root-to-leaf path of a tree (for the chunk rule)."""
    if not edges:
        return 0.0, 0.0
    rates = max_min_rates({i: net.links(p, c) for i, (p, c) in enumerate(edges)}, net.capacity)
    inv = {c: 1.0 / rates[i] if rates[i] > 0 else math.inf for i, (_, c) in enumerate(edges)}
    parent = {c: p for p, c in edges}
    worst, worst_total, worst_lat = 0.0, -1.0, 0.0
    forwarders = set(parent.values())
    for leaf in (c for _, c in edges if c not in forwarders):
        hops, lat, h = [], 0.0, leaf
        while h != source:
            hops.append(inv[h])
            lat = max(lat, net.latency(parent[h], h))
            h = parent[h]
        total = sum(hops)
        if total > worst_total:
            worst, worst_total, worst_lat = total - max(hops), total, lat
    return worst, worst_lat


def plan_broadcast(
    graph: nx.DiGraph,
    source: str,
    receivers: Sequence[str],
    nbytes: float,
    *,
    chunks: int | None = None,
    relays: Collection[str] | None = None,
    paths: PathCache | None = None,
) -> BroadcastPlan:
    """Plan the broadcast of ``nbytes`` from ``source`` to every receiver down a relay tree.

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph (capacities in bytes/s).
    source : str
        The host that has the model (the server).
    receivers : sequence of str
        Hosts that must get the model (distinct, not the source).
    nbytes : float
        The model's size.
    chunks : int, optional
        Equal chunks to pipeline; default: the chunk rule (module docstring).
    relays : collection of str, optional
        Hosts that may forward the model; default every receiver. A listed host that is not a
        receiver may be chosen as a subtree's relay (it then gets the model only to forward it).
    paths : PathCache, optional
        Cached paths of ``graph`` (routes of the tree's edges).

    Returns
    -------
    BroadcastPlan
        Passes :func:`check_broadcast`.

    Raises
    ------
    BroadcastError
        If a host is unknown or listed twice, or ``chunks < 1``.

    Examples
    --------
    A star whose server NIC is four times the workers': the server's own copies are faster.

    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b", "c"], {"ps": 40e9, "a": 10e9, "b": 10e9, "c": 10e9})
    >>> p = plan_broadcast(g, "ps", ["a", "b", "c"], 10e6)
    >>> p.children("ps"), p.shape
    (['a', 'b', 'c'], 'star')
    >>> g = star(["ps", "a", "b", "c"], 10e9)   # equal NICs: the server sends fewer copies
    >>> len(plan_broadcast(g, "ps", ["a", "b", "c"], 10e6).children("ps")) < 3
    True
    """
    rs = list(receivers)
    for h in [source, *rs, *(relays or ())]:
        if h not in graph or graph.nodes[h].get("kind") != "host":
            raise BroadcastError(f"'{h}' is not a host of the bandwidth graph")
    if len(set(rs)) != len(rs) or source in rs:
        raise BroadcastError("receivers must be distinct hosts other than the source")
    if chunks is not None and chunks < 1:
        raise BroadcastError(f"chunks must be >= 1, got {chunks}")
    net = LinkView(graph, paths)
    allowed = set(rs) if relays is None else set(relays) - {source}
    spare = [h for h in allowed if h not in set(rs)]
    spare.sort(key=lambda h: list(graph.nodes).index(h))
    k = chunks
    if k is None:
        median = statistics.median(net.nic(h) for h in rs) if rs else math.inf
        k = pipeline_chunks(nbytes, 2.0 / median, CHUNK_OVERHEAD_SECONDS)
    choice = _Planner(net, source, rs, allowed, nbytes, k).fan(source, rs, spare, math.inf)
    if chunks is None:
        fill, lat = _fill(net, source, choice.edges)
        better = pipeline_chunks(nbytes, fill, CHUNK_OVERHEAD_SECONDS + lat)
        if better != k:
            k = better
            choice = _Planner(net, source, rs, allowed, nbytes, k).fan(source, rs, spare, math.inf)
    arrivals = tree_arrivals(net, source, choice.edges, nbytes, k, math.inf)
    edges = tuple(BroadcastEdge(p, c, net.paths.path(p, c), float(arrivals[c][-1])) for p, c in choice.edges)
    return BroadcastPlan(source, float(nbytes), k, edges, choice.label)
