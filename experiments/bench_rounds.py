"""Synchronous rounds under real arrival times: ``stf+tree`` against its yardstick and fair (issue 23).

Each worker computes for its own jittered time (log-normal sigma ``--jitter``, mean 50 ms),
so a round's updates arrive spread over 10-30 ms. Per instance and jitter, in the fluid
simulator through the decision pipeline, three rounds each of

* ``fair`` — every update sent when ready;
* ``stf+tree (as they come)`` — the tree policy with no round membership (what ran before
  issue 23: each decision plans the few updates it sees);
* ``stf+tree`` — the policy as the service runs it: each round planned at its first
  arrival with every member, the missing ones expected by the learned arrival model
  (``policies/arrivals.LearnedArrivals``), aggregates held for them within a bound;
* ``yardstick`` — the same planner told every member's true arrival time
  (``KnownArrivals``): the round planned with every update present at its arrival time.

The *round* is model out to last update in (it includes the compute); the *transfer part*
is the round less the round's first compute time (from the first update ready). Ratios are
per instance of the mean over the rounds; the table gives medians, min-max and how many
instances meet a bound. Instances: those of ``bench_trees.py`` (2-8 racks of 4-8 hosts,
2:1/4:1/8:1, mixed NICs, server ``h0``, 20 MB updates). Also the decision time of a round's
first decision at 1,024 workers (a new policy; 1 update there, 1,022 expected) and of the
next one (warm).

    python experiments/bench_rounds.py --out experiments/results/bench_rounds.md
    python experiments/bench_rounds.py --instances 5 --seeds 0        # quick
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trees import mixed_nics, sim_instance

from mlfabric.scheduler.core.graph import hosts, two_tier
from mlfabric.scheduler.policies.arrivals import KnownArrivals
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, RoundSpec, Snapshot
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.policies.tree_policy import TreePolicy
from mlfabric.scheduler.sim.engine import APPLIED, Simulator
from mlfabric.scheduler.sim.iteration import SyncSGD
from mlfabric.scheduler.sim.workload import ComputeModel

MB = 1_000_000
COMPUTE = 0.05
ITERATIONS = 3
SYSTEMS = ("fair", "stf+tree (as they come)", "stf+tree", "yardstick")


class AsTheyCome:
    """A policy shown no round membership: its decisions plan the updates they see."""

    def __init__(self, policy: Any) -> None:
        self.policy, self.name = policy, policy.name

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        return self.policy.decide(replace(snapshot, rounds={}), pending)


def run_instance(spec: Mapping[str, Any], jitter: float, seed: int) -> dict[str, Any]:
    g = two_tier(spec["racks"], spec["per_rack"], spec["nics"], oversubscription=spec["over"])
    workers = [h for h in hosts(g) if h != "h0"]
    model = ComputeModel(dict.fromkeys(workers, COMPUTE), jitter=jitter, seed=seed)
    table = model.table(ITERATIONS, workers)
    out: dict[str, Any] = {k: spec[k] for k in ("racks", "per_rack", "over")}
    for name in SYSTEMS:
        setup = make_policy("fair" if name == "fair" else "stf+tree", sync=True)
        policy: Any = setup.policy
        if name == "yardstick":
            policy = TreePolicy(arrivals=KnownArrivals(lambda v: table[v]))
        elif name.endswith("(as they come)"):
            policy = AsTheyCome(policy)
        it = SyncSGD(model, iterations=ITERATIONS)
        sim = Simulator(
            g,
            policy,
            it,
            server_host="h0",
            workers=workers,
            update_bytes=20 * MB,
            replan=setup.trigger,
            batch_window=300e-6,
            batch_max_wait=5e-3,
        )
        t0 = time.process_time()
        records = sim.run()
        cpu = time.process_time() - t0
        if not all(r.outcome == APPLIED for r in records) or len(it.makespans) != ITERATIONS:
            raise RuntimeError(f"{name} on {out} jitter {jitter}: not every update applied")
        out[name] = statistics.mean(it.makespans)
        out[f"{name} transfer"] = statistics.mean(
            m - min(table[k].values()) for k, m in enumerate(it.makespans)
        )
        out[f"{name} cpu"] = cpu
    return out


def decision_times(seed: int, repeat: int) -> dict[str, list[float]]:
    """A round's first decision at 1,024 hosts (1 update there, 1,022 expected), then its second.

    Beside them, alternated: the round planned with every update there (the cold decision
    ``bench_trees.py`` measures), the same plan's cost without expected members.
    """
    rng = random.Random(seed)
    names = [f"h{k}" for k in range(32 * 32)]
    g = two_tier(32, 32, mixed_nics(names, rng), oversubscription=4)
    spec = RoundSpec({h: h for h in names[1:]})
    mk = lambda h, t: PendingUpdate(f"u{h}", "j", "s", h, h, "h0", 20 * MB, 1.0, 0, t)  # noqa: E731
    cold, warm, present = [], [], []
    everyone = [mk(h, 0.0) for h in names[1:]]
    for _ in range(repeat):
        t0 = time.process_time()
        DecisionRunner(TreePolicy()).decide(Snapshot(0.0, g), everyone)  # the round all there
        present.append(time.process_time() - t0)
        runner = DecisionRunner(TreePolicy())  # as the service runs it: the runner keeps what gathers
        t0 = time.process_time()
        runner.decide(Snapshot(0.0, g, rounds={("j", "s"): spec}), [mk("h1", 0.0)])
        cold.append(time.process_time() - t0)
        t0 = time.process_time()
        runner.decide(Snapshot(0.001, g, rounds={("j", "s"): spec}), [mk("h2", 0.001)])
        warm.append(time.process_time() - t0)
    return {"cold": cold, "warm": warm, "present": present}


def spread(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def report(rows: Mapping[str, list[dict[str, Any]]], dec: list[dict[str, list[float]]]) -> str:
    lines = [
        "# Synchronous rounds under real arrival times (issue 23)",
        "",
        "Per jitter, over every seed's instances: the ratio of each system's mean round (model out to",
        "last update in, compute included) and of its transfer part (from the round's first update",
        "ready) to the yardstick's (the same planner told the true arrival times); and fair over",
        "`stf+tree` at 4:1. Median [min-max], and the instances within the bound.",
        "",
        "| jitter | seed | instances | stf+tree / yardstick (round) | (transfer part) "
        "| within 15 % (transfer) | as they come / yardstick (transfer) "
        "| fair / stf+tree at 4:1 (round) | >= 2x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, rs in rows.items():
        jitter, seed = key.split("/")
        ratio = [r["stf+tree"] / r["yardstick"] for r in rs]
        transfer = [r["stf+tree transfer"] / r["yardstick transfer"] for r in rs]
        before = [r["stf+tree (as they come) transfer"] / r["yardstick transfer"] for r in rs]
        fair = [r["fair"] / r["stf+tree"] for r in rs if r["over"] == 4]
        lines.append(
            f"| {jitter} | {seed} | {len(rs)} | {spread(ratio, '{:.3f}')} | {spread(transfer, '{:.3f}')} "
            f"| {sum(x <= 1.15 for x in transfer)}/{len(rs)} | {spread(before, '{:.2f}')} "
            f"| {spread(fair)} | {sum(x >= 2 for x in fair)}/{len(fair)} |"
        )
    cold = [x * 1e3 for d in dec for x in d["cold"]]
    warm = [x * 1e3 for d in dec for x in d["warm"]]
    present = [x * 1e3 for d in dec for x in d["present"]]
    lines += [
        "",
        f"Decision time at 1,024 hosts (CPU, ms; {len(cold)} each): a round's first decision (cold policy, "
        f"1 update there, 1,022 expected) {spread(cold, '{:.1f}')}; its next decision "
        f"{spread(warm, '{:.2f}')}; side by side, the round planned with all 1,023 there (cold) "
        f"{spread(present, '{:.1f}')}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jitters", type=float, nargs="+", default=[0.1, 0.2])
    ap.add_argument("--repeat", type=int, default=5, help="decision-time repeats per seed")
    ap.add_argument("--out", type=Path, help="write the markdown report here (and .json beside it)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    rows: dict[str, list[dict[str, Any]]] = {}
    for jitter in args.jitters:
        for seed in args.seeds:
            key = f"{jitter:g}/{seed}"
            rows[key] = [
                run_instance(sim_instance(seed, i), jitter, seed * 1000 + i) for i in range(args.instances)
            ]
            print(f"jitter {jitter:g} seed {seed}: {args.instances} instances", file=sys.stderr)
    dec = [decision_times(seed, args.repeat) for seed in args.seeds]
    text = report(rows, dec) + f"\nTotal benchmark time: {time.monotonic() - started:.0f} s.\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "decision": dec}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
