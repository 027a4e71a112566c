"""Workloads for the simulator: compute times, stragglers, bandwidth changes (DESIGN §6).

A worker's iteration is *compute, then push* (paper §2: workers fetch the model, compute
an update from it, push it). :class:`ComputeModel` says how long each worker computes in
each iteration: a per-worker mean (compute stragglers are workers with a larger mean,
paper §7 settings CS1-CS3) times an optional random factor. Each worker draws from its
own stream of a seeded generator, so the k-th compute time of a worker is the same under
every policy: a comparison of policies sees exactly the same compute.

:class:`BandwidthChange` is one step of a link's capacity over time (a dynamic cluster,
paper §7 settings NS1-NS3); it and the schedule file's parser,
:func:`parse_bandwidth_schedule`, live in :mod:`mlfabric.scheduler.core.bandwidth_schedule`
(the one format the simulator and the testbed read) and are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from mlfabric.scheduler.core.bandwidth_schedule import BandwidthChange, parse_bandwidth_schedule

__all__ = [
    "BandwidthChange",
    "ComputeModel",
    "ComputeSampler",
    "parse_bandwidth_schedule",
    "pick_stragglers",
]


@dataclass(frozen=True)
class ComputeModel:
    """Per-worker compute time of one iteration (paper §7 compute settings).

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

    def table(self, rounds: int, workers: Iterable[str] | None = None) -> list[dict[str, float]]:
        """Round -> worker -> compute time, as synchronous SGD draws them (one per worker a round).

        What a yardstick told the true arrivals needs (``KnownArrivals``): the same draws a
        fresh :meth:`sampler` gives, worker by worker.

        Parameters
        ----------
        rounds : int
            Rounds to draw.
        workers : iterable of str, optional
            The workers (default: those of ``mean``).

        Returns
        -------
        list of dict

        Examples
        --------
        >>> ComputeModel({"w0": 0.1, "w1": 0.4}).table(2)
        [{'w0': 0.1, 'w1': 0.4}, {'w0': 0.1, 'w1': 0.4}]
        """
        s = self.sampler()
        table: list[dict[str, float]] = [{} for _ in range(rounds)]
        for w in self.mean if workers is None else workers:
            for k in range(rounds):
                table[k][w] = s.next(w)
        return table


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
