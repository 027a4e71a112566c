"""The scheduler's ``auto`` codec against fixed ones: time for a worker's pushes, slow and fast link.

The scheduler service (a process, policy ``stf``) and one daemon per host (in this process,
on loopback): a server on host ``ps`` and a worker on host ``w0`` whose NIC is ``--mbps`` in
the topology and whose daemon sends at most that (its egress token bucket,
``DaemonConfig.egress_rate``); ``--mbps 0``: a 10 Gbit/s NIC in the topology and no limit
(loopback as fast as this machine moves it). Per seed and system (the systems interleaved
within each seed, the order reversed every other seed), a fresh job whose worker pushes
``--pushes`` updates of ``--mib`` MiB float32 one after the other (push, wait for APPLIED);
printed: the wall time of those pushes, the codec they travelled with, and per seed the ratio
of each system's time to the uncompressed one's and ``auto``'s to the best fixed codec's.

Systems: ``none``, ``fp16``, ``int8`` (``push(codec=...)``), ``auto`` (the job registered
with ``Params(compression="auto")``: the scheduler chooses from the path's bandwidth; its
advice arrives before the worker's registration is acknowledged).

Not collected by pytest (no ``test_`` prefix). Run::

    python experiments/bench_auto_codec.py --mbps 25 --pushes 4 --seeds 3
    python experiments/bench_auto_codec.py --mbps 0 --pushes 20 --seeds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import mlfabric
from mlfabric.cluster import ManagedProcess, wait_for_ready_file
from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.host import Daemon

SYSTEMS = ("none", "fp16", "int8", "auto")


def topology(mbps: float) -> str:
    """A star: ``ps`` at 10 Gbit/s, ``w0`` at ``mbps`` (10 Gbit/s when 0)."""
    return (
        'hosts = ["ps", "w0"]\nswitches = ["sw"]\n'
        '[[links]]\na = "ps"\nb = "sw"\nmbps = 10000\n'
        f'[[links]]\na = "w0"\nb = "sw"\nmbps = {mbps or 10000:g}\n'
    )


def round_once(
    daemons: dict[str, Daemon], job: str, system: str, n: int, pushes: int, seed: int
) -> tuple[float, str]:
    """One job: seconds for ``pushes`` pushes of ``system``, and the codec they travelled with."""
    params = mlfabric.Params(compression="auto" if system == "auto" else None)
    model = {"w": np.zeros(n, np.float32)}
    server = mlfabric.register_as_server(job, "ps0", model, params, daemon=daemons["ps"].config.socket_path)
    serving = threading.Thread(
        target=server.serve, kwargs={"max_updates": pushes, "timeout": 600}, daemon=True
    )
    serving.start()
    worker = mlfabric.register_as_worker(job, name="w0", daemon=daemons["w0"].config.socket_path, wait=10)
    worker.rng = np.random.default_rng(seed)
    rng = np.random.default_rng(seed)
    updates = [{"w": rng.standard_normal(n).astype(np.float32)} for _ in range(pushes)]
    codec = None if system in ("none", "auto") else system
    before = dict(daemons["w0"].stats().pushes)
    try:
        t0 = time.perf_counter()
        for update in updates:
            result = worker.push("ps0", update, codec=codec).wait(timeout=600)
            assert result.status == mlfabric.APPLIED, result.reason
        seconds = time.perf_counter() - t0
    finally:
        serving.join(60)
        worker.close()
        server.close()
    after = daemons["w0"].stats().pushes
    used = sorted(c for c in after if after[c] > before.get(c, 0))
    return seconds, "+".join(used)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=float, default=4.5, help="update size, MiB of float32")
    parser.add_argument(
        "--mbps", type=float, default=25.0, help="the worker's NIC and egress, Mbit/s (0: fast)"
    )
    parser.add_argument("--pushes", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    n = int(args.mib * 2**20 / 4)
    with tempfile.TemporaryDirectory(prefix="bench-auto-codec-") as tmp:
        work = Path(tmp)
        (work / "topology.toml").write_text(topology(args.mbps))
        ready = work / "scheduler.json"
        log = open(work / "scheduler.log", "wb")  # noqa: SIM115 - closed below
        argv = [sys.executable, "-m", "mlfabric", "scheduler", "--listen", "127.0.0.1:0", "--policy", "stf"]
        argv += ["--topology", str(work / "topology.toml"), "--ready-file", str(ready)]
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        daemons: dict[str, Daemon] = {}
        try:
            sched = wait_for_ready_file(ready, ManagedProcess("scheduler", popen, work / "scheduler.log"), 30)
            for host in ("ps", "w0"):
                config = DaemonConfig(
                    host=host,
                    scheduler=sched["address"],
                    socket_path=os.path.join(tmp, f"{host}.sock"),
                    egress_rate=args.mbps * 1e6 / 8 if host == "w0" and args.mbps else None,
                )
                daemons[host] = Daemon(config)
                daemons[host].start(timeout=20)
            results: dict[str, list[tuple[float, str]]] = {s: [] for s in SYSTEMS}
            for seed in range(args.seeds):
                order = SYSTEMS if seed % 2 == 0 else SYSTEMS[::-1]
                for system in order:
                    results[system].append(
                        round_once(daemons, f"{system}-{seed}", system, n, args.pushes, seed)
                    )
        finally:
            for d in daemons.values():
                d.stop()
            popen.terminate()
            popen.wait(10)
            log.close()
    report(results, args)


def report(results: dict[str, list[tuple[float, str]]], args: Any) -> None:
    link = (
        f"{args.mbps:g} Mbit/s (the worker daemon's egress)"
        if args.mbps
        else "loopback, unlimited (10 Gbit/s in the topology)"
    )
    print(
        f"{args.pushes} pushes of {args.mib} MiB float32, one after the other, over {link}; "
        f"{args.seeds} seeds"
    )
    print(
        "| system | codec used | s for the pushes: median [min, max] | x none per seed "
        "| auto: best fixed / auto per seed |"
    )
    print("| --- | --- | ---: | --- | --- |")
    base = [s for s, _ in results["none"]]
    fixed = [min(results[f][i][0] for f in SYSTEMS if f != "auto") for i in range(len(base))]
    for system, runs in results.items():
        secs = [s for s, _ in runs]
        to_none = ", ".join(f"{b / s:.2f}" for s, b in zip(secs, base, strict=True))
        to_best = (
            ", ".join(f"{f / s:.2f}" for s, f in zip(secs, fixed, strict=True)) if system == "auto" else "-"
        )
        used = "/".join(sorted({u for _, u in runs}))
        print(
            f"| {system} | {used} | {statistics.median(secs):.3f} [{min(secs):.3f}, {max(secs):.3f}] "
            f"| {to_none} | {to_best} |"
        )


if __name__ == "__main__":
    main()
