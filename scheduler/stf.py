"""Shortest transfer first ordering with preemptive dropping (paper §5 Fig. 4, Fig. 5; DESIGN §4).

:func:`plan_stf` orders ready updates by ``ten(g)`` — the time each would end if started
when ready, given the residual bandwidth of its path — taking the smallest, reserving the
path residual for it (network time-sharing, §3.1.1: on its bottleneck it takes all that is
left), and repeating. An update whose expected delay (server version − base version + the
number of payloads ordered to arrive at its server before it) exceeds ``tau_max`` is dropped
at that point instead of reserved (Fig. 5), and the rest are ordered without it.

Reservations only lower residual bandwidth, so ``ten`` values only grow and a lazy min-heap
applies: pop the smallest key, recompute it, accept it if it is still no larger than the
next key. Updates that provably share one ``ten`` function — same ready time, same links
after their first, and an untouched first link of equal capacity (a host's NIC) — form a
*class* whose members are ordered by size alone, so only each class's head sits in the heap.
Ties break on (ten, bytes, update id): the plan is deterministic.

:class:`STFPolicy` wraps the planner as the service's ``stf`` policy.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import insort
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import networkx as nx

from mlfabric.scheduler.graph import PathCache, TopologyError
from mlfabric.scheduler.policy import Decision, Drop, PendingUpdate, Send, Snapshot
from mlfabric.scheduler.schedule import Link, Schedule, Transfer, Update
from mlfabric.scheduler.timeline import Timelines

__all__ = ["STFPolicy", "drop_reason", "plan_stf", "server_key"]


def server_key(job: str, server: str) -> str:
    """The string naming a (job, server) pair in plans: ``"job/server"``."""
    return f"{job}/{server}"


def drop_reason(delay: int, tau_max: int, version: int, base_version: int, ahead: int) -> str:
    """The reason given to a worker whose update is dropped (Fig. 5).

    Examples
    --------
    >>> drop_reason(7, 5, 10, 4, 1)
    'expected delay 7 > tau_max 5 (server version 10 - base_version 4 + 1 ordered ahead)'
    """
    return (
        f"expected delay {delay} > tau_max {tau_max} "
        f"(server version {version} - base_version {base_version} + {ahead} ordered ahead)"
    )


@dataclass
class _Class:
    """Updates sharing one ten() function, kept sorted by (bytes, update id)."""

    start: float
    members: list[tuple[float, str]] = field(default_factory=list)
    head: int = 0

    def current(self, idx: int, gone: set[str], class_of: Mapping[str, int]) -> tuple[float, str] | None:
        """The head member still in this class (``idx``), skipping taken or moved ones."""
        members = self.members
        while self.head < len(members) and (
            members[self.head][1] in gone or class_of[members[self.head][1]] != idx
        ):
            self.head += 1
        return self.members[self.head] if self.head < len(self.members) else None


def _bound(value: int | Mapping[str, int] | None, server: str, default: int | None) -> int | None:
    if value is None or isinstance(value, int):
        return default if value is None else value
    return value.get(server, default)


def plan_stf(
    graph: nx.DiGraph,
    updates: Sequence[Update],
    *,
    now: float = 0.0,
    timelines: Timelines | None = None,
    paths: PathCache | None = None,
    tau_max: int | Mapping[str, int] | None = None,
    server_version: int | Mapping[str, int] = 0,
    ahead: Mapping[str, int] | None = None,
) -> Schedule:
    """Shortest-transfer-first plan of ``updates`` with preemptive drops (Fig. 4a, Fig. 5).

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph (capacities in bytes/s).
    updates : sequence of Update
        Updates to order; none may start before ``max(ready_at, now)``.
    now : float
        Planning time.
    timelines : Timelines, optional
        Residual bandwidth to plan on (e.g. with transfers in flight already reserved);
        reserved further in place. A fresh one from ``graph`` by default.
    paths : PathCache, optional
        Path cache for ``graph``'s topology.
    tau_max : int or mapping, optional
        Delay bound, for every server or per ``Update.server``; ``None``/negative: none.
    server_version : int or mapping
        Each server's current model version.
    ahead : mapping, optional
        Server -> payloads already ordered to arrive there first (in flight).

    Returns
    -------
    Schedule
        Transfers in STF order (``arrivals`` is that order) and the drops with reasons.

    Examples
    --------
    >>> from mlfabric.scheduler.graph import star
    >>> g = star(["ps", "a", "b"], 8e6)                        # 1 MB/s NICs
    >>> us = [Update("big", "a", "ps", 3e6), Update("small", "b", "ps", 1e6)]
    >>> s = plan_stf(g, us)
    >>> s.arrivals, s.completion_times()
    (('small', 'big'), {'small': 1.0, 'big': 4.0})
    """
    tls = timelines if timelines is not None else Timelines(graph, start=now)
    pc = paths if paths is not None else PathCache(graph)
    ahead_at: Counter[str] = Counter(ahead or {})
    by_id: dict[str, Update] = {}
    drops: dict[str, str] = {}
    classes: list[_Class] = []
    class_of_key: dict[tuple[object, ...], int] = {}
    class_of: dict[str, int] = {}
    on_first_link: dict[Link, list[str]] = defaultdict(list)
    links_of: dict[str, tuple[Link, ...]] = {}
    gone: set[str] = set()

    def add(uid: str, exact: bool) -> int:
        u = by_id[uid]
        links = links_of[uid]
        start = max(u.ready_at, now)
        if links and not exact:
            first = tls.link(links[0])
            if len(first.times) == 1:
                key: tuple[object, ...] = ("nic", start, first.residual[0], links[1:])
                on_first_link[links[0]].append(uid)
            else:
                key = ("path", start, links)
        else:
            key = ("path", start, links)
        idx = class_of_key.get(key)
        if idx is None:
            idx = len(classes)
            class_of_key[key] = idx
            classes.append(_Class(start))
        cls = classes[idx]
        insort(cls.members, (float(u.bytes), uid), lo=cls.head)
        class_of[uid] = idx
        return idx

    for u in updates:
        if u.update_id in by_id:
            raise ValueError(f"update '{u.update_id}' is listed twice")
        by_id[u.update_id] = u
        try:
            links_of[u.update_id] = pc.links(u.src, u.dst)
        except TopologyError as exc:
            drops[u.update_id] = f"no route: {exc}"
            continue
        add(u.update_id, exact=False)

    stamp = 0
    heap: list[tuple[float, float, str, int, int]] = []

    def push(idx: int) -> None:
        cls = classes[idx]
        head = cls.current(idx, gone, class_of)
        if head is None:
            return
        nbytes, uid = head
        _, end = tls.ten(links_of[uid], nbytes, cls.start)
        heapq.heappush(heap, (end, nbytes, uid, idx, stamp))

    for idx in range(len(classes)):
        push(idx)

    transfers: list[Transfer] = []
    arrivals: list[str] = []
    accepted: Counter[str] = Counter()
    while heap:
        _, nbytes, uid, idx, at = heapq.heappop(heap)
        head = classes[idx].current(idx, gone, class_of)
        if head is None:
            continue
        if at != stamp or head[1] != uid:
            push(idx)
            continue
        u = by_id[uid]
        gone.add(uid)
        version = _bound(server_version, u.server, 0) or 0
        bound = _bound(tau_max, u.server, None)
        n_ahead = ahead_at[u.server] + accepted[u.server]
        delay = version - u.base_version + n_ahead
        if bound is not None and bound >= 0 and delay > bound:
            drops[uid] = drop_reason(delay, bound, version, u.base_version, n_ahead)
            push(idx)
            continue
        links = links_of[uid]
        cls = classes[idx]
        start, end, reservations = tls.reserve(links, nbytes, cls.start, who=uid)
        stamp += 1
        path = (u.src, *(v for _, v in links))
        transfers.append(Transfer(uid, u.src, u.dst, path, start, end, u.bytes, reservations))
        arrivals.append(uid)
        accepted[u.server] += 1
        moved: set[int] = {idx}
        for link in links:
            for other in on_first_link.pop(link, ()):
                if other not in gone:
                    moved.add(add(other, exact=True))
        for m in sorted(moved):
            push(m)
    return Schedule(transfers=tuple(transfers), drops=drops, arrivals=tuple(arrivals))


class STFPolicy:
    """The ``stf`` policy: STF order with network time-sharing and tau_max drops (§3.1.1, §5).

    In-flight transfers keep their paths until their expected end; the pending updates are
    planned with :func:`plan_stf` on what is left. Each send's ``after`` names the
    transfers (in flight or planned) that end on one of its links exactly when it is planned
    to start — the transfer(s) it follows on its bottleneck — so the dispatcher releases it
    when they finish (one at a time per bottleneck).

    Examples
    --------
    >>> from mlfabric.scheduler.graph import star
    >>> g = star(["ps", "a", "b"], 8e6)
    >>> mk = lambda uid, host, size: PendingUpdate(uid, "j", "s", host, host, "ps", size, 1.0, 0, 0.0)
    >>> d = STFPolicy().decide(Snapshot(now=0.0, graph=g), [mk("big", "a", 3e6), mk("small", "b", 1e6)])
    >>> [(s.update_id, s.after, s.expected_end) for s in d.sends]
    [('small', (), 1.0), ('big', ('small',), 4.0)]
    """

    name = "stf"

    def __init__(self) -> None:
        self._paths: PathCache | None = None

    def _path_cache(self, graph: nx.DiGraph) -> PathCache:
        if self._paths is None or not self._paths.same_topology(graph):
            self._paths = PathCache(graph)
        return self._paths

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        """Order, time and drop ``pending`` given ``snapshot`` (see the class docstring).

        Parameters
        ----------
        snapshot : Snapshot
            Time, graph (estimated capacities), in-flight transfers, versions, tau_max.
        pending : sequence of PendingUpdate
            Every update not yet released.

        Returns
        -------
        Decision
            Sends in STF order with ``after`` and expected times; drops with reasons.
        """
        now = snapshot.now
        graph = snapshot.graph
        paths = self._path_cache(graph)
        tls = Timelines(graph, start=now)
        ends: dict[Link, dict[float, list[str]]] = defaultdict(lambda: defaultdict(list))
        ahead: Counter[str] = Counter()
        for f in sorted(snapshot.in_flight, key=lambda f: (f.expected_end, f.update_id)):
            links = tuple(itertools.pairwise(f.path))
            end = max(f.expected_end, now)
            if links and not all(graph.has_edge(*link) for link in links):
                continue  # the topology changed under it; it no longer reserves anything
            tls.reserve_until(links, now, end, who=f.update_id)
            for link in links:
                ends[link][end].append(f.update_id)
            ahead[server_key(f.job, f.server)] += 1
        updates = []
        tau: dict[str, int] = {}
        versions: dict[str, int] = {}
        for p in pending:
            key = server_key(p.job, p.server)
            tau[key] = snapshot.tau_max.get(p.job, -1)
            versions[key] = snapshot.server_versions.get((p.job, p.server), 0)
            updates.append(
                Update(p.update_id, p.src_host, p.dst_host, p.bytes, p.ready_at, p.norm, p.base_version, key)
            )
        plan = plan_stf(
            graph,
            updates,
            now=now,
            timelines=tls,
            paths=paths,
            tau_max=tau,
            server_version=versions,
            ahead=ahead,
        )
        sends = []
        for t in plan.transfers:
            links = t.links
            after: set[str] = set()
            for link in links:
                after.update(ends[link].get(t.start, ()))
            for link in links:
                ends[link][t.end].append(t.payload_id)
            sends.append(
                Send(
                    update_id=t.payload_id,
                    next_hop=t.dst,
                    path=t.path,
                    after=tuple(sorted(after)),
                    expected_start=t.start,
                    expected_end=t.end,
                )
            )
        drops = tuple(Drop(uid, reason) for uid, reason in sorted(plan.drops.items()))
        return Decision(sends=tuple(sends), drops=drops)
