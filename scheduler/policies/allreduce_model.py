"""The all-reduce planner's cost model: a pipelined tree's time and a ring's, per executor.

Split from :mod:`mlfabric.scheduler.policies.allreduce` (which plans with it and re-exports its
public names). With pipelining, a tree's time is set by the most loaded directed link
(``max over links of (bytes crossing it / capacity)``: each tree edge loads every link of its
path with the payload ``B`` in each direction, an edge between two participants of one host
loads none), plus the pipeline's fill (the slowest root-to-leaf path up plus the slowest down,
one chunk per hop, a hop taking ``chunk x m / capacity`` on its worst link when ``m`` tree
edges' streams share that link), plus a per-chunk overhead at the busiest participant (the
:class:`Executor`'s ``chunk_overhead`` per frame it sends or receives). A ring moves
``2 (N-1)/N B`` over every link of every ring hop (:func:`ring_seconds`), plus the last chunk's
hop and the ring's per-frame cost (:func:`ring_chunk_seconds`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache

__all__ = [
    "CHUNK_OVERHEAD_SECONDS",
    "DAEMONS",
    "PROCESS_GROUP",
    "Executor",
    "chunk_candidates",
    "link_capacity",
    "native_seconds",
    "nic_rate",
    "ring_chunk_seconds",
    "ring_seconds",
    "tree_seconds",
    "tree_terms",
    "tree_time",
]

#: Per-chunk cost at a participant for each frame it sends or receives (the frame, its ACK, a
#: summing call), in seconds: measured on the namespace testbed (8 Python daemons on 2 shared
#: cores, load average ~32) as 0.7-0.8 ms of daemon CPU per frame end (docs/allreduce.md).
CHUNK_OVERHEAD_SECONDS = 700e-6
#: Chunk sizes the planner chooses from (bytes), per candidate tree, by the model.
_CHUNK_CANDIDATES = (64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20)


@dataclass(frozen=True)
class Executor:
    """Who moves an all-reduce's bytes, as the planner models it.

    Attributes
    ----------
    name : str
        ``"daemons"`` (the daemons' data plane: trees and rings) or ``"process_group"`` (the
        training processes' ``torch.distributed`` group: its own collective, or mlfabric's
        trees through its point-to-point operations; ``mlfabric/torch/collective.py``).
    chunk_overhead : float
        Seconds per chunk a participant sends or receives (CPU, per-message costs).
    native : bool
        The executor has a collective of its own (a ring in process-rank order) that the plan
        may choose (``kind == "native"``).
    native_margin : float
        A tree replaces the native collective only when its model is faster by more than this
        fraction: the native collective is the safer bet where the two are close.
    op_overhead : float
        Fixed seconds per operation of the native collective.
    efficiency : float
        Payload bytes per byte of link capacity the executor's transfers get (TCP over a
        1500-byte MTU carries 1448 payload bytes per 1514-byte frame).

    Examples
    --------
    >>> DAEMONS.name, PROCESS_GROUP.native
    ('daemons', True)
    """

    name: str
    chunk_overhead: float
    native: bool = False
    native_margin: float = 0.1
    op_overhead: float = 0.0
    efficiency: float = 1.0


#: The daemons' data plane (the default).
DAEMONS = Executor("daemons", CHUNK_OVERHEAD_SECONDS)
#: A torch process group (gloo on CPU, NCCL on GPU): 0.3 ms of CPU per point-to-point chunk
#: frame (measured: ``tree_allreduce`` of 16 MB over 4 ranks on loopback took 5.7 CPU-s/GB in
#: 64 KiB chunks, 0.87 in 4 MiB ones, gloo's own all-reduce 0.79), 0.5 ms per native operation,
#: TCP's payload share of a 1500-byte MTU's frames.
PROCESS_GROUP = Executor("process_group", 300e-6, native=True, op_overhead=500e-6, efficiency=1448 / 1514)


def link_capacity(graph: nx.DiGraph, link: tuple[str, str]) -> float:
    return float(graph.edges[link]["capacity"])


def nic_rate(graph: nx.DiGraph, host: str) -> float:
    """The slower direction of a host's NIC (bytes/s); inf for an isolated host."""
    out = [float(c) for _, _, c in graph.out_edges(host, data="capacity")]
    inn = [float(c) for _, _, c in graph.in_edges(host, data="capacity")]
    return min(max(out, default=math.inf), max(inn, default=math.inf))


def _link_loads(
    pc: PathCache, edges: Sequence[tuple[str, str]], per_edge: float, down: bool = True
) -> dict[tuple[str, str], float]:
    """Bytes on each directed link when every (a, b) host pair moves ``per_edge`` a to b (and b to a)."""
    load: dict[tuple[str, str], float] = {}
    for a, b in edges:
        if a == b:
            continue
        for link in (*pc.links(a, b), *pc.links(b, a)) if down else pc.links(a, b):
            load[link] = load.get(link, 0.0) + per_edge
    return load


def tree_terms(
    graph: nx.DiGraph,
    parent: Mapping[str, str | None],
    hosts: Mapping[str, str],
    nbytes: int,
    pc: PathCache,
    *,
    reduce_only: bool = False,
) -> tuple[float, float, int]:
    """``(busiest seconds, fill seconds per chunk byte, busiest participant's tree edges)``.

    A chunk crossing a link shared by ``m`` tree edges' streams gets ``1/m`` of it, so one
    hop of a chunk of ``c`` bytes takes ``c * m / capacity`` on the hop's worst link; the fill
    is the slowest root-to-leaf path up plus the slowest down (store and forward per hop).
    ``reduce_only``: the reduction up the tree alone (a pipelined aggregation tree whose root
    is a parameter server, :mod:`~mlfabric.scheduler.policies.pipelined`): each tree edge
    loads only its child-to-parent links, and the fill is the slowest path up.
    """
    edges = [(hosts[c], hosts[p]) for c, p in parent.items() if p is not None]
    load = _link_loads(pc, edges, float(nbytes), down=not reduce_only)
    busiest = max((b / link_capacity(graph, link) for link, b in load.items()), default=0.0)

    def hop(a: str, b: str) -> float:
        if a == b or nbytes <= 0:
            return 0.0
        return max(load[link] / nbytes / link_capacity(graph, link) for link in pc.links(a, b))

    up: dict[str, float] = {}
    down: dict[str, float] = {}

    def climb(p: str) -> tuple[float, float]:
        """Per-byte time of ``p``'s path to the root, up and down (memoised, iterative)."""
        chain = []
        q: str | None = p
        while q is not None and q not in up:
            chain.append(q)
            q = parent[q]
        for v in reversed(chain):
            w = parent[v]
            if w is None:
                up[v] = down[v] = 0.0
            else:
                up[v] = up[w] + hop(hosts[v], hosts[w])
                down[v] = down[w] + (0.0 if reduce_only else hop(hosts[w], hosts[v]))
        return up[p], down[p]

    paths = [climb(p) for p in parent]
    fill = max((u for u, _ in paths), default=0.0)
    if not reduce_only:
        fill += max((d for _, d in paths), default=0.0)
    edges_at: dict[str, int] = {p: int(q is not None) for p, q in parent.items()}
    for q in parent.values():
        if q is not None:
            edges_at[q] += 1
    return busiest, fill, max(edges_at.values(), default=0)


def tree_time(
    terms: tuple[float, float, int],
    nbytes: int,
    chunk_bytes: int,
    executor: Executor = DAEMONS,
    *,
    reduce_only: bool = False,
) -> float:
    """A tree's time from its :func:`tree_terms` for ``executor``.

    Each tree edge at the busiest participant costs a frame per chunk each way (one way
    with ``reduce_only``, as for those terms).
    """
    busiest, fill, degree = terms
    chunks = max(1, math.ceil(nbytes / max(1, chunk_bytes)))
    wire = (busiest + fill * min(chunk_bytes, nbytes)) / executor.efficiency
    return wire + chunks * degree * (1 if reduce_only else 2) * executor.chunk_overhead


def native_seconds(graph: nx.DiGraph, order: Sequence[str], nbytes: int, executor: Executor) -> float:
    """The executor's own collective: a ring over the hosts ``order`` (process-rank order).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> round(native_seconds(star(4, 8e9), ["h0", "h1", "h2", "h3"], 10**9, PROCESS_GROUP), 3)
    1.569
    """
    if len(order) < 2:
        return 0.0
    return ring_seconds(graph, order, nbytes) / executor.efficiency + executor.op_overhead


def tree_seconds(
    graph: nx.DiGraph,
    parent: Mapping[str, str | None],
    hosts: Mapping[str, str],
    nbytes: int,
    chunk_bytes: int,
    pc: PathCache | None = None,
    *,
    executor: Executor = DAEMONS,
) -> float:
    """The model's time of a pipelined tree all-reduce (see the module docstring).

    Parameters
    ----------
    graph : networkx.DiGraph
        Link capacities (bytes/s) in ``capacity``.
    parent : mapping
        participant -> parent participant (None at the root).
    hosts : mapping
        participant -> host.
    nbytes, chunk_bytes : int
        The payload and the chunk size.
    pc : PathCache, optional
        Paths of ``graph``.
    executor : Executor
        Who runs it (its per-chunk cost and payload share of the links).

    Returns
    -------
    float
        Seconds.

    Examples
    --------
    A chain of three hosts on one 1 GB/s switch, 1 GB in 1 MB chunks: the middle host's NIC
    carries 2 GB each way (2 s); a chunk's hop shares that NIC with the other direction's
    stream (2 x 1 ms per hop, 2 hops up and 2 down: 8 ms); 1000 chunks x 2 edges x 2 frames
    of overhead.

    >>> from mlfabric.scheduler.core.graph import star
    >>> chain = {"a": None, "b": "a", "c": "b"}
    >>> t = tree_seconds(star(3, 8e9), chain, {"a": "h0", "b": "h1", "c": "h2"}, 10**9, 10**6)
    >>> round(t - 1000 * 2 * 2 * CHUNK_OVERHEAD_SECONDS, 4)
    2.008
    """
    pc = pc or PathCache(graph)
    return tree_time(tree_terms(graph, parent, hosts, nbytes, pc), nbytes, chunk_bytes, executor)


def chunk_candidates(nbytes: int) -> list[int]:
    """Chunk sizes to try for ``nbytes``: the candidates below it, and the whole payload."""
    sizes = [c for c in _CHUNK_CANDIDATES if c < nbytes]
    if nbytes <= _CHUNK_CANDIDATES[-1]:
        sizes.append(max(1, nbytes))
    return sizes


def ring_seconds(graph: nx.DiGraph, order: Sequence[str], nbytes: int, pc: PathCache | None = None) -> float:
    """The model's time of a ring all-reduce over the hosts ``order`` (reduce-scatter + all-gather).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> round(ring_seconds(star(4, 8e9), ["h0", "h1", "h2", "h3"], 10**9), 3)   # 2*3/4 s
    1.5
    """
    n = len(order)
    if n < 2:
        return 0.0
    pc = pc or PathCache(graph)
    per_hop = 2 * (n - 1) / n * nbytes
    load: dict[tuple[str, str], float] = {}
    for i, a in enumerate(order):
        b = order[(i + 1) % n]
        if a != b:
            for link in pc.links(a, b):
                load[link] = load.get(link, 0.0) + per_hop
    return max((v / link_capacity(graph, link) for link, v in load.items()), default=0.0)


def ring_chunk_seconds(
    graph: nx.DiGraph,
    order: Sequence[str],
    hosts: Mapping[str, str],
    nbytes: int,
    chunk_bytes: int,
    pc: PathCache | None = None,
) -> float:
    """The model's time of the daemons' ring over the participants ``order``, in chunks.

    The payload is cut into ``N`` segments of ``B/N``; segment ``k`` is summed along the
    ring from participant ``k`` to participant ``k-1`` (reduce-scatter: ``N-1`` hops) and the
    sum goes on around to ``k-2`` (all-gather: ``N-1`` hops), each segment in chunks of
    ``chunk_bytes`` that move as soon as they are summed. Every ring hop so carries
    ``2 (N-1)/N B`` (:func:`ring_seconds`, the most loaded link sets the time), and every link
    is busy from the first step on (each participant starts with its own segment), so the only
    fill is the last chunk's hop (``chunk x m / capacity`` on the worst link shared by ``m``
    ring hops). Each participant sends and receives ``2 (N-1)`` frames per chunk of a segment,
    at :data:`CHUNK_OVERHEAD_SECONDS` each.

    Parameters
    ----------
    graph : networkx.DiGraph
        Link capacities (bytes/s) in ``capacity``.
    order : sequence of str
        Participants in ring order (each sends to the next, the last to the first).
    hosts : mapping
        participant -> host (hops between two participants of one host cost no network).
    nbytes, chunk_bytes : int
        The payload and the chunk size (at most one segment).
    pc : PathCache, optional
        Paths of ``graph``.

    Returns
    -------
    float
        Seconds (0 for fewer than two participants).

    Examples
    --------
    Four hosts on one 1 GB/s switch, 1 GB in 250 MB segments sent whole: ``2 * 3/4`` s on
    every NIC, one 250 ms hop of fill and 12 frame ends per participant.

    >>> from mlfabric.scheduler.core.graph import star
    >>> hosts = {f"p{i}": f"h{i}" for i in range(4)}
    >>> t = ring_chunk_seconds(star(4, 8e9), list(hosts), hosts, 10**9, 250 * 10**6)
    >>> round(t - 12 * CHUNK_OVERHEAD_SECONDS, 3)
    1.75
    """
    n = len(order)
    if n < 2 or nbytes <= 0:
        return 0.0
    pc = pc or PathCache(graph)
    segment = math.ceil(nbytes / n)
    chunk = max(1, min(chunk_bytes, segment))
    per_hop = 2 * (n - 1) / n * nbytes
    load: dict[tuple[str, str], float] = {}
    for i, p in enumerate(order):
        a, b = hosts[p], hosts[order[(i + 1) % n]]
        if a != b:
            for link in pc.links(a, b):
                load[link] = load.get(link, 0.0) + per_hop
    busiest = max((v / link_capacity(graph, link) for link, v in load.items()), default=0.0)
    fill = max((v / per_hop * chunk / link_capacity(graph, link) for link, v in load.items()), default=0.0)
    frames = 4 * (n - 1) * math.ceil(segment / chunk)
    return busiest + fill + frames * CHUNK_OVERHEAD_SECONDS
