"""A simulated run as a :class:`~mlfabric.scheduler.core.schedule.Schedule` (traces and checks).

The fluid network records every transfer's rate over time (:class:`FlowRecord`, kept by
:class:`~mlfabric.scheduler.sim.engine.Simulator`). :func:`flows_to_schedule` turns the records
into a schedule whose reservations are those rates on every link of each path:
the same shape every planner produces, so the invariant checker
(:func:`~mlfabric.scheduler.core.checker.check_schedule`) can verify a simulation and the trace
writer (:mod:`mlfabric.scheduler.core.trace`) can draw it, one track per link.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from mlfabric.scheduler.core.schedule import Aggregate, Reservation, Schedule, Transfer

__all__ = ["FlowRecord", "flows_to_schedule"]


@dataclass(frozen=True)
class FlowRecord:
    """One finished transfer: its links and its rate over time (for traces and checks)."""

    flow_id: str
    kind: str  # "update", "aggregate" or "model"
    path: tuple[str, ...]
    bytes: float
    start: float
    end: float
    rates: tuple[tuple[float, float], ...]  # (from time, rate) steps


def flows_to_schedule(
    flows: Sequence[FlowRecord],
    *,
    aggregates: Sequence[Aggregate] = (),
    drops: dict[str, str] | None = None,
    include_models: bool = False,
) -> Schedule:
    """The schedule a simulation carried out.

    Parameters
    ----------
    flows : sequence of FlowRecord
        Finished transfers with their rate steps.
    aggregates : sequence of Aggregate
        Aggregates the run made (for the checker).
    drops : dict, optional
        Update id -> drop reason.
    include_models : bool
        Also include the model transfers back to workers (they are not updates; leave
        them out when checking).

    Returns
    -------
    Schedule

    Examples
    --------
    >>> f = FlowRecord("u", "update", ("w", "ps"), 4.0, 0.0, 3.0, ((0.0, 1.0), (2.0, 2.0)))
    >>> t = flows_to_schedule([f]).transfers[0]
    >>> [(r.start, r.end, r.rate) for r in t.reservations]
    [(0.0, 2.0, 1.0), (2.0, 3.0, 2.0)]
    """
    transfers = []
    for f in flows:
        if f.kind == "model" and not include_models:
            continue
        steps = [(t, r) for t, r in f.rates if t < f.end]
        reservations: list[Reservation] = []
        links = tuple(itertools.pairwise(f.path))
        ends = [t for t, _ in steps[1:]] + [f.end] * bool(steps)
        for (t0, rate), t1 in zip(steps, ends, strict=True):
            if t1 > t0 and rate > 0:
                reservations.extend(Reservation(link, t0, t1, rate) for link in links)
        transfers.append(
            Transfer(f.flow_id, f.path[0], f.path[-1], f.path, f.start, f.end, f.bytes, tuple(reservations))
        )
    return Schedule(transfers=tuple(transfers), drops=dict(drops or {}), aggregates=tuple(aggregates))
