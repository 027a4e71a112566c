"""All-reduce planning: a reduction tree up and a broadcast down, chosen from the bandwidth graph.

An all-reduce of ``B`` bytes over ``N`` participants is executed by their daemons as a tree
(docs/allreduce.md): each participant sums its children's partial sums with its own
contribution and sends the sum to its parent; the root's sum is the result, which flows back
down the same tree. The payload is cut into chunks that are pipelined, so reduction and
broadcast overlap and every tree edge carries ``B`` bytes up and ``B`` bytes down.

The cost model (:func:`tree_seconds`): with pipelining, the time is set by the most loaded
directed link, ``max over links of (bytes crossing it / capacity)`` — each tree edge loads
every link of its path with ``B`` in each direction, an edge between two participants of
one host loads none — plus the pipeline's fill (the slowest root-to-leaf path up plus the
slowest down, one chunk per hop, a hop taking ``chunk x m / capacity`` on its worst link when
``m`` tree edges' streams share that link), plus a per-chunk overhead at the busiest
participant (:data:`CHUNK_OVERHEAD_SECONDS` per frame it sends or receives). The same model
gives a ring all-reduce's time (:func:`ring_seconds`: ``2 (N-1)/N B`` on every link of every
ring hop, plus the last chunk's hop and the ring's per-frame cost, :func:`ring_chunk_seconds`);
where the ring is faster than the best tree the plan is the ring (``kind == "ring"``), and
the daemons execute either.

Candidate trees (:func:`plan_allreduce` keeps the fastest under the model, each with the chunk
size, 64 KiB .. 16 MiB or the whole payload, that the model says is fastest for it):

- participants of one host are chained under one of them (their edges cost no network);
- hosts are grouped by their first switch (rack); within a group and among the groups'
  roots, hosts sorted by NIC rate (fastest first) are either laid out as a ``d``-ary heap
  (``d`` = 1 (a chain) .. 4, and a star) or attached greedily, each to the node whose
  busiest NIC direction would stay least loaded (fast hosts get more children, slow ones stay
  leaves: a leaf moves ``B`` each way, where a ring moves ``2 (N-1)/N B``);
- the same shapes over all hosts ignoring racks;
- chains rooted at their middle (half the fill of an end-rooted chain): ``chain-rate`` with
  the two slowest hosts at the ends, and ``chain-local``, from the slowest host always to the
  nearest unvisited one (fewest hops, widest path, fastest NIC), so racks stay contiguous. On
  a uniform graph a chain is the best single tree (every inner host moves ``2B`` each way,
  against the ring's ``2 (N-1)/N B``), and small chunks keep its fill short.

Pure: no I/O, no clock.

Examples
--------
>>> from mlfabric.scheduler.core.graph import star
>>> g = star(["a", "b", "c", "d"], {"a": 10e9, "b": 10e9, "c": 10e9, "d": 1e9})
>>> plan = plan_allreduce(g, [("p0", "a"), ("p1", "b"), ("p2", "c"), ("p3", "d")], 64 << 20)
>>> plan.children[plan.root] != [], plan.children["p3"]     # the slow host is a leaf
(True, [])
>>> plan.ring_seconds > plan.seconds
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache

__all__ = [
    "CHUNK_OVERHEAD_SECONDS",
    "DAEMONS",
    "PROCESS_GROUP",
    "AllreducePlan",
    "Executor",
    "plan_allreduce",
    "ring_chunk_seconds",
    "ring_seconds",
    "tree_seconds",
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


#: The daemons' data plane (the default).
DAEMONS = Executor("daemons", CHUNK_OVERHEAD_SECONDS)
#: A torch process group (gloo on CPU, NCCL on GPU): 0.1 ms per point-to-point chunk, 0.5 ms
#: per native operation (gloo on the namespace testbed).
PROCESS_GROUP = Executor("process_group", 100e-6, native=True, op_overhead=500e-6)


@dataclass(frozen=True)
class AllreducePlan:
    """A reduction tree over the participants.

    Attributes
    ----------
    root : str
        The participant where the sum is complete.
    parent : dict
        participant -> its parent (None at the root).
    children : dict
        participant -> its children, in the order their chunks are expected.
    chunk_bytes : int
        Bytes per pipelined chunk of the plan that runs (``kind``).
    seconds : float
        The model's time of the plan that runs (:func:`tree_seconds` or
        :func:`ring_chunk_seconds`).
    ring_seconds : float
        The model's time of a ring all-reduce over the same participants (at its best chunk
        size, per-frame cost included).
    shape : str
        Which candidate tree won (``"rack-greedy"``, ``"flat-heap2"``, ...).
    kind : str
        ``"tree"``: the executor runs the tree (``root``, ``parent``, ``children``);
        ``"ring"``: the daemons run a ring (reduce-scatter + all-gather) in the order ``ring``, and
        the tree fields describe the best tree, which lost; ``"native"``: the process group runs
        its own collective (the tree fields describe the best tree, which lost).
    ring : tuple of str
        The ring's participants in order (each sends to the next); empty for a tree.
    tree_model_seconds : float
        The model's time of the best tree.
    """

    root: str
    parent: dict[str, str | None]
    children: dict[str, list[str]]
    chunk_bytes: int
    seconds: float
    ring_seconds: float
    shape: str
    kind: str = "tree"
    ring: tuple[str, ...] = ()
    tree_model_seconds: float = math.inf

    def depth(self) -> int:
        """Edges on the longest root-to-leaf path."""
        best = 0
        for p in self.parent:
            d, q = 0, self.parent[p]
            while q is not None:
                d, q = d + 1, self.parent[q]
            best = max(best, d)
        return best

    def describe(self, hosts: Mapping[str, str]) -> str:
        """One line for logs and the result: shape, root, depth, the model's times."""
        if self.kind == "native":
            return (
                f"native collective of {len(self.parent)}: model {self.seconds * 1e3:.1f} ms "
                f"(best tree {self.shape} {self.tree_model_seconds * 1e3:.1f} ms)"
            )
        if self.kind == "ring":
            return (
                f"ring of {len(self.ring)}: {' > '.join(hosts[p] for p in self.ring)}, "
                f"{self.chunk_bytes} B chunks, model {self.seconds * 1e3:.1f} ms "
                f"(best tree {self.shape} {self.tree_model_seconds * 1e3:.1f} ms)"
            )
        return (
            f"tree {self.shape}: root {self.root} on {hosts[self.root]}, depth {self.depth()}, "
            f"{self.chunk_bytes} B chunks, model {self.seconds * 1e3:.1f} ms "
            f"(ring {self.ring_seconds * 1e3:.1f} ms)"
        )


def _capacity(graph: nx.DiGraph, link: tuple[str, str]) -> float:
    return float(graph.edges[link]["capacity"])


def _nic(graph: nx.DiGraph, host: str) -> float:
    """The slower direction of a host's NIC (bytes/s); inf for an isolated host."""
    out = [float(c) for _, _, c in graph.out_edges(host, data="capacity")]
    inn = [float(c) for _, _, c in graph.in_edges(host, data="capacity")]
    return min(max(out, default=math.inf), max(inn, default=math.inf))


def _link_loads(
    pc: PathCache, edges: Sequence[tuple[str, str]], per_edge: float
) -> dict[tuple[str, str], float]:
    """Bytes on each directed link when every (a, b) host pair moves ``per_edge`` both ways."""
    load: dict[tuple[str, str], float] = {}
    for a, b in edges:
        if a == b:
            continue
        for link in (*pc.links(a, b), *pc.links(b, a)):
            load[link] = load.get(link, 0.0) + per_edge
    return load


def _terms(
    graph: nx.DiGraph,
    parent: Mapping[str, str | None],
    hosts: Mapping[str, str],
    nbytes: int,
    pc: PathCache,
) -> tuple[float, float, int]:
    """``(busiest seconds, fill seconds per chunk byte, busiest participant's tree edges)``.

    A chunk crossing a link shared by ``m`` tree edges' streams gets ``1/m`` of it, so one
    hop of a chunk of ``c`` bytes takes ``c * m / capacity`` on the hop's worst link; the fill
    is the slowest root-to-leaf path up plus the slowest down (store and forward per hop).
    """
    edges = [(hosts[c], hosts[p]) for c, p in parent.items() if p is not None]
    load = _link_loads(pc, edges, float(nbytes))
    busiest = max((b / _capacity(graph, link) for link, b in load.items()), default=0.0)

    def hop(a: str, b: str) -> float:
        if a == b or nbytes <= 0:
            return 0.0
        return max(load[link] / nbytes / _capacity(graph, link) for link in pc.links(a, b))

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
                down[v] = down[w] + hop(hosts[w], hosts[v])
        return up[p], down[p]

    paths = [climb(p) for p in parent]
    fill = max((u for u, _ in paths), default=0.0) + max((d for _, d in paths), default=0.0)
    edges_at: dict[str, int] = {p: int(q is not None) for p, q in parent.items()}
    for q in parent.values():
        if q is not None:
            edges_at[q] += 1
    return busiest, fill, max(edges_at.values(), default=0)


def _seconds(
    terms: tuple[float, float, int], nbytes: int, chunk_bytes: int, overhead: float = CHUNK_OVERHEAD_SECONDS
) -> float:
    busiest, fill, degree = terms
    chunks = max(1, math.ceil(nbytes / max(1, chunk_bytes)))
    return busiest + fill * min(chunk_bytes, nbytes) + chunks * degree * 2 * overhead


def tree_seconds(
    graph: nx.DiGraph,
    parent: Mapping[str, str | None],
    hosts: Mapping[str, str],
    nbytes: int,
    chunk_bytes: int,
    pc: PathCache | None = None,
    *,
    overhead: float = CHUNK_OVERHEAD_SECONDS,
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
    overhead : float
        Seconds per chunk frame a participant sends or receives (the executor's).

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
    return _seconds(_terms(graph, parent, hosts, nbytes, pc), nbytes, chunk_bytes, overhead)


def _chunk_candidates(nbytes: int) -> list[int]:
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
    return max((v / _capacity(graph, link) for link, v in load.items()), default=0.0)


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
    busiest = max((v / _capacity(graph, link) for link, v in load.items()), default=0.0)
    fill = max((v / per_hop * chunk / _capacity(graph, link) for link, v in load.items()), default=0.0)
    frames = 4 * (n - 1) * math.ceil(segment / chunk)
    return busiest + fill + frames * CHUNK_OVERHEAD_SECONDS


# ------------------------------------------------------------------ tree shapes


def _heap(order: Sequence[str], d: int) -> dict[str, str | None]:
    """``order`` (fastest first) as a ``d``-ary heap: node i's parent is (i - 1) // d."""
    return {v: (None if i == 0 else order[(i - 1) // d]) for i, v in enumerate(order)}


def _greedy(order: Sequence[str], rate: Callable[[str], float]) -> dict[str, str | None]:
    """Attach each node (fastest first) where the busiest NIC direction stays least loaded."""
    parent: dict[str, str | None] = {order[0]: None}
    edges = {order[0]: 0}  # tree edges at each node (children + parent)
    for v in order[1:]:
        best = min(parent, key=lambda p: ((edges[p] + 1) / rate(p), -rate(p), order.index(p)))
        parent[v] = best
        edges[best] += 1
        edges[v] = 1
    return parent


def _shapes(order: Sequence[str], rate: Callable[[str], float]) -> dict[str, dict[str, str | None]]:
    n = len(order)
    shapes = {"greedy": _greedy(order, rate), "star": _heap(order, max(1, n - 1))}
    for d in range(1, min(4, n - 1) + 1):
        shapes[f"heap{d}"] = _heap(order, d)
    return shapes


def _path_tree(order: Sequence[str]) -> dict[str, str | None]:
    """``order`` as a chain rooted at its middle node (half the depth of an end-rooted chain)."""
    mid = (len(order) - 1) // 2
    parent: dict[str, str | None] = {order[mid]: None}
    for i in range(mid - 1, -1, -1):
        parent[order[i]] = order[i + 1]
    for i in range(mid + 1, len(order)):
        parent[order[i]] = order[i - 1]
    return parent


def _chain_orders(
    order: Sequence[str], host: Callable[[str], str], pc: PathCache, graph: nx.DiGraph
) -> dict[str, list[str]]:
    """Chain orders over ``order`` (participants, fastest NIC first).

    ``rate``: the two slowest at the ends (an end has one tree edge, an inner node two);
    ``local``: from the slowest, each step to the nearest unvisited participant (fewest hops,
    then the widest path, then the fastest NIC), so racks stay contiguous and each rack uplink
    is crossed by few chain edges.
    """
    n = len(order)
    orders = {"rate": [order[-1], *order[: n - 2], order[-2]] if n > 2 else list(order)}

    def width(a: str, b: str) -> float:
        links = (*pc.links(host(a), host(b)), *pc.links(host(b), host(a)))
        return min((_capacity(graph, link) for link in links), default=math.inf)

    rank = {p: i for i, p in enumerate(order)}
    local = [order[-1]]
    left = set(order[:-1])
    while left:
        at = local[-1]
        nxt = min(left, key=lambda p: (len(pc.links(host(at), host(p))), -width(at, p), rank[p]))
        local.append(nxt)
        left.remove(nxt)
    orders["local"] = local
    return orders


def _join(top: Mapping[str, str | None], inner: Sequence[Mapping[str, str | None]]) -> dict[str, str | None]:
    """Trees inside groups (each rooted at its first node), their roots joined by ``top``."""
    parent: dict[str, str | None] = {}
    for tree in inner:
        parent.update(tree)
    parent.update(top)
    return parent


def plan_allreduce(
    graph: nx.DiGraph,
    participants: Sequence[tuple[str, str]],
    nbytes: int,
    *,
    chunk_bytes: int | None = None,
    executor: Executor = DAEMONS,
) -> AllreducePlan:
    """Plan the reduction tree of one all-reduce.

    Parameters
    ----------
    graph : networkx.DiGraph
        The bandwidth graph (current estimates).
    participants : sequence of (participant, host)
        Every participant and the host of its daemon; each host must be in ``graph``.
    nbytes : int
        Bytes of one contribution (and of the result).
    chunk_bytes : int, optional
        Use this chunk size (default: for each candidate tree, the size among 64 KiB .. 16 MiB
        and the whole payload that the model says is fastest).
    executor : Executor
        Who runs the plan (:data:`DAEMONS`, or :data:`PROCESS_GROUP`, whose participants are
        then given in process-rank order: its native collective is a ring in that order, and
        the plan is ``"native"`` unless a tree's model beats it by ``native_margin``).

    Returns
    -------
    AllreducePlan

    Raises
    ------
    ValueError
        No participants, a participant listed twice, or a host not in the graph.
    """
    if not participants:
        raise ValueError("an all-reduce needs at least one participant")
    hosts = dict(participants)
    if len(hosts) != len(participants):
        seen: set[str] = set()
        twice = sorted({p for p, _ in participants if p in seen or seen.add(p)})  # type: ignore[func-returns-value]
        raise ValueError(f"participants listed twice: {twice}")
    missing = sorted({h for h in hosts.values() if h not in graph})
    if missing:
        raise ValueError(f"hosts not in the bandwidth graph: {missing}")
    pc = PathCache(graph)
    # participants of one host: the first (by name) stands for the host, the others chain under it
    by_host: dict[str, list[str]] = {}
    for p in sorted(hosts):
        by_host.setdefault(hosts[p], []).append(p)
    local: dict[str, str | None] = {}
    for members in by_host.values():
        for i, p in enumerate(members[1:]):
            local[p] = members[i]
    rep = {h: members[0] for h, members in by_host.items()}
    rate = {h: _nic(graph, h) for h in by_host}
    host_order = sorted(by_host, key=lambda h: (-rate[h], h))

    def host_rate(p: str) -> float:
        return rate[hosts[p]]

    candidates: dict[str, dict[str, str | None]] = {}
    reps = [rep[h] for h in host_order]
    if len(reps) == 1:
        candidates["single"] = {reps[0]: None}
    else:
        for name, tree in _shapes(reps, host_rate).items():
            candidates[f"flat-{name}"] = tree
        racks: dict[str, list[str]] = {}
        for h in host_order:
            first = pc.path(h, next(x for x in host_order if x != h))[1]
            racks.setdefault(first, []).append(rep[h])
        if 1 < len(racks) < len(reps):
            groups = list(racks.values())
            for name in ("greedy", "heap1", "heap2"):
                inner = [
                    _shapes(g, host_rate).get(name, _heap(g, 1)) if len(g) > 1 else {g[0]: None}
                    for g in groups
                ]
                roots = sorted((g[0] for g in groups), key=lambda p: (-host_rate(p), p))
                top = _shapes(roots, host_rate).get(name, _heap(roots, 1))
                candidates[f"rack-{name}"] = _join(top, inner)
        for name, chain in _chain_orders(reps, hosts.__getitem__, pc, graph).items():
            candidates[f"chain-{name}"] = _path_tree(chain)
    chunks = [chunk_bytes] if chunk_bytes else _chunk_candidates(nbytes)
    best: tuple[float, int, str, dict[str, str | None]] | None = None
    for name in sorted(candidates):
        parent = {**candidates[name], **local}
        terms = _terms(graph, parent, hosts, nbytes, pc)
        for chunk in sorted(chunks, reverse=True):  # ties: the larger chunk (fewer frames)
            seconds = _seconds(terms, nbytes, chunk, executor.chunk_overhead)
            if best is None or seconds < best[0] - 1e-12:
                best = (seconds, chunk, name, parent)
    assert best is not None
    seconds, chunk, name, parent = best
    children: dict[str, list[str]] = {p: [] for p in parent}
    for c in sorted(parent, key=lambda p: (-host_rate(p), p)):
        q = parent[c]
        if q is not None:
            children[q].append(c)
    root = next(p for p, q in parent.items() if q is None)
    if executor.native:
        order = [hosts[p] for p, _ in participants]
        native = ring_seconds(graph, order, nbytes, pc) + executor.op_overhead if len(order) > 1 else 0.0
        if seconds * (1 + executor.native_margin) >= native:
            return AllreducePlan(root, parent, children, chunk, native, native, name, "native", (), seconds)
        return AllreducePlan(root, parent, children, chunk, seconds, native, name, "tree", (), seconds)
    # the ring: hosts in chain-local order (racks contiguous), a host's participants together
    ring_hosts = (
        [hosts[p] for p in _chain_orders(reps, hosts.__getitem__, pc, graph)["local"]]
        if len(reps) > 1
        else list(by_host)
    )
    ring = tuple(p for h in ring_hosts for p in by_host[h])
    segment = math.ceil(nbytes / len(ring)) if nbytes > 0 else 0
    ring_best: tuple[float, int] | None = None
    if len(ring) > 1 and segment > 0:
        for chunk_r in sorted([chunk_bytes] if chunk_bytes else _chunk_candidates(segment), reverse=True):
            t = ring_chunk_seconds(graph, ring, hosts, nbytes, chunk_r, pc)
            if ring_best is None or t < ring_best[0] - 1e-12:
                ring_best = (t, min(chunk_r, segment))
    if ring_best is not None and ring_best[0] < seconds - 1e-12:
        return AllreducePlan(
            root, parent, children, ring_best[1], ring_best[0], ring_best[0], name, "ring", ring, seconds
        )
    ring_time = ring_best[0] if ring_best is not None else 0.0
    return AllreducePlan(root, parent, children, chunk, seconds, ring_time, name, "tree", (), seconds)
