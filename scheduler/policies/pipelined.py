"""Pipelined (cut-through) aggregation trees for a synchronous round (``--pipelined-aggregates``).

Store-and-forward aggregation (:mod:`~mlfabric.scheduler.policies.trees`) forwards a sum only
once every member arrived whole, so each level of a tree costs one update's time on its
link: for ``N`` leaves and a summing server, at least ``ceil(log2(N + 1))`` update times
through the server's link. A *pipelined* aggregate forwards chunk ``i`` of its sum as soon as
chunk ``i`` of every member is in, so a chain or a deep tree costs about one update's time on
the most loaded link, plus one chunk per hop of fill: the all-reduce planner's cost model for
its reduction phase (:mod:`~mlfabric.scheduler.policies.allreduce_model`, ``reduce_only``).

:func:`plan_pipelined_round` chooses a round's tree with that model: the participants are the
round's updates (at their workers' hosts) and the server (the root); the candidates are the
all-reduce planner's (:func:`~mlfabric.scheduler.policies.allreduce.candidate_trees`: chains
to stars, per-rack trees joined at the racks' fastest hosts) over the workers' hosts, each
once with its root sending to the server and once over the hosts and the server re-rooted at
the server, and every update sent straight to the server. A host with two or more payloads
to sum (its own updates and its children's) is an aggregator; hosts that may not aggregate
(``aggregators``) stay leaves. :func:`pipelined_schedule` turns the tree into a
:class:`~mlfabric.scheduler.core.schedule.Schedule`: every payload streams at the rate the
most loaded link allows (``B / busiest``), an aggregate one chunk behind the last of its
members to start; :func:`~mlfabric.scheduler.core.checker.check_schedule` checks it with
``pipelined=`` its aggregates (what an aggregate has forwarded never exceeds what each member
has delivered).

The model assumes the round's links are its own (no other traffic): a synchronous round is
planned once, at its first arrival (:class:`~mlfabric.scheduler.policies.round_plans.RoundBook`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.core.schedule import Aggregate, Schedule, Transfer, Update, aggregate_id
from mlfabric.scheduler.policies.allreduce import candidate_trees
from mlfabric.scheduler.policies.allreduce_model import (
    DAEMONS,
    Executor,
    chunk_candidates,
    tree_terms,
    tree_time,
)

__all__ = ["NoPipelinedTree", "PipelinedTree", "pipelined_schedule", "plan_pipelined_round"]


class NoPipelinedTree(ValueError):
    """No candidate tree fits the round: a host with several updates may not sum them."""


_ROOT = "\x00server"  # the server's participant id (never an update id)


@dataclass(frozen=True)
class PipelinedTree:
    """A synchronous round's pipelined reduction tree, rooted at its server.

    Attributes
    ----------
    server : str
        The server's host (the root).
    parent : dict
        worker host -> the host its payload goes to (``server`` at the top).
    members : dict
        host -> the round's updates at that host (those at ``server``'s own host go
        straight in, by no link).
    chunk_bytes : int
        Bytes per pipelined chunk.
    seconds : float
        The model's time of the reduction (:func:`~mlfabric.scheduler.policies.allreduce_model.tree_time`).
    shape : str
        Which candidate won (``"direct"``, ``"to-server:chain-local"``, ``"rooted:rack-greedy"``, ...).
    busiest : float
        Seconds of the most loaded link (one payload per tree edge crossing it).
    """

    server: str
    parent: dict[str, str]
    members: dict[str, tuple[str, ...]]
    chunk_bytes: int
    seconds: float
    shape: str
    busiest: float

    def children(self, host: str) -> list[str]:
        """The hosts whose payloads go to ``host``, in graph order of the plan (sorted)."""
        return sorted(h for h, p in self.parent.items() if p == host)

    def aggregators(self) -> list[str]:
        """Hosts that sum two or more payloads (their own updates and their children's)."""
        return sorted(h for h in self.parent if len(self.members[h]) + len(self.children(h)) > 1)


def _rerooted(parent: dict[str, str | None], root: str) -> dict[str, str | None]:
    """The same undirected tree with ``root`` as its root (the edges to the old root reversed)."""
    out = dict(parent)
    prev: str | None = None
    v: str | None = root
    while v is not None:
        up = parent[v]
        out[v] = prev
        prev, v = v, up
    return out


def plan_pipelined_round(
    graph: nx.DiGraph,
    updates: Sequence[Update],
    *,
    aggregators: Collection[str] | None = None,
    chunk_bytes: int | None = None,
    executor: Executor = DAEMONS,
    paths: PathCache | None = None,
) -> PipelinedTree:
    """Choose a synchronous round's pipelined aggregation tree (see the module docstring).

    Parameters
    ----------
    graph : networkx.DiGraph
        The bandwidth graph (capacities in bytes/s).
    updates : sequence of Update
        The round's updates (or expected updates): their hosts (``src``) and sizes; every
        one goes to the same server host (``dst``).
    aggregators : collection of str, optional
        Hosts that may sum (default: every worker host).
    chunk_bytes : int, optional
        Use this chunk size (default: the model's best of 64 KiB .. 16 MiB and the whole payload).
    executor : Executor
        Who sums and forwards (its per-chunk cost; default the daemons).
    paths : PathCache, optional
        Paths of ``graph``.

    Returns
    -------
    PipelinedTree

    Raises
    ------
    ValueError
        No updates, updates for several server hosts, or a host not in the graph.

    Examples
    --------
    Four workers and the server on one switch, 1 MB/s NICs, 1 MB updates. Store-and-forward
    needs ``ceil(log2(5)) = 3`` s; pipelined, a chain through the four hosts into the server
    loads every NIC direction with one update: 1 s plus a chunk per hop.

    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b", "c", "d"], 8e6)
    >>> ups = [Update(f"u{h}", h, "ps", 1e6) for h in "abcd"]
    >>> t = plan_pipelined_round(g, ups, chunk_bytes=50_000)
    >>> t.shape, t.busiest, sorted(t.parent.values()).count("ps")
    ('chain-local-head', 1.0, 1)
    >>> round(t.seconds, 3) < 1.3
    True
    """
    if not updates:
        raise ValueError("a round needs at least one update")
    servers = {u.dst for u in updates}
    if len(servers) != 1:
        raise ValueError(f"a round's updates go to one server host, got {sorted(servers)}")
    (server,) = servers
    missing = sorted({u.src for u in updates if u.src not in graph} | ({server} - set(graph)))
    if missing:
        raise ValueError(f"hosts not in the bandwidth graph: {missing}")
    pc = paths or PathCache(graph)
    members: dict[str, list[str]] = {}
    for u in updates:
        members.setdefault(u.src, []).append(u.update_id)
    nbytes = math.ceil(max(u.bytes for u in updates))
    workers = {h: h for h in members if h != server}  # participants: the hosts (one each)
    hosts = {**workers, _ROOT: server}
    trees: dict[str, dict[str, str | None]] = {"direct": {_ROOT: None, **dict.fromkeys(workers, _ROOT)}}
    if workers:
        candidates = candidate_trees(graph, workers, pc)
        for name, tree in candidates.trees.items():
            top = next(p for p, q in tree.items() if q is None)
            trees[f"to-server:{name}"] = {_ROOT: None, **tree, top: _ROOT}
        for name, order in candidates.chains.items():  # a chain into the server from either end
            for end, chain in (("head", order), ("tail", order[::-1])):
                trees[f"chain-{name}-{end}"] = {
                    _ROOT: None,
                    **dict(zip(chain, [_ROOT, *chain[:-1]], strict=True)),
                }
        for name, tree in candidate_trees(graph, hosts, pc).trees.items():
            trees[f"rooted:{name}"] = _rerooted(tree, _ROOT)
    may = set(workers) if aggregators is None else set(aggregators)
    chunks = sorted([chunk_bytes] if chunk_bytes else chunk_candidates(nbytes), reverse=True)
    best: tuple[float, int, str, dict[str, str | None], float] | None = None
    for name in sorted(trees):
        parent = trees[name]
        sums = {q for q in parent.values() if q is not None and q != _ROOT}
        if sums - may or any(len(members[h]) > 1 and h not in may for h in workers):
            continue  # a host that may not sum would have to
        terms = tree_terms(graph, parent, hosts, nbytes, pc, reduce_only=True)
        for chunk in chunks:  # ties: the larger chunk (fewer frames)
            seconds = tree_time(terms, nbytes, chunk, executor, reduce_only=True)
            if best is None or seconds < best[0] - 1e-12:
                best = (seconds, chunk, name, parent, terms[0])
    if best is None:
        raise NoPipelinedTree("no tree: a host with several updates may not aggregate")
    seconds, chunk, name, parent, busiest = best
    up = {h: (server if q == _ROOT or q is None else str(q)) for h, q in parent.items() if h != _ROOT}
    # updates at the server's own host (no parent): no network, straight in
    return PipelinedTree(server, up, {h: tuple(m) for h, m in members.items()}, chunk, seconds, name, busiest)


def pipelined_schedule(
    tree: PipelinedTree,
    graph: nx.DiGraph,
    updates: Sequence[Update],
    *,
    paths: PathCache | None = None,
    scope: str = "pipelined",
) -> Schedule:
    """A plan executing ``tree``: every payload streams at the rate its busiest link allows.

    Every transfer runs at ``rate = B / tree.busiest`` (``B`` the largest update), so each
    link carries at most its capacity however the transfers overlap (a link crossed by ``m``
    tree edges carries ``m B`` bytes, at most ``busiest x capacity``). An update leaves when
    ready; an aggregate one chunk's time (``chunk_bytes / rate``) after the last of its
    members started (its own updates are in at their ready time, by a transfer of no link),
    so what it has forwarded never exceeds what a member has delivered. Check it with
    ``check_schedule(..., pipelined=<its aggregate ids>)``.

    Parameters
    ----------
    tree : PipelinedTree
        From :func:`plan_pipelined_round` for ``updates``.
    graph : networkx.DiGraph
        The bandwidth graph.
    updates : sequence of Update
        The round's updates (their ready times).
    paths : PathCache, optional
        Paths of ``graph``.
    scope : str
        Scope of the planner's aggregate ids (``agg:<scope>:<n>``).

    Returns
    -------
    Schedule
        The transfers (in order of start), the aggregates (children first), arrivals at
        the server.

    Examples
    --------
    >>> from mlfabric.scheduler.core.checker import check_schedule
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b", "c", "d"], 8e6)
    >>> ups = [Update(f"u{h}", h, "ps", 1e6) for h in "abcd"]
    >>> t = plan_pipelined_round(g, ups, chunk_bytes=50_000)
    >>> s = pipelined_schedule(t, g, ups)
    >>> [(a.aggregator, a.members) for a in s.aggregates]
    [('b', ('ub', 'uc')), ('a', ('ua', 'agg:pipelined:0')), ('d', ('ud', 'agg:pipelined:1'))]
    >>> round(max(x.end for x in s.transfers), 3)
    1.15
    >>> _ = check_schedule(g, s, updates=ups, pipelined={a.aggregate_id for a in s.aggregates})
    """
    pc = paths or PathCache(graph)
    by_id = {u.update_id: u for u in updates}
    nbytes = max(u.bytes for u in updates)
    rate = nbytes / tree.busiest if tree.busiest > 0 else math.inf
    lag = tree.chunk_bytes / rate if math.isfinite(rate) else 0.0
    transfers: list[Transfer] = []
    aggregates: list[Aggregate] = []

    def move(pid: str, src: str, dst: str, start: float, size: float) -> None:
        path = tuple(pc.path(src, dst)) if src != dst else (src,)
        if len(path) < 2 or not math.isfinite(rate):
            transfers.append(Transfer(pid, src, dst, path, start, start, size))
        else:
            transfers.append(Transfer.at_rate(pid, path, start=start, bytes=size, rate=rate))

    def payload(host: str) -> tuple[str, float]:
        """``host``'s payload to its parent (its sum, or its one update) and when it starts."""
        kids = [payload(c) for c in tree.children(host)]
        own = [by_id[m] for m in tree.members[host]]
        if len(own) == 1 and not kids:
            return own[0].update_id, own[0].ready_at
        for u in own:  # in at their ready time, no link
            move(u.update_id, host, host, u.ready_at, u.bytes)
        for pid, start in kids:
            move(pid, pid_host[pid], host, start, size_of[pid])
        aid = aggregate_id(scope, len(aggregates))
        summed = [*(u.update_id for u in own), *(pid for pid, _ in kids)]
        size = max(size_of[p] for p in summed)
        aggregates.append(Aggregate(aid, host, tuple(summed), size, tree.server))
        pid_host[aid], size_of[aid] = host, size
        return aid, max([u.ready_at for u in own] + [start for _, start in kids]) + lag

    pid_host = {u.update_id: u.src for u in updates}
    size_of = {u.update_id: float(u.bytes) for u in updates}
    for u in (by_id[m] for m in tree.members.get(tree.server, ())):  # at the server already
        move(u.update_id, tree.server, tree.server, u.ready_at, u.bytes)
    for host in tree.children(tree.server):
        pid, start = payload(host)
        move(pid, host, tree.server, start, size_of[pid])
    transfers.sort(key=lambda t: t.start)
    return Schedule.aggregated(transfers, aggregates)
