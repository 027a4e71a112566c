"""Update ordering on the namespace testbed: stf vs fair behind one bottleneck (DESIGN §4, §6).

Workers with heterogeneous uplinks push asynchronously to one server whose ingress is the
bottleneck, through the real scheduler and daemons (one per network namespace). Network
time-sharing (MLfabric Fig. 1, DESIGN §4) pays off when transfers compete at the bottleneck
while workers have compute to overlap, so each worker keeps a window of ``--window``
outstanding pushes and computes between them: ``get`` -> compute -> ``push`` (asynchronous),
starting an iteration only when fewer than ``--window`` of its pushes are unresolved. Compute
times are heterogeneous (a CS setting: ``--stragglers`` workers compute ``--slowdown`` times
longer). For each policy: mean, p50 and p99 update delay (server version at apply minus base
version), push completion times (push call to APPLIED/DROPPED, at the worker), updates
applied and dropped (tau_max), the daemons' per-transfer byte-movement times (their
transfer reports), and CDFs.

    python experiments/testbed_ordering.py --quick    # 4 workers, 50 Mbit/s server, 15 s per policy
    python experiments/testbed_ordering.py            # 8 workers, 100 Mbit/s server, 60 s per policy

Writes experiments/results/testbed_ordering[_quick].{csv,png,md} (the workers' push results)
and ``..._transfers.csv`` (the daemons' transfer reports). Needs root, ip, tc.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.scheduler.core.graph import load_topology
from mlfabric.testbed.cluster import Testbed
from mlfabric.testbed.launch import TestbedCluster, write_transfer_csv
from mlfabric.testbed.netns import SubprocessRunner, missing_prerequisites, new_prefix, sweep_stale
from mlfabric.testbed.schedule import compute_delays
from mlfabric.testbed.topologies import bottleneck_star, to_toml

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("fair", "stf")
UPLINKS_FULL = [200, 200, 100, 100, 50, 50, 25, 25]  # Mbit/s
UPLINKS_QUICK = [200, 100, 50, 25]


def run_policy(
    testbed: Testbed,
    topo: Path,
    policy: str,
    delays: dict[str, float],
    args: argparse.Namespace,
    workdir: Path,
) -> tuple[list[dict], list[dict], dict]:
    """One policy: start scheduler and daemons, the server, the workers.

    Returns the workers' push rows, the daemons' transfer reports and the server's summary.
    """
    roles = [sys.executable, "-m", "mlfabric.testbed.roles"]
    common = ["--job", "order", "--update-bytes", str(args.update_bytes)]
    server_out = workdir / "ps.json"
    with TestbedCluster(testbed, topo, policy=policy, workdir=workdir) as cluster:
        ready = workdir / "server.ready"
        server_argv = [*roles, "server", *common, "--name", "ps", "--tau-max", str(args.tau_max)]
        server_argv += ["--out", str(server_out), "--ready-file", str(ready)]
        server = cluster.spawn("ps", server_argv)
        deadline = time.monotonic() + 60
        while not ready.exists():
            cluster.check_alive()
            if server.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not register:\n{server.log_tail()}")
            time.sleep(0.05)
        procs = []
        for i, (w, compute) in enumerate(delays.items()):
            argv = [*roles, "worker", *common, "--name", w, "--server", "ps", "--seed", str(i)]
            argv += ["--duration", str(args.duration), "--compute-delay", str(compute)]
            argv += ["--window", str(args.window), "--out", str(workdir / f"{w}.csv")]
            procs.append(cluster.spawn(w, argv))
        for proc in procs:
            cluster.wait(proc, timeout=args.duration + 120)
        server.popen.terminate()
        cluster.wait(server, timeout=30)
    transfers = [dict(r, policy=policy) for r in cluster.transfer_reports()]
    rows = []
    for w in delays:
        with (workdir / f"{w}.csv").open() as f:
            rows += [dict(r, policy=policy) for r in csv.DictReader(f)]
    return rows, transfers, json.loads(server_out.read_text())


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize(rows: list[dict], transfers: list[dict], server: dict, policy: str) -> dict:
    """Delay, completion and transfer statistics of one policy's run."""
    applied = [r for r in rows if r["status"] == "APPLIED"]
    delays = [int(r["delay"]) for r in applied]
    seconds = [float(r["seconds"]) for r in rows]
    span = max(float(r["end"]) for r in rows) - min(float(r["start"]) for r in rows)
    moved = [t for t in transfers if t["ok"]]
    movement = [t["end"] - t["start"] for t in moved]
    return {
        "policy": policy,
        "pushes": len(rows),
        "applied": len(applied),
        "dropped": len(rows) - len(applied),
        "server_version": server["version"],
        "delay_mean": mean(delays),
        "delay_p50": pct(delays, 50),
        "delay_p99": pct(delays, 99),
        "completion_mean_s": mean(seconds),
        "completion_p50_s": pct(seconds, 50),
        "completion_p99_s": pct(seconds, 99),
        "applied_mbps": sum(int(r["bytes"]) for r in applied) * 8 / span / 1e6,
        "transfers": len(transfers),
        "transfer_mean_s": mean(movement),
        "transfer_p99_s": pct(movement, 99),
    }


def per_worker(rows: list[dict], policy: str, worker: str) -> tuple[int, int, float, float]:
    """Pushes, applied, mean completion (s) and mean delay of one worker under one policy."""
    mine = [r for r in rows if r["policy"] == policy and r["worker"] == worker]
    applied = [int(r["delay"]) for r in mine if r["status"] == "APPLIED"]
    return len(mine), len(applied), mean([float(r["seconds"]) for r in mine]), mean(applied)


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if len(values):
        xs = np.sort(values)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)


def plot(rows: list[dict], transfers: list[dict], policies: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy]
        _cdf(axes[0], [int(r["delay"]) for r in mine if r["status"] == "APPLIED"], policy)
        _cdf(axes[1], [float(r["seconds"]) for r in mine], policy)
        moved = [t["end"] - t["start"] for t in transfers if t["policy"] == policy and t["ok"]]
        _cdf(axes[2], moved, policy)
    axes[0].set_xlabel("update delay (versions) of applied updates")
    axes[1].set_xlabel("push completion time (s), push -> resolved")
    axes[2].set_xlabel("transfer time (s), sender's daemon report (wire time)")
    for ax in axes:
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("windowed asynchronous pushes behind one bottleneck: stf vs fair (namespace testbed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def write_summary(
    stats: list[dict],
    rows: list[dict],
    args: argparse.Namespace,
    uplinks: dict[str, int],
    delays: dict[str, float],
    notes: list[str],
    path: Path,
) -> None:
    by = {s["policy"]: s for s in stats}
    computes = ", ".join(f"{w} {delays[w]:g}" for w in delays)
    lines = [
        f"# Testbed ordering: stf vs fair ({'quick' if args.quick else 'full'})",
        "",
        f"{len(uplinks)} workers with uplinks {list(uplinks.values())} Mbit/s push "
        f"{args.update_bytes / 1e6:g} MB updates to one server whose {args.server_mbps:g} Mbit/s link is "
        f"the bottleneck; {args.duration:g} s per policy; tau_max {args.tau_max}. Each worker loops "
        f"get -> compute -> push (asynchronous), keeping up to {args.window} pushes outstanding. "
        f"Compute per iteration (s; {args.stragglers} straggler(s) at {args.slowdown:g}x, seed "
        f"{args.seed}): {computes}. Real scheduler and daemons, one per network namespace, "
        "tbf-shaped links.",
        "",
        "Delay: server version at apply minus base version. Completion: push call to resolution, "
        "at the worker. Transfer: the sending daemon's transfer report, end - start: the longer of "
        "the sender's socket writes and the receiver's first-to-last byte (sent back in the ACK), "
        "so it follows the wire, not the local socket buffers.",
        "",
        "| policy | pushes | applied | dropped | delay mean | p50 | p99 | completion mean (s) | p50 | p99 "
        "| applied Mbit/s | transfers | transfer mean (s) | p99 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in stats:
        lines.append(
            f"| {s['policy']} | {s['pushes']} | {s['applied']} | {s['dropped']} | {s['delay_mean']:.2f} | "
            f"{s['delay_p50']:.0f} | {s['delay_p99']:.1f} | {s['completion_mean_s']:.3f} | "
            f"{s['completion_p50_s']:.3f} | {s['completion_p99_s']:.3f} | {s['applied_mbps']:.1f} | "
            f"{s['transfers']} | {s['transfer_mean_s']:.3f} | {s['transfer_p99_s']:.3f} |"
        )
    if "fair" in by and "stf" in by:
        f, s = by["fair"], by["stf"]
        lines += [
            "",
            f"stf / fair: mean delay {_ratio(s['delay_mean'], f['delay_mean'])}, p99 delay "
            f"{_ratio(s['delay_p99'], f['delay_p99'])}, mean completion "
            f"{_ratio(s['completion_mean_s'], f['completion_mean_s'])}, p99 completion "
            f"{_ratio(s['completion_p99_s'], f['completion_p99_s'])}, mean transfer time "
            f"{_ratio(s['transfer_mean_s'], f['transfer_mean_s'])}, applied "
            f"{_ratio(s['applied'], f['applied'])}.",
        ]
    policies = [s["policy"] for s in stats]
    lines += [
        "",
        "Per worker (pushes / applied / mean completion s / mean delay):",
        "",
        "| worker | uplink Mbit/s | compute s | " + " | ".join(policies) + " |",
        "| --- | ---: | ---: | " + " | ".join("---" for _ in policies) + " |",
    ]
    for w in uplinks:
        cells = []
        for policy in policies:
            n, a, c, d = per_worker(rows, policy, w)
            cells.append(f"{n} / {a} / {c:.3f} / {d:.1f}")
        lines.append(f"| {w} | {uplinks[w]} | {delays[w]:g} | " + " | ".join(cells) + " |")
    lines += ["", *(f"Note: {n}" for n in notes)]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: 4 workers, 15 s per policy")
    parser.add_argument("--duration", type=float, help="seconds per policy (15 quick, 60 full)")
    parser.add_argument("--update-bytes", type=int, default=2_000_000)
    parser.add_argument("--server-mbps", type=float, help="bottleneck rate (50 quick, 100 full)")
    parser.add_argument("--window", type=int, default=2, help="pushes outstanding per worker")
    parser.add_argument("--compute-delay", type=float, default=1.0, help="compute s per iteration")
    parser.add_argument(
        "--stragglers", type=int, help="workers computing --slowdown x longer (1 quick, 2 full)"
    )
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1, help="seed of the straggler draw")
    parser.add_argument("--tau-max", type=int, default=16)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    missing = missing_prerequisites()
    if missing:
        print("testbed unavailable: " + "; ".join(missing), file=sys.stderr)
        return 2
    args.duration = args.duration or (15.0 if args.quick else 60.0)
    args.server_mbps = args.server_mbps or (50.0 if args.quick else 100.0)
    if args.stragglers is None:
        args.stragglers = 1 if args.quick else 2
    uplink_list = UPLINKS_QUICK if args.quick else UPLINKS_FULL
    uplinks = {f"w{i}": rate for i, rate in enumerate(uplink_list)}
    delays = compute_delays(
        list(uplinks),
        base=args.compute_delay,
        stragglers=args.stragglers,
        slowdown=args.slowdown,
        rng=random.Random(args.seed),
    )
    policies = args.policies.split(",")
    name = "testbed_ordering" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    sweep_stale(SubprocessRunner())
    rows: list[dict] = []
    transfers: list[dict] = []
    stats = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-ordering-") as tmp:
        topo = Path(tmp) / "topology.toml"
        topo.write_text(to_toml(bottleneck_star("ps", args.server_mbps, uplinks)))
        with Testbed(load_topology(topo), new_prefix(random.Random())) as testbed:
            for policy in policies:
                workdir = Path(tmp) / policy
                policy_rows, policy_transfers, server = run_policy(
                    testbed, topo, policy, delays, args, workdir
                )
                rows += policy_rows
                transfers += policy_transfers
                stats.append(summarize(policy_rows, policy_transfers, server, policy))
                print(json.dumps(stats[-1]), flush=True)
            notes = list(testbed.notes)
    with open(args.out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["policy", *(k for k in rows[0] if k != "policy")])
        writer.writeheader()
        writer.writerows(rows)
    write_transfer_csv(args.out / f"{name}_transfers.csv", transfers, leading=["policy"])
    plot(rows, transfers, policies, args.out / f"{name}.png")
    write_summary(stats, rows, args, uplinks, delays, notes, args.out / f"{name}.md")
    print((args.out / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
