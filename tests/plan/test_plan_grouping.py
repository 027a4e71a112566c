"""Local search over aggregation groups: valid plans, never better than the optimum, the ILP's hint."""

from __future__ import annotations

import itertools
import random
import threading

import pytest

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.plan.bruteforce import brute_force
from mlfabric.scheduler.plan.grouping import Group, groups_of, improve_groups, plan_groups
from mlfabric.scheduler.plan.heuristics import heuristic_plans
from mlfabric.scheduler.plan.ilp import Progress, solve_ilp
from mlfabric.scheduler.plan.instance import objective_of, parse_instance, two_tier_instance


def _inst(seed: int, workers: int = 5, aggregators: int = 2):
    return parse_instance(two_tier_instance(random.Random(seed), workers, aggregators))


def _ticks(step: float = 1.0):
    """A clock that advances ``step`` per call: the number of moves no longer depends on speed."""
    counter = itertools.count()
    return lambda: next(counter) * step


@pytest.mark.parametrize("name", ["stf", "aggregation"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_heuristic_plan_replanned_from_its_groups_is_as_good(name: str, seed: int) -> None:
    inst = _inst(seed, 8, 2)
    plan = heuristic_plans(inst)[name]
    again = plan_groups(inst, groups_of(inst, plan))
    check_schedule(inst.graph, again, updates=list(inst.updates))
    assert objective_of(inst, again) <= objective_of(inst, plan) + 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_search_plans_are_valid_near_and_never_below_the_brute_force_optimum(seed: int) -> None:
    inst = _inst(seed)
    optimum = brute_force(inst).objective
    singles = [Group(None, (u.update_id,)) for u in inst.updates]
    for start in (singles, groups_of(inst, heuristic_plans(inst)["stf"])):
        # a clock that counts calls: the number of moves does not depend on the machine
        best, cost = improve_groups(inst, start, seconds=1e9, seed=seed, clock=_ticks())
        plan = plan_groups(inst, best)
        check_schedule(inst.graph, plan, updates=list(inst.updates))  # members arrive before the aggregate
        assert sorted(m for g in best for m in g.members) == sorted(u.update_id for u in inst.updates)
        assert cost == pytest.approx(objective_of(inst, plan))
        assert cost <= objective_of(inst, plan_groups(inst, start)) + 1e-12
        assert optimum - 1e-9 <= cost <= 1.05 * optimum  # within 5 % of the optimum


def test_search_is_reproducible_and_respects_the_groups_cap() -> None:
    inst = _inst(3, 8, 2)
    start = groups_of(inst, heuristic_plans(inst)["aggregation"])
    runs = [improve_groups(inst, start, seconds=2000, seed=5, groups=1, clock=_ticks()) for _ in range(2)]
    assert runs[0] == runs[1]
    made = [g.aggregator for g in runs[0][0] if g.aggregator is not None]
    assert len(made) == len(set(made))


def test_search_stops_when_asked_and_returns_the_start() -> None:
    inst = _inst(0, 8, 2)
    start = groups_of(inst, heuristic_plans(inst)["stf"])
    best, cost = improve_groups(inst, start, seconds=60, stop=lambda: True)
    assert best == start
    assert cost == pytest.approx(objective_of(inst, plan_groups(inst, start)))


def test_the_ilp_starts_from_the_search_and_reports_it() -> None:
    inst = _inst(1, 12, 3)
    hint = heuristic_plans(inst)["stf"]
    reports: list[Progress] = []
    result = solve_ilp(inst, hint=hint, time_limit=4, search_seconds=1, workers=2, progress=reports.append)
    first = reports[0]
    assert first.bound == 0.0 and first.objective is not None
    assert first.objective < objective_of(inst, hint)  # the search improved on STF
    assert result.objective is not None and result.objective <= first.objective + 1e-12
    assert result.schedule is not None
    check_schedule(inst.graph, result.schedule, updates=list(inst.updates))


def test_ctrl_c_during_the_search_returns_its_best_plan() -> None:
    inst = _inst(1, 16, 4)
    hint = heuristic_plans(inst)["stf"]
    stop = threading.Event()
    timer = threading.Timer(1.0, stop.set)
    timer.start()
    try:
        result = solve_ilp(inst, hint=hint, time_limit=600, search_seconds=60, workers=2, stop=stop)
    finally:
        timer.cancel()
    assert result.status == "INTERRUPTED" and result.wall_seconds < 30
    assert result.objective is not None and result.objective <= objective_of(inst, hint)
    assert result.schedule is not None
    check_schedule(inst.graph, result.schedule, updates=list(inst.updates))
