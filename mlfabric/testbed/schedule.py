"""Changing bandwidth and compute stragglers: the paper's NS and CS settings (paper §7).

A *rate schedule* is a list of :class:`RateChange` (at time ``at`` seconds after the start,
set a link's rate). :func:`parse_schedule` reads one from a bandwidth-schedule file (the one
format the simulator reads too, :mod:`mlfabric.scheduler.core.bandwidth_schedule`),
:func:`ns_schedule` draws a random one (each chosen link takes a random fraction of its
configured rate every ``period`` seconds — a cluster whose available bandwidth changes), and
:class:`ScheduleRunner` applies one in a background thread with an injected clock.
:func:`compute_delays` draws per-worker compute delays (compute stragglers). All but the
runner are pure.

Schedule files::

    [[change]]
    at = 5.0              # seconds after the start
    a = "ps"              # the link's ends
    b = "tor"
    direction = "both"    # both, or ab (only a -> b); default both
    mbps = 20

The former testbed form (``link = ["ps", "tor"]``, direction forward/reverse/both) is still
read, with a :class:`DeprecationWarning` naming the form above.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

from mlfabric.scheduler.core.bandwidth_schedule import parse_bandwidth_schedule

__all__ = [
    "RateChange",
    "ScheduleRunner",
    "compute_delays",
    "ns_schedule",
    "parse_schedule",
]


@dataclass(frozen=True)
class RateChange:
    """Set ``link``'s rate to ``rate`` bytes/s at ``at`` seconds (``direction`` as in ``set_rate``)."""

    at: float
    link: tuple[str, str]
    rate: float
    direction: str = "both"


def parse_schedule(data: Mapping[str, Any], graph: nx.DiGraph | None = None) -> list[RateChange]:
    """Read a rate schedule (the parsed TOML, see the module docstring), sorted by time.

    Parameters
    ----------
    data : mapping
        With a list ``change`` of tables ``at``, ``a``, ``b``, ``mbps`` or ``gbps``, ``direction``.
    graph : networkx.DiGraph, optional
        If given, every link must be one of its links.

    Returns
    -------
    list of RateChange
        One per directed link (``direction = "forward"``), sorted by time.

    Raises
    ------
    ValueError
        Naming the offending entry; also for a rate of 0 (a testbed link cannot be taken down).

    Examples
    --------
    >>> parse_schedule({"change": [{"at": 1, "a": "a", "b": "sw", "mbps": 8, "direction": "ab"}]})
    [RateChange(at=1.0, link=('a', 'sw'), rate=1000000.0, direction='forward')]
    """
    changes = parse_bandwidth_schedule(data, graph)
    for c in changes:
        if c.capacity <= 0:
            raise ValueError(f"link {c.link[0]}-{c.link[1]} at {c.at} s: the testbed needs a rate > 0")
    return [RateChange(c.at, c.link, c.capacity, "forward") for c in changes]


def ns_schedule(
    graph: nx.DiGraph,
    links: Sequence[tuple[str, str]],
    *,
    levels: Sequence[float],
    period: float,
    duration: float,
    rng: random.Random,
    direction: str = "both",
) -> list[RateChange]:
    """A changing-bandwidth (NS) setting: every ``period`` s each link takes a random level.

    Parameters
    ----------
    graph : networkx.DiGraph
        The bandwidth graph (configured rates).
    links : sequence of (str, str)
        The links whose bandwidth changes.
    levels : sequence of float
        Fractions of the configured rate to draw from (e.g. ``(1.0, 0.5, 0.25)``).
    period, duration : float
        Seconds between changes, and how long the schedule runs.
    rng : random.Random
        Seeded source of the draws.

    Returns
    -------
    list of RateChange
        Sorted by time; the first change is at ``period``.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["a", "b"], 8e6)
    >>> [(c.at, c.rate) for c in ns_schedule(g, [("a", "sw")], levels=[0.5], period=2,
    ...                                       duration=5, rng=random.Random(0))]
    [(2.0, 500000.0), (4.0, 500000.0)]
    """
    if period <= 0 or not levels or any(not 0 < f <= 1 for f in levels):
        raise ValueError("need period > 0 and levels in (0, 1]")
    changes = []
    t = period
    while t < duration:
        for link in links:
            capacity = graph.edges[link]["capacity"]
            changes.append(RateChange(float(t), (link[0], link[1]), capacity * rng.choice(levels), direction))
        t += period
    return changes


def compute_delays(
    workers: Sequence[str], *, base: float, stragglers: int, slowdown: float, rng: random.Random
) -> dict[str, float]:
    """Per-worker compute time per iteration for a compute-straggler (CS) setting.

    Parameters
    ----------
    workers : sequence of str
    base : float
        Seconds of compute per iteration on a normal worker.
    stragglers : int
        How many workers (drawn with ``rng``) are slow.
    slowdown : float
        A straggler's compute time is ``base * slowdown``.
    rng : random.Random

    Examples
    --------
    >>> compute_delays(["w0", "w1", "w2"], base=0.5, stragglers=1, slowdown=3, rng=random.Random(2))
    {'w0': 1.5, 'w1': 0.5, 'w2': 0.5}
    """
    slow = set(rng.sample(list(workers), min(stragglers, len(workers))))
    return {w: base * slowdown if w in slow else base for w in workers}


class ScheduleRunner:
    """Applies a rate schedule in a background thread.

    Parameters
    ----------
    apply : callable
        ``apply(change)``, e.g. ``lambda c: testbed.set_rate(c.link, c.rate, c.direction)``.
    changes : sequence of RateChange
    clock : callable
        Monotonic seconds (injected for tests).

    Attributes
    ----------
    applied : list of (float, RateChange)
        Each applied change with the time (since start) it was applied.
    """

    def __init__(
        self,
        apply: Callable[[RateChange], None],
        changes: Sequence[RateChange],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._apply = apply
        self._changes = sorted(changes, key=lambda c: c.at)
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.applied: list[tuple[float, RateChange]] = []
        self.error: BaseException | None = None

    def start(self) -> None:
        """Start applying; time 0 is now."""
        start = self._clock()
        self._thread = threading.Thread(target=self._run, args=(start,), name="rate-schedule", daemon=True)
        self._thread.start()

    def _run(self, start: float) -> None:
        for change in self._changes:
            wait = change.at - (self._clock() - start)
            if self._stop.wait(max(wait, 0.0)):
                return
            try:
                self._apply(change)
            except (OSError, RuntimeError) as exc:  # a failed `tc change`: stop, report it
                self.error = exc
                return
            self.applied.append((self._clock() - start, change))

    def stop(self) -> None:
        """Stop applying further changes and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
