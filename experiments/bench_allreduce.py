"""All-reduce: mlfabric (as planned) vs torch.distributed gloo's ring, side by side (docs/allreduce.md).

The same ranks, tensors and sizes with each system, seeds and systems interleaved; every rank
times each all-reduce (after a barrier that lines the ranks up), and a run's time is the
slowest rank's. Systems:

- ``gloo``: ``torch.distributed.all_reduce`` (gloo's ring);
- ``mlfabric``: ``mlfabric.join_allreduce(..., process_group=WORLD)``: the scheduler plans once
  from the bandwidth graph and the ranks run the kept plan over the same gloo group (gloo's
  own all-reduce where it is at least as fast, mlfabric's tree through its point-to-point
  operations where it wins);
- ``mlfabric-daemons``: ``mlfabric.join_allreduce(...)`` without a process group: the daemons
  move and sum the chunks (a scheduler round trip per call).

Settings:

- ``loopback``: a scheduler and one daemon per rank on 127.0.0.1, unshaped;
- ``uniform`` / ``hetero`` (root; the namespace testbed): hosts on one switch, every NIC
  shaped by tc at each of ``--mbps`` — uniform: all at the rate; hetero: every other host at a
  quarter of it. Before the runs of a rate, a concurrent-flow link check (every host sending
  to the next, at once) prints what the testbed delivers with that many flows on this machine.

Per (setting, rate, size) the summary gives each system's median over seeds and repetitions,
the min-max spread, ``gloo / mlfabric`` (> 1: mlfabric faster) overall and per seed, and
mlfabric's time against its planner's model; then CPU seconds per GB all-reduced (ranks'
processes and daemons).

    python experiments/bench_allreduce.py --setting loopback --ranks 4 --sizes 16,64
    python experiments/bench_allreduce.py --setting hetero,uniform --mbps 100,1000,2500 --sizes 16,64

Writes experiments/results/bench_allreduce_<settings>[_<label>].{json,md}. Needs torch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import init_gloo

from mlfabric.readyfile import write_ready_file

RESULTS = Path(__file__).resolve().parent / "results"
ME = [sys.executable, str(Path(__file__).resolve())]
SYSTEMS = ("gloo", "mlfabric", "mlfabric-daemons")
_MODEL = re.compile(r"model ([0-9.]+) ms")


# ----------------------------------------------------------------------------- ranks


def _tensor(size_mb: int, rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    return rng.integers(-4, 4, size=size_mb * (1 << 20) // 4).astype(np.float32)


def rank_main(args: argparse.Namespace) -> int:
    """One rank: for each size, ``--reps`` timed all-reduces; writes times, plans and CPU."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    times: dict[str, list[float]] = {}
    plans: dict[str, str] = {}
    uses_group = args.system in ("gloo", "mlfabric")
    if uses_group:
        init_gloo(args.store, args.rank, args.world, args.ready_file)
    group = None
    if args.system.startswith("mlfabric"):
        import mlfabric

        group = mlfabric.join_allreduce(
            args.job,
            world_size=args.world,
            participant=f"rank{args.rank}",
            process_group=dist.group.WORLD if args.system == "mlfabric" else None,
            timeout=600,
        )
    barrier = np.zeros(1, np.float32)
    cpu_start = _cpu()
    for size in sizes:
        x = _tensor(size, args.rank, args.seed)
        for rep in range(args.reps + 1):  # the first is a warm-up (and plans)
            t = torch.from_numpy(x.copy())
            if uses_group:
                dist.barrier()
            else:
                assert group is not None
                group.allreduce({"b": barrier}, name="barrier", timeout=600)
            start = time.perf_counter()
            if group is None:
                dist.all_reduce(t)
                total = t.numpy()
            else:
                # in place, as gloo's all_reduce (t is this repetition's copy)
                handle = group.allreduce_async({"x": t}, name=f"x{size}", timeout=600, inplace=True)
                total = handle.wait()["x"].numpy()
                plans[str(size)] = handle.plan
            seconds = time.perf_counter() - start
            if rep == 0:
                _check(total, size, args)
            else:
                times.setdefault(str(size), []).append(seconds)
    cpu = _cpu() - cpu_start
    if group is not None:
        group.close()
    write_ready_file(args.out, {"times": times, "plans": plans, "cpu": cpu})
    if uses_group:
        dist.destroy_process_group()
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
) -> dict[str, Any]:
    """One system's ranks (rank i on a seeded permutation of the hosts); per-size slowest-rank times."""
    order = list(hosts)
    random.Random(seed).shuffle(order)
    common = ["--system", system, "--world", str(len(hosts)), "--sizes", args.sizes, "--reps", str(args.reps)]
    common += ["--seed", str(seed), "--job", f"bench-{seed}-{system}-{env['rate']}"]
    outs = [work / f"{system}-{seed}-{env['rate']}-{r}.json" for r in range(len(hosts))]
    ready = work / f"{system}-{seed}-{env['rate']}.ready"
    procs: list[Any] = []
    daemons_before = _daemon_cpu()
    try:
        port = 0
        for r, h in enumerate(order):
            store = f"{env['address'](order[0])}:{port}"
            argv = [*ME, "rank", *common, "--rank", str(r), "--out", str(outs[r]), "--store", store]
            argv += ["--ready-file", str(ready)]
            if system.startswith("mlfabric"):
                procs.append(env["cluster"].spawn(h, argv, name=f"{system}-{seed}-{r}", env=env["env"]).popen)
            else:
                procs.append(env["popen"](h, argv))
            if r == 0 and system != "mlfabric-daemons":
                deadline = time.monotonic() + 180
                while not ready.exists():
                    if procs[0].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{system} rank 0 did not start its store")
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


def _seeds(
    setting: str,
    rate: int,
    env: Any,
    hosts: list[str],
    args: argparse.Namespace,
    seeds: list[int],
    work: Path,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    systems = [s for s in args.systems.split(",") if s]
    for i, seed in enumerate(seeds):
        order = systems[i % len(systems) :] + systems[: i % len(systems)]  # interleaved
        for system in order:
            res = _run_system(system, {**env, "rate": rate}, hosts, args, seed, work)
            base = {"setting": setting, "mbps": rate, "system": system, "seed": seed}
            for size, ts in res["times"].items():
                rows += [{**base, "size_mb": int(size), "seconds": t} for t in ts]
            rows.append({**base, "cpu": res["cpu"], "sizes": args.sizes, "reps": args.reps})
            for size, plan in res["plans"].items():
                rows.append({**base, "size_mb": int(size), "plan": plan})
            load = os.getloadavg()[0]
            print(
                f"{setting} {rate} Mbit/s seed {seed} {system}: {res['times']} (load {load:.1f})", flush=True
            )
    return rows


def driver(args: argparse.Namespace) -> int:
    from mlfabric.cluster import LocalCluster
    from mlfabric.testbed.topologies import to_toml

    seeds = [int(s) for s in args.seeds.split(",")]
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    load = os.getloadavg()
    for setting in args.setting.split(","):
        hosts = [f"h{i}" for i in range(args.ranks)]
        rates = [0] if setting == "loopback" else [int(m) for m in args.mbps.split(",")]
        for rate in rates:
            with tempfile.TemporaryDirectory(prefix="mlfbar-") as tmp:
                work = Path(tmp)
                topo = work / "topology.toml"
                topo.write_text(to_toml(_topology(hosts, setting, rate or 10_000)))
                if setting == "loopback":
                    cluster = LocalCluster(topo, policy="fair", workdir=work / "run", ready_timeout=180)
                    gloo_env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
                    env = {
                        "cluster": cluster,
                        "env": gloo_env,
                        "address": lambda h: "127.0.0.1",
                        "popen": lambda h, argv, e=gloo_env: subprocess.Popen(argv, env={**os.environ, **e}),
                    }
                    with cluster:
                        rows += _seeds(setting, rate, env, hosts, args, seeds, work)
                else:
                    got, check = _testbed(setting, rate, topo, hosts, args, seeds, work)
                    rows += got
                    checks.append(check)
    commit = _commit()
    summary = report(rows, checks, args, load, os.getloadavg(), commit)
    print(summary)
    name = "bench_allreduce_" + args.setting.replace(",", "_") + (f"_{args.label}" if args.label else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "link_checks": checks,
                "args": vars(args),
                "load": load,
                "load_end": os.getloadavg(),
                "commit": commit,
            },
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


def _testbed(
    setting: str,
    rate: int,
    topo: Path,
    hosts: list[str],
    args: argparse.Namespace,
    seeds: list[int],
    work: Path,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from mlfabric.scheduler.core.graph import load_topology
    from mlfabric.testbed.cluster import Testbed
    from mlfabric.testbed.launch import TestbedCluster
    from mlfabric.testbed.linkcheck import measure_concurrent, ring_pairs
    from mlfabric.testbed.netns import SubprocessRunner, missing_prerequisites, new_prefix, sweep_stale

    missing = missing_prerequisites()
    if missing:
        raise SystemExit("testbed unavailable: " + "; ".join(missing))
    sweep_stale(SubprocessRunner())
    graph = load_topology(topo)
    with Testbed(graph, new_prefix(random.Random())) as testbed:
        check = measure_concurrent(testbed, graph, ring_pairs(hosts), seconds=3.0)
        print(f"{setting} {rate} Mbit/s: {check.summary()}", flush=True)
        summary = {"setting": setting, "mbps": rate, "summary": check.summary(), "ratios": check.ratios()}
        gloo_env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        with TestbedCluster(testbed, topo, policy="fair", workdir=work / "run", ready_timeout=180) as cluster:
            env = {
                "cluster": cluster,
                "env": gloo_env,
                "address": testbed.address,
                "popen": lambda h, argv: testbed.popen(h, argv, env=gloo_env),
            }
            return _seeds(setting, rate, env, hosts, args, seeds, work), summary


def _model_seconds(plan: str) -> float | None:
    m = _MODEL.search(plan)
    return float(m.group(1)) / 1e3 if m else None


def report(
    rows: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    args: argparse.Namespace,
    load: tuple[float, ...],
    load_end: tuple[float, ...] | None = None,
    commit: str = "",
) -> str:
    """The markdown tables: per (setting, rate, size) each system's median (min-max), the ratios."""
    plans = [r for r in rows if "plan" in r]
    cpus = [r for r in rows if "cpu" in r]
    timed = [r for r in rows if "seconds" in r]
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in timed)]
    end = (
        "" if load_end is None else f"; at the end {load_end[0]:.1f} / {load_end[1]:.1f} / {load_end[2]:.1f}"
    )
    lines = [
        f"# All-reduce: mlfabric vs gloo's ring ({args.ranks} ranks, {args.reps} reps x seeds {args.seeds})",
        "",
        *([f"Commit: {commit}.", ""] if commit else []),
        f"Load average at start: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}{end}. Testbed NICs at each "
        "rate (hetero: every other host at a quarter). Times: the slowest rank's, seconds.",
        "",
    ]
    if checks:
        lines += ["Link checks (every host sending to the next at once, before the runs):", ""]
        lines += [f"- {c['setting']} {c['mbps']} Mbit/s: {c['summary']}" for c in checks]
        lines.append("")
    head = " | ".join(f"{s} s (min-max)" for s in systems)
    lines += [
        f"| setting | Mbit/s | MB | {head} | gloo / mlfabric | per seed | mlfabric / its model |",
        "|---|---|---|" + "---|" * len(systems) + "---|---|---|",
    ]
    keys = sorted({(r["setting"], r["mbps"], r["size_mb"]) for r in timed})
    for setting, rate, size in keys:
        sel = [r for r in timed if (r["setting"], r["mbps"], r["size_mb"]) == (setting, rate, size)]
        by = {s: [r["seconds"] for r in sel if r["system"] == s] for s in systems}
        med = {s: statistics.median(v) for s, v in by.items() if v}
        cells = [f"{med[s]:.3f} ({min(by[s]):.3f}-{max(by[s]):.3f})" if by[s] else "-" for s in systems]
        per_seed = []
        for seed in sorted({r["seed"] for r in sel}):
            m = [r["seconds"] for r in sel if r["seed"] == seed and r["system"] == "mlfabric"]
            g = [r["seconds"] for r in sel if r["seed"] == seed and r["system"] == "gloo"]
            if m and g:
                per_seed.append(f"{statistics.median(g) / statistics.median(m):.2f}")
        ratio = med["gloo"] / med["mlfabric"] if "gloo" in med and "mlfabric" in med else float("nan")
        models = [
            _model_seconds(p["plan"])
            for p in plans
            if (p["setting"], p["mbps"], p["size_mb"], p["system"]) == (setting, rate, size, "mlfabric")
        ]
        model = statistics.median([m for m in models if m]) if any(models) else None
        vs_model = f"{med['mlfabric'] / model:.2f}x" if model and "mlfabric" in med else "-"
        lines.append(
            f"| {setting} | {rate or 'loopback'} | {size} | {' | '.join(cells)} | {ratio:.2f}x | "
            f"{' / '.join(per_seed)} | {vs_model} |"
        )
    if cpus:
        lines += [
            "",
            "CPU seconds per GB all-reduced (every rank's contribution counted; median over seeds): the "
            "ranks' processes from their first all-reduce on (warm-ups and barriers included), and the "
            "mlfabric daemons over the run of the system (their idle cost while another system runs is "
            "counted there).",
            "",
            "| setting | Mbit/s | system | ranks' processes | daemons | total |",
            "|---|---|---|---|---|---|",
        ]
        for setting, rate in sorted({(r["setting"], r["mbps"]) for r in cpus}):
            for system in systems:
                sel = [r for r in cpus if (r["setting"], r["mbps"], r["system"]) == (setting, rate, system)]
                if not sel:
                    continue
                sizes = [int(s) for s in sel[0]["sizes"].split(",")]
                gb = sum(sizes) * (1 << 20) / 1e9 * args.ranks * (sel[0]["reps"] + 1)
                ranks = statistics.median(r["cpu"]["ranks"] for r in sel) / gb
                daemons = statistics.median(r["cpu"]["daemons"] for r in sel) / gb
                lines.append(
                    f"| {setting} | {rate or 'loopback'} | {system} | {ranks:.2f} | {daemons:.2f} | "
                    f"{ranks + daemons:.2f} |"
                )
    if plans:
        lines += ["", "mlfabric's plans (setting, rate, MB, seed, system: the plan's line):", ""]
        for r in sorted(plans, key=lambda r: (r["setting"], r["mbps"], r["size_mb"], r["seed"], r["system"])):
            lines.append(
                f"- {r['setting']} {r['mbps']} {r['size_mb']} MB seed {r['seed']} {r['system']}: {r['plan']}"
            )
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
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--sizes", default="16,64", help="MB per tensor, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument(
        "--systems", default="gloo,mlfabric", help=f"comma-separated, of {', '.join(SYSTEMS)}"
    )
    parser.add_argument(
        "--mbps", default="1000", help="testbed NIC rates, comma-separated (hetero: half the hosts at 1/4)"
    )
    parser.add_argument("--time-limit", type=float, default=3600.0)
    parser.add_argument("--label", default="", help="suffix of the result files' name")
    args = parser.parse_args()
    if args.command == "rank":
        from mlfabric.torch import exit_rank

        exit_rank(rank_main(args))  # gloo's threads outlive the group: no interpreter teardown
    bad = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if bad:
        parser.error(f"unknown systems {bad}; choose from {SYSTEMS}")
    return driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
