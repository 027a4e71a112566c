"""Workloads for the simulator: compute times, stragglers, bandwidth changes (DESIGN §6).

A worker's iteration is *compute, then push* (paper §2: workers fetch the model, compute
an update from it, push it). :class:`ComputeModel` says how long each worker computes in
each iteration: a per-worker mean (compute stragglers are workers with a larger mean,
paper §6 settings CS1-CS3) times an optional random factor. Each worker draws from its
own stream of a seeded generator, so the k-th compute time of a worker is the same under
every policy: a comparison of policies sees exactly the same compute.

:class:`BandwidthChange` is one step of a link's capacity over time (a dynamic cluster,
paper §6 settings NS1-NS3).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

__all__ = [
    "BandwidthChange",
    "ComputeModel",
    "ComputeSampler",
    "parse_bandwidth_schedule",
    "pick_stragglers",
]

BITS_PER_BYTE = 8


@dataclass(frozen=True)
class ComputeModel:
    """Per-worker compute time of one iteration (paper §6 compute settings).

    Parameters
    ----------
    mean : mapping of str to float
        Worker -> mean compute time (s) of one iteration.
    jitter : float
        Sigma of a log-normal factor with mean 1 applied to every compute time (0: none).
    seed : int
        Seed of the per-worker random streams.

    Examples
    --------
    >>> m = ComputeModel({"w0": 0.1, "w1": 0.4})
    >>> s = m.sampler()
    >>> s.next("w0"), s.next("w1")
    (0.1, 0.4)
    """

    mean: Mapping[str, float]
    jitter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.jitter < 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        for worker, t in self.mean.items():
            if t < 0 or not math.isfinite(t):
                raise ValueError(f"worker '{worker}': compute time must be finite and >= 0, got {t}")

    def sampler(self) -> ComputeSampler:
        """Fresh random streams: every run (and every policy) draws the same sequence.

        Returns
        -------
        ComputeSampler
        """
        return ComputeSampler(self)


@dataclass
class ComputeSampler:
    """Draws compute times of a :class:`ComputeModel`, one seeded stream per worker.

    Parameters
    ----------
    model : ComputeModel
        Means, jitter and seed.
    """

    model: ComputeModel
    _streams: dict[str, np.random.Generator] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        workers = list(self.model.mean)
        children = np.random.SeedSequence(self.model.seed).spawn(len(workers))
        pairs = zip(workers, children, strict=True)
        self._streams = {w: np.random.Generator(np.random.PCG64(s)) for w, s in pairs}

    def next(self, worker: str) -> float:
        """The next compute time (s) of ``worker``."""
        mean = self.model.mean[worker]
        sigma = self.model.jitter
        if sigma == 0.0:
            return mean
        # log-normal with mean 1: mu = -sigma^2 / 2
        return mean * float(self._streams[worker].lognormal(-sigma * sigma / 2.0, sigma))


def pick_stragglers(
    workers: Sequence[str], fraction: float, factor: float, base: float, rng: np.random.Generator
) -> dict[str, float]:
    """Mean compute times with a random ``fraction`` of workers ``factor`` times slower.

    Parameters
    ----------
    workers : sequence of str
        Worker names.
    fraction : float
        Share of stragglers in [0, 1]; ``round(fraction * len(workers))`` are picked.
    factor : float
        Slow-down of a straggler (>= 1 makes it slower).
    base : float
        Compute time (s) of a normal worker.
    rng : numpy.random.Generator
        Seeded generator choosing the stragglers.

    Returns
    -------
    dict
        Worker -> mean compute time.

    Examples
    --------
    >>> m = pick_stragglers(["a", "b", "c", "d"], 0.5, 3.0, 1.0, np.random.default_rng(0))
    >>> sorted(m.values())
    [1.0, 1.0, 3.0, 3.0]
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"straggler fraction must be in [0, 1], got {fraction}")
    if factor <= 0:
        raise ValueError(f"straggler factor must be > 0, got {factor}")
    k = round(fraction * len(workers))
    slow = set(rng.choice(len(workers), size=k, replace=False).tolist()) if k else set()
    return {w: base * factor if i in slow else base for i, w in enumerate(workers)}


@dataclass(frozen=True, order=True)
class BandwidthChange:
    """From time ``at`` on, directed link ``link`` has ``capacity`` bytes/s.

    Examples
    --------
    >>> BandwidthChange(2.0, ("h1", "sw"), 1.25e8).capacity
    125000000.0
    """

    at: float
    link: tuple[str, str]
    capacity: float


def _change_rate(entry: Mapping[str, Any], where: str) -> float:
    gbps, mbps = entry.get("gbps"), entry.get("mbps")
    if (gbps is None) == (mbps is None):
        raise ValueError(f"{where}: give exactly one of gbps or mbps")
    rate, scale = (gbps, 1e9) if gbps is not None else (mbps, 1e6)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or rate < 0:
        raise ValueError(f"{where}: rate must be a number >= 0")
    return float(rate) * scale / BITS_PER_BYTE


def parse_bandwidth_schedule(data: Mapping[str, Any], graph: nx.DiGraph) -> list[BandwidthChange]:
    """Bandwidth changes from a parsed TOML table (the ``--bandwidth-schedule`` file).

    The file holds ``[[change]]`` tables with ``at`` (s), the link ends ``a`` and ``b``,
    a rate ``gbps`` or ``mbps`` (0 takes the link down) and optional ``direction``:
    ``"both"`` (default) or ``"ab"`` (only a -> b)::

        [[change]]
        at = 2.0
        a = "h3"
        b = "sw"
        mbps = 100

    Parameters
    ----------
    data : mapping
        The parsed file.
    graph : networkx.DiGraph
        The bandwidth graph the links must belong to.

    Returns
    -------
    list of BandwidthChange
        Sorted by time (stable for equal times).

    Raises
    ------
    ValueError
        Naming the offending entry.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> ch = parse_bandwidth_schedule({"change": [{"at": 1, "a": "h0", "b": "sw", "gbps": 8}]}, star(2, 8e9))
    >>> [(c.at, c.link) for c in ch]
    [(1.0, ('h0', 'sw')), (1.0, ('sw', 'h0'))]
    """
    entries = data.get("change", [])
    if not isinstance(entries, list):
        raise ValueError("'change' must be a list of tables")
    out: list[BandwidthChange] = []
    for i, entry in enumerate(entries):
        where = f"change[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: expected a table")
        extra = set(entry) - {"at", "a", "b", "gbps", "mbps", "direction"}
        if extra:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
        at = entry.get("at")
        if isinstance(at, bool) or not isinstance(at, int | float) or at < 0:
            raise ValueError(f"{where}: 'at' must be a time >= 0 (s)")
        a, b = str(entry.get("a")), str(entry.get("b"))
        if not graph.has_edge(a, b):
            raise ValueError(f"{where}: no link {a}-{b} in the bandwidth graph")
        direction = entry.get("direction", "both")
        if direction not in ("both", "ab"):
            raise ValueError(f"{where}: direction must be 'both' or 'ab', got {direction!r}")
        rate = _change_rate(entry, where)
        out.append(BandwidthChange(float(at), (a, b), rate))
        if direction == "both":
            out.append(BandwidthChange(float(at), (b, a), rate))
    out.sort(key=lambda c: c.at)
    return out
