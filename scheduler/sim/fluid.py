"""Fluid model of a network: max-min fair sharing by progressive filling (DESIGN §6).

The simulator does not move packets: every active transfer is a *flow* with a rate, and
the rates of concurrent flows are the max-min fair allocation over the links they cross
(what long-lived TCP flows converge to; the ``fair`` baseline of DESIGN §4 relies on it).
The allocation is computed by *progressive filling* (water-filling): raise every flow's
rate together until some link is full; freeze the flows on it at that link's fair share;
repeat on the rest. :func:`max_min_rates` is the plain reference; :class:`FluidNetwork`
runs the same rounds on numpy arrays.

Network time-sharing (paper §3.1.1) needs nothing special here: a policy that releases
transfers one after another on a bottleneck simply leaves one flow on it at a time, which
then gets the whole link.

:class:`FluidNetwork` keeps the active flows, their remaining bytes and rates, and
recomputes max-min rates only when something changed (a flow started or ended, a
capacity changed), once per instant however many changes it saw, and only for the flows
that can be affected. The max-min allocation decomposes over the connected components of
the flow-link graph (flows sharing a link, transitively): a change on some links changes
only the rates in their components. Links are kept in a union-find that merges the links of
every flow started; a flow's end does not split its component at once (a component too big
is only more work, never a wrong rate: the filling of two components together gives each
its own rates), so the union-find is rebuilt from the active flows once as many flows have
ended as were active at the last rebuild (amortized O(links per flow) per flow). A refill
then runs the filling over the flows of the components the changed links are in, each round
vectorized (numpy over flow-link incidences, links renumbered to those in use), so a
refill costs ``O(F·P)`` array work over those flows plus ``O(L)`` per distinct fair-share
level. With one parameter server every update crosses its ingress and the updates are one
component; model transfers from the server (its egress) are another.

Each flow's expected end (at its current rate) is kept per flow and updated when its rate
changes, and the earliest of them is cached until a flow starts, ends or changes rate, so
an event that touches no transfer costs no work over the flows.

A flow may have a rate *cap* (:meth:`FluidNetwork.set_cap`: a pipelined aggregate moves no
faster than its members' bytes arrive, :mod:`~mlfabric.scheduler.sim.pipelines`): the filling
sees it as a private link of that capacity crossed by the flow alone. Without caps the
filling is the same arithmetic as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

import numpy as np

from mlfabric.scheduler.core.fairshare import max_min_rates

__all__ = ["FluidNetwork", "max_min_rates"]

#: a link's id (any hashable: a name, a ``(u, v)`` pair)
Link = TypeVar("Link", bound=Hashable)
#: a flow's id (any hashable)
FlowId = TypeVar("FlowId", bound=Hashable)

#: relative tolerance under which two completion times are the same instant
TIME_RTOL = 1e-9


def water_fill(capacity: np.ndarray, flow_of: np.ndarray, link_of: np.ndarray, n_flows: int) -> np.ndarray:
    """Max-min fair rates by progressive filling, vectorized (the rounds of :func:`max_min_rates`).

    Parameters
    ----------
    capacity : numpy.ndarray
        Capacity of every link (bytes/s), indexed by link number.
    flow_of, link_of : numpy.ndarray
        The flow-link incidences: entry ``i`` says flow ``flow_of[i]`` crosses link
        ``link_of[i]``.
    n_flows : int
        Number of flows (flows without an incidence get ``inf``).

    Returns
    -------
    numpy.ndarray
        Rate of every flow.

    Notes
    -----
    Each round takes the smallest fair share ``remaining / unfrozen`` over the links and
    freezes, at that share, every flow crossing a link whose share equals it (to a
    relative ``1e-12``), then drops the frozen flows' incidences.

    Examples
    --------
    >>> r = water_fill(np.array([10.0, 4.0]), np.array([0, 1, 1, 2]), np.array([0, 0, 1, 1]), 3)
    >>> r.tolist()
    [8.0, 2.0, 2.0]
    """
    n_links = len(capacity)
    rates = np.full(n_flows, np.inf)
    remaining = capacity.astype(float).copy()
    count = np.bincount(link_of, minlength=n_links).astype(float)
    frozen = np.zeros(n_flows, dtype=bool)
    f, lk = flow_of, link_of
    while len(f):
        used = count > 0
        share = np.full(n_links, np.inf)
        np.divide(remaining, count, out=share, where=used)
        level = float(share.min())
        full = share <= level * (1.0 + 1e-12)
        newly = f[full[lk]]  # repeated where a flow has several full links: same value, no sort
        rates[newly] = level
        frozen[newly] = True
        gone = frozen[f]
        links_gone = lk[gone]
        remaining -= level * np.bincount(links_gone, minlength=n_links)
        np.maximum(remaining, 0.0, out=remaining)
        count -= np.bincount(links_gone, minlength=n_links)
        keep = ~gone
        f, lk = f[keep], lk[keep]
    return rates


class FluidNetwork(Generic[Link, FlowId]):
    """Active flows sharing links max-min fairly, advanced through time (DESIGN §6).

    Parameters
    ----------
    capacity : mapping
        Link -> capacity in bytes/s. Links not listed cannot be used.
    now : float
        Start time (s).
    on_rate : callable, optional
        Called as ``on_rate(flow, time, rate)`` whenever a flow's rate changes (to
        record rate histories for traces and schedule checks).

    Examples
    --------
    Two 10-byte flows on a 1 byte/s link end together at t = 20; alone, one would take 10.

    >>> net = FluidNetwork({"l": 1.0})
    >>> net.add("a", ["l"], 10.0); net.add("b", ["l"], 10.0)
    >>> net.next_completion()
    20.0
    >>> net.advance_to(20.0)
    ['a', 'b']
    """

    def __init__(
        self,
        capacity: Mapping[Link, float],
        now: float = 0.0,
        on_rate: Callable[[FlowId, float, float], None] | None = None,
    ) -> None:
        self._link_index: dict[Link, int] = {link: i for i, link in enumerate(capacity)}
        self._capacity = np.array([float(c) for c in capacity.values()], dtype=float)
        self._on_rate = on_rate
        self.now = float(now)
        # per-slot flow state; a slot is reused once its flow has ended
        size = 64
        self._remaining = np.zeros(size)  # bytes left at time `since`
        self._rate = np.zeros(size)
        self._since = np.zeros(size)
        self._order = np.zeros(size, dtype=np.int64)  # start sequence (completion tie-break)
        self._active = np.zeros(size, dtype=bool)
        self._slot_of: dict[FlowId, int] = {}
        self._flow_at: list[FlowId | None] = [None] * size
        self._links_at: list[tuple[int, ...]] = [()] * size
        self._hops = np.full((size, 4), -1, dtype=np.int64)  # link numbers per slot, -1 padded
        self._end = np.full(size, math.inf)  # expected end at the current rate
        self._cap = np.full(size, math.inf)  # rate caps (inf: none)
        self._capped = 0  # active flows with a finite cap
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._started = 0
        self._dirty: set[int] = set()  # links whose flows or capacity changed since the last refill
        self._next: float | None = None  # earliest expected end (None: to recompute)
        # union-find over links: links of one component share a root (may over-merge, see above)
        self._parent = np.arange(len(self._capacity), dtype=np.int64)
        self._ended_since_rebuild = 0
        self._active_at_rebuild = 0
        #: number of max-min recomputations and of flows they covered (profiling counters)
        self.refills = 0
        self.refilled_flows = 0

    # -- queries ---------------------------------------------------------------------
    def __contains__(self, flow: FlowId) -> bool:
        return flow in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def capacity(self, link: Link) -> float:
        """Current capacity of ``link`` (bytes/s)."""
        return float(self._capacity[self._link_index[link]])

    def rate(self, flow: FlowId) -> float:
        """Current max-min rate of ``flow`` (bytes/s)."""
        self._refill()
        return float(self._rate[self._slot_of[flow]])

    def remaining(self, flow: FlowId) -> float:
        """Bytes ``flow`` still has to move at :attr:`now`."""
        self._refill()
        i = self._slot_of[flow]
        if not math.isfinite(self._rate[i]):
            return 0.0
        return max(0.0, float(self._remaining[i] - self._rate[i] * (self.now - self._since[i])))

    def expected_end(self, flow: FlowId) -> float:
        """When ``flow`` ends if rates stay as they are now."""
        self._refill()
        return float(self._end[self._slot_of[flow]])

    def expected_ends(self, flows: Sequence[FlowId]) -> np.ndarray:
        """:meth:`expected_end` of several flows at once."""
        self._refill()
        slot_of = self._slot_of
        return self._end[np.array([slot_of[f] for f in flows], dtype=np.int64)]

    def link_load(self, link: Link) -> float:
        """Sum of the rates of the flows on ``link`` (bytes/s)."""
        self._refill()
        i = self._link_index[link]
        return float(sum(self._rate[s] for s in self._slot_of.values() if i in self._links_at[s]))

    # -- changes -----------------------------------------------------------------------
    def add(self, flow: FlowId, links: Iterable[Link], nbytes: float, cap: float = math.inf) -> None:
        """Start ``flow`` of ``nbytes`` over ``links`` at :attr:`now` (at most ``cap`` bytes/s).

        Raises
        ------
        KeyError
            If a link has no capacity or the flow id is already active.
        """
        if flow in self._slot_of:
            raise KeyError(f"flow {flow!r} is already active")
        try:
            path = tuple(self._link_index[link] for link in links)
        except KeyError as exc:
            raise KeyError(f"flow {flow!r}: link {exc.args[0]!r} is not in the network") from None
        if not self._free:
            self._grow()
        i = self._free.pop()
        self._slot_of[flow] = i
        self._flow_at[i] = flow
        self._links_at[i] = path
        if len(path) > self._hops.shape[1]:
            wider = np.full((len(self._hops), len(path)), -1, dtype=np.int64)
            wider[:, : self._hops.shape[1]] = self._hops
            self._hops = wider
        self._hops[i] = -1
        self._hops[i, : len(path)] = path
        self._remaining[i] = float(nbytes)
        self._rate[i] = 0.0 if path else math.inf
        self._since[i] = self.now
        self._end[i] = self.now if nbytes <= 0 or not path else math.inf
        self._order[i] = self._started
        self._active[i] = True
        self._started += 1
        self._next = None
        if path:
            self._dirty.update(path)
            self._union(path)
        if cap != math.inf:
            self.set_cap(flow, cap)

    def remove(self, flow: FlowId) -> float:
        """Stop ``flow`` now; returns the bytes it had left."""
        left = self.remaining(flow)
        self._release(self._slot_of[flow])
        return left

    def set_cap(self, flow: FlowId, cap: float) -> None:
        """Limit ``flow``'s rate to ``cap`` bytes/s from :attr:`now` on (``inf``: no limit).

        Examples
        --------
        >>> net = FluidNetwork({"l": 1.0})
        >>> net.add("a", ["l"], 1.0); net.add("b", ["l"], 1.0); net.set_cap("a", 0.25)
        >>> net.rate("a"), net.rate("b")
        (0.25, 0.75)
        """
        if cap < 0:
            raise ValueError(f"flow {flow!r}: cap must be >= 0, got {cap}")
        i = self._slot_of[flow]
        old = float(self._cap[i])
        if old == cap:
            return
        self._capped += int(cap != math.inf) - int(old != math.inf)
        self._cap[i] = cap
        self._dirty.update(self._links_at[i])

    def set_capacity(self, link: Link, capacity: float) -> None:
        """Change ``link``'s capacity from :attr:`now` on (a dynamic cluster)."""
        if capacity < 0:
            raise ValueError(f"link {link!r}: capacity must be >= 0, got {capacity}")
        i = self._link_index[link]
        self._capacity[i] = float(capacity)
        self._dirty.add(i)

    # -- time --------------------------------------------------------------------------
    def next_completion(self) -> float:
        """Time of the next flow completion at current rates (``inf`` if none)."""
        self._refill()
        if not self._slot_of:
            return math.inf
        if self._next is None:
            self._next = float(self._end[self._active].min())
        return self._next

    def advance_to(self, t: float) -> list[FlowId]:
        """Move time to ``t`` and end the flows whose last byte is through by then.

        ``t`` must not pass :meth:`next_completion` by more than rounding; flows ending
        within a relative ``1e-9`` of ``t`` end together (equal fair shares finish at the
        same instant despite rounding).

        Returns
        -------
        list
            The flows that ended, in completion order (ties by start order).
        """
        if t < self.now:
            raise ValueError(f"cannot go back in time from {self.now} to {t}")
        self._refill()
        self.now = t
        if not self._slot_of:
            return []
        horizon = t + TIME_RTOL * max(1.0, abs(t))
        if self.next_completion() > horizon:
            return []
        slots = np.flatnonzero(self._active)
        finish = self._end[slots]
        ending = finish <= horizon
        if not ending.any():
            return []
        slots, finish = slots[ending], finish[ending]
        done = slots[np.lexsort((self._order[slots], finish))]
        flows = [self._occupant(i) for i in done.tolist()]
        for i in done.tolist():
            self._release(i)
        return flows

    # -- internals ---------------------------------------------------------------------
    def _finish(self, slots: np.ndarray) -> np.ndarray:
        rate = self._rate[slots]
        rem = self._remaining[slots]
        with np.errstate(divide="ignore", invalid="ignore"):
            dt = np.where(rem <= 0.0, 0.0, np.where(rate > 0.0, rem / rate, np.inf))
        return self._since[slots] + dt

    def _occupant(self, i: int) -> FlowId:
        """The flow in slot ``i`` (which must be in use)."""
        flow = self._flow_at[i]
        if flow is None:
            raise RuntimeError(f"slot {i} holds no flow")
        return flow

    def _release(self, i: int) -> None:
        del self._slot_of[self._occupant(i)]
        self._flow_at[i] = None
        self._active[i] = False
        self._end[i] = math.inf
        if self._cap[i] != math.inf:
            self._cap[i] = math.inf
            self._capped -= 1
        self._next = None
        if self._links_at[i]:
            self._dirty.update(self._links_at[i])
            self._ended_since_rebuild += 1
        self._links_at[i] = ()
        self._free.append(i)

    def _grow(self) -> None:
        old = len(self._active)
        new = 2 * old
        for name in ("_remaining", "_rate", "_since", "_order", "_active", "_end", "_cap"):
            arr = getattr(self, name)
            grown = np.full(new, math.inf) if name in ("_end", "_cap") else np.zeros(new, dtype=arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)
        hops = np.full((new, self._hops.shape[1]), -1, dtype=np.int64)
        hops[:old] = self._hops
        self._hops = hops
        self._flow_at.extend([None] * old)
        self._links_at.extend([()] * old)
        self._free.extend(range(new - 1, old - 1, -1))

    def _find(self, link: int) -> int:
        parent = self._parent
        while parent[link] != link:
            parent[link] = parent[parent[link]]
            link = int(parent[link])
        return link

    def _union(self, path: Sequence[int]) -> None:
        root = self._find(path[0])
        for link in path[1:]:
            other = self._find(link)
            if other != root:
                self._parent[other] = root

    def _rebuild_components(self) -> None:
        """Components from the active flows alone (those of ended flows split off)."""
        self._parent = np.arange(len(self._capacity), dtype=np.int64)
        for path in self._links_at:
            if path:
                self._union(path)
        self._ended_since_rebuild = 0
        self._active_at_rebuild = len(self._slot_of)

    def _affected(self) -> np.ndarray:
        """Active slots with links in the components of the changed links (dirty set cleared)."""
        if self._ended_since_rebuild > max(64, self._active_at_rebuild):
            self._rebuild_components()
        parent = self._parent
        while True:  # pointer jumping: every link points at its root
            up = parent[parent]
            if np.array_equal(up, parent):
                break
            parent = up
        self._parent = parent
        roots = np.unique(parent[np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))])
        self._dirty = set()
        slots = np.flatnonzero(self._active)
        first = self._hops[slots, 0]
        slots, first = slots[first >= 0], first[first >= 0]
        if len(roots) == 1:
            return slots[parent[first] == roots[0]]
        return slots[np.isin(parent[first], roots)]

    def _refill(self) -> None:
        if not self._dirty:
            return
        slots = self._affected()
        if not len(slots):
            return
        self.refills += 1
        self.refilled_flows += len(slots)
        hops = self._hops[slots]
        flow_of, col = np.nonzero(hops >= 0)
        links = hops[flow_of, col]
        in_use = np.zeros(len(self._capacity), dtype=bool)
        in_use[links] = True
        number = np.cumsum(in_use) - 1  # the links in use, renumbered 0.. (no sort)
        capacity, link_of = self._capacity[in_use], number[links]
        if self._capped:  # each capped flow: a private link of its cap, after the links in use
            capped = np.flatnonzero(np.isfinite(self._cap[slots]))
            flow_of = np.concatenate([flow_of, capped])
            link_of = np.concatenate([link_of, len(capacity) + np.arange(len(capped))])
            capacity = np.concatenate([capacity, self._cap[slots][capped]])
        new = water_fill(capacity, flow_of, link_of, len(slots))
        idx = slots
        old = self._rate[idx]
        changed = new != old
        if not changed.any():
            return
        idx, new, old = idx[changed], new[changed], old[changed]
        now = self.now
        moved = np.where(np.isfinite(old) & (old > 0.0), old * (now - self._since[idx]), 0.0)
        self._remaining[idx] = np.maximum(0.0, self._remaining[idx] - moved)
        self._since[idx] = now
        self._rate[idx] = new
        self._end[idx] = self._finish(idx)
        self._next = None
        if self._on_rate is not None:
            for i, r in zip(idx.tolist(), new.tolist(), strict=True):
                self._on_rate(self._occupant(i), now, r)
