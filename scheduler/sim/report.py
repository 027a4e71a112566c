"""Summaries of simulated runs and the side-by-side table (DESIGN §5 yardsticks).

:func:`summarize` turns one run's :class:`~mlfabric.scheduler.sim.engine.UpdateRecord` s
into a :class:`PolicyStats`: update delay (mean, p50, p99 over applied updates),
completion time (ready at the worker to arrived at the server), updates applied and
dropped, and for synchronous SGD the iteration makespans. :func:`format_table` prints
several policies side by side with their ratios to a baseline (``fair``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mlfabric.scheduler.sim.engine import APPLIED, DROPPED, UpdateRecord

__all__ = ["PolicyStats", "format_table", "summarize"]


def _q(values: Sequence[float], q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else math.nan


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


@dataclass(frozen=True)
class PolicyStats:
    """One policy's results in one simulated scenario (times in seconds)."""

    policy: str
    pushed: int
    applied: int
    dropped_policy: int
    dropped_server: int
    unresolved: int
    delay_mean: float
    delay_p50: float
    delay_p99: float
    completion_mean: float
    completion_p50: float
    completion_p99: float
    sim_time: float
    iterations: int = 0
    makespan_mean: float = math.nan
    makespan_max: float = math.nan
    decisions: int = 0
    events: int = 0
    wall_s: float = math.nan
    decide_s: float = math.nan  # of wall_s, in the policy's decisions

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (NaN stays NaN: "no value", e.g. no makespan without iterations)."""
        return asdict(self)

    def as_json(self) -> dict[str, Any]:
        """:meth:`as_dict` with every non-finite number as None, so that the JSON is valid.

        Examples
        --------
        >>> s = summarize("fair", [], sim_time=0.0)
        >>> s.as_dict()["makespan_mean"], s.as_json()["makespan_mean"]
        (nan, None)
        """
        return {
            k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in asdict(self).items()
        }


def summarize(
    policy: str,
    records: Sequence[UpdateRecord],
    *,
    sim_time: float,
    makespans: Sequence[float] = (),
    decisions: int = 0,
    events: int = 0,
    wall_s: float = math.nan,
    decide_s: float = math.nan,
) -> PolicyStats:
    """Statistics of one run.

    Parameters
    ----------
    policy : str
        Policy name.
    records : sequence of UpdateRecord
        Every update of the run.
    sim_time : float
        Simulated time at the end of the run.
    makespans : sequence of float
        Synchronous SGD iteration durations (empty for asynchronous runs).
    decisions, events : int
        Policy calls and simulator events (for the record).
    wall_s : float
        Wall-clock seconds the run took (measured by the caller).
    decide_s : float
        Of those, the seconds spent in the policy's decisions.

    Returns
    -------
    PolicyStats

    Examples
    --------
    >>> r = UpdateRecord("u", "w", 0, ready_at=0.0, arrived_at=2.0, delay=3, outcome="applied")
    >>> s = summarize("fair", [r], sim_time=2.0)
    >>> s.applied, s.delay_mean, s.completion_mean
    (1, 3.0, 2.0)
    """
    applied = [r for r in records if r.outcome == APPLIED]
    dropped = [r for r in records if r.outcome == DROPPED]
    delays = [float(r.delay) for r in applied]
    completions = [r.completion_time for r in applied]
    return PolicyStats(
        policy=policy,
        pushed=len(records),
        applied=len(applied),
        dropped_policy=sum(1 for r in dropped if r.reason.startswith("policy")),
        dropped_server=sum(1 for r in dropped if r.reason.startswith("server")),
        unresolved=sum(1 for r in records if not r.outcome),
        delay_mean=_mean(delays),
        delay_p50=_q(delays, 0.5),
        delay_p99=_q(delays, 0.99),
        completion_mean=_mean(completions),
        completion_p50=_q(completions, 0.5),
        completion_p99=_q(completions, 0.99),
        sim_time=sim_time,
        iterations=len(makespans),
        makespan_mean=_mean(makespans),
        makespan_max=max(makespans, default=math.nan),
        decisions=decisions,
        events=events,
        wall_s=wall_s,
        decide_s=decide_s,
    )


def _fmt(x: float, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if math.isnan(x) else f"{x * scale:.{digits}f}"


def _ratio(x: float, base: float) -> str:
    if math.isnan(x) or math.isnan(base) or base == 0:
        return "-"
    return f"{x / base:.2f}x"


def format_table(stats: Sequence[PolicyStats], baseline: str = "fair") -> str:
    """A markdown table, one row per policy, plus each policy's ratios to ``baseline``.

    Parameters
    ----------
    stats : sequence of PolicyStats
        Results of one scenario.
    baseline : str
        Policy the others are compared with (ratios ``policy / baseline``; < 1 is better).

    Returns
    -------
    str

    Examples
    --------
    >>> a = summarize("fair", [UpdateRecord("u", "w", 0, 0.0, 0.0, 4.0, 2, APPLIED)], sim_time=4)
    >>> b = summarize("stf", [UpdateRecord("u", "w", 0, 0.0, 0.0, 2.0, 1, APPLIED)], sim_time=2)
    >>> print(format_table([a, b]).splitlines()[-1])
    | stf / fair | | | | 0.50x | | | 0.50x | | | - | 0.50x |
    """
    head = (
        "| policy | pushed | applied | dropped (policy/server) | delay mean | p50 | p99 "
        "| completion mean (ms) | p50 (ms) | p99 (ms) | makespan mean (ms) | sim time (s) |"
    )
    lines = [head, "|" + " --- |" * 12]
    for s in stats:
        lines.append(
            f"| {s.policy} | {s.pushed} | {s.applied} | {s.dropped_policy}/{s.dropped_server} "
            f"| {_fmt(s.delay_mean)} | {_fmt(s.delay_p50, digits=0)} | {_fmt(s.delay_p99, digits=0)} "
            f"| {_fmt(s.completion_mean, 1e3, 1)} | {_fmt(s.completion_p50, 1e3, 1)} "
            f"| {_fmt(s.completion_p99, 1e3, 1)} | {_fmt(s.makespan_mean, 1e3, 1)} | {_fmt(s.sim_time)} |"
        )
    base = next((s for s in stats if s.policy == baseline), None)
    if base is not None:
        for s in stats:
            if s is base:
                continue
            lines.append(
                f"| {s.policy} / {base.policy} | | | | {_ratio(s.delay_mean, base.delay_mean)} | | "
                f"| {_ratio(s.completion_mean, base.completion_mean)} | | "
                f"| {_ratio(s.makespan_mean, base.makespan_mean)} | {_ratio(s.sim_time, base.sim_time)} |"
            )
    return "\n".join(lines)
