"""DDP training with mlfabric's all-reduce hook vs plain DDP (gloo ring) on the namespace testbed.

The end-to-end half of the all-reduce measurement (docs/allreduce.md): the same PyTorch
``DistributedDataParallel`` script trains the digits MLP 64-1024-1024-10 (4.5 MB of float32
gradients per step, as in ``testbed_aggregation.py``) on 8 ranks, one per testbed host, to a
target test accuracy, with

- ``gloo``     — DDP's own all-reduce (gloo's ring);
- ``mlfabric`` — the same script plus the one line
  ``model.register_comm_hook(HookState(group), mlfabric.torch.allreduce_hook)`` with the group
  joined over DDP's process group: every gradient bucket goes through mlfabric's all-reduce,
  planned once by the scheduler from the bandwidth graph and run by the ranks over gloo (gloo's
  own all-reduce where the graph is uniform, mlfabric's tree through gloo's point-to-point
  operations where that is faster);
- ``mlfabric-daemons`` (``--systems``) — the same hook with the daemons moving the chunks;
- ``gloo+fp16`` (``--systems``) — DDP's own all-reduce with torch's ``fp16_compress_hook``
  (the gradients all-reduced as float16: the yardstick for mlfabric's codecs).

The hosts' NICs are shaped as in ``bench_allreduce.py``: ``--setting hetero`` puts every other
host at a quarter of the rate, ``uniform`` all at the rate, for each rate of ``--mbps``; before
each rate's runs a concurrent-flow link check prints what the testbed delivers with a flow out of
and into every host. Every rank trains with the same
seeded batches in both systems (the parameters agree to float32 rounding,
``tests/allreduce/test_ddp_hook.py``), so the runs of one seed differ only in how the gradients
travel. Seeds and systems are interleaved; rank 0 evaluates the test accuracy after every step
and records the time from the first step. The summary gives per system the median time to
target over the seeds, its min-max, ``gloo / mlfabric`` (> 1: mlfabric faster) overall and per
seed, and the median time per step.

    python experiments/testbed_ddp.py --mbps 1000,2500      # hetero, 8 ranks, target 0.85, seeds 0-2
    python experiments/testbed_ddp.py --setting uniform --mbps 1000,2500 --seeds 0,1,2

Writes experiments/results/testbed_ddp_<setting>_<rates>.{csv,md}. Needs root, ip, tc, torch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed_e2e as e2e  # the model, data and accuracy log
from bench_allreduce import _commit, _topology
from harness import save_results, stop_all
from testbed_aggregation import _init

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("gloo", "mlfabric", "mlfabric-daemons", "gloo+fp16")
#: seconds a run may take to start (8 ranks importing torch on a loaded machine)
STARTUP_ALLOWANCE = 180.0


# ----------------------------------------------------------------------------- one rank


def rank_main(args: argparse.Namespace) -> int:
    """One DDP rank; rank 0 records the accuracy after every step and says when to stop."""
    import torch

    torch.set_num_threads(1)
    dist = _init(args, args.world)
    group = None
    try:
        net = torch.nn.parallel.DistributedDataParallel(e2e.make_model(), bucket_cap_mb=args.bucket_mb)
        if args.comm.startswith("mlfabric"):
            import mlfabric
            import mlfabric.torch

            group = mlfabric.join_allreduce(
                args.job,
                world_size=args.world,
                participant=f"rank{args.rank}",
                process_group=dist.group.WORLD if args.comm == "mlfabric" else None,
                timeout=120.0,
            )
            net.register_comm_hook(
                mlfabric.torch.HookState(group, timeout=120.0), mlfabric.torch.allreduce_hook
            )
        elif args.comm == "gloo+fp16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            net.register_comm_hook(None, fp16_compress_hook)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr * args.world)  # DDP averages: lr * sum
        xtr, ytr, xte, yte = e2e.dataset()
        rng = np.random.default_rng(args.seed * 1000 + args.rank)
        log = e2e.AccuracyLog(Path(args.out), args.target) if args.rank == 0 else None
        stop, steps, step_times = torch.zeros(1), 0, []
        deadline = time.monotonic() + args.time_limit
        while True:
            t0 = time.perf_counter()
            b = torch.as_tensor(rng.integers(0, len(xtr), size=args.batch))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xtr[b]), ytr[b]).backward()  # all-reduces the buckets
            time.sleep(args.compute_delay)
            opt.step()
            step_times.append(time.perf_counter() - t0)
            steps += 1
            if log is not None:
                log.record(steps, e2e.accuracy(net.module, xte, yte))
                stop[0] = float(log.reached is not None or time.monotonic() > deadline)
            dist.broadcast(stop, src=0)
            if stop.item():
                break
        if log is not None:
            log.save({"steps": steps, "step_seconds": statistics.median(step_times)})
        return 0
    finally:
        if group is not None:
            group.close()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def run_one(
    system: str, cluster: Any, testbed: Any, hosts: list[str], args: argparse.Namespace, seed: int
) -> dict:
    """All ranks of one system (rank i on a seeded permutation of the hosts); rank 0's log."""
    work = args.tmp / f"{system}-{seed}-{args.rate}"
    work.mkdir(parents=True)
    order = list(hosts)
    random.Random(seed).shuffle(order)
    out, ready = work / "rank0.json", work / "rank0.ready"
    base = [sys.executable, str(Path(__file__).resolve()), "--role", "rank", "--comm", system]
    base += ["--world", str(len(hosts)), "--seed", str(seed), "--job", f"ddp-{seed}-{system}"]
    base += ["--lr", str(args.lr), "--batch", str(args.batch), "--target", str(args.target)]
    base += ["--time-limit", str(args.time_limit), "--bucket-mb", str(args.bucket_mb)]
    base += ["--compute-delay", str(args.compute), "--out", str(out), "--ready-file", str(ready)]
    env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    procs: list[Any] = []
    port = 0
    try:
        for rank, host in enumerate(order):
            store = f"{testbed.address(order[0])}:{0 if rank == 0 else port}"
            argv = [*base, "--rank", str(rank), "--store", store]
            procs.append(cluster.spawn(host, argv, name=f"{system}-{seed}-rank{rank}", env=env))
            if rank == 0:
                port = json.loads(e2e.wait_file(ready, procs[0].popen, STARTUP_ALLOWANCE))["port"]
        cluster.wait(procs[0], timeout=args.time_limit + STARTUP_ALLOWANCE)
        for p in procs[1:]:
            cluster.wait(p, timeout=60)
    finally:
        stop_all([p.popen for p in procs])
    return dict(json.loads(out.read_text()))


def driver(args: argparse.Namespace) -> int:
    from mlfabric.scheduler.core.graph import load_topology
    from mlfabric.testbed.cluster import Testbed
    from mlfabric.testbed.launch import TestbedCluster
    from mlfabric.testbed.linkcheck import measure_concurrent, ring_pairs
    from mlfabric.testbed.netns import SubprocessRunner, missing_prerequisites, new_prefix, sweep_stale
    from mlfabric.testbed.topologies import to_toml

    missing = missing_prerequisites()
    if missing:
        print("testbed unavailable: " + "; ".join(missing), file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    hosts = [f"h{i}" for i in range(args.ranks)]
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    checks: list[str] = []
    sweep_stale(SubprocessRunner())
    for rate in [int(m) for m in args.mbps.split(",")]:
        args.rate = rate
        with tempfile.TemporaryDirectory(prefix="mlfddp-") as tmp:
            args.tmp = Path(tmp)
            topo = args.tmp / "topology.toml"
            topo.write_text(to_toml(_topology(hosts, args.setting, rate)))
            graph = load_topology(topo)
            with Testbed(graph, new_prefix(random.Random())) as testbed:
                check = measure_concurrent(testbed, graph, ring_pairs(hosts), seconds=3.0).summary()
                checks.append(f"{rate} Mbit/s: {check}")
                print(f"{args.setting} {rate} Mbit/s: {check}", flush=True)
                with TestbedCluster(
                    testbed, topo, policy="fair", workdir=args.tmp / "run", ready_timeout=180
                ) as cluster:
                    for i, seed in enumerate(seeds):
                        for system in systems[i % len(systems) :] + systems[: i % len(systems)]:
                            started = time.monotonic()
                            res = run_one(system, cluster, testbed, hosts, args, seed)
                            row = {
                                "mbps": rate,
                                "seed": seed,
                                "system": system,
                                "time_to_target": res["time_to_target"],
                                "steps": res["steps"],
                                "step_seconds": res["step_seconds"],
                                "final_accuracy": res["rows"][-1]["accuracy"] if res["rows"] else None,
                                "load1": round(os.getloadavg()[0], 1),
                            }
                            rows.append(row)
                            wall = round(time.monotonic() - started, 1)
                            print(json.dumps({**row, "wall": wall}), flush=True)
    name = f"testbed_ddp_{args.setting}_{args.mbps.replace(',', '_')}"
    text = summary(rows, args, load, _commit(), checks)
    save_results(args.out, name, rows, text)
    print(text)
    return 0


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-"


def summary(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    load: tuple[float, ...],
    commit: str,
    checks: list[str] | None = None,
) -> str:
    """Per rate and system: median time to target and step time; gloo / mlfabric overall and per seed.

    Examples
    --------
    >>> a = argparse.Namespace(setting="hetero", ranks=2, mbps="100", target=0.85, seeds="0", lr=0.05,
    ...                        batch=64, bucket_mb=25.0, compute=0.02, systems="gloo,mlfabric")
    >>> rows = [{"mbps": 100, "seed": 0, "system": "gloo", "time_to_target": 30.0, "steps": 10,
    ...          "step_seconds": 3.0, "final_accuracy": 0.86, "load1": 2.0},
    ...         {"mbps": 100, "seed": 0, "system": "mlfabric", "time_to_target": 20.0, "steps": 10,
    ...          "step_seconds": 2.0, "final_accuracy": 0.86, "load1": 2.0}]
    >>> print(summary(rows, a, (1.0, 1.0, 1.0), "abc").splitlines()[-4])
    | 100 | mlfabric | 1 | 1 | 20.0 (20.0-20.0) | 2.00 (2.00-2.00) | 1.50x | 1.50 | 0.860 |
    """
    loads = [r["load1"] for r in rows]
    lines = [
        f"# DDP training: mlfabric's all-reduce hook vs gloo ({args.setting}, {args.ranks} ranks)",
        "",
        f"Commit {commit}. Digits MLP 64-1024-1024-10 (4.5 MB float32 gradients per step), batch "
        f"{args.batch} per rank, SGD lr {args.lr} x ranks, compute delay {args.compute:g} s; NICs "
        f"at each rate ({'every other host at a quarter' if args.setting == 'hetero' else 'all'}); "
        f"target {args.target}; seeds {args.seeds}, systems interleaved. Load average at the start "
        f"{load[0]:.1f}, at the end of each run {min(loads):g} to {max(loads):g} (2 cores). Command: "
        f"`python experiments/testbed_ddp.py --setting {args.setting} --ranks {args.ranks} "
        f"--mbps {args.mbps} --target {args.target} --seeds {args.seeds} --systems {args.systems}`.",
        "",
        *([*(f"- link check at {c}" for c in checks), ""] if checks else []),
        "| Mbit/s | system | runs | reached | median time to target (s) (min-max) | median step (s) "
        "(min-max) | gloo / mlfabric (median) | per seed | final accuracy |",
        "| ---: | --- | ---: | ---: | --- | --- | ---: | --- | ---: |",
    ]
    for rate in sorted({r["mbps"] for r in rows}):
        at = [r for r in rows if r["mbps"] == rate]
        per_seed: dict[int, dict[str, float]] = {s: {} for s in sorted({r["seed"] for r in at})}
        for r in at:
            if r["time_to_target"] is not None:
                per_seed[r["seed"]][r["system"]] = r["time_to_target"]
        for system in SYSTEMS:
            rs = [r for r in at if r["system"] == system]
            if not rs:
                continue
            ratios = [t["gloo"] / t[system] for t in per_seed.values() if "gloo" in t and system in t]
            times = [r["time_to_target"] for r in rs if r["time_to_target"] is not None]
            steps = [r["step_seconds"] for r in rs]
            finals = [r["final_accuracy"] for r in rs if r["final_accuracy"] is not None]
            step_text = f"{statistics.median(steps):.2f} ({min(steps):.2f}-{max(steps):.2f})"
            mine = system != "gloo" and ratios
            ratio = f"{statistics.median(ratios):.2f}x" if mine else "-"
            each = ", ".join(f"{x:.2f}" for x in ratios) if mine else "-"
            final = f"{statistics.median(finals):.3f}" if finals else "-"
            lines.append(
                f"| {rate} | {system} | {len(rs)} | {len(times)} | {_spread(times)} | {step_text} | {ratio} "
                f"| {each} | {final} |"
            )
    lines += [
        "",
        "Time to target counts from rank 0's first step; a step is forward, backward (with the",
        "all-reduce of every bucket), the compute delay and the optimizer step.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setting", choices=["hetero", "uniform"], default="hetero")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument(
        "--mbps", default="1000", help="NIC rates, comma-separated (hetero: every other host at 1/4)"
    )
    parser.add_argument("--systems", default="gloo,mlfabric", help=f"comma-separated: {', '.join(SYSTEMS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument(
        "--time-limit", type=float, default=240.0, help="seconds per run, from the first step"
    )
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--compute", type=float, default=0.02, help="compute delay per step, s")
    parser.add_argument("--out", type=Path, default=RESULTS)
    # a rank, as started by the driver inside a namespace
    parser.add_argument("--role", choices=["rank"], help=argparse.SUPPRESS)
    parser.add_argument("--comm", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    parser.add_argument("--job", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--compute-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "rank":
        from mlfabric.torch import exit_rank

        exit_rank(rank_main(args))  # gloo's threads outlive the group: no interpreter teardown
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
