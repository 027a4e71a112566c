"""Fluid model of a network: max-min fair sharing by progressive filling (DESIGN §6).

The simulator does not move packets: every active transfer is a *flow* with a rate, and
the rates of concurrent flows are the max-min fair allocation over the links they cross
(what long-lived TCP flows converge to; the ``fair`` baseline of DESIGN §4 relies on it).
The allocation is computed by *progressive filling* (water-filling): raise every flow's
rate together until some link is full; freeze the flows on it at that link's fair share;
repeat on the rest.

Network time-sharing (paper §3.1.1) needs nothing special here: a policy that releases
transfers one after another on a bottleneck simply leaves one flow on it at a time, which
then gets the whole link.

:class:`FluidNetwork` keeps the active flows, their remaining bytes and rates, and
recomputes max-min rates incrementally: after a flow starts or ends or a link's capacity
changes, only the connected component of flows and links around the change is refilled
(the max-min allocation decomposes over connected components).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["FluidNetwork", "max_min_rates"]

Link = Hashable
FlowId = Hashable

#: relative tolerance under which two completion times are the same instant
TIME_RTOL = 1e-9


def max_min_rates(
    flows: Mapping[FlowId, Sequence[Link]], capacity: Mapping[Link, float]
) -> dict[FlowId, float]:
    """Max-min fair rates of ``flows`` over links of ``capacity`` by progressive filling.

    Parameters
    ----------
    flows : mapping
        Flow id -> the links it crosses. A flow with no links is unconstrained (rate
        ``inf``).
    capacity : mapping
        Link -> capacity (bytes/s, >= 0).

    Returns
    -------
    dict
        Flow id -> rate (bytes/s). No link carries more than its capacity, and no flow
        can be raised without lowering a flow whose rate is no larger (max-min fairness).

    Notes
    -----
    Water-filling with a lazy min-heap of link fair shares ``remaining / unfrozen``.
    Freezing flows at the smallest share never lowers another link's share, so stale
    heap entries are skipped by a per-link version. ``O((F·P + L) log L)`` for ``F``
    flows of ``P`` links over ``L`` links.

    Examples
    --------
    One flow on link ``a`` (10), one on ``a`` and ``b`` (4), one on ``b``: ``b`` splits
    evenly, the first flow takes what ``a`` has left.

    >>> r = max_min_rates({"f1": ["a"], "f2": ["a", "b"], "f3": ["b"]}, {"a": 10.0, "b": 4.0})
    >>> r == {"f1": 8.0, "f2": 2.0, "f3": 2.0}
    True
    """
    link_flows: dict[Link, list[FlowId]] = {}
    rates: dict[FlowId, float] = {}
    for f, links in flows.items():
        if not links:
            rates[f] = math.inf
        for link in links:
            link_flows.setdefault(link, []).append(f)
    remaining = {link: max(0.0, float(capacity[link])) for link in link_flows}
    unfrozen = {link: len(fs) for link, fs in link_flows.items()}
    version = dict.fromkeys(link_flows, 0)
    heap: list[tuple[float, int, int, Link]] = []
    order = {link: i for i, link in enumerate(link_flows)}  # deterministic tie-break
    for link, n in unfrozen.items():
        heap.append((remaining[link] / n, order[link], 0, link))
    heapq.heapify(heap)
    while heap:
        share, _, ver, link = heapq.heappop(heap)
        if ver != version[link] or unfrozen[link] == 0:
            continue
        for f in link_flows[link]:
            if f in rates:
                continue
            rates[f] = share
            for other in flows[f]:
                remaining[other] = max(0.0, remaining[other] - share)
                unfrozen[other] -= 1
                version[other] += 1
                if other != link and unfrozen[other] > 0:
                    heapq.heappush(
                        heap, (remaining[other] / unfrozen[other], order[other], version[other], other)
                    )
    return rates


@dataclass
class _Flow:
    links: tuple[Link, ...]
    remaining: float  # bytes left at time `since`
    rate: float
    since: float
    version: int = 0

    def finish(self) -> float:
        if self.remaining <= 0.0:
            return self.since
        if self.rate <= 0.0:
            return math.inf
        return self.since + self.remaining / self.rate


class FluidNetwork:
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
    >>> sorted(net.advance_to(20.0))
    ['a', 'b']
    """

    def __init__(
        self,
        capacity: Mapping[Link, float],
        now: float = 0.0,
        on_rate: Callable[[FlowId, float, float], None] | None = None,
    ) -> None:
        self._capacity: dict[Link, float] = {link: float(c) for link, c in capacity.items()}
        self._flows: dict[FlowId, _Flow] = {}
        self._link_flows: dict[Link, dict[FlowId, None]] = {}
        self._dirty: dict[Link, None] = {}
        self._heap: list[tuple[float, int, int, FlowId]] = []
        self._seq = 0
        self.now = float(now)
        self._on_rate = on_rate
        #: number of max-min recomputations and flows refilled (profiling counters)
        self.refills = 0
        self.refilled_flows = 0

    # -- queries ---------------------------------------------------------------------
    def __contains__(self, flow: FlowId) -> bool:
        return flow in self._flows

    def __len__(self) -> int:
        return len(self._flows)

    def capacity(self, link: Link) -> float:
        """Current capacity of ``link`` (bytes/s)."""
        return self._capacity[link]

    def rate(self, flow: FlowId) -> float:
        """Current max-min rate of ``flow`` (bytes/s)."""
        self._refill()
        return self._flows[flow].rate

    def remaining(self, flow: FlowId) -> float:
        """Bytes ``flow`` still has to move at :attr:`now`."""
        f = self._flows[flow]
        return max(0.0, f.remaining - f.rate * (self.now - f.since)) if f.rate > 0 else f.remaining

    def expected_end(self, flow: FlowId) -> float:
        """When ``flow`` ends if rates stay as they are now."""
        self._refill()
        return self._flows[flow].finish()

    def link_load(self, link: Link) -> float:
        """Sum of the rates of the flows on ``link`` (bytes/s)."""
        self._refill()
        return sum(self._flows[f].rate for f in self._link_flows.get(link, ()))

    def flows_on(self, link: Link) -> list[FlowId]:
        """Flows currently crossing ``link``, in the order they started."""
        return list(self._link_flows.get(link, ()))

    # -- changes -----------------------------------------------------------------------
    def add(self, flow: FlowId, links: Iterable[Link], nbytes: float) -> None:
        """Start ``flow`` of ``nbytes`` over ``links`` at :attr:`now`.

        Raises
        ------
        KeyError
            If a link has no capacity or the flow id is already active.
        """
        if flow in self._flows:
            raise KeyError(f"flow {flow!r} is already active")
        path = tuple(links)
        for link in path:
            if link not in self._capacity:
                raise KeyError(f"flow {flow!r}: link {link!r} is not in the network")
        f = _Flow(links=path, remaining=float(nbytes), rate=0.0 if path else math.inf, since=self.now)
        self._flows[flow] = f
        for link in path:
            self._link_flows.setdefault(link, {})[flow] = None
            self._dirty[link] = None
        self._push(flow, f)

    def remove(self, flow: FlowId) -> float:
        """Stop ``flow`` now; returns the bytes it had left."""
        left = self.remaining(flow)
        f = self._flows.pop(flow)
        for link in f.links:
            del self._link_flows[link][flow]
            self._dirty[link] = None
        return left

    def set_capacity(self, link: Link, capacity: float) -> None:
        """Change ``link``'s capacity from :attr:`now` on (a dynamic cluster)."""
        if capacity < 0:
            raise ValueError(f"link {link!r}: capacity must be >= 0, got {capacity}")
        self._capacity[link] = float(capacity)
        self._dirty[link] = None

    # -- time --------------------------------------------------------------------------
    def next_completion(self) -> float:
        """Time of the next flow completion at current rates (``inf`` if none)."""
        self._refill()
        heap = self._heap
        while heap:
            t, _, ver, flow = heap[0]
            f = self._flows.get(flow)
            if f is not None and f.version == ver:
                return t
            heapq.heappop(heap)
        return math.inf

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
        horizon = t + TIME_RTOL * max(1.0, abs(t))
        done: list[FlowId] = []
        heap = self._heap
        while heap and heap[0][0] <= horizon:
            _, _, ver, flow = heapq.heappop(heap)
            f = self._flows.get(flow)
            if f is None or f.version != ver:
                continue
            done.append(flow)
        self.now = t
        for flow in done:
            f = self._flows.pop(flow)
            for link in f.links:
                del self._link_flows[link][flow]
                self._dirty[link] = None
        return done

    # -- internals ---------------------------------------------------------------------
    def _push(self, flow: FlowId, f: _Flow) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (f.finish(), self._seq, f.version, flow))

    def _component(self) -> tuple[dict[FlowId, None], dict[Link, None]]:
        """Flows and links connected to a dirty link."""
        links: dict[Link, None] = {}
        flows: dict[FlowId, None] = {}
        stack = list(self._dirty)
        while stack:
            link = stack.pop()
            if link in links:
                continue
            links[link] = None
            for flow in self._link_flows.get(link, ()):
                if flow not in flows:
                    flows[flow] = None
                    stack.extend(x for x in self._flows[flow].links if x not in links)
        return flows, links

    def _refill(self) -> None:
        if not self._dirty:
            return
        flows, _ = self._component()
        self._dirty.clear()
        if not flows:
            return
        self.refills += 1
        self.refilled_flows += len(flows)
        rates = max_min_rates({f: self._flows[f].links for f in flows}, self._capacity)
        now = self.now
        for flow, rate in rates.items():
            f = self._flows[flow]
            if rate == f.rate:
                continue
            if f.rate > 0 and math.isfinite(f.rate):
                f.remaining = max(0.0, f.remaining - f.rate * (now - f.since))
            f.since = now
            f.rate = rate
            f.version += 1
            self._push(flow, f)
            if self._on_rate is not None:
                self._on_rate(flow, now, rate)
