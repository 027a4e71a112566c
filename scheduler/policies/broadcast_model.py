"""The broadcast planner's data and cost model: plans, the chunk rule, the pipelined estimate.

Split from :mod:`mlfabric.scheduler.policies.broadcast` (which plans with it and re-exports its
public names; the rules are described there). A plan is plain frozen data
(:class:`BroadcastPlan`); :func:`estimate_arrivals` says when each chunk is in at each host of a
tree; :func:`pipeline_chunks` is the chunk rule.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from mlfabric.scheduler.core.fairshare import max_min_rates
from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.policies.allreduce_model import nic_rate

__all__ = [
    "MAX_CHUNKS",
    "MIN_CHUNK_BYTES",
    "BroadcastEdge",
    "BroadcastError",
    "BroadcastPlan",
    "LinkView",
    "estimate_arrivals",
    "pipeline_chunks",
    "tree_arrivals",
]

#: The smallest chunk the rule makes (bytes): below it per-chunk costs dominate.
MIN_CHUNK_BYTES = 64 << 10
#: The most chunks the rule makes.
MAX_CHUNKS = 1024

Edge = tuple[str, str]


class BroadcastError(ValueError):
    """A broadcast cannot be planned, or a plan breaks an invariant (the message says which)."""


@dataclass(frozen=True)
class BroadcastEdge:
    """One edge of a broadcast tree: ``parent`` streams the model to ``child`` along ``path``.

    Attributes
    ----------
    parent, child : str
        Hosts; ``parent`` is the source or a host that received the model before.
    path : tuple of str
        Node path from ``parent`` to ``child`` (graph links).
    expected : float
        Estimated seconds from the broadcast's start until ``child`` has the whole model.
    """

    parent: str
    child: str
    path: tuple[str, ...]
    expected: float


@dataclass(frozen=True)
class BroadcastPlan:
    """A planned broadcast: plain frozen data.

    Attributes
    ----------
    source : str
        The host that has the model at the start.
    nbytes : float
        The model's size.
    chunks : int
        Equal chunks the model moves in (pipelined).
    edges : tuple of BroadcastEdge
        One per host that receives the model, parents before their children.
    shape : str
        How the tree was chosen (relay points and shapes), for reports.

    Examples
    --------
    >>> p = BroadcastPlan("s", 1.0, 1, (BroadcastEdge("s", "a", ("s", "a"), 1.0),
    ...                                   BroadcastEdge("a", "b", ("a", "b"), 2.0)))
    >>> p.parents(), p.children("a"), p.makespan, p.expected()["b"]
    ({'a': 's', 'b': 'a'}, ['b'], 2.0, 2.0)
    """

    source: str
    nbytes: float
    chunks: int
    edges: tuple[BroadcastEdge, ...]
    shape: str = field(default="", compare=False)

    @property
    def chunk_bytes(self) -> float:
        """Bytes of one chunk."""
        return self.nbytes / self.chunks

    @property
    def makespan(self) -> float:
        """Estimated seconds until the last host has the model (0 without edges)."""
        return max((e.expected for e in self.edges), default=0.0)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Every host that receives the model (receivers and relays), in plan order."""
        return tuple(e.child for e in self.edges)

    def parents(self) -> dict[str, str]:
        """Host -> the host it receives the model from."""
        return {e.child: e.parent for e in self.edges}

    def children(self, host: str) -> list[str]:
        """The hosts ``host`` sends the model to, in plan order."""
        return [e.child for e in self.edges if e.parent == host]

    def expected(self) -> dict[str, float]:
        """Host -> estimated seconds until it has the whole model (the source: 0)."""
        return {self.source: 0.0, **{e.child: e.expected for e in self.edges}}


def pipeline_chunks(nbytes: float, fill_seconds_per_byte: float, per_chunk_seconds: float) -> int:
    """The chunk count of the chunk rule: ``round(sqrt(B * S / o))``, clamped.

    Parameters
    ----------
    nbytes : float
        The model's size ``B``.
    fill_seconds_per_byte : float
        ``S``: seconds per byte of every hop of the slowest path but its bottleneck.
    per_chunk_seconds : float
        ``o``: what one more chunk costs on the bottleneck.

    Returns
    -------
    int
        In ``1 .. min(MAX_CHUNKS, nbytes // MIN_CHUNK_BYTES)`` (at least 1).

    Examples
    --------
    20 MB, a relay hop at 2 Gbit/s after the bottleneck, 0.7 ms per chunk:

    >>> pipeline_chunks(20e6, 1 / 250e6, 700e-6)
    11
    >>> pipeline_chunks(100e3, 1 / 250e6, 700e-6), pipeline_chunks(20e6, 0.0, 700e-6)
    (1, 1)
    """
    most = max(1, min(MAX_CHUNKS, int(nbytes // MIN_CHUNK_BYTES)))
    if fill_seconds_per_byte <= 0 or nbytes <= 0:
        return 1
    if per_chunk_seconds <= 0:
        return most
    return max(1, min(most, round(math.sqrt(nbytes * fill_seconds_per_byte / per_chunk_seconds))))


class LinkView:
    """A bandwidth graph's links as the planner reads them: capacities (read once), paths, each
    host pair's path latency and each host's NIC rate (cached).

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph.
    paths : PathCache, optional
        Its cached paths (a new cache when missing or of another topology).
    """

    def __init__(self, graph: nx.DiGraph, paths: PathCache | None) -> None:
        self.graph = graph
        self.paths = paths if paths is not None and paths.same_topology(graph) else PathCache(graph)
        self.capacity = {(u, v): float(c) for u, v, c in graph.edges(data="capacity")}
        self._latency: dict[Edge, float] = {}
        self._nic: dict[str, float] = {}

    def links(self, a: str, b: str) -> tuple[Edge, ...]:
        """Directed links of the path from ``a`` to ``b``."""
        return self.paths.links(a, b)

    def latency(self, a: str, b: str) -> float:
        """Sum of the link latencies from ``a`` to ``b`` (s)."""
        key = (a, b)
        lat = self._latency.get(key)
        if lat is None:
            lat = sum(float(self.graph.edges[link].get("latency", 0.0)) for link in self.links(a, b))
            self._latency[key] = lat
        return lat

    def nic(self, host: str) -> float:
        """The slower direction of ``host``'s NIC (bytes/s)."""
        rate = self._nic.get(host)
        if rate is None:
            rate = self._nic[host] = nic_rate(self.graph, host)
        return rate

    def path_rate(self, a: str, b: str) -> float:
        """The slowest link's capacity from ``a`` to ``b`` (bytes/s)."""
        return min((self.capacity[link] for link in self.links(a, b)), default=math.inf)


def estimate_arrivals(
    graph: nx.DiGraph,
    source: str,
    edges: Sequence[Edge],
    nbytes: float,
    chunks: int,
    *,
    paths: PathCache | None = None,
    feed_rate: float = math.inf,
) -> dict[str, np.ndarray]:
    """When each chunk is in at each host of a broadcast tree (the planner's estimate).

    Every edge streams over its path at its max-min fair rate among all the tree's edges
    (:func:`~mlfabric.scheduler.core.fairshare.max_min_rates`, every edge active); chunk ``i``
    leaves the parent once the parent has it and chunk ``i - 1`` is in at the child, and takes
    ``chunk / rate + latency`` to arrive.

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph.
    source : str
        The tree's root.
    edges : sequence of (parent, child)
        Parents before their children.
    nbytes : float
        The model's size.
    chunks : int
        Equal chunks.
    paths : PathCache, optional
        The graph's paths (routes of the edges).
    feed_rate : float
        The source itself receives the chunks at this rate (a relay's stream); ``inf``: it has
        them all at 0.

    Returns
    -------
    dict
        Host -> array of the ``chunks`` arrival times (the last: it has the whole model).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["s", "a", "b"], 8e6)  # 1 MB/s NICs
    >>> chain = estimate_arrivals(g, "s", [("s", "a"), ("a", "b")], 1e6, 4)
    >>> fan = estimate_arrivals(g, "s", [("s", "a"), ("s", "b")], 1e6, 4)
    >>> float(chain["b"][-1]), float(fan["b"][-1])
    (1.25, 2.0)
    """
    return tree_arrivals(LinkView(graph, paths), source, edges, nbytes, chunks, feed_rate)


def tree_arrivals(
    net: LinkView, source: str, edges: Sequence[Edge], nbytes: float, chunks: int, feed_rate: float
) -> dict[str, np.ndarray]:
    """:func:`estimate_arrivals` on a :class:`LinkView` (the planner scores many trees on one)."""
    chunk = nbytes / chunks
    idx = np.arange(chunks, dtype=float)
    feed = (idx + 1.0) * (chunk / feed_rate) if math.isfinite(feed_rate) else np.zeros(chunks)
    arrivals = {source: feed}
    if not edges:
        return arrivals
    rates = max_min_rates({i: net.links(p, c) for i, (p, c) in enumerate(edges)}, net.capacity)
    for i, (p, c) in enumerate(edges):
        rate = rates[i]
        step = (chunk / rate if rate > 0 else math.inf) + net.latency(p, c)
        # chunk j is in at c at max over m <= j of (in at p at m) + (j - m + 1) steps
        arrivals[c] = np.maximum.accumulate(arrivals[p] - idx * step) + (idx + 1.0) * step
    return arrivals
