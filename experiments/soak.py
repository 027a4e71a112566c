"""Soak: N workers pushing on loopback for T minutes; does anything grow or slow down? (DESIGN §5)

Starts ``mlfabric scheduler`` (``--star H``, ``--metrics-port 0``) and one ``mlfabric daemon``
per host; a server (in this process) on h0 with a ``--kib`` KiB float32 model, and
``--workers`` workers spread over h1..h{H-1}, each a thread with its own connection to its
host's daemon that pushes, waits for the verdict, sleeps ``--gap`` seconds, and again, until
the run's time is up. Integer-valued updates (all ones) make the final model prove how many
pushes were applied. Everything is bounded: each push is awaited at most ``--push-timeout``
seconds, the run stops itself after ``--minutes`` (or ``--seconds``), and every process it
started is stopped at the end.

Every ``--interval`` seconds it samples the scheduler's and daemons' RSS (``VmRSS``) and open
file descriptors (``/proc/PID/fd``), the push latencies (push to verdict) of the window, and the
scheduler's decision-time histogram (``mlfabric_decision_seconds``; the p99 is the upper bound
of the bucket it falls in). The baseline is the samples after ``--warmup`` seconds (default:
half the run). The scheduler and a server's daemon keep bounded caches (the last 100,000
outcomes and verdicts, for late duplicates and queries): at a few hundred pushes a second they
fill in the first minutes, and that growth is bounded, not a leak, so the default baseline comes
after it; the report also gives the growth from the first sample. RSS and fds are compared as
medians of ``WINDOW`` samples at the baseline and at the end (in-flight memfds come and go).

Targets: RSS growth < 5 % and no fd growth from the baseline to the end, no
push slower than 10x the median, decision p99 steady. The script prints a table and writes
it (``--out``); it exits 1 when a push was not APPLIED or did not resolve, or the model
disagrees with the pushes applied (timing targets are reported, not enforced).

Run (a quiet machine; defaults 64 workers, 10 minutes)::

    python experiments/soak.py --out experiments/results/soak.md

A short run::

    python experiments/soak.py --workers 16 --minutes 2 --out experiments/results/soak.md
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import mlfabric

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import decision_buckets, proc_stats, quantile_bound, start


@dataclass
class Pushes:
    """Push latencies and outcomes, thread-safe; ``take()`` returns the window's latencies."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    window: list[float] = field(default_factory=list)
    all: list[float] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def record(self, seconds: float, status: str, reason: str) -> None:
        with self.lock:
            self.window.append(seconds)
            self.all.append(seconds)
            self.outcomes[status] = self.outcomes.get(status, 0) + 1
            if status != mlfabric.APPLIED and len(self.problems) < 5:
                self.problems.append(f"{status}: {reason}")

    def take(self) -> list[float]:
        with self.lock:
            window, self.window = self.window, []
        return window


def run(args: argparse.Namespace) -> tuple[str, bool]:
    """One soak run: (the report in markdown, whether every push was APPLIED and counted)."""
    seconds = args.seconds if args.seconds is not None else args.minutes * 60.0
    work = Path(tempfile.mkdtemp(prefix="mlfabric-soak-"))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    hosts = [f"h{i}" for i in range(args.hosts)]
    try:
        sched_cmd = ["scheduler", "--listen", "127.0.0.1:0", "--star", str(args.hosts)]
        sched_cmd += ["--policy", args.policy, "--metrics-port", "0"]
        procs["scheduler"], sched = start(sched_cmd, work / "s.json", work / "s.log")
        sockets = {}
        for h in hosts:
            cmd = [
                "daemon",
                "--host",
                h,
                "--scheduler",
                sched["address"],
                "--socket",
                str(work / f"{h}.sock"),
            ]
            procs[h], info = start(cmd, work / f"{h}.json", work / f"{h}.log")
            sockets[h] = info["socket"]
        n = args.kib * 256
        server = mlfabric.register_as_server(
            "soak", "ps0", {"w": np.zeros(n, np.float32)}, daemon=sockets["h0"]
        )
        serving = threading.Thread(target=server.serve, daemon=True)
        serving.start()
        pushes = Pushes()
        stop = threading.Event()

        def work_loop(i: int) -> None:
            host = hosts[1 + i % (args.hosts - 1)]
            worker = mlfabric.register_as_worker("soak", name=f"w{i}", daemon=sockets[host], wait=30)
            update = {"w": np.ones(n, np.float32)}
            try:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        result = worker.push("ps0", update).wait(args.push_timeout)
                    except TimeoutError as exc:
                        pushes.record(time.monotonic() - t0, "UNRESOLVED", str(exc))
                        continue
                    pushes.record(time.monotonic() - t0, result.status, result.reason)
                    stop.wait(args.gap)
            finally:
                worker.close()

        threads = [threading.Thread(target=work_loop, args=(i,), daemon=True) for i in range(args.workers)]
        for t in threads:
            t.start()
        rows, started = [], time.monotonic()
        warmup = seconds / 2 if args.warmup is None else args.warmup
        samples: list[dict[str, tuple[int, int]]] = []
        first_base = -1
        buckets = decision_buckets(sched["metrics_port"])
        last: dict[str, tuple[int, int]] = {}
        while (elapsed := time.monotonic() - started) < seconds:
            time.sleep(min(args.interval, max(0.0, seconds - elapsed)))
            now = decision_buckets(sched["metrics_port"])
            p99, decisions = quantile_bound(buckets, now)
            buckets = now
            last = {name: proc_stats(p.pid) for name, p in procs.items()}
            window = pushes.take()
            samples.append(last)
            if first_base < 0 and time.monotonic() - started >= warmup:
                first_base = len(samples) - 1
            rows.append(
                {
                    "t": time.monotonic() - started,
                    "pushes": len(window),
                    "median": statistics.median(window) if window else 0.0,
                    "max": max(window) if window else 0.0,
                    "p99": p99,
                    "decisions": decisions,
                    "rss": sum(r for r, _ in last.values()),
                    "fds": sum(f for _, f in last.values()),
                }
            )
            print(_row(rows[-1]), flush=True)
        stop.set()
        for t in threads:
            t.join(args.push_timeout + 10)
        server.stop()
        serving.join(10)
        applied = pushes.outcomes.get(mlfabric.APPLIED, 0)
        model_ok = bool(np.all(np.asarray(server.model["w"]) == -float(applied)))
        server.close()
        base = _window(samples[first_base : first_base + WINDOW]) if first_base >= 0 else {}
        end = _window(samples[-WINDOW:])
        early = _window(samples[:WINDOW])
        report = _report(args, seconds, warmup, rows, (early, base, end), pushes, applied, model_ok)
        ok = model_ok and applied > 0 and set(pushes.outcomes) == {mlfabric.APPLIED}
        return report, ok
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


#: samples whose median stands for one point in time (RSS, fds)
WINDOW = 3


def _window(samples: list[dict[str, tuple[int, int]]]) -> dict[str, tuple[int, int]]:
    """Per process, the median RSS and the median fd count of ``samples``."""
    names = set().union(*samples) if samples else set()
    return {
        name: (
            int(statistics.median(s[name][0] for s in samples if name in s)),
            int(statistics.median(s[name][1] for s in samples if name in s)),
        )
        for name in names
    }


def _growth(
    base: dict[str, tuple[int, int]], end: dict[str, tuple[int, int]]
) -> dict[str, tuple[float, int]]:
    """Per process, RSS growth in percent and fd growth from ``base`` to ``end``."""
    return {
        name: (100.0 * (end[name][0] - base[name][0]) / base[name][0], end[name][1] - base[name][1])
        for name in end
        if name in base and base[name][0]
    }


def _row(r: dict[str, Any]) -> str:
    return (
        f"| {r['t']:.0f} | {r['pushes']} | {r['median'] * 1e3:.1f} | {r['max'] * 1e3:.1f} | "
        f"{r['p99'] * 1e3:g} ({r['decisions']}) | {r['rss'] / 1e6:.1f} | {r['fds']} |"
    )


def _report(
    args: argparse.Namespace,
    seconds: float,
    warmup: float,
    rows: list[dict[str, Any]],
    points: tuple[dict[str, tuple[int, int]], ...],
    pushes: Pushes,
    applied: int,
    model_ok: bool,
) -> str:
    early, base, last = points
    growth = _growth(base, last)
    since_start = _growth(early, last)
    worst_rss = max((g for g, _ in growth.values()), default=0.0)
    worst_fd = max((f for _, f in growth.values()), default=0)
    median = statistics.median(pushes.all) if pushes.all else 0.0
    slowest = max(pushes.all, default=0.0)
    p99s = [r["p99"] for r in rows if r["decisions"]]
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(pushes.outcomes.items()))
    lines = [
        f"Soak: {args.workers} workers on {args.hosts - 1} worker hosts, policy {args.policy}, "
        f"{seconds:g} s, {args.kib} KiB updates, {args.gap:g} s between a worker's pushes.",
        "",
        "| t (s) | pushes | median latency (ms) | max latency (ms) | decision p99 <= (ms) (decisions) "
        "| RSS, all processes (MB) | fds, all processes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(_row(r) for r in rows),
        "",
        "| target | measured | met |",
        "| --- | --- | --- |",
        f"| RSS growth < 5 % (per process, from {warmup:g} s to the end) | {worst_rss:+.1f} % (worst) "
        f"| {'yes' if worst_rss < 5 else 'no'} |",
        f"| no fd growth | {worst_fd:+d} (worst) | {'yes' if worst_fd <= 0 else 'no'} |",
        f"| no push slower than 10x the median | median {median * 1e3:.1f} ms, slowest "
        f"{slowest * 1e3:.1f} ms ({slowest / median if median else 0:.1f}x) "
        f"| {'yes' if median and slowest <= 10 * median else 'no'} |",
        f"| decision p99 steady | first {p99s[0] * 1e3 if p99s else 0:g} ms, last "
        f"{p99s[-1] * 1e3 if p99s else 0:g} ms, max {max(p99s, default=0) * 1e3:g} ms "
        f"| {'yes' if p99s and p99s[-1] <= max(p99s[0], 1e-3) * 2 else 'no'} |",
        "",
        f"Pushes: {sum(pushes.outcomes.values())} ({outcomes}); "
        f"model agrees with {applied} applied: {'yes' if model_ok else 'NO'}."
        + (f" First problems: {pushes.problems}" if pushes.problems else ""),
        "",
        "Per process (first samples -> baseline -> end, medians of "
        f"{WINDOW} samples): "
        + ", ".join(
            f"{name} {early[name][0] / 1e6:.0f}->{base[name][0] / 1e6:.0f}->{last[name][0] / 1e6:.0f} MB, "
            f"{early[name][1]}->{base[name][1]}->{last[name][1]} fds"
            for name in sorted(last)
            if name in base and name in early
        ),
        "",
        "RSS growth from the first samples (bounded caches filling included): "
        + ", ".join(f"{name} {g:+.1f} %" for name, (g, _) in sorted(since_start.items())),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64, help="workers (default 64)")
    parser.add_argument(
        "--hosts", type=int, default=9, help="hosts: h0 the server's, the rest workers' (default 9)"
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="run time (default 10)")
    parser.add_argument("--seconds", type=float, help="run time in seconds (overrides --minutes)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds per sample (default 10)")
    parser.add_argument(
        "--warmup",
        type=float,
        help="seconds before the baseline samples (default: half the run, after the bounded caches fill)",
    )
    parser.add_argument("--kib", type=int, default=64, help="update size in KiB (default 64)")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between a worker's pushes")
    parser.add_argument("--push-timeout", type=float, default=60.0, help="longest wait for one verdict")
    parser.add_argument("--policy", default="fair", help="scheduler policy (default fair)")
    parser.add_argument("--out", help="write the report (markdown) here")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.hosts < 2:
        parser.error("need at least 1 worker and 2 hosts")
    report, ok = run(args)
    print(report)
    if args.out:
        cmd = " ".join(["python", "experiments/soak.py", *(argv if argv is not None else sys.argv[1:])])
        Path(args.out).write_text(f"# Soak\n\n`{cmd}`\n\n{report}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
