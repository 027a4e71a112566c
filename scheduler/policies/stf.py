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
Ties break on (ten, bytes, ready time, update id): equal transfers go first come, first
served, and the plan is deterministic.

:class:`STFPolicy` wraps the planner as the service's ``stf`` policy.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right, insort
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache, TopologyError
from mlfabric.scheduler.core.schedule import Link, Schedule, Transfer, Update
from mlfabric.scheduler.core.timeline import INF, Timelines
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, Snapshot
from mlfabric.scheduler.policies.convert import schedule_to_decision
from mlfabric.scheduler.policies.planning import core_updates, server_key

__all__ = ["STFPolicy", "drop_reason", "plan_stf", "server_key"]


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
            members[self.head][1] in gone or class_of.get(members[self.head][1], idx) != idx
        ):
            self.head += 1
        return self.members[self.head] if self.head < len(self.members) else None


def _bound(value: int | Mapping[str, int] | None, server: str, default: int | None) -> int | None:
    if value is None or isinstance(value, int):
        return default if value is None else value
    return value.get(server, default)


#: heap entry: (key, bytes, update id, sequence, kind, class index or gate link)
_Entry = tuple[float, float, str, int, int, object]
_EXACT, _GROUP = 0, 1


class _Planner:
    """One run of :func:`plan_stf`: update classes, gate groups and the lazy min-heap.

    Heap keys are lower bounds of ``ten``. An *exact* entry holds a class head's computed
    ``ten``; popped, it is accepted if no reservation since changed the rate the transfer
    would get on any of its links (:meth:`still_exact`), else recomputed. A class whose
    path is fully booked until ``f`` on some *gate* link sits in that link's group:
    ``ten >= f + bytes / peak`` (it cannot start before every link has residual, nor move
    faster than the path's peak residual), so one heap entry per gate, keyed by the group's
    smallest bound, stands for all of them. When a reservation pushes a gate back, only
    that entry moves — no cascade of recomputations over every update queued behind the
    same bottleneck.
    """

    def __init__(
        self,
        tls: Timelines,
        now: float,
        tau_max: int | Mapping[str, int] | None,
        server_version: int | Mapping[str, int],
        ahead: Mapping[str, int] | None,
    ) -> None:
        self.tls = tls
        self.now = now
        self.tau_max = tau_max
        self.server_version = server_version
        self.ahead: Counter[str] = Counter(ahead or {})
        self.accepted: Counter[str] = Counter()
        self.by_id: dict[str, Update] = {}
        self.links_of: dict[str, tuple[Link, ...]] = {}
        self.classes: list[_Class] = []
        self.class_of_key: dict[tuple[object, ...], int] = {}
        self.class_of: dict[str, int] = {}
        self.gate_of: list[Link | None] = []
        self.on_first_link: dict[Link, list[str]] = defaultdict(list)
        self.gone: set[str] = set()
        self.groups: dict[Link, list[tuple[float, float, str, int]]] = defaultdict(list)
        self.group_live: dict[Link, int] = {}  # gate -> sequence number of its live heap entry
        self.group_key: dict[Link, tuple[float, float, str]] = {}
        self.heap: list[_Entry] = []
        self.seq = itertools.count()
        self.stamp = 0
        self.modified: dict[Link, int] = {}
        self.free_cache: dict[Link, float] = {}
        self.peak_cache: dict[Link, float] = {}
        #: class -> (head, stamp, ten, rate pieces) of its head's latest computed ten
        self.exact: dict[int, tuple[str, int, float, list[tuple[float, float, float]]]] = {}
        self.transfers: list[Transfer] = []
        self.drops: dict[str, str] = {}
        #: planner id -> the update id its transfer is named by (None: the planner id)
        self.names: Mapping[str, str] | None = None

    # -- classes ---------------------------------------------------------------------
    def add(self, uid: str, exact: bool) -> int:
        """Put ``uid`` in its class (``exact``: by full path, else by NIC if untouched)."""
        u = self.by_id[uid]
        links = self.links_of[uid]
        start = max(u.ready_at, self.now)
        key: tuple[object, ...] = ("path", start, links)
        if links and not exact:
            first = self.tls.link(links[0])
            if len(first.times) == 1:
                key = ("nic", start, first.residual[0], links[1:])
                self.on_first_link[links[0]].append(uid)
        idx = self.class_of_key.get(key)
        if idx is None:
            idx = len(self.classes)
            self.class_of_key[key] = idx
            self.classes.append(_Class(start))
            self.gate_of.append(None)
        cls = self.classes[idx]
        insort(cls.members, (float(u.bytes), uid), lo=cls.head)
        self.class_of[uid] = idx
        return idx

    def head(self, idx: int) -> tuple[float, str] | None:
        return self.classes[idx].current(idx, self.gone, self.class_of)

    def class_index(self, uid: str) -> int:
        """The class ``uid`` is in now."""
        return self.class_of[uid]

    def first_link_members(self, link: Link) -> Sequence[str]:
        """The updates classed by their untouched first link ``link``, once (it is touched now)."""
        return self.on_first_link.pop(link, ())

    # -- bounds ----------------------------------------------------------------------
    def free_from(self, link: Link) -> float:
        """First time from ``now`` on at which ``link`` has residual bandwidth."""
        t = self.free_cache.get(link)
        if t is None:
            tl = self.tls.link(link)
            times, res = tl.times, tl.residual
            i = max(bisect_right(times, self.now) - 1, 0)
            while i < len(res) and res[i] <= tl.eps:
                i += 1
            t = INF if i == len(res) else max(times[i], self.now)
            self.free_cache[link] = t
        return t

    def peak(self, link: Link) -> float:
        """Largest residual of ``link`` from ``now`` on."""
        p = self.peak_cache.get(link)
        if p is None:
            tl = self.tls.link(link)
            i = max(bisect_right(tl.times, self.now) - 1, 0)
            p = max(tl.residual[i:])
            self.peak_cache[link] = p
        return p

    # -- heap ------------------------------------------------------------------------
    def place(self, idx: int) -> None:
        """Queue class ``idx``'s head: in its gate's group, or as an exact entry."""
        h = self.head(idx)
        self.gate_of[idx] = None
        if h is None:
            return
        nbytes, uid = h
        links = self.links_of[uid]
        gate: Link | None = None
        free = self.classes[idx].start
        for link in links:
            f = self.free_from(link)
            if f > free:
                gate, free = link, f
        if gate is None or free == INF:
            self.push_exact(idx, nbytes, uid)
            return
        d = nbytes / min(self.peak(link) for link in links)
        self.gate_of[idx] = gate
        heapq.heappush(self.groups[gate], (d, nbytes, uid, idx))
        self.push_group(gate)

    def push_exact(self, idx: int, nbytes: float, uid: str) -> None:
        self.gate_of[idx] = None
        try:
            end = self.ten(idx, uid, nbytes)
        except ValueError as exc:
            self.gone.add(uid)
            self.drops[uid] = f"no residual bandwidth: {exc}"
            self.place(idx)
            return
        heapq.heappush(self.heap, (end, nbytes, uid, next(self.seq), _EXACT, idx))

    def ten(self, idx: int, uid: str, nbytes: float) -> float:
        """``ten`` of class ``idx``'s head ``uid``, remembering its rates."""
        _, end, pieces = self.tls.rates(self.links_of[uid], nbytes, self.classes[idx].start)
        self.exact[idx] = (uid, self.stamp, end, pieces)
        return end

    def still_exact(self, idx: int, uid: str) -> float | None:
        """The remembered ten of class ``idx``'s head, if reservations since cannot change it.

        A later reservation on one of its links changes nothing if that link kept at least
        the rate the transfer was getting, at every moment of the transfer: the path
        minimum is the same.
        """
        cached = self.exact.get(idx)
        if cached is None or cached[0] != uid:
            return None
        _, at, end, pieces = cached
        for link in self.links_of[uid]:
            if self.modified.get(link, -1) > at:
                tl = self.tls.link(link)
                for lo, hi, rate in pieces:
                    if tl.min_over(lo, hi) < rate:
                        return None
        return end

    def group_top(self, gate: Link) -> tuple[float, float, str, int] | None:
        grp = self.groups[gate]
        while grp:
            _, _, uid, idx = grp[0]
            h = self.head(idx)
            if self.gate_of[idx] == gate and h is not None and h[1] == uid:
                return grp[0]
            heapq.heappop(grp)
        return None

    def push_group(self, gate: Link) -> None:
        """(Re)key the one live heap entry of ``gate``'s group; older entries die."""
        top = self.group_top(gate)
        if top is None:
            self.group_live[gate] = -1
            return
        d, nbytes, uid, _ = top
        entry = (self.free_from(gate) + d, nbytes, uid)
        if self.group_live.get(gate, -1) >= 0 and self.group_key.get(gate) == entry:
            return
        seq = next(self.seq)
        self.group_live[gate] = seq
        self.group_key[gate] = entry
        heapq.heappush(self.heap, (*entry, seq, _GROUP, gate))

    # -- the STF loop ----------------------------------------------------------------
    def run(self, limit: int | None = None) -> None:
        """Pop, verify and accept until every update is planned or dropped (Fig. 4a).

        With ``limit``, stop once that many transfers are planned: they are exactly the
        first ``limit`` of the full STF order (the greedy never revisits a choice).
        """
        for idx in range(len(self.classes)):
            self.place(idx)
        heap = self.heap
        while heap and (limit is None or len(self.transfers) < limit):
            key, nbytes, popped, seq, kind, ref = heapq.heappop(heap)
            if kind == _EXACT:
                assert isinstance(ref, int)
                h = self.head(ref)
                if h is None or h[1] != popped or self.gate_of[ref] is not None:
                    continue
                if self.still_exact(ref, popped) == key:
                    self.accept(ref, popped, nbytes)
                else:
                    self.place(ref)
                continue
            gate = cast(Link, ref)
            if self.group_live.get(gate) != seq:
                continue  # superseded by a newer entry of the same group
            self.group_live[gate] = -1
            top = self.group_top(gate)
            if top is None:
                continue
            d, nbytes, uid, idx = top
            free = self.free_from(gate)
            if free + d != key or uid != popped:
                self.push_group(gate)  # the gate moved or the group's head changed: re-key
                continue
            links = self.links_of[uid]
            if any(self.free_from(link) > free for link in links):
                heapq.heappop(self.groups[gate])  # another link now gates it
                self.place(idx)
                self.push_group(gate)
                continue
            known = self.still_exact(idx, uid)
            if known is not None:
                end = known
            else:
                try:
                    end = self.ten(idx, uid, nbytes)
                except ValueError:
                    heapq.heappop(self.groups[gate])
                    self.push_exact(idx, nbytes, uid)
                    self.push_group(gate)
                    continue
            # compare with every other bound, the rest of this group's included
            heapq.heappop(self.groups[gate])
            self.push_group(gate)
            if not heap or (end, nbytes, uid) <= heap[0][:3]:
                self.accept(idx, uid, nbytes)
            elif end == key:
                heapq.heappush(self.groups[gate], top)  # its bound is exact: back in the group
                self.push_group(gate)
            else:
                self.gate_of[idx] = None
                heapq.heappush(heap, (end, nbytes, uid, next(self.seq), _EXACT, idx))

    def accept(self, idx: int, uid: str, nbytes: float) -> None:
        """Drop ``uid`` if its expected delay exceeds tau_max (Fig. 5), else reserve its path."""
        u = self.by_id[uid]
        self.gone.add(uid)
        version = _bound(self.server_version, u.server, 0) or 0
        bound = _bound(self.tau_max, u.server, None)
        n_ahead = self.ahead[u.server] + self.accepted[u.server]
        delay = version - u.base_version + n_ahead
        if bound is not None and bound >= 0 and delay > bound:
            self.drops[uid] = drop_reason(delay, bound, version, u.base_version, n_ahead)
            self.place(idx)
            return
        links = self.links_of[uid]
        start, end, reservations = self.tls.reserve(links, nbytes, self.classes[idx].start, who=uid)
        self.stamp += 1
        for link in links:
            self.modified[link] = self.stamp
            self.free_cache.pop(link, None)
            self.peak_cache.pop(link, None)
        path = (u.src, *(v for _, v in links))
        name = uid if self.names is None else self.names[uid]
        self.transfers.append(Transfer(name, u.src, u.dst, path, start, end, u.bytes, reservations))
        self.accepted[u.server] += 1
        moved = {idx}
        for link in links:
            for other in self.first_link_members(link):
                if other not in self.gone:
                    moved.add(self.class_index(other))
                    moved.add(self.add(other, exact=True))
        for m in sorted(moved):
            self.place(m)


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
    limit: int | None = None,
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
    limit : int, optional
        Plan only the first ``limit`` transfers of the STF order (a *partial* plan: the
        updates not reached are neither planned nor dropped, so it is not checkable as a
        whole). Default: plan everything.

    Returns
    -------
    Schedule
        Transfers in STF order (``arrivals`` is that order) and the drops with reasons.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b"], 8e6)                        # 1 MB/s NICs
    >>> us = [Update("big", "a", "ps", 3e6), Update("small", "b", "ps", 1e6)]
    >>> s = plan_stf(g, us)
    >>> s.arrivals, s.completion_times()
    (('small', 'big'), {'small': 1.0, 'big': 4.0})
    """
    tls = timelines if timelines is not None else Timelines(graph, start=now)
    pc = paths if paths is not None else PathCache(graph)
    planner = _Planner(tls, now, tau_max, server_version, ahead)
    # The planner breaks ties on the id it is given. Plan under ids that rank by
    # (ready_at, update_id), so equal transfers go first come, first served: tie-breaking
    # on the callers' ids alone would starve the workers whose ids sort last.
    ids = [u.update_id for u in updates]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"update '{dup}' is listed twice")
    ranked = sorted(updates, key=lambda u: (u.ready_at, u.update_id))
    width = len(str(len(ranked)))
    real = {f"{rank:0{width}d}": u.update_id for rank, u in enumerate(ranked)}
    planner.names = real
    for alias, u in zip(real, ranked, strict=True):
        planner.by_id[alias] = u  # the planner never reads an update's own id
        try:
            planner.links_of[alias] = pc.links(u.src, u.dst)
        except TopologyError as exc:
            planner.drops[alias] = f"no route: {exc}"
            continue
        planner.add(alias, exact=False)
    planner.run(limit)
    transfers = tuple(planner.transfers)
    drops = {real[uid]: reason for uid, reason in planner.drops.items()}
    return Schedule(transfers=transfers, drops=drops, arrivals=tuple(t.payload_id for t in transfers))


class STFPolicy:
    """The ``stf`` policy: STF order with network time-sharing and tau_max drops (§3.1.1, §5).

    In-flight transfers keep their paths until their expected end; the pending updates are
    planned with :func:`plan_stf` on what is left. Each send's ``after`` names the
    transfers (in flight or planned) that end on one of its links exactly when it is planned
    to start — the transfer(s) it follows on its bottleneck — so the dispatcher releases it
    when they finish (one at a time per bottleneck).

    Parameters
    ----------
    horizon : int, optional
        Plan only the first ``horizon`` sends of the STF order per decision (they are the
        same as in the full order; the rest stay pending, undecided). This bounds the
        decision time on a large backlog, but the caller must then decide again before
        the plan runs out. Default: plan every pending update.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b"], 8e6)
    >>> mk = lambda uid, host, size: PendingUpdate(uid, "j", "s", host, host, "ps", size, 1.0, 0, 0.0)
    >>> d = STFPolicy().decide(Snapshot(now=0.0, graph=g), [mk("big", "a", 3e6), mk("small", "b", 1e6)])
    >>> [(s.update_id, s.after, s.expected_end) for s in d.sends]
    [('small', (), 1.0), ('big', ('small',), 4.0)]
    """

    name = "stf"

    def __init__(self, horizon: int | None = None) -> None:
        if horizon is not None and horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.horizon = horizon
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
        busy: list[tuple[str, tuple[Link, ...], float]] = []
        ahead: Counter[str] = Counter()
        for f in sorted(snapshot.in_flight, key=lambda f: (f.expected_end, f.update_id)):
            links = tuple(itertools.pairwise(f.path))
            end = max(f.expected_end, now)
            if links and not all(graph.has_edge(*link) for link in links):
                continue  # the topology changed under it; it no longer reserves anything
            tls.reserve_until(links, now, end, who=f.update_id)
            busy.append((f.update_id, links, end))
            ahead[server_key(f.job, f.server)] += 1
        updates = core_updates(pending)
        tau: dict[str, int] = {}
        versions: dict[str, int] = {}
        for p in pending:
            key = server_key(p.job, p.server)
            tau[key] = snapshot.tau_max.get(p.job, -1)
            versions[key] = snapshot.server_versions.get((p.job, p.server), 0)
        plan = plan_stf(
            graph,
            updates,
            now=now,
            timelines=tls,
            paths=paths,
            tau_max=tau,
            server_version=versions,
            ahead=ahead,
            limit=self.horizon,
        )
        return schedule_to_decision(plan, busy=busy)
