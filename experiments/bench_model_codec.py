"""The model to the workers, compressed or not: time for W workers to ``get`` a new version.

The downlink problem of issue 26: with compressed pushes every worker still ``get``s the whole
float32 model through the server's link. Here the scheduler service (a process) and one daemon
per host (in this process, on loopback) serve a ``--mib`` float32 model from host ``ps``, whose
daemon sends at most ``--mbps`` (its egress token bucket, ``DaemonConfig.egress_rate``: the
server's link), to ``--workers`` workers on other hosts of the same switch (so every get
crosses the server's link; no relay). Per seed and codec (``Params(model_compression=)``, the
codecs interleaved within each seed), a fresh job: the server publishes version 1 (its encode
included in the time) and every worker ``get``s it with ``min_version=1`` at once; printed: the
wall time until all have it, the bytes the server's daemon served per get (its stats), and per
seed the ratio of each codec's time to the uncompressed one's; medians and spread.

Not collected by pytest (no ``test_`` prefix). Run::

    python experiments/bench_model_codec.py --mib 4.5 --mbps 100 --workers 3 --seeds 3

Measured (experiments/results/bench_model_codec.md; 2 shared cores, load ~6.7): all 3 workers
have the 4.5 MiB model after 1.133 s uncompressed, 0.576 s with fp16, 0.570 s with bf16
(medians of 3 seeds; per-seed ratios to uncompressed 0.44-0.51), 4,718,592 against 2,359,296
bytes served per get.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import mlfabric
from mlfabric.cluster import ManagedProcess, wait_for_ready_file
from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.host import Daemon


def topology(workers: int) -> str:
    hosts = ["ps", *(f"w{i}" for i in range(workers))]
    links = "".join(f'\n[[links]]\na = "{h}"\nb = "sw"\nmbps = 10000\n' for h in hosts)
    return f'hosts = {hosts!r}\nswitches = ["sw"]\n{links}'.replace("'", '"')


def round_once(
    daemons: dict[str, Daemon], job: str, codec: str, model: dict[str, np.ndarray], pool: ThreadPoolExecutor
) -> tuple[float, int]:
    """One job with ``codec``: seconds until every worker got version 1, and ps's bytes served."""
    hosts = [h for h in daemons if h != "ps"]
    params = mlfabric.Params(model_compression=None if codec == "none" else codec)
    server = mlfabric.register_as_server(job, "ps0", model, params, daemon=daemons["ps"].config.socket_path)
    workers = [
        mlfabric.register_as_worker(job, name=h, daemon=daemons[h].config.socket_path, wait=10) for h in hosts
    ]
    try:
        before = sum(daemons["ps"].stats().model_bytes_served.values())
        t0 = time.perf_counter()
        server.version = 1
        server.publish()
        for got in pool.map(lambda w: w.get("ps0", min_version=1, timeout=60), workers):
            assert got[0] == 1
        seconds = time.perf_counter() - t0
        served = sum(daemons["ps"].stats().model_bytes_served.values()) - before
    finally:
        for c in (*workers, server):
            c.close()
    return seconds, served // len(workers)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=float, default=4.5, help="model size, MiB of float32")
    parser.add_argument("--mbps", type=float, default=100.0, help="the server daemon's egress, Mbit/s")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--codecs", nargs="+", default=["none", "fp16", "bf16"])
    args = parser.parse_args()
    codecs = ["none", *(c for c in args.codecs if c != "none")]
    with tempfile.TemporaryDirectory(prefix="bench-model-codec-") as tmp:
        work = Path(tmp)
        (work / "topology.toml").write_text(topology(args.workers))
        ready = work / "scheduler.json"
        log = open(work / "scheduler.log", "wb")  # noqa: SIM115 - closed below
        argv = [sys.executable, "-m", "mlfabric", "scheduler", "--listen", "127.0.0.1:0"]
        argv += ["--topology", str(work / "topology.toml"), "--ready-file", str(ready)]
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        daemons: dict[str, Daemon] = {}
        try:
            sched = wait_for_ready_file(ready, ManagedProcess("scheduler", popen, work / "scheduler.log"), 30)
            for host in ["ps", *(f"w{i}" for i in range(args.workers))]:
                config = DaemonConfig(
                    host=host,
                    scheduler=sched["address"],
                    socket_path=os.path.join(tmp, f"{host}.sock"),
                    egress_rate=args.mbps * 1e6 / 8 if host == "ps" else None,
                )
                daemons[host] = Daemon(config)
                daemons[host].start(timeout=20)
            results: dict[str, list[tuple[float, int]]] = {c: [] for c in codecs}
            with ThreadPoolExecutor(args.workers) as pool:
                for seed in range(args.seeds):
                    rng = np.random.default_rng(seed)
                    model = {"w": rng.standard_normal(int(args.mib * 2**20 / 4)).astype(np.float32)}
                    order = codecs if seed % 2 == 0 else codecs[::-1]
                    for codec in order:
                        results[codec].append(round_once(daemons, f"{codec}-{seed}", codec, model, pool))
        finally:
            for d in daemons.values():
                d.stop()
            popen.terminate()
            popen.wait(10)
            log.close()
    report(results, args)


def report(results: dict[str, list[tuple[float, int]]], args: Any) -> None:
    base = [s for s, _ in results["none"]]
    print(
        f"{args.workers} workers get a {args.mib} MiB float32 model through {args.mbps:g} Mbit/s "
        f"(the server daemon's egress), {args.seeds} seeds"
    )
    print(
        "| codec | s until all have it: median [min, max] | bytes served per get | ratio to none per seed |"
    )
    print("| --- | ---: | ---: | --- |")
    for codec, runs in results.items():
        secs = [s for s, _ in runs]
        ratios = ", ".join(f"{s / b:.2f}" for s, b in zip(secs, base, strict=True))
        print(
            f"| {codec} | {statistics.median(secs):.3f} [{min(secs):.3f}, {max(secs):.3f}] "
            f"| {runs[0][1]:,} | {ratios} |"
        )


if __name__ == "__main__":
    main()
