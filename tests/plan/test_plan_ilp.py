"""The ILP against brute force and STF; every plan passes the shared invariant checker."""

from __future__ import annotations

import random

import pytest

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.core.schedule import Schedule
from mlfabric.scheduler.plan.bruteforce import brute_force
from mlfabric.scheduler.plan.heuristics import fair_schedule, heuristic_plans, warm_start
from mlfabric.scheduler.plan.ilp import Progress, solve_ilp
from mlfabric.scheduler.plan.instance import Instance, objective_of, parse_instance, two_tier_instance
from mlfabric.scheduler.policies.stf import plan_stf

MB = 1_000_000  # one slot at 8 Mb/s with 1 s slots


def star_instance(seed: int, n: int, k: int, objective: str | None = None) -> Instance:
    """A random slot-aligned instance: a star of 8 Mb/s links, 1-3 slot updates, ready at 0-2.

    Workers may repeat (two updates from one host share its NIC)."""
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(n)]
    aggs = [f"a{j}" for j in range(k)]
    hosts = ["s", *workers, *aggs]
    return parse_instance(
        {
            "topology": {
                "hosts": hosts,
                "switches": ["sw"],
                "links": [{"a": h, "b": "sw", "mbps": 8} for h in hosts],
            },
            "server": "s",
            "aggregators": aggs,
            "slot_seconds": 1.0,
            "objective": objective or rng.choice(["mean_completion", "makespan"]),
            "updates": [
                {
                    "id": f"u{i}",
                    "worker": rng.choice(workers),
                    "bytes": MB * rng.randint(1, 3),
                    "ready_at": float(rng.randint(0, 2)),
                }
                for i in range(n)
            ],
        }
    )


def _check(inst: Instance, schedule: Schedule) -> None:
    check_schedule(inst.graph, schedule, updates=list(inst.updates))


# (seed, updates, aggregators): up to 6 updates with one aggregator, 4 with two
TINY = [(s, 3 + s % 3, 1) for s in range(8)] + [(7, 6, 1)] + [(s, 3 + s % 2, 2) for s in range(8, 14)]


@pytest.mark.parametrize(("seed", "n", "k"), TINY)
def test_ilp_optimum_equals_brute_force(seed: int, n: int, k: int) -> None:
    inst = star_instance(seed, n, k)
    exact = brute_force(inst)
    stf = plan_stf(inst.graph, list(inst.updates))
    horizon = int(_sequential_slots(inst))  # long enough for any optimal plan
    result = solve_ilp(inst, hint=stf, horizon_slots=horizon, time_limit=60, workers=2, seed=seed, groups=1)
    assert result.status == "OPTIMAL"
    assert result.schedule is not None and result.objective is not None
    assert result.objective == pytest.approx(exact.objective, abs=1e-9)
    assert result.bound == pytest.approx(result.objective, abs=1e-9)
    assert objective_of(inst, result.schedule) == pytest.approx(result.objective)
    _check(inst, result.schedule)
    _check(inst, exact.schedule)
    assert objective_of(inst, exact.schedule) == pytest.approx(exact.objective)


def _sequential_slots(inst: Instance) -> float:
    return max(u.ready_at for u in inst.updates) + sum(u.bytes for u in inst.updates) / MB


@pytest.mark.parametrize("seed", range(4))
def test_ilp_never_worse_than_the_heuristics_and_all_plans_check(seed: int) -> None:
    objective = "makespan" if seed % 2 else "mean_completion"
    inst = parse_instance(two_tier_instance(random.Random(seed), 5, 2, racks=2, objective=objective))
    plans = heuristic_plans(inst)
    assert set(plans) == {"stf", "aggregation"}
    plans["fair"] = fair_schedule(inst)
    result = solve_ilp(inst, hint=warm_start(inst), time_limit=30, workers=2, seed=0)
    assert result.schedule is not None and result.objective is not None
    for plan in (*plans.values(), result.schedule):
        _check(inst, plan)
    for plan in plans.values():
        assert result.objective <= objective_of(inst, plan) + 1e-9
    assert result.bound <= result.objective + 1e-12
    assert 0.0 <= result.gap < 1.0


def test_warm_start_is_the_best_heuristic() -> None:
    inst = parse_instance(two_tier_instance(random.Random(0), 8, 2))
    plans = heuristic_plans(inst)
    best = warm_start(inst)
    assert objective_of(inst, best) == min(objective_of(inst, p) for p in plans.values())


def test_aggregation_wins_when_the_server_ingress_is_the_bottleneck() -> None:
    # four 1-slot updates for a server whose NIC is the only shared link; an aggregator
    # with two workers on its own switch: sum two there, send one payload.
    links = [{"a": "s", "b": "core", "mbps": 8}, {"a": "tor", "b": "core", "mbps": 16}]
    links += [{"a": h, "b": "tor", "mbps": 8} for h in ("w1", "w2", "a")]
    links += [{"a": h, "b": "core", "mbps": 8} for h in ("w3", "w4")]
    inst = parse_instance(
        {
            "topology": {
                "hosts": ["s", "w1", "w2", "w3", "w4", "a"],
                "switches": ["core", "tor"],
                "links": links,
            },
            "server": "s",
            "aggregators": ["a"],
            "slot_seconds": 1.0,
            "objective": "makespan",
            "updates": [{"id": f"u{i}", "worker": f"w{i}", "bytes": MB} for i in range(1, 5)],
        }
    )
    direct_only = 4.0  # four payloads through the server's 1 MB/s NIC
    result = solve_ilp(inst, time_limit=30, workers=2, groups=1)
    assert result.status == "OPTIMAL"
    assert result.schedule is not None and result.objective is not None
    assert result.objective < direct_only
    assert [a.aggregator for a in result.schedule.aggregates] == ["a"]
    _check(inst, result.schedule)
    assert brute_force(inst).objective == pytest.approx(result.objective)


def test_time_limit_returns_best_plan_and_progress_is_reported() -> None:
    inst = parse_instance(two_tier_instance(random.Random(5), 8, 2))
    stf = plan_stf(inst.graph, list(inst.updates))
    seen: list[Progress] = []
    result = solve_ilp(inst, hint=stf, time_limit=4, workers=2, progress=seen.append)
    assert result.status in ("OPTIMAL", "FEASIBLE")
    assert result.schedule is not None and result.objective is not None
    assert result.wall_seconds < 15
    assert any(p.bound > 0 for p in seen)
    assert all(p.bound <= (p.objective or float("inf")) + 1e-9 for p in seen)
    assert result.objective <= objective_of(inst, stf) + 1e-9
    _check(inst, result.schedule)


def test_stopped_before_any_solution_returns_the_warm_start() -> None:
    inst = parse_instance(two_tier_instance(random.Random(5), 16, 4))
    hint = warm_start(inst)
    result = solve_ilp(inst, hint=hint, time_limit=0.01, workers=1)
    assert result.status == "FEASIBLE"
    assert result.schedule is not None and result.objective is not None
    assert result.objective == pytest.approx(objective_of(inst, hint))
    assert 0.0 <= result.bound <= result.objective
    _check(inst, result.schedule)


@pytest.mark.parametrize("engine", ["scip", "highs"])
def test_mip_engines_agree_with_cp_sat(engine: str) -> None:
    inst = star_instance(4, 3, 1, objective="mean_completion")
    ref = solve_ilp(inst, time_limit=30, workers=2)
    other = solve_ilp(inst, time_limit=30, engine=engine)
    assert other.status == ref.status == "OPTIMAL"
    assert other.schedule is not None
    assert other.objective == pytest.approx(ref.objective)
    _check(inst, other.schedule)


def test_brute_force_orders_shortest_first_on_one_bottleneck() -> None:
    inst = star_instance(0, 3, 0, objective="mean_completion")
    result = brute_force(inst)
    sizes = {u.update_id: u.bytes for u in inst.updates}
    ready = {u.update_id: u.ready_at for u in inst.updates}
    # every order the search could pick is no better than the one it returns
    for plan_order in _all_orders(list(sizes)):
        assert result.objective <= _sequential_cost(plan_order, sizes, ready) + 1e-9
    with pytest.raises(ValueError, match="at most"):
        brute_force(star_instance(1, 8, 0), max_updates=7)


def _all_orders(ids: list[str]) -> list[tuple[str, ...]]:
    import itertools

    return list(itertools.permutations(ids))


def _sequential_cost(order, sizes, ready) -> float:
    """Mean completion sending one at a time in ``order`` (1 MB/s ingress)."""
    t, total = 0.0, 0.0
    for uid in order:
        t = max(t, ready[uid]) + sizes[uid] / MB
        total += t
    return total / len(order)


def test_fair_shares_the_bottleneck_max_min() -> None:
    inst = star_instance(2, 3, 0, objective="mean_completion")
    plan = fair_schedule(inst)
    _check(inst, plan)
    ingress = ("sw", "s")
    # while updates are active together, the server's ingress is full and split evenly
    for t in plan.transfers:
        for r in t.reservations:
            if r.link == ingress:
                active = [
                    x
                    for other in plan.transfers
                    for x in other.reservations
                    if x.link == ingress and x.start <= r.start < x.end
                ]
                assert sum(x.rate for x in active) == pytest.approx(1e6)
                assert r.rate == pytest.approx(1e6 / len(active))


@pytest.mark.parametrize("seed", [1, 4])
def test_ilp_optimum_equals_brute_force_on_two_tier_instances(seed: int) -> None:
    # the benchmark's graphs: rack uplinks shared, the optimum aggregates at a0 (the LP
    # strengthening rows, the energy roundings and twins in particular, must cut no plan)
    inst = parse_instance(two_tier_instance(random.Random(seed), 5, 2))
    exact = brute_force(inst)
    assert exact.schedule.aggregates  # the instance exercises aggregation
    result = solve_ilp(inst, hint=warm_start(inst), time_limit=60, workers=2, groups=1)
    assert result.status == "OPTIMAL"
    assert result.schedule is not None and result.objective is not None
    assert result.objective == pytest.approx(exact.objective, abs=1e-9)
    _check(inst, result.schedule)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_instances_that_are_not_slot_aligned_get_real_plans_no_better_than_brute_force(seed: int) -> None:
    # sizes and ready times off the slot grid: aggregates of one size class differ in bytes
    rng = random.Random(seed)
    hosts = ["s", "a", "w0", "w1", "w2", "w3"]
    inst = parse_instance(
        {
            "topology": {
                "hosts": hosts,
                "switches": ["sw"],
                "links": [{"a": h, "b": "sw", "mbps": 8} for h in hosts],
            },
            "server": "s",
            "aggregators": ["a"],
            "objective": "mean_completion",
            "updates": [
                {
                    "id": f"u{i}",
                    "worker": f"w{i}",
                    "bytes": rng.randint(300_000, 2_000_000),
                    "ready_at": rng.uniform(0, 0.5),
                }
                for i in range(4)
            ],
        }
    )
    exact = brute_force(inst)
    result = solve_ilp(inst, hint=warm_start(inst), time_limit=5, workers=2)
    assert result.schedule is not None and result.objective is not None
    _check(inst, result.schedule)
    assert objective_of(inst, result.schedule) == pytest.approx(result.objective)
    assert result.objective >= exact.objective - 1e-9  # the fluid optimum is a lower bound
    assert result.bound <= result.objective + 1e-9


def test_groups_caps_the_aggregates_per_aggregator_and_defaults_to_no_cap() -> None:
    inst = parse_instance(two_tier_instance(random.Random(1), 6, 1))
    capped = solve_ilp(inst, hint=warm_start(inst), time_limit=30, workers=2, groups=1)
    free = solve_ilp(inst, hint=warm_start(inst), time_limit=30, workers=2)
    assert capped.status == free.status == "OPTIMAL"
    assert capped.schedule is not None and capped.objective is not None
    assert free.schedule is not None and free.objective is not None
    assert len(capped.schedule.aggregates) <= 1
    assert free.objective <= capped.objective + 1e-9
    _check(inst, capped.schedule)
    _check(inst, free.schedule)


def test_an_aggregator_may_make_two_groups_one_after_another() -> None:
    # five 1 MB updates, server NIC 1 MB/s, aggregator NIC 2 MB/s: two aggregates at "a" beat one
    hosts = ["s", "a", *(f"w{i}" for i in range(5))]
    links = [{"a": "s", "b": "sw", "mbps": 8}, {"a": "a", "b": "sw", "mbps": 16}]
    links += [{"a": f"w{i}", "b": "sw", "mbps": 8} for i in range(5)]
    inst = parse_instance(
        {
            "topology": {"hosts": hosts, "switches": ["sw"], "links": links},
            "server": "s",
            "aggregators": ["a"],
            "slot_seconds": 0.5,
            "updates": [{"id": f"u{i}", "worker": f"w{i}", "bytes": MB} for i in range(5)],
        }
    )
    one = solve_ilp(inst, time_limit=30, workers=2, groups=1)
    two = solve_ilp(inst, time_limit=30, workers=2, groups=2)
    free = solve_ilp(inst, time_limit=30, workers=2)
    assert one.status == two.status == free.status == "OPTIMAL"
    assert one.schedule is not None and one.objective is not None
    assert two.schedule is not None and two.objective is not None
    assert free.objective is not None
    assert two.objective < one.objective - 1e-9
    assert free.objective == pytest.approx(two.objective)
    assert [a.aggregator for a in two.schedule.aggregates] == ["a", "a"]
    _check(inst, two.schedule)
    _check(inst, one.schedule)


def test_twins_finish_in_id_order_and_the_optimum_is_unchanged() -> None:
    # u0..u2 are twins (same size, same ready time, same rack); u3 is larger: the symmetry
    # cut orders the twins' completions and the hint is remapped to respect it.
    hosts = ["s", "a", "w0", "w1", "w2", "w3"]
    links = [{"a": h, "b": "sw", "mbps": 8} for h in hosts]
    inst = parse_instance(
        {
            "topology": {"hosts": hosts, "switches": ["sw"], "links": links},
            "server": "s",
            "aggregators": ["a"],
            "slot_seconds": 1.0,
            "objective": "mean_completion",
            "updates": [
                *({"id": f"u{i}", "worker": f"w{i}", "bytes": MB, "ready_at": 1.0} for i in (2, 0, 1)),
                {"id": "u3", "worker": "w3", "bytes": 2 * MB},
            ],
        }
    )
    stf = plan_stf(inst.graph, list(inst.updates))
    result = solve_ilp(inst, hint=stf, horizon_slots=8, time_limit=30, workers=2, groups=1)
    assert result.status == "OPTIMAL"
    assert result.schedule is not None and result.objective is not None
    assert result.objective == pytest.approx(brute_force(inst).objective)
    done = result.schedule.update_completion_times(list(inst.updates))
    # the model orders twins as listed in the instance: u2, then u0, then u1
    assert done["u2"] <= done["u0"] <= done["u1"]
    _check(inst, result.schedule)
