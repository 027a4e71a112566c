"""Memory of the receiving daemon under one big push, before, during and after (DESIGN §3, §5).

Starts ``mlfabric scheduler`` and two ``mlfabric daemon`` processes on loopback (h0: the
server's host, h1: the worker's), a server (in this process) with one float32 tensor of
``--mib`` MiB and a worker that pushes it ``--pushes`` times (one after another, or all at
once with ``--concurrent``; daemon options such as ``--max-inflight-bytes`` go after ``--``).
A thread samples the daemons' ``/proc/PID/status`` (VmRSS = RssAnon + RssFile + RssShmem) every
10 ms. The table gives h0's RSS before the first push, its peak while pushes were in flight,
right after the last push resolved, and after the daemon's receive pool trimmed its idle
buffers (``pool_idle_seconds``, 10 s); and the same for h1.

Run::

    python experiments/bench_memory.py --mib 1024 --out experiments/results/memory.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import mlfabric

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import start

MIB = 1 << 20


def rss(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of ``pid`` in bytes (``/proc/PID/status``)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Sampler:
    """Samples the RSS of some pids every ``interval`` seconds on a thread; keeps each one's peak."""

    def __init__(self, pids: dict[str, int], interval: float = 0.01) -> None:
        self.pids = pids
        self.interval = interval
        self.peak: dict[str, int] = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> None:
        self.peak = dict.fromkeys(self.pids, 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss(pid)["VmRSS"])


def gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def run(
    mib: int, pushes: int, daemon_args: list[str], settle: float, concurrent: bool = False
) -> list[dict[str, Any]]:
    """One run; rows of the table (one per daemon)."""
    work = Path(tempfile.mkdtemp(prefix="mlfabric-mem-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sched_proc, sched = start(
            ["scheduler", "--listen", "127.0.0.1:0", "--star", "2"],
            work / "s.json",
            work / "s.log",
            timeout=30.0,
        )
        procs.append(sched_proc)
        daemons = {}
        for host in ("h0", "h1"):
            cmd = ["daemon", "--host", host, "--scheduler", sched["address"]]
            cmd += ["--socket", str(work / f"{host}.sock"), *daemon_args]
            proc, info = start(cmd, work / f"{host}.json", work / f"{host}.log", timeout=30.0)
            procs.append(proc)
            daemons[host] = info
        n = mib * MIB // 4
        server = mlfabric.register_as_server(
            "job", "ps0", {"w": np.zeros(n, np.float32)}, daemon=daemons["h0"]["socket"]
        )
        serving = threading.Thread(target=server.serve, daemon=True)
        serving.start()
        worker = mlfabric.register_as_worker("job", name="w1", daemon=daemons["h1"]["socket"], wait=10)
        pids = {h: d["pid"] for h, d in daemons.items()}
        before = {h: rss(p)["VmRSS"] for h, p in pids.items()}
        sampler = Sampler(pids)
        sampler.start()
        update = {"w": np.ones(n, np.float32)}
        t0 = time.monotonic()
        if concurrent:  # all pushed before any is awaited (push() itself waits for push budget)
            results = [h.wait(600) for h in [worker.push("ps0", update) for _ in range(pushes)]]
        else:
            results = [worker.push("ps0", update).wait(600) for _ in range(pushes)]
        if not all(r.applied for r in results):
            raise RuntimeError(f"push not applied: {[r for r in results if not r.applied][:1]}")
        seconds = time.monotonic() - t0
        sampler.stop()
        after = {h: rss(p)["VmRSS"] for h, p in pids.items()}
        time.sleep(settle)
        settled = {h: rss(p)["VmRSS"] for h, p in pids.items()}
        worker.close()
        server.stop()
        serving.join(10)
        server.close()
        rows = []
        for h in pids:
            rows.append(
                {
                    "daemon": f"{h} ({'receiving' if h == 'h0' else 'sending'})",
                    "before": before[h],
                    "peak": sampler.peak[h],
                    "after": after[h],
                    "settled": settled[h],
                    "seconds": seconds,
                }
            )
        return rows
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def table(rows: list[dict[str, Any]], settle: float) -> str:
    lines = [
        f"| daemon | RSS before (GB) | peak (GB) | right after (GB) | after {settle:g} s idle (GB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['daemon']} | {gb(r['before'])} | {gb(r['peak'])} | {gb(r['after'])} | {gb(r['settled'])} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="payload size in MiB (default 1024)")
    parser.add_argument("--pushes", type=int, default=1, help="pushes, one after another (default 1)")
    parser.add_argument("--concurrent", action="store_true", help="push all before awaiting any")
    parser.add_argument("--settle", type=float, default=12.0, help="seconds idle before the last sample")
    parser.add_argument("--out", help="write the table (markdown) here")
    parser.add_argument("daemon_args", nargs="*", help="extra `mlfabric daemon` options (after --)")
    args = parser.parse_args()
    rows = run(args.mib, args.pushes, args.daemon_args, args.settle, args.concurrent)
    text = table(rows, args.settle)
    print(text)
    if args.out:
        cmd = " ".join(["python", "experiments/bench_memory.py", *sys.argv[1:]])
        with open(args.out, "a", encoding="utf-8") as out:
            out.write(f"`{cmd}` ({rows[0]['seconds']:.1f} s for the pushes)\n\n{text}\n\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MLFABRIC_LOG_LEVEL", "WARNING")
    sys.exit(main())
