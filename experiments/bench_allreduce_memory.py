"""Daemons' memory and CPU over many all-reduces through the daemons (DESIGN §9, docs/allreduce.md).

Starts a scheduler and ``--ranks`` daemons on loopback (a star of 10 Gbit/s NICs), and one
training process per daemon; each calls ``mlfabric.join_allreduce(...).allreduce`` (no process
group: the daemons move and sum the chunks) ``--ops`` times on one float32 tensor of ``--mb``
MB, checking the sum exactly on the first, the last and every hundredth call. The driver
samples each daemon's RSS (``/proc/PID/status`` VmRSS) after the ``--early``-th operation (the
ranks wait for it there, so no operation is in flight) and after the last, and the daemons'
CPU between those two points (``/proc/PID/stat``) per GB
all-reduced (one rank's tensor bytes per operation, as ``bench_allreduce.py`` counts it).

Run::

    python experiments/bench_allreduce_memory.py --ranks 4 --mb 64 --ops 1000 \\
        --out experiments/results/memory_allreduce.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ME = [sys.executable, str(Path(__file__).resolve())]


def rank_main(args: argparse.Namespace) -> int:
    """One participant: ``--ops`` all-reduces; rank 0 writes how many are done to ``--progress``.

    After the ``--early``-th each rank says so (``<progress>.<rank>``) and waits for the driver
    (``<progress>.go``): no operation is in flight at any daemon while it samples.
    """
    import mlfabric

    n = args.mb * 1_000_000 // 4
    x = np.full(n, float(args.rank + 1), np.float32)
    expected = float(sum(range(1, args.world + 1)))
    progress = Path(args.progress)
    with mlfabric.join_allreduce(args.job, world_size=args.world, participant=f"rank{args.rank}") as group:
        for op in range(1, args.ops + 1):
            handle = group.allreduce_async({"x": x}, name="x", timeout=600)
            total = handle.wait()["x"]
            if op == 1 and args.rank == 0:
                Path(f"{progress}.plan").write_text(handle.plan)
            if (op == 1 or op == args.ops or op % 100 == 0) and not bool((total == expected).all()):
                raise RuntimeError(f"all-reduce {op}: wrong sum (expected {expected} everywhere)")
            if args.rank == 0:
                tmp = progress.with_suffix(".tmp")
                tmp.write_text(str(op))
                tmp.replace(progress)
            if op == args.early:
                Path(f"{progress}.{args.rank}").touch()
                while not Path(f"{progress}.go").exists():
                    time.sleep(0.01)
    return 0


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _done(progress: Path) -> int:
    try:
        return int(progress.read_text())
    except (FileNotFoundError, ValueError):
        return 0


def driver(args: argparse.Namespace) -> str:
    from mlfabric.cluster import LocalCluster
    from mlfabric.testbed.topologies import to_toml

    hosts = [f"h{i}" for i in range(args.ranks)]
    links = [{"a": h, "b": "sw", "mbps": 10_000} for h in hosts]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mlfb-armem-") as tmp:
        work = Path(tmp)
        topo = work / "topology.toml"
        topo.write_text(to_toml({"hosts": hosts, "switches": ["sw"], "links": links}))
        progress = work / "progress"
        with LocalCluster(topo, policy="fair", workdir=work / "run", ready_timeout=120) as cluster:
            pids = {h: int(cluster.daemons[h]["pid"]) for h in hosts}
            base = {h: _rss(p) for h, p in pids.items()}
            common = ["rank", "--job", "mem", "--world", str(args.ranks), "--mb", str(args.mb)]
            common += ["--ops", str(args.ops), "--early", str(args.early), "--progress", str(progress)]
            procs = [
                cluster.spawn(h, [*ME, *common, "--rank", str(r)], name=f"rank{r}")
                for r, h in enumerate(hosts)
            ]
            start = time.monotonic()
            early: dict[str, int] = {}
            cpu0: dict[str, float] = {}
            said = start
            while True:
                done = _done(progress)
                if time.monotonic() - said >= 30:  # a long run says how far it is
                    said = time.monotonic()
                    rss = max(_rss(p) for p in pids.values()) / 1e6
                    print(
                        f"{done}/{args.ops} all-reduces in {said - start:.0f} s; "
                        f"largest daemon RSS {rss:.0f} MB",
                        file=sys.stderr,
                        flush=True,
                    )
                if not early and all(Path(f"{progress}.{r}").exists() for r in range(args.ranks)):
                    early = {h: _rss(p) for h, p in pids.items()}  # every rank waits: nothing in flight
                    cpu0 = {h: _cpu(p) for h, p in pids.items()}
                    t_early, ops_early = time.monotonic(), done
                    Path(f"{progress}.go").touch()
                if done >= args.ops:
                    break
                for p in procs:
                    if p.popen.poll() not in (None, 0):
                        raise RuntimeError(f"{p.name} failed:\n{p.log_tail()}")
                time.sleep(0.05)
            for p in procs:
                cluster.wait(p, 120)
            seconds = time.monotonic() - start
            late = {h: _rss(p) for h, p in pids.items()}
            cpu1 = {h: _cpu(p) for h, p in pids.items()}
            rate_ops = args.ops - ops_early
            plan = Path(f"{progress}.plan").read_text()
            per_op = (time.monotonic() - t_early) / max(1, rate_ops)
    gb = args.mb / 1000 * rate_ops
    lines = [
        f"{args.ranks} ranks on loopback, {args.ops} all-reduces of {args.mb} MB float32 through the "
        f"daemons in {seconds:.0f} s ({per_op:.2f} s each after the {args.early}th); "
        f"{os.cpu_count()} CPUs, load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end",
        "",
        f"plan: {plan}",
        "",
        f"| daemon | RSS at start (MB) | after {args.early} (MB) | after {args.ops} (MB) | change | "
        f"CPU s per GB all-reduced ({args.early}..{args.ops}) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for h in hosts:
        change = (late[h] - early[h]) / early[h]
        cpu = (cpu1[h] - cpu0[h]) / gb
        mb = " | ".join(f"{v[h] / 1e6:.0f}" for v in (base, early, late))
        lines.append(f"| {h} | {mb} | {change:+.1%} | {cpu:.2f} |")
    total = sum(cpu1[h] - cpu0[h] for h in hosts) / gb
    worst = max((late[h] - early[h]) / early[h] for h in hosts)
    median = statistics.median((late[h] - early[h]) / early[h] for h in hosts)
    lines += [
        "",
        f"all daemons together: {total:.2f} CPU s per GB all-reduced; RSS change after {args.early} -> "
        f"{args.ops}: median {median:+.1%}, largest {worst:+.1%} (target: within 10 %)",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    r = sub.add_parser("rank")
    r.add_argument("--job")
    r.add_argument("--progress")
    for a in ("--world", "--rank", "--mb", "--ops", "--early"):
        r.add_argument(a, type=int)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mb", type=int, default=64, help="MB per all-reduce (default 64)")
    parser.add_argument("--ops", type=int, default=1000, help="all-reduces (default 1000)")
    parser.add_argument("--early", type=int, default=10, help="the first RSS sample, after this many")
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args()
    if args.command == "rank":
        return rank_main(args)
    table = driver(args)
    print(table)
    if args.out is not None:
        cmd = " ".join(["python", "experiments/bench_allreduce_memory.py", *sys.argv[1:]])
        args.out.write_text(f"# Daemon memory over many all-reduces\n\n`{cmd}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MLFABRIC_LOG_LEVEL", "WARNING")
    raise SystemExit(main())
