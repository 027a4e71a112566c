"""Bandwidth estimation from transfer reports (paper §1 and §5: dynamic clusters; DESIGN §4).

Daemons measure every transfer (bytes, duration, path) and report it; the scheduler's link
capacities follow the measurements so that ``ten(g)`` and the STF order (Fig. 4) use the
bandwidth the network really has now.

How a measurement is used
-------------------------
A transfer of ``b`` bytes in ``d`` seconds moved at ``x = b / d``. Under network
time-sharing (§3.1.1) a scheduled transfer has its path to itself, so ``x`` is the capacity
of the path's *bottleneck*: the link with the lowest current estimate.

* ``x`` is a lower bound on every link of the path: any estimate below ``x`` is raised to
  ``x`` at once (capped at the configured, nominal capacity, which no link exceeds).
* ``x`` below the bottleneck's estimate is weaker evidence: the link may be shared with
  traffic the scheduler does not control (or, under ``fair``, with other transfers — pass
  ``shared=k`` when ``k`` transfers used it at once and the sample becomes ``k * x``), and
  short transfers are latency- rather than bandwidth-bound. So a low sample only moves the
  bottleneck's estimate by an exponentially weighted average (weight ``alpha``); only the
  bottleneck is lowered, never the other links of the path; transfers under ``min_bytes``
  are ignored; and an estimate never falls under ``floor`` times the nominal capacity.
* A real change must be followed within a few transfers: ``confirm`` consecutive samples
  deviating by more than ``reset`` (relative) reset the estimate to the latest sample.
* Without measurements an estimate relaxes back to the nominal capacity with half-life
  ``recovery`` seconds (a link believed slow gets no transfers and so no new samples).

The estimator is pure: time comes in through ``now``; no clock, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import networkx as nx

from mlfabric.scheduler.core.schedule import Link

__all__ = ["BandwidthEstimator", "Estimator", "StaticEstimator"]


@dataclass
class _LinkState:
    estimate: float
    updated: float
    deviations: int = 0


class BandwidthEstimator:
    """Per-link capacity estimates that follow transfer measurements.

    Parameters
    ----------
    graph : networkx.DiGraph
        The configured bandwidth graph; its capacities are the nominal (maximum) rates.
        Not modified.
    alpha : float
        EWMA weight of a sample below the current estimate.
    reset : float
        Relative deviation beyond which a sample counts towards a reset.
    confirm : int
        Consecutive deviating samples that reset the estimate to the latest sample.
    min_bytes : int
        Transfers smaller than this are ignored (latency-bound).
    floor : float
        Lowest estimate as a fraction of the nominal capacity.
    recovery : float
        Half-life (s) of the relaxation back to the nominal capacity; ``inf`` disables it.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> est = BandwidthEstimator(star(["ps", "w"], 8e9), recovery=float("inf"))  # 1 GB/s NICs
    >>> for t in range(3):
    ...     est.observe(["w", "sw", "ps"], 100_000_000, 0.4, now=float(t))  # 250 MB/s
    >>> round(est.estimates()[("w", "sw")] / 1e6)
    250
    >>> est.estimated_graph()["w"]["sw"]["capacity"] == est.estimates()[("w", "sw")]
    True
    """

    def __init__(
        self,
        graph: nx.DiGraph,
        *,
        alpha: float = 0.3,
        reset: float = 0.3,
        confirm: int = 2,
        min_bytes: int = 256 * 1024,
        floor: float = 0.01,
        recovery: float = 60.0,
    ) -> None:
        if not 0 < alpha <= 1 or not 0 < reset < 1 or confirm < 1 or not 0 < floor <= 1 or recovery <= 0:
            raise ValueError("need 0 < alpha <= 1, 0 < reset < 1, confirm >= 1, 0 < floor <= 1, recovery > 0")
        self._graph = graph
        self._nominal: dict[Link, float] = {(u, v): float(c) for u, v, c in graph.edges(data="capacity")}
        self._alpha = alpha
        self._reset = reset
        self._confirm = confirm
        self._min_bytes = min_bytes
        self._floor = floor
        self._recovery = recovery
        self._links: dict[Link, _LinkState] = {}
        self._now = 0.0
        self._version = 0
        self._cached: tuple[int, float, nx.DiGraph] | None = None

    def _current(self, link: Link, now: float) -> float:
        nominal = self._nominal[link]
        st = self._links.get(link)
        if st is None:
            return nominal
        if self._recovery == float("inf") or now <= st.updated:
            return st.estimate
        keep = 0.5 ** ((now - st.updated) / self._recovery)
        return nominal - (nominal - st.estimate) * keep

    def _set(self, link: Link, value: float, now: float, deviations: int = 0) -> None:
        nominal = self._nominal[link]
        value = min(max(value, self._floor * nominal), nominal)
        self._links[link] = _LinkState(value, now, deviations)
        self._version += 1

    def observe(
        self, path: Sequence[str], nbytes: int, duration: float, now: float, *, shared: int = 1
    ) -> None:
        """Account for ``nbytes`` moved along ``path`` in ``duration`` seconds, ending at ``now``.

        Parameters
        ----------
        path : sequence of str
            Node path of the transfer.
        nbytes : int
            Bytes moved.
        duration : float
            Seconds from first to last byte.
        now : float
            Time of the report (for recovery towards nominal).
        shared : int
            How many transfers shared the bottleneck at once (1 under time-sharing).

        Raises
        ------
        KeyError
            If the path uses a link that is not in the graph.
        """
        self._now = max(self._now, now)
        links = list(itertools.pairwise(path))
        if not links or duration <= 0 or nbytes < self._min_bytes:
            return
        for link in links:
            if link not in self._nominal:
                raise KeyError(f"link {link} of reported path {list(path)} is not in the bandwidth graph")
        sample = nbytes / duration * max(shared, 1)
        current = {link: self._current(link, now) for link in links}
        bottleneck = min(links, key=lambda link: (current[link], self._nominal[link]))
        for link in links:
            if current[link] < sample:
                self._set(link, sample, now)  # a measurement is a lower bound on every link
        est = current[bottleneck]
        if sample >= est:
            return
        st = self._links.get(bottleneck)
        deviations = (st.deviations if st is not None else 0) + 1 if sample < est * (1 - self._reset) else 0
        if deviations >= self._confirm:
            self._set(bottleneck, sample, now)
        else:
            self._set(bottleneck, (1 - self._alpha) * est + self._alpha * sample, now, deviations)

    def estimates(self) -> dict[Link, float]:
        """Link -> current capacity estimate (bytes/s), for every link of the graph.

        Examples
        --------
        >>> from mlfabric.scheduler.core.graph import star
        >>> sorted(BandwidthEstimator(star(["a"], 8.0)).estimates().items())
        [(('a', 'sw'), 1.0), (('sw', 'a'), 1.0)]
        """
        return {link: self._current(link, self._now) for link in self._nominal}

    def estimated_graph(self) -> nx.DiGraph:
        """A copy of the graph with capacities replaced by the estimates.

        The copy is cached until a measurement (or the passing of time, for recovery)
        changes an estimate, so repeated calls between reports return the same object.
        """
        key = (self._version, self._now if self._links else 0.0)
        if self._cached is not None and self._cached[:2] == key:
            return self._cached[2]
        g = self._graph.copy()
        for link in self._links:
            g.edges[link]["capacity"] = self._current(link, self._now)
        self._cached = (key[0], key[1], g)
        return g


class Estimator(Protocol):
    """Bandwidth estimation as the service uses it (``scheduler/core/estimation.py``)."""

    def observe(
        self, path: Sequence[str], nbytes: int, duration: float, now: float, *, shared: int = 1
    ) -> None:
        """Account for ``nbytes`` moved along ``path`` in ``duration`` s, ``shared`` at once."""
        ...

    def estimated_graph(self) -> nx.DiGraph:
        """The bandwidth graph with the current capacity estimates."""
        ...


class StaticEstimator:
    """An estimator that trusts the configured capacities (ignores measurements)."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self._graph = graph

    def observe(
        self, path: Sequence[str], nbytes: int, duration: float, now: float, *, shared: int = 1
    ) -> None:
        """Ignore the measurement."""

    def estimated_graph(self) -> nx.DiGraph:
        """The configured graph."""
        return self._graph
