"""What a replica costs: time to a target accuracy with no replica, div_max, chain (issue #14).

Asynchronous training on the namespace testbed exactly as in ``testbed_aggregation.py`` (its
server, workers, topology, NS bandwidth schedule and compute straggler are imported, not
copied): the digits MLP 64-1024-1024-10 (4.5 MB float32 updates), 8 workers with uplinks of
200-25 Mbit/s, the server's ingress the bottleneck (100 Mbit/s, changing every ``--period`` s
to 1, 1/2 or 1/4 of it), trained to a target test accuracy under the ``stf+agg`` policy, in
three modes:

- ``none``    — no replica (the host ``rep`` and its daemon are up, idle);
- ``div_max`` — a replica on host ``rep`` (1 Gbit/s link) with ``Params(div_max=D)``,
  ``D = --div-updates`` (default 4) x a reference update norm: the median L2 norm of
  ``lr * gradient`` over a local SGD run from the same initial model to the target;
- ``chain``   — the same replica with ``div_max = 0`` (chain replication: every update at
  the replica before its push resolves).

Per seed the three modes run one after the other on the same testbed, bandwidth schedule and
straggler, their order rotated from seed to seed. Per run: time to target (from the first
update), worker updates applied, updates the replica received, the median norm of the
applied updates (so ``D`` can be read in updates) and the 1-minute load average at the
start. The summary gives per mode the median time over the seeds, the min-max spread, the
ratio against ``none`` (of the medians and the median of the per-seed ratios) and the
updates applied.

    python experiments/testbed_replication.py --quick    # target 0.85, 3 seeds: 9 runs of 1.5-3.5 min
                                                         # (start-up is most of it: ~15 min idle, ~26 loaded)
    python experiments/testbed_replication.py            # target 0.95, 5 seeds

Writes experiments/results/testbed_replication[_quick].{csv,md}. Needs root, ip, tc, torch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed_aggregation as agg  # the server and worker roles, topology, NS schedule, one run
import testbed_e2e as e2e  # the model, data and accuracy
from harness import write_csv

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("none", "div_max", "chain")
REPLICA_HOST = "rep"
SYSTEM = "stf+agg"


# ------------------------------------------------------------------------- pure helpers


def mode_order(index: int, modes: Sequence[str] = MODES) -> list[str]:
    """The modes of the ``index``-th seed, rotated so that each mode runs first, second, ... in turn.

    Parameters
    ----------
    index : int
        The seed's position in the run (0, 1, ...).
    modes : sequence of str
        The modes in their base order.

    Returns
    -------
    list of str
        ``modes`` rotated left by ``index``.
    """
    k = index % len(modes) if modes else 0
    return [*modes[k:], *modes[:k]]


def summarize(rows: Sequence[dict[str, Any]], modes: Sequence[str] = MODES) -> list[dict[str, Any]]:
    """Per mode: runs, runs that reached the target, median/min/max time, ratios against ``none``.

    Parameters
    ----------
    rows : sequence of dict
        One per run, with ``seed``, ``mode``, ``time_to_target`` (None: not reached),
        ``updates`` (worker updates applied) and ``updates_per_s`` (None when unknown).
    modes : sequence of str
        The modes in the order of the table; ``modes[0]`` is the baseline of the ratios.

    Returns
    -------
    list of dict
        Per mode (those with rows): ``mode``, ``runs``, ``reached``, ``median``, ``min``,
        ``max`` (seconds, None if no run reached), ``ratio`` (median / the baseline's median),
        ``paired_ratio`` (the median over the seeds where both reached of time / the
        baseline's time of the same seed), ``updates`` and ``rate`` (the medians of updates
        applied and of updates/s over the runs that reached the target) and ``rate_ratio``
        (``rate`` / the baseline's).
    """
    base = modes[0] if modes else None
    times = {
        (r["mode"], r["seed"]): float(r["time_to_target"]) for r in rows if r["time_to_target"] is not None
    }
    out: list[dict[str, Any]] = []
    base_median: float | None = None
    base_rate: float | None = None
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        reached = [r for r in mine if r["time_to_target"] is not None]
        ts = [float(r["time_to_target"]) for r in reached]
        med = float(statistics.median(ts)) if ts else None
        rates = [float(r["updates_per_s"]) for r in reached if r.get("updates_per_s") is not None]
        rate = float(statistics.median(rates)) if rates else None
        if mode == base:
            base_median, base_rate = med, rate
        pairs = [times[(mode, s)] / times[(base, s)] for m, s in times if m == mode and (base, s) in times]
        updates = [r["updates"] for r in reached if r.get("updates") is not None]
        out.append(
            {
                "mode": mode,
                "runs": len(mine),
                "reached": len(ts),
                "median": med,
                "min": min(ts) if ts else None,
                "max": max(ts) if ts else None,
                "ratio": med / base_median if med is not None and base_median else None,
                "paired_ratio": float(statistics.median(pairs)) if pairs else None,
                "updates": float(statistics.median(updates)) if updates else None,
                "rate": rate,
                "rate_ratio": rate / base_rate if rate is not None and base_rate else None,
            }
        )
    return out


# ---------------------------------------------------------------------------- roles


def role_replica(args: argparse.Namespace) -> int:
    """The replica of the aggregation experiment's server ``ps`` (job ``agg``): the same apply."""
    import mlfabric

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    replica = mlfabric.register_as_replica("agg", "ps", timeout=agg.STARTUP_ALLOWANCE)
    counts = {"replicated_updates": 0, "replicated_payloads": 0, "after_promotion": 0}

    @replica.on_update
    def apply(update: dict[str, np.ndarray], meta: Any) -> None:
        if replica.promoted.is_set():  # the server exited at the target: the workers come here
            counts["after_promotion"] += meta.num_updates
        else:
            counts["replicated_updates"] += meta.num_updates
            counts["replicated_payloads"] += 1
        for k, v in update.items():
            replica.model[k] -= v

    Path(args.ready_file).write_text("{}")
    try:  # at the end its daemon may stop first: serve raises, the counts are written all the same
        replica.serve(until=stop)
    finally:
        Path(args.out).write_text(json.dumps({**counts, "promoted": replica.promoted.is_set()}))
        replica.close()
    return 0


# ---------------------------------------------------------------------------- driver


def reference_norm(args: argparse.Namespace, max_steps: int = 400) -> float:
    """Median L2 norm of ``lr * gradient`` over local SGD from the initial model to the target."""
    import torch

    xtr, ytr, xte, yte = e2e.dataset()
    model = e2e.make_model()
    rng = np.random.default_rng(0)
    norms = []
    for step in range(1, max_steps + 1):
        update = e2e.gradient(model, xtr, ytr, args.batch, rng, args.lr)
        norms.append(float(np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in update.values()))))
        with torch.no_grad():
            for k, p in model.named_parameters():
                p -= torch.as_tensor(update[k])
        if step % 10 == 0 and e2e.reached(e2e.accuracy(model, xte, yte), args.target):
            break
    return float(statistics.median(norms))


def replica_starter(holder: dict[str, Path]) -> Callable[[Any, Path], list[Any]]:
    """``before_workers`` of :func:`testbed_aggregation.run_one`: start the replica, wait for its model."""

    def start(cluster: Any, workdir: Path) -> list[Any]:
        out, ready = workdir / "replica.json", workdir / "replica.ready"
        holder["out"] = out
        argv = [sys.executable, str(Path(__file__).resolve()), "--role", "replica"]
        proc = cluster.spawn(REPLICA_HOST, [*argv, "--out", str(out), "--ready-file", str(ready)])
        e2e.wait_file(ready, proc.popen, agg.STARTUP_ALLOWANCE)
        return [proc]

    return start


def run_mode(
    mode: str, testbed: Any, topo: Path, workers: list[str], args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """One run of ``mode`` (the aggregation experiment's async run, plus the replica)."""
    args.tmp = args.base_tmp / mode
    holder: dict[str, Path] = {}
    if mode == "none":
        res = agg.run_one(SYSTEM, False, testbed, topo, workers, args, seed)
    else:
        div_max = args.div_max if mode == "div_max" else 0.0
        res = agg.run_one(
            SYSTEM,
            False,
            testbed,
            topo,
            workers,
            args,
            seed,
            server_args=["--div-max", repr(div_max)],
            before_workers=replica_starter(holder),
        )
    out = holder.get("out")
    if out is not None and out.exists():
        res.update(json.loads(out.read_text()))
    return res


def topology(workers: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The aggregation experiment's star plus the replica's host on a ``--replica-mbps`` link."""
    topo = agg.topology(workers, args)
    topo["hosts"].append(REPLICA_HOST)
    topo["links"].append(
        {"a": REPLICA_HOST, "b": "tor", "mbps": args.replica_mbps, "mbps_ba": args.replica_mbps}
    )
    return topo


def driver(args: argparse.Namespace) -> int:
    from mlfabric.scheduler.core.graph import load_topology
    from mlfabric.testbed.cluster import Testbed
    from mlfabric.testbed.netns import SubprocessRunner, missing_prerequisites, new_prefix, sweep_stale
    from mlfabric.testbed.topologies import to_toml

    missing = missing_prerequisites()
    if missing:
        print("testbed unavailable: " + "; ".join(missing), file=sys.stderr)
        return 2
    workers = [f"w{i}" for i in range(len(agg.UPLINKS))]
    name = "testbed_replication" + ("_quick" if args.quick else "")
    seeds = [int(s) for s in args.seeds.split(",")]
    load_before, wall_start = os.getloadavg(), time.monotonic()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.reference_norm = reference_norm(args)
    args.div_max = args.div_updates * args.reference_norm
    print(f"reference update norm {args.reference_norm:.4f}, div_max {args.div_max:.4f}", flush=True)
    sweep_stale(SubprocessRunner())
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-repl-") as tmp_dir:
        args.base_tmp = args.workdir or Path(tmp_dir)
        args.base_tmp.mkdir(parents=True, exist_ok=True)
        topo = args.base_tmp / "topology.toml"
        topo.write_text(to_toml(topology(workers, args)))
        with Testbed(load_topology(topo), new_prefix(random.Random())) as testbed:
            for index, seed in enumerate(seeds):
                for mode in mode_order(index):
                    rows.append(run_with_retry(mode, testbed, topo, workers, args, seed))
                    write_csv(args.out / f"{name}.csv", rows)  # kept as it goes
    load_after = os.getloadavg()
    args.wall_minutes = (time.monotonic() - wall_start) / 60
    text = report(rows, args, load_before, load_after, started_at)
    (args.out / f"{name}.md").write_text(text)
    print(text)
    return 0


def run_with_retry(
    mode: str, testbed: Any, topo: Path, workers: list[str], args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """Run ``mode`` (tried again once if it fails to start) and return its CSV row."""
    started, load = time.monotonic(), os.getloadavg()[0]
    res: dict[str, Any] = {"rows": []}
    for attempt in range(1, agg.START_ATTEMPTS + 1):
        try:
            res = run_mode(mode, testbed, topo, workers, args, seed)
            break
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            print(f"{mode} seed {seed} failed (attempt {attempt}): {exc!r}", file=sys.stderr, flush=True)
            res = {"rows": [], "error": repr(exc)}
    last = res["rows"][-1] if res["rows"] else None
    norm = res.get("median_update_norm")
    row = {
        "seed": seed,
        "mode": mode,
        "div_max": {"none": None, "div_max": args.div_max, "chain": 0.0}[mode],
        "time_to_target": next(
            (r["t"] for r in res["rows"] if e2e.reached(r["accuracy"], args.target)), None
        ),
        "updates": res.get("updates"),
        "payloads": res.get("payloads"),
        "dropped": res.get("dropped"),
        "updates_per_s": (res.get("updates") or 0) / last["t"] if last and last["t"] > 0 else None,
        "final_accuracy": last["accuracy"] if last else None,
        "median_update_norm": norm,
        "replicated_updates": res.get("replicated_updates"),
        "load1_at_start": round(load, 2),
        "wall_s": round(time.monotonic() - started, 1),
        "error": res.get("error"),
    }
    print(json.dumps(row), flush=True)
    return row


def report(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    load_before: tuple[float, ...],
    load_after: tuple[float, ...],
    started_at: str,
) -> str:
    """The Markdown summary: setting, the per-mode table, the runs."""

    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    def f1(x: float | None) -> str:
        return num(x, ".1f")

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f} ({(x - 1) * 100:+.1f} %)"

    norms = [r["median_update_norm"] for r in rows if r["mode"] == "div_max" and r["median_update_norm"]]
    in_updates = args.div_max / statistics.median(norms) if norms else None
    cmd = f"python experiments/testbed_replication.py{' --quick' if args.quick else ''} --seeds {args.seeds}"
    lines = [
        f"# Replication overhead on the testbed ({'quick' if args.quick else 'full'})",
        "",
        f"Async training as in `testbed_aggregation.py` ({SYSTEM}): digits MLP 64-1024-1024-10 "
        f"(4.5 MB float32 updates), lr {args.lr}, batch {args.batch}, {len(agg.UPLINKS)} workers, "
        f"uplinks {agg.UPLINKS} Mbit/s, server ingress {args.server_mbps:g} Mbit/s (the bottleneck; "
        f"every {args.period:g} s 1, 1/2 or 1/4 of it), one straggler {args.slowdown:g}x slower; the "
        f"replica on host `{REPLICA_HOST}` ({args.replica_mbps:g} Mbit/s). Target {args.target}, "
        f"tau_max {args.tau_max}, seeds {args.seeds} (modes interleaved per seed, order rotated). "
        f"div_max = {args.div_updates:g} x {args.reference_norm:.4f} (median update norm of local SGD "
        f"to the target) = {args.div_max:.4f}"
        + (
            f", {in_updates:.1f} x the median norm of the updates applied in the div_max runs"
            if in_updates
            else ""
        )
        + f". Command: `{cmd}`. Started {started_at}; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in load_before)}, after {', '.join(f'{x:.2f}' for x in load_after)} "
        f"(2 cores shared with other jobs); the whole run took {args.wall_minutes:.0f} min.",
        "",
        "| replication | runs | reached | median time to target (s) | min-max (s) | vs none (medians) "
        "| vs none (median of per-seed ratios) | updates applied (median) | updates/s (median) | vs none |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summarize(rows):
        spread = f"{s['min']:.1f}-{s['max']:.1f}" if s["min"] is not None else "-"
        lines.append(
            f"| {s['mode']} | {s['runs']} | {s['reached']} | {f1(s['median'])} | {spread} | "
            f"{ratio(s['ratio'])} | {ratio(s['paired_ratio'])} | {f1(s['updates'])} | "
            f"{num(s['rate'], '.2f')} | {num(s['rate_ratio'], '.3f')} |"
        )
    lines += [
        "",
        "Per run (seconds from the first update; updates = worker updates applied by the server; "
        "replicated = updates the replica applied before it was promoted when the server exited):",
        "",
        "| seed | mode | time to target | updates | updates/s | replicated | median update norm "
        "| final accuracy | load1 at start | wall (s) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        cells = [r["seed"], r["mode"], f1(r["time_to_target"]), num(r["updates"], "d")]
        cells += [num(r["updates_per_s"], ".2f"), num(r["replicated_updates"], "d")]
        cells += [num(r["median_update_norm"] or None, ".4f"), num(r["final_accuracy"], ".3f")]
        cells += [r["load1_at_start"], r["wall_s"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        "A ratio > 1 is slower than without a replica. The time to target of asynchronous SGD varies",
        "from run to run (staleness, the accuracy fluctuating around the target), and the machine is",
        "shared, so a few percent are within the noise of these runs; the per-seed ratios pair runs",
        "with the same bandwidth schedule and straggler.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="target 0.85, 120 s limit per run, 3 seeds")
    parser.add_argument("--seeds", help="comma-separated (default 0,1,2 quick, 0,1,2,3,4 full)")
    parser.add_argument("--target", type=float)
    parser.add_argument(
        "--time-limit", type=float, help="seconds per run from the first update (120 quick, 400)"
    )
    parser.add_argument("--div-updates", type=float, default=4.0, help="div_max in reference update norms")
    parser.add_argument("--replica-mbps", type=float, default=1000.0, help="the replica host's link")
    agg.add_setting_arguments(parser)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, help="keep logs and per-run files here (default: a temp dir)")
    parser.add_argument("--role", choices=["replica"], help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "replica":
        return role_replica(args)
    args.seeds = args.seeds or ("0,1,2" if args.quick else "0,1,2,3,4")
    args.target = args.target or (0.85 if args.quick else 0.95)
    args.time_limit = args.time_limit or (120.0 if args.quick else 400.0)
    args.aggregate_plan = "async"  # read by run_one for synchronous runs only
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
