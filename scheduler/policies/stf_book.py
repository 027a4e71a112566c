"""Pending updates kept between STF decisions, so a decision pays for what changed (DESIGN §8).

A decision of :class:`~mlfabric.scheduler.policies.stf.STFPolicy` plans the head of the STF
order (paper §5, Fig. 4a) over *every* pending update. Planning from scratch
(:func:`~mlfabric.scheduler.policies.stf.plan_stf`) costs O(n) Python per decision before the
first send is chosen: an :class:`~mlfabric.scheduler.core.schedule.Update` per pending update,
its path, its rank by (ready time, id), its class. :class:`STFBook` keeps all of that between
decisions and updates it by arrivals and departures (a pending update is compared by
identity first, then by value):

* per update: the core update, its path's links (from a
  :class:`~mlfabric.scheduler.core.graph.PathCache`, rebuilt with the book when the topology
  changes), and a rank key, a string that sorts as (ready time, update id) — the planner's
  tie-break, so no per-decision renaming;
* the *classes* of updates ready by now whose ten() functions provably coincide while their
  first link (a NIC) is untouched: same first-link capacity, same links after it; members
  kept sorted by (bytes, rank). A capacity change of a first link moves its updates; an
  update ready later than ``now`` waits in a heap and joins its class once ``now`` passes
  its ready time.

Each decision then builds a :class:`~mlfabric.scheduler.policies.stf_planner.Planner` over
these classes (sharing their member lists, read-only) and runs the same lazy-heap STF loop
as :func:`plan_stf`, so it plans the same order, times and drops (``tests/scheduler/
test_stf_incremental.py`` replays decision sequences through both).
"""

from __future__ import annotations

import heapq
import itertools
import struct
from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache, TopologyError
from mlfabric.scheduler.core.native import _plan_native
from mlfabric.scheduler.core.schedule import Link, Schedule, TransferTimes, Update
from mlfabric.scheduler.core.timeline import INF, Timelines
from mlfabric.scheduler.policies.base import PendingUpdate
from mlfabric.scheduler.policies.planning import server_key
from mlfabric.scheduler.policies.stf_planner import Planner, UpdateClass

__all__ = ["STFBook", "rank_key"]

#: a class of updates ready by now: (capacity of the first link, links after it)
GroupKey = tuple[float, tuple[Link, ...]]
#: what the C loop reads of an update: (links, their numbers, src, dst, bytes, server)
_Row = tuple[tuple[Link, ...], tuple[int, ...], str, str, float, str]

_PACK = struct.Struct(">d")
_UNPACK = struct.Struct(">Q")


def rank_key(ready_at: float, update_id: str) -> str:
    """A string that sorts as ``(ready_at, update_id)``: the STF tie-break, first come first served.

    The float's IEEE-754 bits, flipped so that they order as the numbers do, in 16 hex
    digits, then a NUL, then the id.

    Examples
    --------
    >>> keys = [rank_key(t, u) for t, u in [(1.5, "a"), (-2.0, "z"), (1.5, "", ), (0.0, "b"), (-0.0, "a")]]
    >>> [k.split("\\x00")[1] for k in sorted(keys)]
    ['z', 'a', 'b', '', 'a']
    """
    (bits,) = _UNPACK.unpack(_PACK.pack(ready_at + 0.0))  # + 0.0: -0.0 ranks as 0.0
    bits = bits ^ 0xFFFFFFFFFFFFFFFF if bits >> 63 else bits | 0x8000000000000000
    return f"{bits:016x}\x00{update_id}"


class _Rec:
    """What the book keeps of one pending update."""

    __slots__ = ("gen", "key", "pending", "serial", "server")

    def __init__(self, pending: PendingUpdate, key: str, server: tuple[str, str, str], serial: int) -> None:
        self.pending = pending
        self.key = key
        self.server = server
        self.gen = 0
        self.serial = serial  # the order of the book's records


def _serial(rec: _Rec) -> int:
    return rec.serial


def _listed_twice(pending: Sequence[PendingUpdate]) -> None:
    ids = [q.update_id for q in pending]
    dup = next(i for i in ids if ids.count(i) > 1)
    raise ValueError(f"update '{dup}' is listed twice")


class STFBook:
    """The pending updates of an STF policy between its decisions (see the module docstring).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b"], 8e6)
    >>> mk = lambda uid, host, size: PendingUpdate(uid, "j", "s", host, host, "ps", size, 1.0, 0, 0.0)
    >>> book = STFBook()
    >>> book.sync(g, 0.0, [mk("big", "a", 3e6), mk("small", "b", 1e6)])
    >>> plan = book.plan(Timelines(g), 0.0, {}, {})
    >>> plan.arrivals, plan.completion_times()
    (('small', 'big'), {'small': 1.0, 'big': 4.0})
    >>> book.sync(g, 0.5, [mk("big", "a", 3e6)])           # small left, time moved on
    >>> book.plan(Timelines(g, start=0.5), 0.5, {}, {}).completion_times()
    {'big': 3.5}
    """

    def __init__(self) -> None:
        self._clear(None)

    def _clear(self, paths: PathCache | None) -> None:
        self._paths = paths
        self._graph: nx.DiGraph | None = None
        self._graph_version: int | None = None
        self._now = -INF
        self._gen = 0
        self._serial = 0
        self._recs: dict[str, _Rec] = {}
        self._held: dict[int, _Rec] = {}  # id of the PendingUpdate a record holds -> the record
        # the list of the last sync, where its objects are exactly those the records hold
        # (else None): the next sync's objects added and taken out are found by a walk of both
        self._last: list[PendingUpdate] | None = None
        #: rank key -> core update (its ``update_id`` is the rank key), links, real id
        self._by_key: dict[str, Update] = {}
        self._links_of: dict[str, tuple[Link, ...]] = {}
        self._names: dict[str, str] = {}
        self._noroute: dict[str, str] = {}
        self._loose: dict[str, None] = {}  # no links: classed per decision
        self._future: list[tuple[float, str]] = []  # (ready_at, key), lazily deleted
        self._groups: dict[GroupKey, list[tuple[float, str]]] = {}
        self._group_of: dict[str, GroupKey] = {}
        self._on_link: dict[Link, dict[str, None]] = {}  # first link -> grouped keys
        self._caps: dict[Link, float] = {}  # first link -> capacity its updates are grouped by
        self._servers: Counter[tuple[str, str, str]] = Counter()
        # the links numbered (the C loop's slots, no lookups by link per decision, issue 24):
        # link -> number, number -> link, number -> capacity read by the C loop (None: not
        # yet, or the graph's capacities may have changed since), rank key -> its row for the
        # C loop: (links, their numbers, and its update's src, dst, bytes and server)
        self._link_ix: dict[Link, int] = {}
        self._link_list: list[Link] = []
        self._link_caps: list[float | None] = []
        self._ix_of: dict[str, _Row] = {}

    def __len__(self) -> int:
        return len(self._recs)

    # -- keeping up with the inputs ----------------------------------------------------
    def sync(
        self,
        graph: nx.DiGraph,
        now: float,
        pending: Sequence[PendingUpdate],
        graph_version: int | None = None,
    ) -> None:
        """Make the book hold exactly ``pending`` on ``graph`` at ``now``.

        ``graph_version`` (:attr:`~mlfabric.scheduler.policies.base.Snapshot.graph_version`):
        the capacities of the NICs are not read again where it and the graph object are those
        of the last sync.

        Raises
        ------
        ValueError
            If an update id is listed twice.
        """
        same = graph_version is not None and graph is self._graph and graph_version == self._graph_version
        if self._paths is None or not self._paths.same_topology(graph):
            self._clear(PathCache(graph))
        elif now < self._now:  # time went back: updates ready by then may not be now
            self._clear(self._paths)
        self._graph, self._graph_version = graph, graph_version
        self._now = now
        if not same:  # (the same graph, its capacities unchanged: the NICs' classes hold)
            self._recapacity(graph)
            self._link_caps = [None] * len(self._link_list)
        self._gen += 1
        gen = self._gen
        recs, held = self._recs, self._held
        # The objects the book holds already are found by identity, in C: a walk of the last
        # list and this one where this one is the last less some plus some after them (the
        # simulator's), else set operations. Only the others are looked at one by one, in the
        # order listed, and then the records of the objects no longer listed are removed in
        # the book's order (issue 24).
        last, self._last = self._last, None
        diff = None
        listed: set[int] | None = None  # the ids listed (the walk: the last list's less those taken)
        taken: set[int] = set()
        if last is not None and _plan_native is not None and type(pending) is list:
            diff = _plan_native.list_diff(last, pending)
        if diff is not None:  # (no object listed twice, none of the last list's moved)
            added, taken_out = diff
            taken = set(map(id, taken_out))
            gone = set(taken)
            fresh_objects: Iterable[PendingUpdate] = added
        else:
            keys = list(map(id, pending))
            listed = set(keys)
            if len(listed) != len(keys):
                _listed_twice(pending)
            gone = held.keys() - listed
            fresh = listed.difference(held)
            fresh_objects = itertools.compress(pending, map(fresh.__contains__, keys)) if fresh else ()
        kept_others = False
        for p in fresh_objects:
            rec = recs.get(p.update_id)
            if rec is not None:
                # its object listed too (the walk: a held object is listed unless taken out)
                if rec.gen == gen or (
                    id(rec.pending) in listed if listed is not None else id(rec.pending) not in taken
                ):
                    _listed_twice(pending)
                gone.discard(id(rec.pending))
                if rec.pending == p:  # the same update, another object: kept as it is
                    rec.gen = gen
                    kept_others = True
                    continue
                self._remove(rec)
            self._insert(p).gen = gen
        if gone:
            for rec in sorted((held[i] for i in gone), key=_serial):
                self._remove(rec)
        if not kept_others:  # (the records hold exactly the objects listed)
            self._last = pending.copy() if type(pending) is list else list(pending)
        future = self._future
        while future and future[0][0] <= now:
            _, key = heapq.heappop(future)
            if self._waiting(key):
                self._group(key)

    def _recapacity(self, graph: nx.DiGraph) -> None:
        """Move the updates whose first link's capacity changed to their new class."""
        succ = graph._succ
        if _plan_native is not None:  # the scan in C: every NIC's, each decision (issue 24)
            changed = _plan_native.changed_capacities(self._caps, succ)
        else:
            changed = [(u, v) for (u, v), cap in self._caps.items() if succ[u][v]["capacity"] != cap]
        for link in changed:
            del self._caps[link]
            for key in list(self._on_link.pop(link, {})):
                self._ungroup(key, link)
                self._group(key)

    def _insert(self, p: PendingUpdate) -> _Rec:
        key = rank_key(p.ready_at, p.update_id)
        server = (p.job, p.server, server_key(p.job, p.server))
        rec = _Rec(p, key, server, self._serial)
        self._serial += 1
        self._recs[p.update_id] = rec
        self._held[id(p)] = rec
        self._servers[server] += 1
        self._names[key] = p.update_id
        u = self._by_key[key] = Update(
            key, p.src_host, p.dst_host, p.bytes, p.ready_at, p.norm, p.base_version, server[2]
        )
        assert self._paths is not None
        try:
            links = self._paths.links(p.src_host, p.dst_host)
        except TopologyError as exc:
            self._noroute[key] = f"no route: {exc}"
            return rec
        self._links_of[key] = links
        self._ix_of[key] = (links, tuple(map(self._link_number, links)), u.src, u.dst, u.bytes, u.server)
        if not links:
            self._loose[key] = None
        elif p.ready_at <= self._now:
            self._group(key)
        else:
            heapq.heappush(self._future, (p.ready_at, key))
        return rec

    def _remove(self, rec: _Rec) -> None:
        key = rec.key
        if key in self._group_of:
            self._ungroup(key, self._links_of[key][0])
        self._loose.pop(key, None)
        self._noroute.pop(key, None)
        self._links_of.pop(key, None)
        self._ix_of.pop(key, None)
        del (
            self._by_key[key],
            self._names[key],
            self._recs[rec.pending.update_id],
            self._held[id(rec.pending)],
        )
        self._servers[rec.server] -= 1
        if not self._servers[rec.server]:
            del self._servers[rec.server]

    def _link_number(self, link: Link) -> int:
        ix = self._link_ix.get(link)
        if ix is None:
            ix = self._link_ix[link] = len(self._link_list)
            self._link_list.append(link)
            self._link_caps.append(None)
        return ix

    def _waiting(self, key: str) -> bool:
        """Whether ``key`` (popped from the future heap) is pending and not classed yet."""
        return key in self._links_of and key not in self._group_of and key not in self._loose

    def _group(self, key: str) -> None:
        links = self._links_of[key]
        first = links[0]
        cap = self._caps.get(first)
        if cap is None:
            assert self._graph is not None
            cap = self._caps[first] = self._graph._succ[first[0]][first[1]]["capacity"]
        gk = (cap, links[1:])
        insort(self._groups.setdefault(gk, []), (float(self._by_key[key].bytes), key))
        self._group_of[key] = gk
        self._on_link.setdefault(first, {})[key] = None

    def _ungroup(self, key: str, first: Link) -> None:
        gk = self._group_of.pop(key)
        members = self._groups[gk]
        del members[bisect_left(members, (float(self._by_key[key].bytes), key))]
        if not members:
            del self._groups[gk]
        on = self._on_link.get(first)
        if on is not None:
            on.pop(key, None)
            if not on:
                del self._on_link[first]

    # -- planning ------------------------------------------------------------------------
    def servers(self) -> list[tuple[str, str, str]]:
        """The (job, server, server key) of the pending updates."""
        return list(self._servers)

    def plan(
        self,
        tls: Timelines,
        now: float,
        tau_max: Mapping[str, int],
        server_version: Mapping[str, int],
        ahead: Mapping[str, int] | None = None,
        *,
        touched: Collection[Link] = (),
        limit: int | None = None,
    ) -> Schedule:
        """The STF plan of the book's updates on ``tls`` (as :func:`plan_stf` would plan them).

        Parameters
        ----------
        tls : Timelines
            Residual bandwidth from ``now`` (transfers in flight reserved); reserved further.
        now : float
            The time of the last :meth:`sync`.
        tau_max, server_version : mapping
            Per server key, as :func:`plan_stf` takes them.
        ahead : mapping, optional
            Server key -> payloads in flight to it.
        touched : collection of Link
            Every link ``tls`` has reserved something on (the links of the transfers in flight).
        limit : int, optional
            Plan only the first ``limit`` transfers of the order.

        Returns
        -------
        Schedule
            As :func:`plan_stf` returns it.
        """
        planner = self._run(tls, now, tau_max, server_version, ahead, touched, limit, reservations=True)
        names = self._names
        return Schedule(
            transfers=tuple(planner.transfers),
            drops={names[k]: reason for k, reason in planner.drops.items()},
            arrivals=tuple(t.payload_id for t in planner.transfers),
        )

    def plan_times(
        self,
        tls: Timelines,
        now: float,
        tau_max: Mapping[str, int],
        server_version: Mapping[str, int],
        ahead: Mapping[str, int] | None = None,
        *,
        touched: Collection[Link] = (),
        limit: int | None = None,
        keep_timelines: bool = True,
    ) -> tuple[tuple[TransferTimes, ...], dict[str, str]]:
        """:meth:`plan`'s transfers as :class:`TransferTimes` (no reservation records), and its drops.

        The same plan, reserved on ``tls`` the same way, for a caller that executes it and
        does not check it (:class:`~mlfabric.scheduler.policies.stf.STFPolicy`): the
        planner's C loop then makes one untracked row per transfer instead of a
        :class:`~mlfabric.scheduler.core.schedule.Transfer` and its reservations (issue 24).
        Parameters as :meth:`plan`'s, and ``keep_timelines``: False, for a caller that drops
        ``tls`` afterwards, lets the C loop leave out of ``tls`` the link timelines it made
        (their reservations are the same; a decision makes hundreds, issue 24).

        Returns
        -------
        tuple of TransferTimes, dict
            The planned transfers in STF order, and update id -> drop reason.

        Examples
        --------
        >>> from mlfabric.scheduler.core.graph import star
        >>> g = star(["ps", "a", "b"], 8e6)
        >>> mk = lambda uid, host, size: PendingUpdate(uid, "j", "s", host, host, "ps", size, 1.0, 0, 0.0)
        >>> book = STFBook()
        >>> book.sync(g, 0.0, [mk("big", "a", 3e6), mk("small", "b", 1e6)])
        >>> times, drops = book.plan_times(Timelines(g), 0.0, {}, {})
        >>> [(t.payload_id, t.start, t.end) for t in times], drops
        ([('small', 0.0, 1.0), ('big', 1.0, 4.0)], {})
        """
        args = (tls, now, tau_max, server_version, ahead, touched, limit)
        planner = self._run(*args, reservations=False, keep=keep_timelines)
        names = self._names
        return planner.times(), {names[k]: reason for k, reason in planner.drops.items()}

    def _run(
        self,
        tls: Timelines,
        now: float,
        tau_max: Mapping[str, int],
        server_version: Mapping[str, int],
        ahead: Mapping[str, int] | None,
        touched: Collection[Link],
        limit: int | None,
        *,
        reservations: bool,
        keep: bool = True,
    ) -> Planner:
        """A planner over the book's classes, run (see :meth:`plan`)."""
        planner = _BookPlanner(self, tls, now, tau_max, server_version, ahead)
        planner.reservations = reservations
        planner.keep_timelines = keep
        groups = self._groups  # (shared with the planner: made its classes only if it runs in Python)
        planner.shared = list(groups.values())
        planner.classes = [_PLACEHOLDER] * len(groups)
        planner.gate_of = [None] * len(groups)
        for link in sorted(touched):  # a NIC in use: its updates' ten() is their own
            on_link = self._on_link.get(link)
            if on_link and tls.last_change(link) > -INF:
                planner.popped.add(link)
                for uid in on_link:
                    planner.add(uid, exact=True)
        for _, uid in self._future:
            if self._waiting(uid) and uid not in planner.class_of:
                planner.add(uid, exact=False)
        for uid in self._loose:
            planner.add(uid, exact=False)
        planner.drops.update(self._noroute)
        planner.run(limit)
        return planner


#: what a planner's class shared with the book is until its Python loop runs (never read)
_PLACEHOLDER = UpdateClass(-INF)


class _BookPlanner(Planner):
    """A :class:`Planner` over an :class:`STFBook`'s classes (shared, never modified)."""

    def __init__(
        self,
        book: STFBook,
        tls: Timelines,
        now: float,
        tau_max: Mapping[str, int],
        server_version: Mapping[str, int],
        ahead: Mapping[str, int] | None,
    ) -> None:
        super().__init__(tls, now, tau_max, server_version, ahead)
        self.book = book
        self.by_id = book._by_key
        self.links_of = book._links_of
        self.names = book._names
        #: the book's classes' indices, made when first needed (class_index: the C loop rarely
        #: asks, and hashing every class's key costs a decision ~0.3 ms at 10,240 workers, issue 24)
        self.group_idx: dict[GroupKey, int] | None = None
        self.popped: set[Link] = set()

    def link_numbers(self) -> tuple[Mapping[str, _Row], list[Link], list[float | None]] | None:
        book = self.book
        if self.tls._graph is not book._graph:  # (capacities read from another graph)
            return None
        return book._ix_of, book._link_list, book._link_caps

    def class_index(self, uid: str) -> int:
        idx = self.class_of.get(uid)
        if idx is not None:
            return idx
        if self.group_idx is None:
            groups = self.book._groups
            self.group_idx = dict(zip(groups, range(len(groups)), strict=True))
        return self.group_idx[self.book._group_of[uid]]

    def book_links(self) -> tuple[Mapping[Link, Mapping[str, None]] | None, set[Link] | None]:
        return self.book._on_link, self.popped

    def first_link_members(self, link: Link) -> Sequence[str]:
        out = list(self.on_first_link.pop(link, ()))
        if link not in self.popped:
            self.popped.add(link)
            out.extend(self.book._on_link.get(link, ()))
        return out
