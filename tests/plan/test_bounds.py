"""Lower bounds on a round's makespan (plan/bounds.py) and their use by ``mlfabric plan``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mlfabric.cli import main
from mlfabric.scheduler.core.graph import hosts, star, two_tier
from mlfabric.scheduler.core.schedule import Update
from mlfabric.scheduler.plan.bounds import makespan_bound
from mlfabric.scheduler.plan.bruteforce import brute_force
from mlfabric.scheduler.plan.heuristics import fair_schedule, heuristic_plans
from mlfabric.scheduler.plan.instance import objective_of, parse_instance, two_tier_instance
from mlfabric.scheduler.policies.trees import plan_tree

MB = 1_000_000


def test_the_motivating_round_is_bounded_by_rack_1s_uplink() -> None:
    g = two_tier(2, 6, 10e9, oversubscription=60)
    us = [Update(f"u{i}", f"h{i}", "h0", 20 * MB) for i in range(1, 12)]
    b = makespan_bound(g, us, "h0", aggregators=hosts(g)[1:])
    # one 20 MB payload over 1 Gbit/s (0.16 s) after at least one 10 Gbit/s fold (0.016 s)
    assert b.value == pytest.approx(0.176)
    assert b.path == pytest.approx(0.16)
    assert b.where == "cut tor1"
    assert b.value <= plan_tree(g, us).makespan()


def test_without_aggregators_the_server_ingress_takes_every_update() -> None:
    g = star(["ps", "w0", "w1", "w2"], 8e6)  # 1 MB/s
    us = [Update(f"u{i}", f"w{i}", "ps", MB, ready_at=0.5) for i in range(3)]
    b = makespan_bound(g, us, "ps")
    assert b.value == pytest.approx(3.5) and b.where == "ingress"
    with_agg = makespan_bound(g, us, "ps", aggregators=["w0", "w1", "w2"])
    assert with_agg.value < b.value


def test_a_slow_worker_is_its_own_bound() -> None:
    g = star(["ps", "w0", "w1"], {"ps": 80e6, "w0": 80e6, "w1": 8e6})
    us = [Update("fast", "w0", "ps", MB), Update("slow", "w1", "ps", MB, ready_at=1.0)]
    b = makespan_bound(g, us, "ps")
    assert b.value == pytest.approx(2.0) and b.where == "path slow"


@pytest.mark.parametrize("seed", range(12))
def test_no_plan_beats_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    inst = parse_instance(
        two_tier_instance(
            rng, rng.randint(2, 6), rng.randint(0, 2), racks=rng.randint(1, 3), objective="makespan"
        )
    )
    updates = list(inst.updates)
    bound = makespan_bound(inst.graph, updates, inst.server, aggregators=inst.aggregators).value
    assert bound > 0
    plans = [*heuristic_plans(inst).values(), fair_schedule(inst)]
    plans.append(plan_tree(inst.graph, updates, aggregators=list(inst.aggregators)))
    for plan in plans:
        assert objective_of(inst, plan) >= bound * (1 - 1e-9)
    if len(updates) <= 5:
        assert brute_force(inst).objective >= bound * (1 - 1e-9)


def test_mlfabric_plan_reports_the_bound_for_the_makespan_objective(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = two_tier_instance(random.Random(3), 6, 0, racks=2, objective="makespan")
    path = tmp_path / "inst.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--solver", "stf", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["bound"] > 0 and record["gap"] < 1
    inst = parse_instance(data)
    expected = makespan_bound(inst.graph, list(inst.updates), inst.server).value
    assert record["bound"] == pytest.approx(expected)
    assert "bound" in capsys.readouterr().out
