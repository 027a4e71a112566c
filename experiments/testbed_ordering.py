"""Update ordering on the namespace testbed: stf vs fair behind one bottleneck (issue 5, exp. 2).

Workers with heterogeneous uplinks push asynchronously to one server whose link is the
bottleneck, through the real scheduler and daemons (one per network namespace). Each worker
loops ``get`` -> compute (a fixed delay) -> ``push`` -> wait. For each policy: mean, p50 and
p99 update delay (server version at apply minus base version), push completion times
(push to APPLIED/DROPPED), updates applied and dropped (tau_max), and the CDFs.

    python experiments/testbed_ordering.py --quick    # 4 workers, 15 s per policy
    python experiments/testbed_ordering.py            # 8 workers, 60 s per policy

Writes experiments/results/testbed_ordering[_quick].{csv,png,md}. Needs root, ip, tc.
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

import numpy as np

from mlfabric.scheduler.graph import load_topology
from mlfabric.testbed.cluster import Testbed
from mlfabric.testbed.launch import TestbedCluster
from mlfabric.testbed.netns import SubprocessRunner, missing_prerequisites, new_prefix, sweep_stale
from mlfabric.testbed.topologies import bottleneck_star, to_toml

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("fair", "stf")
UPLINKS_FULL = [200, 200, 100, 100, 50, 50, 25, 25]  # Mbit/s
UPLINKS_QUICK = [200, 100, 50, 25]


def run_policy(
    testbed: Testbed, topo: Path, policy: str, workers: list[str], args: argparse.Namespace, workdir: Path
) -> tuple[list[dict], dict]:
    """One policy: start scheduler and daemons, the server, the workers; return the push rows."""
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
        for i, w in enumerate(workers):
            argv = [*roles, "worker", *common, "--name", w, "--server", "ps", "--seed", str(i)]
            argv += ["--duration", str(args.duration), "--compute-delay", str(args.compute_delay)]
            argv += ["--out", str(workdir / f"{w}.csv")]
            procs.append(cluster.spawn(w, argv))
        for proc in procs:
            cluster.wait(proc, timeout=args.duration + 120)
        server.popen.terminate()
        cluster.wait(server, timeout=30)
    rows = []
    for w in workers:
        with (workdir / f"{w}.csv").open() as f:
            rows += [dict(r, policy=policy) for r in csv.DictReader(f)]
    return rows, json.loads(server_out.read_text())


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(rows: list[dict], server: dict, policy: str) -> dict:
    applied = [r for r in rows if r["status"] == "APPLIED"]
    delays = [int(r["delay"]) for r in applied]
    seconds = [float(r["seconds"]) for r in rows]
    span = max(float(r["end"]) for r in rows) - min(float(r["start"]) for r in rows)
    return {
        "policy": policy,
        "pushes": len(rows),
        "applied": len(applied),
        "dropped": len(rows) - len(applied),
        "server_version": server["version"],
        "delay_mean": statistics.fmean(delays) if delays else float("nan"),
        "delay_p50": pct(delays, 50),
        "delay_p99": pct(delays, 99),
        "completion_mean_s": statistics.fmean(seconds),
        "completion_p50_s": pct(seconds, 50),
        "completion_p99_s": pct(seconds, 99),
        "applied_mbps": sum(int(r["bytes"]) for r in applied) * 8 / span / 1e6,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in POLICIES:
        mine = [r for r in rows if r["policy"] == policy]
        delays = np.sort([int(r["delay"]) for r in mine if r["status"] == "APPLIED"])
        seconds = np.sort([float(r["seconds"]) for r in mine])
        if len(delays):
            ax1.step(delays, np.arange(1, len(delays) + 1) / len(delays), where="post", label=policy)
        if len(seconds):
            ax2.step(seconds, np.arange(1, len(seconds) + 1) / len(seconds), where="post", label=policy)
    ax1.set_xlabel("update delay (versions) of applied updates")
    ax2.set_xlabel("push completion time (s)")
    for ax in (ax1, ax2):
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("asynchronous pushes behind one bottleneck: stf vs fair (namespace testbed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_summary(
    stats: list[dict], args: argparse.Namespace, uplinks: list[int], notes: list[str], path: Path
) -> None:
    by = {s["policy"]: s for s in stats}
    lines = [
        f"# Testbed ordering: stf vs fair ({'quick' if args.quick else 'full'})",
        "",
        f"{len(uplinks)} workers with uplinks {uplinks} Mbit/s push {args.update_bytes / 1e6:g} MB updates",
        f"to one server whose {args.server_mbps} Mbit/s link is the bottleneck; {args.duration:g} s per",
        f"policy; each worker loops get -> {args.compute_delay:g} s compute -> push -> wait; tau_max "
        f"{args.tau_max}. Real scheduler and daemons, one per network namespace, tbf-shaped links.",
        "",
        "| policy | pushes | applied | dropped | delay mean | p50 | p99 | completion mean (s) | p50 | p99 "
        "| applied Mbit/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in stats:
        lines.append(
            f"| {s['policy']} | {s['pushes']} | {s['applied']} | {s['dropped']} | {s['delay_mean']:.2f} | "
            f"{s['delay_p50']:.0f} | {s['delay_p99']:.1f} | {s['completion_mean_s']:.3f} | "
            f"{s['completion_p50_s']:.3f} | {s['completion_p99_s']:.3f} | {s['applied_mbps']:.1f} |"
        )
    if "fair" in by and "stf" in by:
        f, s = by["fair"], by["stf"]
        lines += [
            "",
            "stf / fair: mean delay "
            f"{s['delay_mean'] / f['delay_mean']:.2f}x, p99 delay {s['delay_p99'] / f['delay_p99']:.2f}x, "
            f"mean completion {s['completion_mean_s'] / f['completion_mean_s']:.2f}x, "
            f"applied {s['applied'] / max(f['applied'], 1):.2f}x.",
        ]
    lines += ["", *(f"Note: {n}" for n in notes)]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: 4 workers, 15 s per policy")
    parser.add_argument("--duration", type=float, help="seconds per policy (15 quick, 60 full)")
    parser.add_argument("--update-bytes", type=int, default=1_000_000)
    parser.add_argument("--server-mbps", type=float, default=100.0)
    parser.add_argument("--compute-delay", type=float, default=0.05)
    parser.add_argument("--tau-max", type=int, default=16)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    missing = missing_prerequisites()
    if missing:
        print("testbed unavailable: " + "; ".join(missing), file=sys.stderr)
        return 2
    args.duration = args.duration or (15.0 if args.quick else 60.0)
    uplinks = UPLINKS_QUICK if args.quick else UPLINKS_FULL
    workers = [f"w{i}" for i in range(len(uplinks))]
    name = "testbed_ordering" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    sweep_stale(SubprocessRunner())
    rows: list[dict] = []
    stats = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-ordering-") as tmp:
        topo = Path(tmp) / "topology.toml"
        topo.write_text(
            to_toml(bottleneck_star("ps", args.server_mbps, dict(zip(workers, uplinks, strict=True))))
        )
        with Testbed(load_topology(topo), new_prefix(random.Random())) as testbed:
            for policy in args.policies.split(","):
                workdir = Path(tmp) / policy
                policy_rows, server = run_policy(testbed, topo, policy, workers, args, workdir)
                rows += policy_rows
                stats.append(summarize(policy_rows, server, policy))
                print(json.dumps(stats[-1]), flush=True)
            notes = list(testbed.notes)
    notes.append(
        "the daemons' per-transfer reports are not exported by the daemon (no report file); "
        "completion times are measured by the workers (push -> resolved)."
    )
    with open(args.out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["policy", *(k for k in rows[0] if k != "policy")])
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / f"{name}.png")
    write_summary(stats, args, uplinks, notes, args.out / f"{name}.md")
    print((args.out / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
