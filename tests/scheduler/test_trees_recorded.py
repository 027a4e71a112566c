"""The tree planner's plans on seeded instances, as recorded from its code before issue 24's speed-up.

``tree_plans.json`` beside this file holds, for every instance below, the SHA-256 (first 16
hex digits) of the ``repr`` of the plan (every transfer with its reservations, every
aggregate) or of the decisions, and the plan's makespan and sizes (for a readable failure).
It was generated from main's code at commit 84953f9, before the speed-up, with::

    git -C /work/main worktree add --detach /tmp/tree-ref 84953f9
    cd /tmp/tree-ref && PYTHONPATH=/tmp/tree-ref python \\
        $WT/tests/scheduler/test_trees_recorded.py --write $WT/tests/scheduler/tree_plans.json

(``$WT``: this worktree; ``PYTHONPATH`` makes the script import the reference checkout's
``mlfabric``, not the installed one; it prints the planner module it used). The instances: the
decision time benchmark's 1,024-worker round (``experiments/bench_trees.py``, seeds 0-2, a cold
decision then a warm one on the same policy), a synchronous round's first decision at 1,024
hosts (``experiments/bench_rounds.py``), and ``plan_tree`` on seeded two-tier graphs of 8 to
320 hosts (oversubscription 1-8, mixed NICs and sizes, ready times spread or not, restricted
aggregators, transfers in flight), small enough for the local search and the member moves.
A change of a digest is a change of plan: if intended, say so in the commit and re-record.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlfabric.scheduler.core.graph import PathCache, two_tier
from mlfabric.scheduler.core.schedule import Update
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies.base import PendingUpdate, RoundSpec, Snapshot
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.policies.tree_policy import TreePolicy
from mlfabric.scheduler.policies.trees import plan_tree

MB = 1_000_000
FIXTURE = Path(__file__).with_name("tree_plans.json")


def digest(obj: object) -> str:
    # decisions' aggregates gained ``chunk_bytes`` after the recording (pipelined aggregates):
    # 0, store-and-forward, is what the code recorded did, so it is left out of the repr
    return hashlib.sha256(repr(obj).replace(", chunk_bytes=0)", ")").encode()).hexdigest()[:16]


def nics(n: int, rng: random.Random) -> dict[str, float]:
    """70 % 10 Gbit/s, 20 % 25 Gbit/s, 10 % 2.5 Gbit/s (``bench_trees.mixed_nics``); h0 never slow."""
    out = {}
    for i in range(n):
        x = rng.random()
        out[f"h{i}"] = 25e9 if x < 0.2 else (2.5e9 if x > 0.9 and i > 0 else 10e9)
    return out


def bench_decisions(seed: int) -> dict[str, Any]:
    """``bench_trees.decision_times``' round: 1,023 updates on 32 x 32 hosts, 4:1; cold, then warm."""
    g = two_tier(32, 32, nics(1024, random.Random(seed)), oversubscription=4)
    ps = [
        PendingUpdate(f"uh{k}", "j", "s", f"h{k}", f"h{k}", "h0", 20 * MB, 1.0, 0, 0.0)
        for k in range(1, 1024)
    ]
    policy = TreePolicy()
    cold = policy.decide(Snapshot(0.0, g), ps)
    warm = policy.decide(Snapshot(0.0, g), list(ps))
    return {"digest": digest((cold, warm)), "sends": len(cold.sends), "aggregates": len(cold.aggregates)}


def round_first_decision(seed: int) -> dict[str, Any]:
    """``bench_rounds.decision_times``: a round's first decision (1 update there, 1,022 expected), second."""
    g = two_tier(32, 32, nics(1024, random.Random(seed)), oversubscription=4)
    spec = RoundSpec({f"h{k}": f"h{k}" for k in range(1, 1024)})

    def mk(h: str, t: float) -> PendingUpdate:
        return PendingUpdate(f"u{h}", "j", "s", h, h, "h0", 20 * MB, 1.0, 0, t)

    runner = DecisionRunner(TreePolicy())
    first = runner.decide(Snapshot(0.0, g, rounds={("j", "s"): spec}), [mk("h1", 0.0)])
    second = runner.decide(Snapshot(0.001, g, rounds={("j", "s"): spec}), [mk("h2", 0.001)])
    return {"digest": digest((first, second)), "sends": len(first.sends), "aggregates": len(first.aggregates)}


def seeded_plan(seed: int) -> dict[str, Any]:
    """``plan_tree`` on a seeded two-tier instance (shape, NICs, sizes, ready times, in flight)."""
    rng = random.Random(1000 + seed)
    racks, per = rng.choice([(2, 4), (2, 6), (3, 4), (3, 6), (4, 8), (8, 16), (10, 32)])
    n = racks * per
    g = two_tier(racks, per, nics(n, rng), oversubscription=rng.choice([1, 2, 4, 8]))
    spread = rng.choice([0.0, 0.0, 0.01])
    servers = ["h0"] if rng.random() < 0.8 else ["h0", "h1"]
    us = [
        Update(
            f"u{i}",
            f"h{i}",
            servers[i % len(servers)],
            rng.choice([5, 20, 40]) * MB,
            ready_at=rng.random() * spread,
        )
        for i in range(len(servers), n)
        if rng.random() < 0.9
    ]
    aggregators = None
    if rng.random() < 0.3:
        aggregators = sorted({f"h{rng.randrange(len(servers), n)}" for _ in range(max(2, n // 4))})
    timelines = None
    now = 0.0
    if rng.random() < 0.3:  # transfers in flight on a few paths
        now = 0.001
        pc = PathCache(g)
        timelines = Timelines(g, start=now)
        for k in rng.sample(range(len(servers), n), max(1, n // 8)):
            timelines.reserve_until(pc.links(f"h{k}", "h0"), now, now + rng.random() * 0.01)
    s = plan_tree(g, us, aggregators=aggregators, now=now, timelines=timelines)
    return {
        "digest": digest((s.transfers, s.aggregates)),
        "makespan": repr(s.makespan()),
        "transfers": len(s.transfers),
        "aggregates": len(s.aggregates),
    }


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    **{f"bench_decision_1024_seed{s}": functools.partial(bench_decisions, s) for s in range(3)},
    "round_first_decision_1024_seed0": functools.partial(round_first_decision, 0),
    **{f"plan_seed{s}": functools.partial(seeded_plan, s) for s in range(24)},
}


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict[str, Any]]:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_is_the_recorded_one(name: str, recorded: dict[str, dict[str, Any]]) -> None:
    assert CASES[name]() == recorded[name]


def test_every_recorded_case_is_checked(recorded: dict[str, dict[str, Any]]) -> None:
    assert sorted(recorded) == sorted(CASES)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"] or len(sys.argv) != 3:
        raise SystemExit("usage: test_trees_recorded.py --write PATH")
    import mlfabric.scheduler.policies.trees as planner

    print(f"planner: {planner.__file__}", file=sys.stderr)
    out = {name: make() for name, make in sorted(CASES.items())}
    Path(sys.argv[2]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
