"""All-reduce planning: a reduction tree up and a broadcast down, chosen from the bandwidth graph.

An all-reduce of ``B`` bytes over ``N`` participants is executed by their daemons as a tree
(docs/allreduce.md): each participant sums its children's partial sums with its own
contribution and sends the sum to its parent; the root's sum is the result, which flows back
down the same tree. The payload is cut into chunks that are pipelined, so reduction and
broadcast overlap and every tree edge carries ``B`` bytes up and ``B`` bytes down.

The cost model (:mod:`~mlfabric.scheduler.policies.allreduce_model`: :func:`tree_seconds`,
:func:`ring_seconds`, :func:`ring_chunk_seconds`) gives each candidate's time for the executor
that runs it (:data:`DAEMONS`, or :data:`PROCESS_GROUP`: the training processes over their
``torch.distributed`` group). For the daemons, where the ring is faster than the best tree the
plan is the ring (``kind == "ring"``); for a process group, the plan is the group's own
collective (``kind == "native"``, modelled as a ring in process-rank order) unless a tree beats
it by the executor's margin.

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
from dataclasses import dataclass, field

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.policies.allreduce_model import (
    CHUNK_OVERHEAD_SECONDS,
    DAEMONS,
    PROCESS_GROUP,
    Executor,
    chunk_candidates,
    link_capacity,
    native_seconds,
    nic_rate,
    ring_chunk_seconds,
    ring_seconds,
    tree_seconds,
    tree_terms,
    tree_time,
)

__all__ = [
    "CHUNK_OVERHEAD_SECONDS",
    "DAEMONS",
    "PROCESS_GROUP",
    "AllreducePlan",
    "Candidates",
    "Executor",
    "candidate_trees",
    "plan_allreduce",
    "ring_chunk_seconds",
    "ring_seconds",
    "tree_seconds",
]


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
        return min((link_capacity(graph, link) for link in links), default=math.inf)

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


@dataclass(frozen=True)
class Candidates:
    """Candidate reduction trees over participants (:func:`candidate_trees`).

    Attributes
    ----------
    trees : dict
        shape name -> parent of each host's first participant (None at the tree's root).
    local : dict
        A host's other participants, each chained under the one before it (no network).
    by_host : dict
        host -> its participants, sorted by name.
    host_order : list of str
        The hosts, fastest NIC first (ties by name).
    rate : dict
        host -> its NIC rate (:func:`nic_rate`).
    hosts : dict
        participant -> host.
    chains : dict
        chain name (``"local"``, ``"rate"``) -> its order of the hosts' first participants (the
        ``chain-*`` trees are paths over them).
    """

    trees: dict[str, dict[str, str | None]]
    local: dict[str, str | None]
    by_host: dict[str, list[str]]
    host_order: list[str]
    rate: dict[str, float]
    hosts: dict[str, str]
    chains: dict[str, list[str]] = field(default_factory=dict)

    def host_rate(self, p: str) -> float:
        """The NIC rate of participant ``p``'s host."""
        return self.rate[self.hosts[p]]


def candidate_trees(graph: nx.DiGraph, hosts: Mapping[str, str], pc: PathCache) -> Candidates:
    """The candidate trees the planners score (the module docstring's list), over ``hosts``.

    Parameters
    ----------
    graph : networkx.DiGraph
        The bandwidth graph.
    hosts : mapping
        participant -> host (each host in ``graph``).
    pc : PathCache
        Paths of ``graph``.

    Returns
    -------
    Candidates
        The trees over each host's first participant (full tree: ``{**tree, **local}``).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["a", "b", "c"], 8e9)
    >>> c = candidate_trees(g, {"p": "a", "q": "b", "r": "c"}, PathCache(g))
    >>> c.trees["flat-heap1"]
    {'p': None, 'q': 'p', 'r': 'q'}
    """
    # participants of one host: the first (by name) stands for the host, the others chain under it
    by_host: dict[str, list[str]] = {}
    for p in sorted(hosts):
        by_host.setdefault(hosts[p], []).append(p)
    local: dict[str, str | None] = {}
    for members in by_host.values():
        for i, p in enumerate(members[1:]):
            local[p] = members[i]
    rep = {h: members[0] for h, members in by_host.items()}
    rate = {h: nic_rate(graph, h) for h in by_host}
    host_order = sorted(by_host, key=lambda h: (-rate[h], h))

    def host_rate(p: str) -> float:
        return rate[hosts[p]]

    candidates: dict[str, dict[str, str | None]] = {}
    chains: dict[str, list[str]] = {}
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
        chains = _chain_orders(reps, hosts.__getitem__, pc, graph)
        for name, chain in chains.items():
            candidates[f"chain-{name}"] = _path_tree(chain)
    return Candidates(candidates, local, by_host, host_order, rate, dict(hosts), chains)


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
    cands = candidate_trees(graph, hosts, pc)
    candidates, local, by_host = cands.trees, cands.local, cands.by_host
    reps = [by_host[h][0] for h in cands.host_order]
    host_rate = cands.host_rate
    chunks = [chunk_bytes] if chunk_bytes else chunk_candidates(nbytes)
    best: tuple[float, int, str, dict[str, str | None]] | None = None
    for name in sorted(candidates):
        parent = {**candidates[name], **local}
        terms = tree_terms(graph, parent, hosts, nbytes, pc)
        for chunk in sorted(chunks, reverse=True):  # ties: the larger chunk (fewer frames)
            seconds = tree_time(terms, nbytes, chunk, executor)
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
        native = native_seconds(graph, [hosts[p] for p, _ in participants], nbytes, executor)
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
        for chunk_r in sorted([chunk_bytes] if chunk_bytes else chunk_candidates(segment), reverse=True):
            t = ring_chunk_seconds(graph, ring, hosts, nbytes, chunk_r, pc)
            if ring_best is None or t < ring_best[0] - 1e-12:
                ring_best = (t, min(chunk_r, segment))
    if ring_best is not None and ring_best[0] < seconds - 1e-12:
        return AllreducePlan(
            root, parent, children, ring_best[1], ring_best[0], ring_best[0], name, "ring", ring, seconds
        )
    ring_time = ring_best[0] if ring_best is not None else 0.0
    return AllreducePlan(root, parent, children, chunk, seconds, ring_time, name, "tree", (), seconds)
