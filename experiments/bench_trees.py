"""Aggregation trees (``stf+tree``) against fair, ``stf+agg`` and the ILP (DESIGN §5).

Three measurements, each over several master seeds:

1. **Simulator** — synchronous rounds on seeded two-tier graphs (2-8 racks of 4-8 hosts,
   2:1, 4:1 or 8:1 oversubscribed uplinks, mixed NICs: 70 % 10 Gbit/s, 20 % 25 Gbit/s,
   10 % 2.5 Gbit/s), server ``h0``, every other host a worker with a 20 MB update, compute
   time 0 (every update ready at once). Each policy runs in the fluid simulator through
   the decision pipeline (``make_policy(name, sync=True)``); the makespan is the mean of two
   rounds. Also the offline lower bound (``plan/bounds.py``, every host but the server an
   aggregator). Targets: ``stf+tree`` >= 2x better than fair at 4:1.
2. **ILP** — small slot-aligned makespan instances (``two_tier_instance``: 6-8 workers,
   1-2 aggregator hosts of their own, 2-3 racks, every link 10 Gbit/s so a rack's uplink
   is one NIC) solved by ``solve_ilp`` within a short limit, with one level (direct or one
   aggregator) and, where there are two aggregators, two levels (``levels=2``: an aggregate
   summed into another aggregator's, the tree's plan space); the ILP's best plan is the
   better of the two. ``plan_tree`` (and stf, stf+agg, fair) planned on the same instance
   with the same aggregators. Target: the tree within 10 % of the ILP's best plan.
3. **Decision time** — ``TreePolicy.decide`` for 1,023 pending updates on 32 racks x 32
   hosts (4:1, mixed NICs), cold (a new policy object) and warm (paths and routes kept). Target
   <= 50 ms.

Run (about 6-8 minutes on the shared 2-core machine; the ILP gets ``--ilp-limit`` s per solve)::

    python experiments/bench_trees.py --out experiments/results/bench_trees.md
    python experiments/bench_trees.py --instances 10 --seeds 0 --ilp-instances 2   # quick

``--only decision`` re-measures the decision time alone; with ``--out`` it replaces the
decision part of the JSON beside the report and rewrites the report from it (sections 1
and 2 as they were measured, section 3 noting the command that re-measured it)::

    python experiments/bench_trees.py --only decision --out experiments/results/bench_trees.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.core.graph import hosts, two_tier
from mlfabric.scheduler.core.schedule import Update, is_aggregate_id
from mlfabric.scheduler.plan.bounds import makespan_bound
from mlfabric.scheduler.plan.heuristics import fair_schedule, heuristic_plans, warm_start
from mlfabric.scheduler.plan.ilp import solve_ilp
from mlfabric.scheduler.plan.instance import objective_of, parse_instance, two_tier_instance
from mlfabric.scheduler.policies.base import PendingUpdate, Snapshot
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.policies.tree_policy import TreePolicy
from mlfabric.scheduler.policies.trees import plan_tree
from mlfabric.scheduler.sim.engine import APPLIED, Simulator
from mlfabric.scheduler.sim.iteration import SyncSGD
from mlfabric.scheduler.sim.workload import ComputeModel

MB = 1_000_000
POLICIES = ("fair", "stf", "stf+agg", "stf+tree")
OVERSUBSCRIPTION = (2, 4, 8)


def mixed_nics(names: list[str], rng: random.Random) -> dict[str, float]:
    """70 % 10 Gbit/s, 20 % 25 Gbit/s, 10 % 2.5 Gbit/s; the server (first) never slow."""
    out = {}
    for i, h in enumerate(names):
        x = rng.random()
        out[h] = 25e9 if x < 0.2 else (2.5e9 if x > 0.9 and i > 0 else 10e9)
    return out


def sim_instance(seed: int, i: int) -> dict[str, Any]:
    rng = random.Random(seed * 100_003 + i)
    racks, per_rack = rng.randint(2, 8), rng.randint(4, 8)
    over = OVERSUBSCRIPTION[i % len(OVERSUBSCRIPTION)]
    names = [f"h{k}" for k in range(racks * per_rack)]
    return {"racks": racks, "per_rack": per_rack, "over": over, "nics": mixed_nics(names, rng)}


def run_sim(spec: dict[str, Any]) -> dict[str, Any]:
    g = two_tier(spec["racks"], spec["per_rack"], spec["nics"], oversubscription=spec["over"])
    workers = [h for h in hosts(g) if h != "h0"]
    out: dict[str, Any] = {k: spec[k] for k in ("racks", "per_rack", "over")}
    for name in POLICIES:
        setup = make_policy(name, sync=True)
        it = SyncSGD(ComputeModel(dict.fromkeys(workers, 0.0)), iterations=2)
        sim = Simulator(
            g, setup.policy, it, server_host="h0", workers=workers, update_bytes=20 * MB, replan=setup.trigger
        )
        t0 = time.process_time()
        records = sim.run()
        if not all(r.outcome == APPLIED for r in records) or len(it.makespans) != 2:
            raise RuntimeError(f"{name} on {out}: not every update applied")
        out[name] = statistics.mean(it.makespans)
        out[f"{name} cpu"] = time.process_time() - t0
    us = [Update(f"u{w}", w, "h0", 20 * MB) for w in workers]
    out["bound"] = makespan_bound(g, us, "h0", aggregators=workers).value
    plan = plan_tree(g, us)
    check_schedule(g, plan, updates=us)
    out["tree plan"] = plan.makespan()
    out["levels"] = 2 if any(is_aggregate_id(m) for a in plan.aggregates for m in a.members) else 1
    return out


def run_ilp(seed: int, i: int, limit: float) -> dict[str, Any]:
    rng = random.Random(seed * 7919 + i)
    data = two_tier_instance(
        rng, rng.choice([6, 8]), rng.choice([1, 2]), racks=rng.choice([2, 3]), objective="makespan"
    )
    inst = parse_instance(data)
    updates = list(inst.updates)
    heur = heuristic_plans(inst)
    hint = warm_start(inst, heur.values())
    out: dict[str, Any] = {"workers": len(updates), "aggregators": len(inst.aggregators)}
    # levels 2 (an aggregate into another aggregator) needs two aggregators; with one it is level 1
    for levels in (1, 2) if len(inst.aggregators) > 1 else (1,):
        result = solve_ilp(inst, hint=hint, time_limit=limit, workers=2, seed=seed, levels=levels)
        assert result.schedule is not None
        check_schedule(inst.graph, result.schedule, updates=updates)
        out[f"ilp{levels}"] = result.objective
        out[f"ilp{levels} status"] = result.status
        out[f"ilp{levels} bound"] = result.bound
        out[f"ilp{levels} seconds"] = result.wall_seconds
        out[f"ilp{levels} nests"] = any(
            is_aggregate_id(m) for a in result.schedule.aggregates for m in a.members
        )
    out["ilp"] = min(out.get("ilp1", math.inf), out.get("ilp2", math.inf))
    tree = plan_tree(inst.graph, updates, aggregators=list(inst.aggregators))
    check_schedule(inst.graph, tree, updates=updates)
    out["bound"] = makespan_bound(inst.graph, updates, inst.server, aggregators=inst.aggregators).value
    out["tree"] = objective_of(inst, tree)
    out["nested"] = any(is_aggregate_id(m) for a in tree.aggregates for m in a.members)
    out["stf"] = objective_of(inst, heur["stf"])
    out["stf+agg"] = objective_of(inst, heur.get("aggregation", heur["stf"]))
    out["fair"] = objective_of(inst, fair_schedule(inst))
    return out


def decision_times(seed: int, repeat: int) -> dict[str, Any]:
    rng = random.Random(seed)
    names = [f"h{k}" for k in range(32 * 32)]
    g = two_tier(32, 32, mixed_nics(names, rng), oversubscription=4)
    pending = [PendingUpdate(f"u{h}", "j", "s", h, h, "h0", 20 * MB, 1.0, 0, 0.0) for h in names[1:]]
    snap = Snapshot(0.0, g)
    cold, warm, wall = [], [], []
    for _ in range(repeat):
        policy = TreePolicy()
        t0, w0 = time.process_time(), time.perf_counter()
        d = policy.decide(snap, pending)
        cold.append(time.process_time() - t0)
        wall.append(time.perf_counter() - w0)
        t0 = time.process_time()
        policy.decide(snap, pending[:0] + pending)  # same round again (the tree above is not started)
        warm.append(time.process_time() - t0)
    return {"cold": cold, "warm": warm, "wall": wall, "sends": len(d.sends), "aggregates": len(d.aggregates)}


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def _ratio_row(label: str, rows: list[dict[str, Any]]) -> str:
    cells = [spread([r[name] / r["stf+tree"] for r in rows]) for name in POLICIES if name != "stf+tree"]
    cells.append(spread([r["stf+tree"] / r["bound"] for r in rows]))
    return f"| {label} | {len(rows)} | " + " | ".join(cells) + f" | {sum(r['levels'] == 2 for r in rows)} |"


def report(
    sims: dict[int, list[dict[str, Any]]],
    ilps: list[dict[str, Any]],
    dec: list[dict[str, Any]],
    decision_note: str = "",
) -> str:
    lines = [
        "# Aggregation trees (stf+tree) vs fair, stf, stf+agg and the ILP",
        "",
        "Reproduce: `python experiments/bench_trees.py --out experiments/results/bench_trees.md` "
        "(module docstring: instances, policies, limits). Simulator: two-tier graphs of 2-8 racks x 4-8 "
        "hosts, 2:1/4:1/8:1 uplinks, NICs 70 % 10, 20 % 25, 10 % 2.5 Gbit/s, server h0, 20 MB per "
        "worker, all ready at once, mean of 2 synchronous rounds per policy. ILP: `two_tier_instance` "
        "(one NIC per rack uplink, aggregators on hosts of their own, 1-3 slot updates ready at 0-3 "
        "slots), CP-SAT with 2 workers, one level (direct or one aggregator) and, with two aggregators, "
        "two levels (`plan/ilp_relays.py`: an aggregate into another aggregator, the tree's plan "
        "space), each from the better of the stf/stf+agg plans. 2-core machine shared with other jobs "
        "(load average about 15-28 during the runs).",
        "",
    ]
    n = sum(len(v) for v in sims.values())
    others = [name for name in POLICIES if name != "stf+tree"]
    lines += [
        f"## 1. Simulator: synchronous rounds, {n} instances ({len(sims)} seeds x {n // max(1, len(sims))})",
        "",
        "Round makespan of each policy / stf+tree's (higher = stf+tree better), and stf+tree / the "
        "lower bound; median [min-max] over the instances. Nested: stf+tree's offline plan sums an "
        "aggregate into another.",
        "",
        "| oversubscription | instances | "
        + " | ".join(f"{p} / tree" for p in others)
        + " | bound / tree | nested |",
        "|---|---|" + "---|" * (len(others) + 2),
    ]
    rows = [r for v in sims.values() for r in v]
    for over in OVERSUBSCRIPTION:
        lines.append(_ratio_row(f"{over}:1", [r for r in rows if r["over"] == over]))
    lines.append(_ratio_row("all", rows))
    lines += ["", "Per seed, medians:", ""]
    lines += [
        "| seed | fair / tree at 4:1 | stf / tree | stf+agg / tree | tree / bound |",
        "|---|---|---|---|---|",
    ]
    for seed, v in sims.items():
        four = [r["fair"] / r["stf+tree"] for r in v if r["over"] == 4]
        lines.append(
            f"| {seed} | {statistics.median(four):.2f} | "
            f"{statistics.median([r['stf'] / r['stf+tree'] for r in v]):.2f} | "
            f"{statistics.median([r['stf+agg'] / r['stf+tree'] for r in v]):.2f} | "
            f"{statistics.median([r['stf+tree'] / r['bound'] for r in v]):.2f} |"
        )
    sim_vs_plan = [r["stf+tree"] / r["tree plan"] for r in rows]
    lines += ["", f"Simulated stf+tree round / its offline plan: {spread(sim_vs_plan)}.", ""]
    lines += [
        f"## 2. ILP: {len(ilps)} slot-aligned makespan instances",
        "",
        "Makespans (s); ILP best = the better of the one- and two-level solves; each heuristic / ILP "
        "best (1.00 = as good).",
        "",
        "| workers | aggs | ILP 1 level | ILP 2 levels | ILP best | bound (ours / ILP's) | tree | tree nests"
        " | tree / ILP | stf+agg / ILP | stf / ILP | fair / ILP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def solve(r: dict[str, Any], levels: int) -> str:
        if f"ilp{levels}" not in r:
            return "= 1 level"
        return f"{r[f'ilp{levels}']:.4g} {r[f'ilp{levels} status'][:3]}" + (
            " (nests)" if r[f"ilp{levels} nests"] else ""
        )

    for r in ilps:
        best = max(r["ilp1 bound"], r.get("ilp2 bound", 0.0))
        lines.append(
            f"| {r['workers']} | {r['aggregators']} | {solve(r, 1)} | {solve(r, 2)} | {r['ilp']:.4g} "
            f"| {r['bound']:.4g} / {best:.4g} | {r['tree']:.4g} | {'yes' if r['nested'] else 'no'} "
            f"| {r['tree'] / r['ilp']:.3f} | {r['stf+agg'] / r['ilp']:.3f} | {r['stf'] / r['ilp']:.3f} "
            f"| {r['fair'] / r['ilp']:.3f} |"
        )
    lines += [
        "",
        "| heuristic | / ILP best: median [min-max] | within 10 % | better than ILP |",
        "|---|---|---|---|",
    ]
    for name in ("tree", "stf+agg", "stf", "fair"):
        ratios = [r[name] / r["ilp"] for r in ilps]
        lines.append(
            f"| {name} | {spread(ratios)} | {sum(x <= 1.10 + 1e-9 for x in ratios)}/{len(ratios)} "
            f"| {sum(x < 1 - 1e-9 for x in ratios)} |"
        )
    targets = _targets(rows, ilps, dec)
    lines += ["", "## 3. Decision time, 1,023 pending updates, 32 x 32 hosts (4:1, mixed NICs)", ""]
    if decision_note:
        lines += [decision_note, ""]
    cold = [x * 1e3 for d in dec for x in d["cold"]]
    warm = [x * 1e3 for d in dec for x in d["warm"]]
    wall = [x * 1e3 for d in dec for x in d["wall"]]
    lines += [
        "CPU time of `TreePolicy.decide` (the machine is shared: wall time of the cold decision also shown).",
        "",
        "| | median (ms) | min (ms) | max (ms) |",
        "|---|---|---|---|",
        f"| cold (new policy), CPU | {statistics.median(cold):.1f} | {min(cold):.1f} | {max(cold):.1f} |",
        f"| cold (new policy), wall | {statistics.median(wall):.1f} | {min(wall):.1f} | {max(wall):.1f} |",
        f"| warm (same policy: paths and routes kept), CPU | {statistics.median(warm):.1f} | {min(warm):.1f} "
        f"| {max(warm):.1f} |",
        "",
        f"Decision: {dec[0]['sends']} sends, {dec[0]['aggregates']} aggregates.",
        "",
        "## Targets",
        "",
        *targets,
    ]
    return "\n".join(lines) + "\n"


def _targets(
    rows: list[dict[str, Any]], solved: list[dict[str, Any]], dec: list[dict[str, Any]]
) -> list[str]:
    four = [r["fair"] / r["stf+tree"] for r in rows if r["over"] == 4]
    out = [
        f"* >= 2x better than fair at 4:1: median {statistics.median(four):.2f}x, "
        f"{sum(x >= 2 for x in four)}/{len(four)} instances at >= 2x "
        f"({'met' if statistics.median(four) >= 2 else 'not met'} at the median).",
    ]
    if solved:
        ratios = [r["tree"] / r["ilp"] for r in solved]
        within = sum(x <= 1.10 + 1e-9 for x in ratios)
        out.append(
            f"* within 10 % of the ILP's best plan (one or two levels): {within}/{len(solved)} instances, "
            f"median {(statistics.median(ratios) - 1) * 100:+.0f} %, worst {(max(ratios) - 1) * 100:+.0f} % "
            f"({'met' if within == len(solved) else 'not met on every instance'})."
        )
    cpu = [x * 1e3 for d in dec for x in d["cold"]]
    out.append(
        f"* decision for 1,024 workers <= 50 ms: median {statistics.median(cpu):.0f} ms CPU, "
        f"best {min(cpu):.0f} ms ({'met' if statistics.median(cpu) <= 50 else 'not met'} at the median "
        "on this loaded machine)."
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=50, help="simulator instances per seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--ilp-instances", type=int, default=4, help="ILP instances per seed")
    ap.add_argument("--ilp-limit", type=float, default=10.0, help="ILP time limit (s) per instance")
    ap.add_argument("--repeat", type=int, default=5, help="decision-time repeats per seed")
    ap.add_argument("--out", type=Path, help="write the markdown report here (and .json beside it)")
    ap.add_argument("--from-json", type=Path, help="rewrite the report from a previous run's JSON")
    ap.add_argument(
        "--only",
        choices=["decision"],
        help="measure only this part; with --out, replace it in the JSON beside the report and rewrite both",
    )
    args = ap.parse_args(argv)
    if args.only == "decision":
        return _only_decision(args)
    if args.from_json is not None:
        doc = json.loads(args.from_json.read_text())
        text = report(
            {int(k): v for k, v in doc["sim"].items()},
            doc["ilp"],
            doc["decision"],
            doc.get("decision_note", ""),
        )
        print(text)
        if args.out is not None:
            old = args.out.read_text() if args.out.exists() else ""
            tail = old[old.index("\nTotal benchmark time") :] if "\nTotal benchmark time" in old else ""
            args.out.write_text(text + tail)
        return 0
    started = time.monotonic()
    sims: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for seed in args.seeds:
        for i in range(args.instances):
            sims[seed].append(run_sim(sim_instance(seed, i)))
        print(f"seed {seed}: {len(sims[seed])} simulated instances", file=sys.stderr)
    ilps = [run_ilp(seed, i, args.ilp_limit) for seed in args.seeds for i in range(args.ilp_instances)]
    dec = [decision_times(seed, args.repeat) for seed in args.seeds]
    text = report(sims, ilps, dec)
    text += (
        f"\nTotal benchmark time: {time.monotonic() - started:.0f} s (ILP limit {args.ilp_limit:g} s each).\n"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)
        doc = {"sim": sims, "ilp": ilps, "decision": dec}
        args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _only_decision(args: argparse.Namespace) -> int:
    """Measure the decision time alone; with ``--out``, replace it in the previous run's JSON and report."""
    started = time.monotonic()
    dec = [decision_times(seed, args.repeat) for seed in args.seeds]
    cold = [x * 1e3 for d in dec for x in d["cold"]]
    warm = [x * 1e3 for d in dec for x in d["warm"]]
    print(f"cold CPU {spread(cold)} ms, warm CPU {spread(warm)} ms ({len(cold)} decisions each)")
    if args.out is None:
        return 0
    path = args.out.with_suffix(".json")
    if not path.exists():
        raise SystemExit(f"--only decision --out {args.out}: no {path} of a full run to update")
    doc = json.loads(path.read_text())
    seeds = " ".join(str(s) for s in args.seeds)
    doc["decision"] = dec
    doc["decision_note"] = (
        f"Re-measured separately on {time.strftime('%Y-%m-%d', time.gmtime())} (sections 1 and 2 are "
        f"from the full run): `python experiments/bench_trees.py --only decision --seeds {seeds} "
        f"--repeat {args.repeat} --out {args.out}`, {time.monotonic() - started:.0f} s, load average "
        f"{os.getloadavg()[0]:.0f} on the 2 shared cores."
    )
    path.write_text(json.dumps(doc, indent=1) + "\n")
    text = report({int(k): v for k, v in doc["sim"].items()}, doc["ilp"], dec, doc["decision_note"])
    old = args.out.read_text() if args.out.exists() else ""
    tail = old[old.index("\nTotal benchmark time") :] if "\nTotal benchmark time" in old else ""
    args.out.write_text(text + tail)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
