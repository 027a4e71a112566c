"""The heuristic plans the ILP is the yardstick for, and its warm start (DESIGN §4, §5).

:func:`heuristic_plans` runs the online policies' planners on an instance: ``stf``
(shortest transfer first, Fig. 4) and, with aggregators, ``aggregation`` (Fig. 6).
:func:`warm_start` picks the best of them as the ILP's hint. :func:`fair_schedule` is the
network-agnostic baseline ``fair``: every update goes at once, directly, and the links are
shared max-min fairly (progressive filling,
:func:`~mlfabric.scheduler.core.fairshare.max_min_rates`), as TCP would.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from mlfabric.scheduler.core.fairshare import max_min_rates
from mlfabric.scheduler.core.graph import path_links
from mlfabric.scheduler.core.schedule import Reservation, Schedule, Transfer
from mlfabric.scheduler.plan.instance import Instance, objective_of
from mlfabric.scheduler.policies.aggregation import plan_aggregation, plan_aggregation_sync
from mlfabric.scheduler.policies.stf import plan_stf

__all__ = ["fair_schedule", "heuristic_plans", "warm_start"]


def heuristic_plans(instance: Instance) -> dict[str, Schedule]:
    """The heuristics the ILP is the yardstick for: ``stf`` (Fig. 4) and, with aggregators,
    ``aggregation`` (groups over the STF order, Fig. 6; for the makespan objective chosen
    for one synchronous iteration by
    :func:`~mlfabric.scheduler.policies.aggregation.plan_aggregation_sync`).

    Examples
    --------
    >>> import random
    >>> from mlfabric.scheduler.plan.instance import parse_instance, two_tier_instance
    >>> sorted(heuristic_plans(parse_instance(two_tier_instance(random.Random(0), 4, 1))))
    ['aggregation', 'stf']
    """
    updates = list(instance.updates)
    plans = {"stf": plan_stf(instance.graph, updates)}
    if instance.aggregators:
        group = plan_aggregation_sync if instance.objective == "makespan" else plan_aggregation
        plans["aggregation"] = group(instance.graph, updates, aggregators=list(instance.aggregators))
    return plans


def warm_start(instance: Instance, plans: Iterable[Schedule] | None = None) -> Schedule:
    """The best of the heuristic plans (default :func:`heuristic_plans`): the ILP's hint.

    Examples
    --------
    >>> import random
    >>> from mlfabric.scheduler.plan.instance import parse_instance, two_tier_instance
    >>> inst = parse_instance(two_tier_instance(random.Random(0), 8, 2))
    >>> plan = warm_start(inst)
    >>> objective_of(inst, plan) <= objective_of(inst, plan_stf(inst.graph, list(inst.updates)))
    True
    """
    candidates = list(plans) if plans is not None else list(heuristic_plans(instance).values())
    return min(candidates, key=lambda plan: objective_of(instance, plan))


def fair_schedule(instance: Instance, updates: Sequence[str] | None = None) -> Schedule:
    """The ``fair`` baseline: every update direct, as soon as ready, max-min fair sharing.

    Parameters
    ----------
    instance : Instance
        The instance.
    updates : sequence of str, optional
        Which updates (default: all).

    Returns
    -------
    Schedule
        Transfers whose reservations change at every arrival and completion.

    Examples
    --------
    Two equal updates sharing a link finish together, at twice the time of one.

    >>> from mlfabric.scheduler.plan.instance import parse_instance
    >>> inst = parse_instance({
    ...     "topology": {"hosts": ["s", "w1", "w2"], "switches": ["sw"],
    ...                  "links": [{"a": h, "b": "sw", "mbps": 8} for h in ("s", "w1", "w2")]},
    ...     "server": "s", "updates": [{"id": "a", "worker": "w1", "bytes": 1000000},
    ...                                {"id": "b", "worker": "w2", "bytes": 1000000}]})
    >>> sorted(fair_schedule(inst).completion_times().values())
    [2.0, 2.0]
    """
    chosen = [instance.update(uid) for uid in updates] if updates is not None else list(instance.updates)
    links = {u.update_id: path_links(list(instance.direct_path(u.update_id))) for u in chosen}
    capacity = {e: instance.capacity(e) for ls in links.values() for e in ls}
    remaining = {u.update_id: u.bytes for u in chosen}
    pieces: dict[str, list[tuple[float, float, float]]] = {uid: [] for uid in remaining}
    waiting = sorted(chosen, key=lambda u: u.ready_at)
    now = waiting[0].ready_at if waiting else 0.0
    active: set[str] = set()
    while waiting or active:
        while waiting and waiting[0].ready_at <= now + 1e-12:
            active.add(waiting.pop(0).update_id)
        rates = max_min_rates({f: links[f] for f in active}, capacity)
        step = min((remaining[f] / rates[f] for f in active), default=math.inf)
        if waiting:
            step = min(step, waiting[0].ready_at - now)
        for f in active:
            if step > 0:
                pieces[f].append((now, now + step, rates[f]))
            remaining[f] -= rates[f] * step
        now += step
        active = {f for f in active if remaining[f] > 1e-9 * instance.update(f).bytes}
    transfers = []
    for u in chosen:
        path = instance.direct_path(u.update_id)
        ps = pieces[u.update_id]
        res = tuple(Reservation(e, lo, hi, rate) for lo, hi, rate in ps for e in links[u.update_id])
        transfers.append(
            Transfer(u.update_id, u.src, instance.server, path, ps[0][0], ps[-1][1], u.bytes, res)
        )
    return Schedule(transfers=tuple(transfers))
