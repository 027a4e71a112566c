"""All-reduce: mlfabric's scheduled tree or ring vs torch.distributed gloo's ring (docs/allreduce.md).

The same ranks, tensors and sizes with both systems, seeds and systems interleaved; every
rank times each all-reduce (after a small all-reduce that lines the ranks up), and a run's
time is the slowest rank's. Per (setting, size) the summary gives the median over seeds and
repetitions, the min-max spread and ``gloo / mlfabric`` (> 1: mlfabric faster).

- ``--setting loopback``: a scheduler and one daemon per rank on 127.0.0.1, unshaped (both
  systems run at memory/CPU speed; no network effect to exploit);
- ``--setting uniform`` / ``hetero`` (root; the namespace testbed): 8 hosts on one switch,
  every NIC shaped by tc — uniform: all ``--mbps``; hetero: half the hosts at ``--mbps``,
  half at a quarter of it (the issue's targets: >= 1.3x gloo on hetero, >= 0.8x on uniform).

    python experiments/bench_allreduce.py --setting loopback --ranks 4 --sizes 4,16,64
    python experiments/bench_allreduce.py --setting hetero,uniform --sizes 4,16 --seeds 1,2,3

Writes experiments/results/bench_allreduce_<settings>.{json,md}. Needs torch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
ME = [sys.executable, str(Path(__file__).resolve())]


# ----------------------------------------------------------------------------- ranks


def _tensor(size_mb: int, rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    return rng.integers(-4, 4, size=size_mb * (1 << 20) // 4).astype(np.float32)


def rank_main(args: argparse.Namespace) -> int:
    """One rank: for each size, ``--reps`` timed all-reduces; writes ``{size: [seconds]}``."""
    sizes = [int(s) for s in args.sizes.split(",")]
    times: dict[str, list[float]] = {}
    plans: dict[str, str] = {}
    cpu_start = 0.0  # CPU seconds of this process when its first all-reduce begins
    if args.system == "mlfabric":
        import mlfabric

        group = mlfabric.join_allreduce(args.job, world_size=args.world, participant=f"rank{args.rank}")
        barrier = np.zeros(1, np.float32)
        cpu_start = _cpu()
        for size in sizes:
            x = _tensor(size, args.rank, args.seed)
            group.allreduce({"x": x}, name=f"warm{size}", timeout=600)
            for rep in range(args.reps):
                group.allreduce({"b": barrier}, name="barrier", timeout=600)
                start = time.perf_counter()
                h = group.allreduce_async({"x": x}, name=f"x{size}", timeout=600)
                total = h.wait()
                times.setdefault(str(size), []).append(time.perf_counter() - start)
                plans[str(size)] = h.plan
                if rep == 0:
                    _check(total["x"], size, args)
        group.close()
    else:
        import torch
        import torch.distributed as dist

        host, port = args.store.rsplit(":", 1)
        if args.rank == 0:
            store = dist.TCPStore(host, 0, args.world, is_master=True, wait_for_workers=False)
            Path(args.ready_file).write_text(json.dumps({"port": store.port}))
        else:
            store = dist.TCPStore(host, int(port), args.world, is_master=False)
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
        cpu_start = _cpu()
        for size in sizes:
            base = torch.from_numpy(_tensor(size, args.rank, args.seed))
            dist.all_reduce(base.clone())
            for rep in range(args.reps):
                t = base.clone()
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.setdefault(str(size), []).append(time.perf_counter() - start)
                if rep == 0:
                    _check(t.numpy(), size, args)
        dist.destroy_process_group()
    cpu = _cpu() - cpu_start
    Path(args.out).write_text(json.dumps({"times": times, "plans": plans, "cpu": cpu}))
    return 0


def _cpu() -> float:
    """CPU seconds (user + system, all threads) of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _check(total: np.ndarray, size: int, args: argparse.Namespace) -> None:
    """The sum must be exact (small integers in float32)."""
    expected = sum(_tensor(size, r, args.seed) for r in range(args.world))
    if not np.array_equal(total, expected):
        raise SystemExit(f"rank {args.rank}: wrong sum for {size} MB ({args.system})")


# ----------------------------------------------------------------------------- driver


def _topology(hosts: list[str], setting: str, mbps: int) -> dict[str, Any]:
    rates = [mbps if (setting != "hetero" or i % 2 == 0) else mbps // 4 for i in range(len(hosts))]
    links = [{"a": h, "b": "sw", "mbps": r} for h, r in zip(hosts, rates, strict=True)]
    return {"hosts": hosts, "switches": ["sw"], "links": links}


def _wait(procs: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        if code != 0:
            raise RuntimeError(f"a rank exited with code {code}")


def _daemon_cpu() -> float:
    """CPU seconds (user + system) used so far by the mlfabric daemons among our descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        stats[int(entry)] = fields
    me, total = os.getpid(), 0.0
    for pid, fields in stats.items():
        q = parent.get(pid)
        while q and q != me:
            q = parent.get(q)
        if q != me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"daemon" in argv and b"--host" in argv:
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _run_system(
    system: str, env: Any, hosts: list[str], args: argparse.Namespace, seed: int, work: Path
) -> dict:
    """One system's ranks (rank i on a seeded permutation of the hosts); per-size slowest-rank times."""
    order = list(hosts)
    random.Random(seed).shuffle(order)
    common = ["--system", system, "--world", str(len(hosts)), "--sizes", args.sizes, "--reps", str(args.reps)]
    common += ["--seed", str(seed), "--job", f"bench-{seed}"]
    outs = [work / f"{system}-{seed}-{r}.json" for r in range(len(hosts))]
    procs: list[Any] = []
    daemons_before = _daemon_cpu()
    try:
        if system == "mlfabric":
            for r, h in enumerate(order):
                argv = [*ME, "rank", *common, "--rank", str(r), "--out", str(outs[r])]
                procs.append(env["cluster"].spawn(h, argv, name=f"mlf-{seed}-{r}").popen)
        else:
            ready, port = work / f"gloo-{seed}.ready", 0
            for r, h in enumerate(order):
                store = f"{env['address'](order[0])}:{0 if r == 0 else port}"
                argv = [*ME, "rank", *common, "--rank", str(r), "--out", str(outs[r]), "--store", store]
                procs.append(env["popen"](h, [*argv, "--ready-file", str(ready)]))
                if r == 0:
                    deadline = time.monotonic() + 120
                    while not ready.exists():
                        if procs[0].poll() is not None or time.monotonic() > deadline:
                            raise RuntimeError("gloo rank 0 did not start its store")
                        time.sleep(0.05)
                    port = json.loads(ready.read_text())["port"]
        _wait(procs, args.time_limit)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    per_rank = [json.loads(o.read_text()) for o in outs]
    sizes = per_rank[0]["times"]
    slowest = {s: [max(pr["times"][s][i] for pr in per_rank) for i in range(args.reps)] for s in sizes}
    cpu = {"ranks": sum(pr["cpu"] for pr in per_rank), "daemons": _daemon_cpu() - daemons_before}
    return {"times": slowest, "plans": per_rank[0]["plans"], "cpu": cpu}


def driver(args: argparse.Namespace) -> int:
    from mlfabric.cluster import LocalCluster
    from mlfabric.testbed.topologies import to_toml

    seeds = [int(s) for s in args.seeds.split(",")]
    rows: list[dict[str, Any]] = []
    load = os.getloadavg()
    for setting in args.setting.split(","):
        hosts = [f"h{i}" for i in range(args.ranks)]
        with tempfile.TemporaryDirectory(prefix="mlfbar-") as tmp:
            work = Path(tmp)
            topo = work / "topology.toml"
            topo.write_text(to_toml(_topology(hosts, setting, args.mbps)))
            if setting == "loopback":
                cluster = LocalCluster(topo, policy="fair", workdir=work / "run", ready_timeout=180)
                env = {
                    "cluster": cluster,
                    "address": lambda h: "127.0.0.1",
                    "popen": lambda h, argv: subprocess.Popen(
                        argv, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
                    ),
                }
                with cluster:
                    rows += _seeds(setting, env, hosts, args, seeds, work)
            else:
                rows += _testbed(setting, topo, hosts, args, seeds, work)
    commit = _commit()
    summary = report(rows, args, load, os.getloadavg(), commit)
    print(summary)
    name = "bench_allreduce_" + args.setting.replace(",", "_") + (f"_{args.label}" if args.label else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(
        json.dumps(
            {"rows": rows, "args": vars(args), "load": load, "load_end": os.getloadavg(), "commit": commit},
            indent=1,
        )
    )
    (RESULTS / f"{name}.md").write_text(summary + "\n")
    return 0


def _commit() -> str:
    """The checked-out commit, with ``+changes`` if the all-reduce's files differ from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        paths = ["daemon", "scheduler/policies/allreduce.py", "scheduler/service/allreduce.py", "mlfabric"]
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *paths], cwd=root, check=False)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"unknown ({exc})"
    return head + ("+changes" if dirty.returncode else "")


def _seeds(
    setting: str, env: Any, hosts: list[str], args: argparse.Namespace, seeds: list[int], work: Path
) -> list:
    rows = []
    for seed in seeds:
        systems = ["mlfabric", "gloo"] if seed % 2 else ["gloo", "mlfabric"]  # interleaved
        for system in systems:
            res = _run_system(system, env, hosts, args, seed, work)
            for size, ts in res["times"].items():
                base = {"setting": setting, "system": system, "seed": seed, "size_mb": int(size)}
                rows += [{**base, "seconds": t} for t in ts]
            rows.append({"setting": setting, "seed": seed, "system": system, "cpu": res["cpu"]})
            if system == "mlfabric":
                print(f"{setting} seed {seed}: plans {res['plans']}", flush=True)
                for size, plan in res["plans"].items():
                    rows.append({"setting": setting, "seed": seed, "size_mb": int(size), "plan": plan})
            print(
                f"{setting} seed {seed} {system}: {res['times']} (load {os.getloadavg()[0]:.1f})", flush=True
            )
    return rows


def _testbed(
    setting: str, topo: Path, hosts: list[str], args: argparse.Namespace, seeds: list[int], work: Path
) -> list:
    from mlfabric.scheduler.core.graph import load_topology
    from mlfabric.testbed.cluster import Testbed
    from mlfabric.testbed.launch import TestbedCluster
    from mlfabric.testbed.netns import SubprocessRunner, missing_prerequisites, new_prefix, sweep_stale

    missing = missing_prerequisites()
    if missing:
        raise SystemExit("testbed unavailable: " + "; ".join(missing))
    sweep_stale(SubprocessRunner())
    with Testbed(load_topology(topo), new_prefix(random.Random())) as testbed:
        gloo_env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        with TestbedCluster(testbed, topo, policy="fair", workdir=work / "run", ready_timeout=180) as cluster:
            env = {
                "cluster": cluster,
                "address": testbed.address,
                "popen": lambda h, argv: testbed.popen(h, argv, env=gloo_env),
            }
            return _seeds(setting, env, hosts, args, seeds, work)


def report(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    load: tuple[float, ...],
    load_end: tuple[float, ...] | None = None,
    commit: str = "",
) -> str:
    """The markdown table: median (min-max) per system, gloo / mlfabric, and mlfabric's plans."""
    plans = [r for r in rows if "plan" in r]
    cpus = [r for r in rows if "cpu" in r]
    rows = [r for r in rows if "seconds" in r]
    end = (
        "" if load_end is None else f"; at the end: {load_end[0]:.1f} / {load_end[1]:.1f} / {load_end[2]:.1f}"
    )
    lines = [
        f"# All-reduce: mlfabric (tree or ring, as planned) vs gloo ring ({args.ranks} ranks, "
        f"{args.reps} reps x seeds {args.seeds})",
        "",
        *([f"Commit: {commit}.", ""] if commit else []),
        f"Load average at start: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}{end}. "
        f"Testbed NICs: {args.mbps} Mbit/s (hetero: every other host at a quarter).",
        "",
        "| setting | MB | mlfabric s (min-max) | gloo s (min-max) | gloo / mlfabric | per seed |",
        "|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["setting"], r["size_mb"]) for r in rows})
    for setting, size in keys:
        sel = [r for r in rows if r["setting"] == setting and r["size_mb"] == size]
        by = {s: [r["seconds"] for r in sel if r["system"] == s] for s in ("mlfabric", "gloo")}
        med = {s: statistics.median(v) for s, v in by.items() if v}
        per_seed = []
        for seed in sorted({r["seed"] for r in sel}):
            m = [r["seconds"] for r in sel if r["seed"] == seed and r["system"] == "mlfabric"]
            g = [r["seconds"] for r in sel if r["seed"] == seed and r["system"] == "gloo"]
            if m and g:
                per_seed.append(f"{statistics.median(g) / statistics.median(m):.2f}")
        spread = {s: f"{med[s]:.3f} ({min(v):.3f}-{max(v):.3f})" for s, v in by.items() if v}
        ratio = med["gloo"] / med["mlfabric"] if len(med) == 2 else float("nan")
        lines.append(
            f"| {setting} | {size} | {spread.get('mlfabric', '-')} | {spread.get('gloo', '-')} | "
            f"{ratio:.2f}x | {' / '.join(per_seed)} |"
        )
    if cpus:
        lines += [
            "",
            "CPU seconds per run of one system, median over seeds: the ranks' processes from their "
            f"first all-reduce on (per size, one warm-up and {args.reps} timed all-reduces, with "
            "barriers), and the mlfabric daemons over the whole run (idle while gloo runs: that "
            "row is their baseline).",
            "",
            "| setting | system | ranks' processes | daemons | total |",
            "|---|---|---|---|---|",
        ]
        for setting in sorted({r["setting"] for r in cpus}):
            for system in ("mlfabric", "gloo"):
                sel = [r["cpu"] for r in cpus if r["setting"] == setting and r["system"] == system]
                if sel:
                    ranks = statistics.median(c["ranks"] for c in sel)
                    daemons = statistics.median(c["daemons"] for c in sel)
                    total = statistics.median(c["ranks"] + c["daemons"] for c in sel)
                    lines.append(f"| {setting} | {system} | {ranks:.1f} | {daemons:.1f} | {total:.1f} |")
    if plans:
        lines += ["", "mlfabric's plans (setting, MB, seed: the plan's line):", ""]
        for r in sorted(plans, key=lambda r: (r["setting"], r["size_mb"], r["seed"])):
            lines.append(f"- {r['setting']} {r['size_mb']} MB seed {r['seed']}: {r['plan']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    r = sub.add_parser("rank")
    for a in ("--system", "--sizes", "--job", "--out", "--store", "--ready-file"):
        r.add_argument(a)
    for a in ("--world", "--reps", "--seed", "--rank"):
        r.add_argument(a, type=int)
    parser.add_argument("--setting", default="loopback", help="loopback, uniform, hetero (comma-separated)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes", default="4,16,64", help="MB per tensor, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument(
        "--mbps", type=int, default=1000, help="testbed NIC rate (hetero: half the hosts at 1/4)"
    )
    parser.add_argument("--time-limit", type=float, default=1800.0)
    parser.add_argument("--label", default="", help="suffix of the result files' name")
    args = parser.parse_args()
    if args.command == "rank":
        return rank_main(args)
    return driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
