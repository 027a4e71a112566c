"""Link timelines: residual bandwidth per link as a step function of time (paper §5, Fig. 4).

Each directed link of the bandwidth graph has a :class:`LinkTimeline`: the bandwidth not yet
reserved by scheduled transfers, piecewise constant in time. The residual bandwidth of a
path at time ``t`` is the minimum over its links. :meth:`Timelines.ten` integrates that
minimum from a transfer's ready time until its bytes are through — ``ten(g)`` of Fig. 4b —
and :meth:`Timelines.reserve` subtracts the transfer's rate from every link of its path
(Fig. 4c). Under network time-sharing (§3.1.1) a transfer takes *all* the residual of its
bottleneck, which is exactly the path minimum.

A :class:`Timelines` is mutable working state of one planning run; it never touches the
graph it was built from.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence

import networkx as nx

from mlfabric.scheduler.core.native import _plan_native
from mlfabric.scheduler.core.schedule import Link, Reservation, Transfer

__all__ = ["LinkTimeline", "Timelines"]

INF = math.inf
#: residual at or below this share of a link's capacity counts as zero (rounding of reservations)
EPS = 1e-9


class LinkTimeline:
    """Residual bandwidth of one link: ``residual[i]`` on ``[times[i], times[i+1])``.

    The last piece extends to infinity; times before ``times[0]`` read the first piece.

    Parameters
    ----------
    capacity : float
        Capacity in bytes/s from ``start`` on.
    start : float
        Origin of the timeline.
    profile : sequence of (float, float), optional
        Capacity changes ``(time, capacity)`` after ``start`` (a link whose rate varies).
    eps : float
        Residual at or below ``eps * capacity`` counts as zero (rounding of reservations).

    Examples
    --------
    >>> tl = LinkTimeline(10.0)
    >>> tl.reserve(1.0, 3.0, 4.0)
    >>> tl.at(0.5), tl.at(2.0), tl.at(3.0)
    (10.0, 6.0, 10.0)
    """

    __slots__ = ("eps", "residual", "times")

    def __init__(
        self,
        capacity: float,
        start: float = 0.0,
        profile: Sequence[tuple[float, float]] = (),
        eps: float = EPS,
    ) -> None:
        self.times: list[float] = [start]
        self.residual: list[float] = [float(capacity)]
        if not profile:
            self.eps = eps * float(capacity)
            return
        self.eps = eps * max(float(capacity), *(c for _, c in profile))
        for t, cap in sorted(profile):
            if t <= start:
                self.residual[0] = float(cap)
            elif cap != self.residual[-1]:
                self.times.append(float(t))
                self.residual.append(float(cap))

    def copy(self) -> LinkTimeline:
        """An independent copy."""
        new = LinkTimeline.__new__(LinkTimeline)
        new.times = list(self.times)
        new.residual = list(self.residual)
        new.eps = self.eps
        return new

    def at(self, t: float) -> float:
        """Residual bandwidth at time ``t``."""
        return self.residual[max(0, bisect_right(self.times, t) - 1)]

    def min_over(self, start: float, end: float) -> float:
        """Lowest residual over ``[start, end)`` (the residual at ``start`` if empty)."""
        times = self.times
        i = max(bisect_right(times, start) - 1, 0)
        j = bisect_left(times, end, lo=i + 1)
        return min(self.residual[i:j]) if j > i else self.residual[i]

    def pieces(self, start: float = -INF, end: float = INF) -> list[tuple[float, float, float]]:
        """The pieces ``(from, to, residual)`` overlapping ``[start, end)``, clipped to it."""
        out = []
        i = max(0, bisect_right(self.times, start) - 1)
        while i < len(self.times) and self.times[i] < end:
            lo = max(self.times[i], start)
            hi = min(self.times[i + 1] if i + 1 < len(self.times) else INF, end)
            if hi > lo:
                out.append((lo, hi, self.residual[i]))
            i += 1
        return out

    def reserve(self, start: float, end: float, rate: float, *, who: str = "") -> None:
        """Subtract ``rate`` over ``[start, end)``.

        Raises
        ------
        ValueError
            If the residual would fall below zero (beyond rounding), naming ``who``.
        """
        if end <= start or rate <= 0:
            return
        times, residual, eps = self.times, self.residual, self.eps
        last = len(times) - 1
        c = residual[last]
        left = c - rate
        if start >= times[last] and left >= -eps:  # from the last piece on: what the steps below do
            left = 0.0 if left < 0.0 else left
            if start != times[last]:
                if abs(c - left) > eps:  # else both new breakpoints merge away
                    times.append(start)
                    times.append(end)
                    residual.append(left)
                    residual.append(c)
                return
            residual[last] = left
            if abs(c - left) > eps:
                times.append(end)
                residual.append(c)
            if last > 0 and abs(left - residual[last - 1]) <= eps:
                del times[last]
                del residual[last]
            return
        # make start, then end, a breakpoint (i, j: their indices); inline, the hot path of planning
        i = bisect_right(times, start) - 1
        if i < 0:  # before the origin: extend the first piece backwards
            times.insert(0, start)
            residual.insert(0, residual[0])
            i = 0
        elif times[i] != start:
            i += 1
            times.insert(i, start)
            residual.insert(i, residual[i - 1])
        j = bisect_right(times, end, i) - 1  # end > start: its piece is i's or later
        if times[j] != end:
            j += 1
            times.insert(j, end)
            residual.insert(j, residual[j - 1])
        for k in range(i, j):
            left = residual[k] - rate
            if left < -eps:
                raise ValueError(
                    f"reserving {rate:g} B/s for {who or 'a transfer'} at t={times[k]:g} "
                    f"exceeds the residual {residual[k]:g} B/s"
                )
            residual[k] = 0.0 if left < 0.0 else left  # max(left, 0.0), -0.0 kept as max keeps it
        # merge equal neighbours from the piece before i to the one after j
        lo = i - 1 if i > 0 else 0
        k = min(j + 1, len(times) - 1)
        while k > lo:  # k < len(times) throughout: a deletion shortens times by one as k steps down
            if abs(residual[k] - residual[k - 1]) <= eps:
                del times[k]
                del residual[k]
            k -= 1


class Timelines:
    """Residual bandwidth of every link of a bandwidth graph (paper §5, Fig. 4).

    Parameters
    ----------
    graph : networkx.DiGraph
        Links with ``capacity`` (bytes/s). Only read.
    start : float
        Origin of every timeline (e.g. the scheduler's "now").
    profiles : mapping, optional
        ``link -> [(time, capacity), ...]`` for links whose capacity changes over time.

    Examples
    --------
    The paper's Fig. 4b: a 30 MB update ready at t=0 on a path whose residual bandwidth
    is 2, 5, 3, then 10 MB/s for two seconds each ends at t = 7.

    >>> g = nx.DiGraph()
    >>> g.add_edge("w", "ps", capacity=10e6)
    >>> tls = Timelines(g, profiles={("w", "ps"): [(0, 2e6), (2, 5e6), (4, 3e6), (6, 10e6)]})
    >>> tls.ten([("w", "ps")], 30e6, ready=0.0)
    (0.0, 7.0)
    """

    __slots__ = ("_graph", "_links", "_profiles", "_start")

    def __init__(
        self,
        graph: nx.DiGraph,
        start: float = 0.0,
        profiles: Mapping[Link, Sequence[tuple[float, float]]] | None = None,
    ) -> None:
        self._graph = graph
        self._start = start
        self._profiles = profiles or {}
        self._links: dict[Link, LinkTimeline] = {}

    def link(self, link: Link) -> LinkTimeline:
        """The timeline of ``link`` (created from the graph's capacity on first use)."""
        tl = self._links.get(link)
        if tl is None:
            data = self._graph.get_edge_data(*link)  # graph.edges[link], without making a view
            if data is None:
                raise KeyError(f"no link {link} in the graph")
            cap = data["capacity"]
            tl = LinkTimeline(cap, self._start, self._profiles.get(link, ()) if self._profiles else ())
            self._links[link] = tl
        return tl

    def empty(self) -> bool:
        """Whether no link has a reservation or a capacity profile (every residual constant).

        Examples
        --------
        >>> g = nx.DiGraph()
        >>> g.add_edge("a", "b", capacity=4.0)
        >>> tls = Timelines(g)
        >>> tls.empty(), tls.link(("a", "b")) is not None, tls.empty()
        (True, True, True)
        >>> _ = tls.reserve_until([("a", "b")], 1.0, 2.0)
        >>> tls.empty()
        False
        """
        return not self._profiles and all(len(tl.times) == 1 for tl in self._links.values())

    def last_change(self, link: Link) -> float:
        """When the residual of ``link`` last changes (``-inf``: constant from the origin on).

        Unlike :meth:`link`, makes no timeline for a link that has none and no capacity profile.

        Examples
        --------
        >>> g = nx.DiGraph()
        >>> g.add_edge("a", "b", capacity=4.0)
        >>> tls = Timelines(g)
        >>> tls.last_change(("a", "b"))
        -inf
        >>> _ = tls.reserve_until([("a", "b")], 1.0, 2.0)
        >>> tls.last_change(("a", "b"))
        2.0
        """
        tl = self._links.get(link)
        if tl is None:
            if link not in self._profiles:
                return -INF
            tl = self.link(link)
        times = tl.times
        return times[-1] if len(times) > 1 else -INF

    def last_changes(self, links: Iterable[Link]) -> list[float]:
        """:meth:`last_change` of each of ``links``, in order.

        Examples
        --------
        >>> tls = Timelines(nx.DiGraph([("a", "b", {"capacity": 4.0}), ("b", "c", {"capacity": 4.0})]))
        >>> _ = tls.reserve_until([("a", "b")], 1.0, 2.0)
        >>> tls.last_changes([("a", "b"), ("b", "c")])
        [2.0, -inf]
        """
        own, profiles, out = self._links, self._profiles, []  # last_change(link) inline, per link
        for link in links:
            tl = own.get(link)
            if tl is None:
                if link not in profiles:
                    out.append(-INF)
                    continue
                tl = self.link(link)
            times = tl.times
            out.append(times[-1] if len(times) > 1 else -INF)
        return out

    def copy(self, links: Iterable[Link] | None = None) -> Timelines:
        """An independent copy (for what-if planning); with ``links``, of their timelines alone.

        A copy of some links' timelines (the others start empty there) serves what-if
        planning that reserves on them only, without copying every other timeline (the tree
        planner's member moves, issue 24).

        Examples
        --------
        >>> tls = Timelines(nx.DiGraph([("a", "b", {"capacity": 4.0}), ("b", "c", {"capacity": 4.0})]))
        >>> _ = tls.reserve_until([("a", "b"), ("b", "c")], 1.0, 2.0)
        >>> part = tls.copy([("a", "b")])
        >>> part.last_change(("a", "b")), part.last_change(("b", "c")), tls.copy().last_change(("b", "c"))
        (2.0, -inf, 2.0)
        """
        new = Timelines(self._graph, self._start, self._profiles)
        own = self._links
        if links is not None:
            own = {link: own[link] for link in links if link in own}
        if _plan_native is not None:  # the loop below in C: a tree planner copies them per trial
            new._links = _plan_native.copy_timelines(own, LinkTimeline)
        else:
            new._links = {k: v.copy() for k, v in own.items()}
        return new

    def residual(self, links: Iterable[Link], t: float) -> float:
        """Path residual bandwidth at ``t``: the minimum over ``links`` (inf for no links)."""
        return min((self.link(link).at(t) for link in links), default=INF)

    def ten(self, links: Sequence[Link], nbytes: float, ready: float) -> tuple[float, float]:
        """When a transfer of ``nbytes`` over ``links`` would start and end (Fig. 4b ``ten(g)``).

        The transfer starts at the first time from ``ready`` on at which every link has
        residual bandwidth, and then moves at the path residual until its bytes are through.

        Parameters
        ----------
        links : sequence of Link
            The path's links (empty: same host, done at ``ready``).
        nbytes : float
            Bytes to move.
        ready : float
            Earliest start.

        Returns
        -------
        (float, float)
            Start and end (``ten``).

        Raises
        ------
        ValueError
            If the path never has enough residual bandwidth.

        Examples
        --------
        >>> g = nx.DiGraph()
        >>> g.add_edge("a", "b", capacity=4.0)
        >>> tls = Timelines(g)
        >>> tls.reserve([("a", "b")], 8.0, ready=0.0)[:2]
        (0.0, 2.0)
        >>> tls.ten([("a", "b")], 4.0, ready=1.0)
        (2.0, 3.0)
        """
        if _plan_native is not None and type(ready) is float:  # the walk in C (None: the loop below)
            got = _plan_native.ten(self, self._links, tuple(links), nbytes, ready)
            if got is not None:
                return got
        start, end, _ = self._walk(links, nbytes, ready, record=False)
        return start, end

    def rates(
        self, links: Sequence[Link], nbytes: float, ready: float
    ) -> tuple[float, float, list[tuple[float, float, float]]]:
        """Like :meth:`ten`, also returning the rate the transfer would get: ``(from, to, rate)`` pieces.

        Examples
        --------
        >>> g = nx.DiGraph()
        >>> g.add_edge("a", "b", capacity=4.0)
        >>> tls = Timelines(g)
        >>> _ = tls.reserve_until([("a", "b")], 1.0, 2.0)
        >>> tls.rates([("a", "b")], 8.0, ready=0.0)
        (0.0, 3.0, [(0.0, 1.0, 4.0), (2.0, 3.0, 4.0)])
        """
        return self._walk(links, nbytes, ready, record=True)

    def reserve(
        self, links: Sequence[Link], nbytes: float, ready: float, *, who: str = ""
    ) -> tuple[float, float, tuple[Reservation, ...]]:
        """Reserve the path residual for ``nbytes`` from ``ready`` on (Fig. 4c).

        Returns
        -------
        (float, float, tuple of Reservation)
            Start, end and the rate reserved on each link over each piece.
        """
        if _plan_native is not None:
            got = self._native(tuple(links), nbytes, ready, who)
            if got is not None:
                return got
        start, end, pieces = self._walk(links, nbytes, ready, record=True)
        return start, end, self._reserve_pieces(links, pieces, who)

    def _native(
        self, links: tuple[Link, ...], nbytes: float, ready: float, who: str
    ) -> tuple[float, float, tuple[Reservation, ...]] | None:
        """:meth:`reserve` in C (``_plan_native.transfer``); None: the Python loops are to run.

        They run where a time is not a float, or the path never has residual bandwidth
        (they raise); the C code changed nothing then.
        """
        if type(ready) is not float:
            return None
        tls = self._links
        for link in links:
            if link not in tls:
                self.link(link)  # as the walk makes them, in path order
        return _plan_native.transfer(tls, links, nbytes, ready, who or "a transfer", Reservation)

    def transfer(self, payload_id: str, path: Sequence[str], nbytes: float, ready: float) -> Transfer:
        """Reserve ``nbytes`` along the node ``path`` from ``ready`` on (:meth:`reserve`) as a Transfer.

        Examples
        --------
        >>> g = nx.DiGraph()
        >>> g.add_edge("a", "b", capacity=4.0)
        >>> t = Timelines(g).transfer("u1", ("a", "b"), 8.0, ready=1.0)
        >>> t.src, t.dst, t.start, t.end
        ('a', 'b', 1.0, 3.0)
        """
        hops = tuple(path)
        if _plan_native is not None:
            got = self._native(tuple(itertools.pairwise(hops)), nbytes, ready, payload_id)
            if got is not None:
                return Transfer(payload_id, hops[0], hops[-1], hops, got[0], got[1], nbytes, got[2])
        links = list(itertools.pairwise(hops))
        start, end, pieces = self._walk(links, nbytes, ready, record=True)  # self.reserve(...), inline
        res = self._reserve_pieces(links, pieces, payload_id)
        return Transfer(payload_id, hops[0], hops[-1], hops, start, end, nbytes, res)

    def reserve_until(
        self, links: Sequence[Link], start: float, end: float, *, who: str = ""
    ) -> tuple[Reservation, ...]:
        """Reserve the whole path residual over ``[start, end)`` (a transfer already in flight).

        Examples
        --------
        >>> g = nx.DiGraph()
        >>> g.add_edge("a", "b", capacity=4.0)
        >>> tls = Timelines(g)
        >>> len(tls.reserve_until([("a", "b")], 0.0, 1.0))
        1
        >>> tls.link(("a", "b")).at(0.5)
        0.0
        """
        if _plan_native is not None:
            name = who or "a transfer"
            got = _plan_native.reserve_until(
                self, self._links, tuple(links), start, end, name, Reservation, LinkTimeline, EPS
            )
            if got is not None:
                return got
        if not links or end <= start:
            return ()
        pieces = []
        t = start
        while t < end:
            rate, nxt = self._rate_at(links, t)
            hi = min(nxt, end)
            if rate > 0:
                pieces.append((t, hi, rate))
            t = hi
        return self._reserve_pieces(links, pieces, who)

    def _reserve_pieces(
        self, links: Sequence[Link], pieces: Sequence[tuple[float, float, float]], who: str
    ) -> tuple[Reservation, ...]:
        """Reserve every ``(lo, hi, rate)`` piece on every link, in link order."""
        out = []
        get = self._links.get
        new = tuple.__new__  # Reservation(link, lo, hi, rate), without the namedtuple's __new__ call
        for link in links:
            tl = get(link) or self.link(link)
            for lo, hi, rate in pieces:
                tl.reserve(lo, hi, rate, who=who)
                out.append(new(Reservation, (link, lo, hi, rate)))
        return tuple(out)

    def _rate_at(self, links: Sequence[Link], t: float) -> tuple[float, float]:
        rate = INF
        nxt = INF
        for link in links:
            tl = self._links.get(link) or self.link(link)
            times = tl.times
            i = bisect_right(times, t) - 1
            if i < 0:
                i = 0
            r = tl.residual[i]
            if r <= tl.eps:
                r = 0.0
            if r < rate:
                rate = r
            if i + 1 < len(times) and times[i + 1] < nxt:
                nxt = times[i + 1]
        return rate, nxt

    def _walk(
        self, links: Sequence[Link], nbytes: float, ready: float, record: bool
    ) -> tuple[float, float, list[tuple[float, float, float]]]:
        """Integrate the path residual from ``ready`` until ``nbytes`` are through.

        Links with one piece (never reserved) are folded into a constant cap; the others
        are walked with one index each, advanced monotonically. With ``record``, the
        pieces ``(from, to, rate)`` are returned, adjacent equal rates merged.
        """
        pieces: list[tuple[float, float, float]] = []
        if not links or nbytes <= 0:
            return ready, ready, pieces
        cap = INF
        times_of: list[list[float]] = []
        res_of: list[list[float]] = []
        eps_of: list[float] = []
        for link in links:
            tl = self._links.get(link) or self.link(link)
            if len(tl.times) == 1:
                r = tl.residual[0]
                if r <= tl.eps:
                    raise ValueError(f"path {list(links)} never has residual bandwidth (link {link})")
                cap = min(cap, r)
            else:
                times_of.append(tl.times)
                res_of.append(tl.residual)
                eps_of.append(tl.eps)
        t = ready
        remaining = float(nbytes)
        if not times_of:
            finish = t + remaining / cap
            if record:
                pieces.append((t, finish, cap))
            return t, finish, pieces
        n = len(times_of)
        if n == 1:  # the common case: one link reserved before
            return self._walk_one(times_of[0], res_of[0], eps_of[0], cap, links, remaining, t, record)
        index = [max(bisect_right(times_of[k], t) - 1, 0) for k in range(n)]
        start = -INF
        while True:
            rate = cap
            nxt = INF
            blocked = -INF  # latest next breakpoint among links with no residual now
            for k in range(n):
                times = times_of[k]
                i = index[k]
                last = len(times) - 1
                while i < last and times[i + 1] <= t:
                    i += 1
                index[k] = i
                r = res_of[k][i]
                following = times[i + 1] if i < last else INF
                if r <= eps_of[k]:
                    r = 0.0
                    if following > blocked:
                        blocked = following
                if r < rate:
                    rate = r
                if following < nxt:
                    nxt = following
            if rate <= 0.0:
                # nothing moves until every full link frees: skip the others' breakpoints
                if blocked == INF:
                    raise ValueError(f"path {list(links)} never has residual bandwidth after t={t:g}")
                t = blocked
                continue
            if start == -INF:
                start = t
            finish = t + remaining / rate
            done = finish <= nxt
            hi = finish if done else nxt
            if record:
                if pieces and pieces[-1][2] == rate and pieces[-1][1] == t:
                    pieces[-1] = (pieces[-1][0], hi, rate)
                else:
                    pieces.append((t, hi, rate))
            if done:
                return start, finish, pieces
            remaining -= rate * (nxt - t)
            t = nxt

    @staticmethod
    def _walk_one(
        times: list[float],
        res: list[float],
        eps: float,
        cap: float,
        links: Sequence[Link],
        remaining: float,
        t: float,
        record: bool,
    ) -> tuple[float, float, list[tuple[float, float, float]]]:
        """:meth:`_walk` where one link has pieces (``times``, ``res``), the others a ``cap``."""
        pieces: list[tuple[float, float, float]] = []
        last = len(times) - 1
        i = max(bisect_right(times, t) - 1, 0)
        start = -INF
        while True:
            while i < last and times[i + 1] <= t:
                i += 1
            nxt = times[i + 1] if i < last else INF
            rate = res[i]
            if rate <= eps:  # nothing moves until the link frees
                if nxt == INF:
                    raise ValueError(f"path {list(links)} never has residual bandwidth after t={t:g}")
                t = nxt
                continue
            if cap < rate:
                rate = cap
            if start == -INF:
                start = t
            finish = t + remaining / rate
            done = finish <= nxt
            hi = finish if done else nxt
            if record:
                if pieces and pieces[-1][2] == rate and pieces[-1][1] == t:
                    pieces[-1] = (pieces[-1][0], hi, rate)
                else:
                    pieces.append((t, hi, rate))
            if done:
                return start, finish, pieces
            remaining -= rate * (nxt - t)
            t = nxt
