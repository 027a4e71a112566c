"""The lazy-heap planner behind shortest transfer first (paper §5 Fig. 4a, Fig. 5; DESIGN §4).

:class:`Planner` is one run of :func:`~mlfabric.scheduler.policies.stf.plan_stf`: update
classes, gate groups and the lazy min-heap, with preemptive drops. :func:`plan_stf` fills it
from scratch; :class:`~mlfabric.scheduler.policies.stf_book.STFBook` fills it from the
classes it keeps between decisions. Both plan the same order.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right, insort
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from mlfabric.scheduler.core.native import _plan_native
from mlfabric.scheduler.core.records import init_fields
from mlfabric.scheduler.core.schedule import Link, Reservation, Transfer, TransferTimes, Update
from mlfabric.scheduler.core.timeline import EPS, INF, LinkTimeline, Timelines

__all__ = ["Planner", "UpdateClass", "drop_reason"]


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
class UpdateClass:
    """Updates sharing one ten() function, kept sorted by (bytes, update id)."""

    start: float
    members: list[tuple[float, str]] = field(default_factory=list)
    head: int = 0

    def current(self, idx: int, gone: set[str], class_of: Mapping[str, int]) -> tuple[float, str] | None:
        """The head member still in this class (``idx``), skipping taken or moved ones."""
        members = self.members
        head, n = self.head, len(members)
        while head < n:
            member = members[head]
            uid = member[1]
            if uid not in gone and class_of.get(uid, idx) == idx:
                self.head = head
                return member
            head += 1
        self.head = head
        return None


def _bound(value: int | Mapping[str, int] | None, server: str, default: int | None) -> int | None:
    if value is None or isinstance(value, int):
        return default if value is None else value
    return value.get(server, default)


#: heap entry: (key, bytes, update id, sequence, kind, class index or gate link)
_Entry = tuple[float, float, str, int, int, object]
_EXACT, _GROUP = 0, 1


class Planner:
    """One run of :func:`~mlfabric.scheduler.policies.stf.plan_stf`: classes, gate groups, the lazy heap.

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
        self.classes: list[UpdateClass] = []
        #: the member lists of classes 0 .. len(shared) - 1, shared with the caller, from ``now``
        #: with head 0: ``classes`` holds a placeholder for each until the Python loop runs
        #: (the C loop reads the lists as they are, issue 24)
        self.shared: list[list[tuple[float, str]]] = []
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
        #: False: the C loop makes no reservation records, only the transfers' times (:meth:`times`)
        self.reservations = True
        #: False: the C loop may leave ``tls`` without the timelines it made (its caller drops it)
        self.keep_timelines = True
        self._times: list[TransferTimes] = []
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
            self.classes.append(UpdateClass(start))
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
        cls = self.classes[idx]
        h = cls.current(idx, self.gone, self.class_of)
        self.gate_of[idx] = None
        if h is None:
            return
        nbytes, uid = h
        links = self.links_of[uid]
        gate: Link | None = None
        free = cls.start
        known = self.free_cache
        for link in links:
            f = known.get(link)
            if f is None:
                f = self.free_from(link)
            if f > free:
                gate, free = link, f
        if gate is None or free == INF:
            self.push_exact(idx, nbytes, uid)
            return
        peaks = self.peak_cache
        low = INF
        for link in links:
            p = peaks.get(link)
            if p is None:
                p = self.peak(link)
            if p < low:
                low = p
        d = nbytes / low
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
        classes, gone, class_of, gate_of = self.classes, self.gone, self.class_of, self.gate_of
        while grp:
            top = grp[0]
            idx = top[3]
            if gate_of[idx] == gate:
                h = classes[idx].current(idx, gone, class_of)
                if h is not None and h[1] == top[2]:
                    return top
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
        first ``limit`` of the full STF order (the greedy never revisits a choice). Where
        the C extension is built the loop runs there (same plan, to the last bit); the
        planner is then spent — run it once.
        """
        if _plan_native is not None and (limit is None or limit >= 0) and self._run_native(limit):
            return
        for idx, members in enumerate(self.shared):  # the placeholders made real
            self.classes[idx] = UpdateClass(self.now, members)
        self.shared = []
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

    def times(self) -> tuple[TransferTimes, ...]:
        """The planned transfers' paths and times, in the plan's order (after :meth:`run`)."""
        return tuple(self._times) if self._times else tuple(map(TransferTimes.of, self.transfers))

    def book_links(self) -> tuple[Mapping[Link, Mapping[str, None]] | None, set[Link] | None]:
        """Untouched first links' updates kept outside the planner, and those links taken (none here)."""
        return None, None

    def link_numbers(self) -> tuple[Mapping[str, tuple[object, ...]], list[Link], list[float | None]] | None:
        """The links numbered outside the planner, for the C loop (none here).

        ``(rows, links, capacities)``: update id -> (its links, their numbers, and its update's
        ``src``, ``dst``, ``bytes`` and ``server``, as in :attr:`by_id`), number -> link,
        number -> the link's graph capacity (``None`` where not read yet; the C loop fills it
        in, so the lists must be dropped when the graph's capacities change).
        """
        return None

    def _run_native(self, limit: int | None) -> bool:
        """:meth:`run` in C (``_plan_native.stf_run``); False: the inputs need the Python loop.

        Without :attr:`reservations` the C makes :class:`TransferTimes` rows, no reservation
        records (:meth:`times`; :attr:`transfers` stays empty).
        """
        tls, n = self.tls, len(self.shared)
        light = not self.reservations
        on_link, popped = self.book_links()
        ix_of, link_list, cap_cache = self.link_numbers() or (None, None, None)
        got = _plan_native.stf_run(
            [(c.start, c.members, c.head) for c in itertools.islice(self.classes, n, None)],
            self.class_of,
            self.class_of_key,
            self.on_first_link,
            on_link,
            popped,
            self.by_id,
            self.links_of,
            self.names,
            self.now,
            self.tau_max,
            self.server_version,
            self.ahead,
            -1 if limit is None else limit,
            tls,
            tls._links,
            tls._graph._succ,
            tls._start,
            tls._profiles,
            TransferTimes if light else Transfer,
            None if light else init_fields(Transfer),
            None if light else Reservation,
            LinkTimeline,
            EPS,
            drop_reason,
            self.drops,
            ix_of,
            link_list,
            cap_cache,
            self.class_index,  # (the C takes each class's members as its head reaches them)
            self.keep_timelines,
            self.shared,  # (classes 0 .. n - 1, from now; their lists as they are, no tuple each)
        )
        if got is None:
            return False
        (self._times if light else self.transfers).extend(got)
        return True

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
