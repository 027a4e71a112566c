"""Simulated benefit of stf over fair, and of aggregation groups (DESIGN §5, §6).

For 16 to 1,024 workers on two clusters with heterogeneous NICs (a quarter of the workers'
NICs 4x slower) and compute stragglers (a tenth of the workers 3x slower, log-normal jitter):

* ``star``: every host on one switch, 10 Gb/s NICs; the server's NIC is the bottleneck;
* ``two-tier``: racks of 16 hosts, uplinks 4x oversubscribed, the server (h0, rack 0) with
  a 40 Gb/s NIC, so rack uplinks and slow NICs bind as well as the server's ingress;

it runs, with the same seeded workload for every policy, in the fluid simulator
(``mlfabric.scheduler.sim``, the same policy code as the service):

* asynchronous SGD (workers wait for the model; 10 MB updates, 100 ms compute): mean and
  p99 delay and mean completion time, ``stf`` vs ``fair``;
* synchronous SGD: the iteration makespan with aggregation groups (``stf+agg``) and
  without (``stf``; ``fair`` for reference).

Writes ``experiments/results/bench_simulated.{md,json,png}`` (``.quick.*`` with ``--quick``:
16 and 64 workers, fewer iterations). Run::

    python experiments/bench_simulated.py            # minutes (1,024 workers dominate)
    python experiments/bench_simulated.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from mlfabric.scheduler.policies.registry import PolicySetup, make_policy
from mlfabric.scheduler.sim.report import PolicyStats, format_table
from mlfabric.scheduler.sim.scenario import Scenario, cluster, run_scenario
from mlfabric.scheduler.sim.workload import ComputeModel, pick_stragglers

RESULTS = Path(__file__).resolve().parent / "results"


class Preset(TypedDict, total=False):
    """The keyword arguments of :func:`~mlfabric.scheduler.sim.scenario.cluster` a preset sets."""

    nic_bps: float
    server_bps: float
    hosts_per_rack: int
    oversubscription: float


PRESETS: dict[str, Preset] = {
    "star": {"nic_bps": 10e9},
    "two-tier": {"nic_bps": 10e9, "server_bps": 40e9, "hosts_per_rack": 16, "oversubscription": 4.0},
}


def scenario(preset: str, workers: int, mode: str, iterations: int, seed: int) -> Scenario:
    """The benchmark's scenario: heterogeneous NICs, stragglers, seeded."""
    rng = np.random.default_rng(seed)
    c = cluster(preset, workers, slow_fraction=0.25, slow_factor=4.0, rng=rng, **PRESETS[preset])
    mean = pick_stragglers(c.workers, 0.1, 3.0, 0.1, rng)
    return Scenario(
        c, ComputeModel(mean, jitter=0.2, seed=seed), mode=mode, update_bytes=10e6, iterations=iterations
    )


def _progress(label: str) -> Any:
    last = [time.monotonic()]

    def report(sim_time: float, events: int) -> None:
        if time.monotonic() - last[0] > 10:
            last[0] = time.monotonic()
            print(f"    {label}: t={sim_time:.2f}s simulated, {events} events", file=sys.stderr)

    return report


#: (preset, mode) -> pushes per worker (async) or iterations (sync) at 1,024 workers, where
#: every policy decision plans ~1,000 pending updates (STF's cost, not the simulator's)
AT_1024 = {("star", "async"): 2, ("two-tier", "async"): 2, ("star", "sync"): 1, ("two-tier", "sync"): 1}


def _policy(name: str) -> PolicySetup:
    """The policy and its re-plan trigger, as the scheduler service builds them."""
    return make_policy(name, sync=True)


def run(
    sizes: list[int], iterations: dict[str, int], seed: int, checkpoint: Path, done: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every (preset, workers, mode, policy) cell not in ``done``; rows saved after each cell."""
    rows = list(done)
    have = {(r["preset"], r["workers"], r["mode"], r["policy"]) for r in rows}
    for preset in PRESETS:
        for n in sizes:
            for mode, policies in (("async", ("fair", "stf")), ("sync", ("fair", "stf", "stf+agg"))):
                its = iterations[mode] if n < 1024 else AT_1024[(preset, mode)]
                sc = scenario(preset, n, mode, its, seed)
                for name in policies:
                    if (preset, n, mode, name) in have:
                        continue
                    label = f"{preset} n={n} {mode} {name}"
                    policy, replan = _policy(name)
                    s, _ = run_scenario(
                        sc, policy, replan=replan, clock=time.perf_counter, progress=_progress(label)
                    )
                    print(f"  {label}: {s.wall_s:.1f} s wall", file=sys.stderr)
                    rows.append({"preset": preset, "workers": n, "mode": mode, **s.as_dict()})
                    checkpoint.write_text(json.dumps(rows, indent=1))
                stats = [
                    PolicyStats(**{k: v for k, v in r.items() if k not in ("preset", "workers", "mode")})
                    for r in rows
                    if (r["preset"], r["workers"], r["mode"]) == (preset, n, mode)
                ]
                print(f"\n### {preset}, {n} workers, {mode}\n\n{format_table(stats)}\n", file=sys.stderr)
    return rows


def _get(rows: list[dict[str, Any]], preset: str, n: int, mode: str, policy: str, key: str) -> float:
    for r in rows:
        if (r["preset"], r["workers"], r["mode"], r["policy"]) == (preset, n, mode, policy):
            return float(r[key])
    return math.nan


def _cell(rows: list[dict[str, Any]], preset: str, n: int, mode: str) -> Any:
    """``g(policy, key)`` for one (preset, workers, mode) cell."""
    return lambda policy, key: _get(rows, preset, n, mode, policy, key)


def markdown(rows: list[dict[str, Any]], sizes: list[int], note: str) -> str:
    """The summary tables: async stf vs fair, sync with vs without aggregation."""
    out = [
        "# Simulated benefit (fluid simulator, same policy code as the service)",
        "",
        note,
        "",
        "## Asynchronous SGD: stf vs fair",
        "",
        "| cluster | workers | delay mean fair | delay mean stf | ratio | delay p99 fair | delay p99 stf "
        "| completion mean fair (ms) | completion mean stf (ms) | ratio | wall s (fair/stf) |",
        "|" + " --- |" * 11,
    ]
    for preset in PRESETS:
        for n in sizes:
            g = _cell(rows, preset, n, "async")
            out.append(
                f"| {preset} | {n} | {g('fair', 'delay_mean'):.1f} | {g('stf', 'delay_mean'):.1f} "
                f"| {g('stf', 'delay_mean') / g('fair', 'delay_mean'):.2f}x "
                f"| {g('fair', 'delay_p99'):.0f} | {g('stf', 'delay_p99'):.0f} "
                f"| {g('fair', 'completion_mean') * 1e3:.1f} | {g('stf', 'completion_mean') * 1e3:.1f} "
                f"| {g('stf', 'completion_mean') / g('fair', 'completion_mean'):.2f}x "
                f"| {g('fair', 'wall_s'):.1f}/{g('stf', 'wall_s'):.1f} |"
            )
    out += [
        "",
        "## Synchronous SGD: iteration makespan with and without aggregation groups",
        "",
        "| cluster | workers | makespan fair (ms) | makespan stf (ms) | makespan stf+agg (ms) "
        "| stf+agg / stf | completion mean stf (ms) | completion mean stf+agg (ms) |",
        "|" + " --- |" * 8,
    ]
    for preset in PRESETS:
        for n in sizes:
            g = _cell(rows, preset, n, "sync")
            out.append(
                f"| {preset} | {n} | {g('fair', 'makespan_mean') * 1e3:.1f} "
                f"| {g('stf', 'makespan_mean') * 1e3:.1f} | {g('stf+agg', 'makespan_mean') * 1e3:.1f} "
                f"| {g('stf+agg', 'makespan_mean') / g('stf', 'makespan_mean'):.2f}x "
                f"| {g('stf', 'completion_mean') * 1e3:.1f} | {g('stf+agg', 'completion_mean') * 1e3:.1f} |"
            )
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], sizes: list[int], path: Path) -> None:
    """Three panels against the number of workers: mean delay, mean completion, sync makespan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("async", "delay_mean", 1.0, "async: mean delay (versions)", ("fair", "stf")),
        ("async", "completion_mean", 1e3, "async: mean completion time (ms)", ("fair", "stf")),
        ("sync", "makespan_mean", 1e3, "sync: iteration makespan (ms)", ("fair", "stf", "stf+agg")),
    ]
    styles = {"star": "-", "two-tier": "--"}
    colors = {"fair": "tab:blue", "stf": "tab:orange", "stf+agg": "tab:green"}
    for ax, (mode, key, scale, title, policies) in zip(axes, panels, strict=True):
        for preset in PRESETS:
            for policy in policies:
                ys = [_get(rows, preset, n, mode, policy, key) * scale for n in sizes]
                ax.plot(
                    sizes, ys, styles[preset], color=colors[policy], marker="o", label=f"{policy} ({preset})"
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("mlfabric simulated benefit: heterogeneous NICs (25% at 1/4), stragglers (10% at 3x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the results."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="16 and 64 workers, fewer iterations")
    parser.add_argument("--sizes", help="comma-separated worker counts (default 16,64,256,1024)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument(
        "--reuse", action="store_true", help="keep the cells already in the results JSON (resume a run)"
    )
    args = parser.parse_args(argv)
    sizes = [16, 64] if args.quick else [16, 64, 256, 1024]
    if args.sizes:
        sizes = [int(x) for x in args.sizes.split(",")]
    iterations = {"async": 3, "sync": 2} if args.quick else {"async": 4, "sync": 2}
    stem = "bench_simulated.quick" if args.quick else "bench_simulated"
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.out / f"{stem}.json"
    done = json.loads(checkpoint.read_text()) if args.reuse and checkpoint.exists() else []
    t0 = time.perf_counter()
    rows = run(sizes, iterations, args.seed, checkpoint, done)
    wall = time.perf_counter() - t0 + sum(r["wall_s"] for r in done)
    note = (
        f"Workers {sizes}; async: {iterations['async']} pushes per worker, sync: {iterations['sync']} "
        f"iterations; at 1,024 workers: {', '.join(f'{p} {m} {k}' for (p, m), k in AT_1024.items())} "
        f"(STF's decisions over ~1,000 pending updates on "
        f"these graphs dominate the run time). 10 MB updates, 100 ms compute, seed {args.seed}. "
        f"Delay = server version at apply - base version; completion = ready at the worker to "
        f"arrival at the server. Policy + simulation wall time {wall:.0f} s. Command: "
        f"`python experiments/bench_simulated.py{' --quick' if args.quick else ''}`."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, sizes, note)
    (args.out / f"{stem}.md").write_text(md)
    plot(rows, sizes, args.out / f"{stem}.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
