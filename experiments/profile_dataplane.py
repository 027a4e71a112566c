"""Where one process of a data-path case spends its CPU: ``perf`` or ``py-spy`` on it (DESIGN §9).

Runs a case of ``bench_dataplane.py`` (``push``, ``dataplane``, ``relay``, ``sum``) in a loop
and records one of its processes for ``--seconds``:

- ``--tool perf`` (default): ``perf record -e cpu-clock -g`` (hardware counters are not
  available on these machines); the report groups samples by the shared object and symbol
  they were taken in (the kernel's copies and page faults, the interpreter, numpy, the C
  extension) and prints the top ones;
- ``--tool py-spy``: ``py-spy record --native``; the report counts, per Python function, the
  samples whose stack passes through it ("inclusive") and those where it is the innermost
  Python frame ("own", native frames below it included).

The process (``--process``) is named by its role in the case: ``push``: ``receiver`` (the
server's daemon), ``sender`` (the worker's daemon), ``server``, ``worker``; ``dataplane``:
``receiver``; ``relay`` / ``sum``: ``middle``; ``allreduce`` (``bench_allreduce_memory.py``:
four ranks all-reducing through their daemons): ``h0`` .. ``h3``, a daemon. Also counts the
system calls of the process with ``strace -c -f`` for ``--strace`` seconds when ``strace`` is
installed (not for ``allreduce``).

Run::

    python experiments/profile_dataplane.py --case push --process receiver --mib 64 --seconds 15
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dataplane as bench


def _loop(session: bench.Session, stop: threading.Event) -> int:
    done = 0
    while not stop.is_set():
        next(session)
        done += 1
    return done


#: perf samples grouped by what they do: (category, pattern on "dso symbol"), first match wins.
CATEGORIES = [
    (
        "socket copy (kernel)",
        r"\[k\] .*(copy_to_iter|copy_from_iter|check_object_size|virt_addr_valid|copy_user)",
    ),
    (
        "page faults, mapping, zeroing",
        r"\[k\] .*(fault|clear_page|alloc_pages|folio|pte|page_range|get_user_pages|rmap|tlb)",
    ),
    (
        "sendfile (splice from the memfd)",
        r"\[k\] .*(splice|filemap_get|shmem_get|xas_|pipe_buf|pagefrags|iov_iter_extract)",
    ),
    (
        "wake-ups, switches, futex",
        r"\[k\] .*(spin_unlock_irq|finish_task_switch|futex|schedule|wake|pick_next|enqueue|dequeue)",
    ),
    ("TCP/IP, softirq, other kernel", r"\[k\]"),
    ("CRC-32 (C extension or ISA-L)", r"isal|fold_128|crc_le"),
    ("NaN/inf test (C extension: py_check; numpy: block sums)", r"py_check|pairwise_sum|isfinite"),
    ("copy (user space)", r"memmove|memcpy|py_copy_crc|copy_out"),
    ("summing (numpy add)", r"FLOAT_add|DOUBLE_add"),
    ("interpreter, protobuf, other user space", r"."),
]


def _perf_report(data: Path, top: int) -> str:
    out = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "--stdio", "-g", "none"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.strip() and not line.startswith("#")]
    shares: dict[str, float] = collections.defaultdict(float)
    for line in rows:
        pct, _, rest = line.strip().partition("%")
        for name, pattern in CATEGORIES:
            if re.search(pattern, rest):
                shares[name] += float(pct)
                break
    ranked = sorted(shares.items(), key=lambda kv: -kv[1])
    lines = ["by category:"] + [f"  {v:6.1f}%  {k}" for k, v in ranked]
    return "\n".join([*lines, "", "top symbols:", *rows[:top]])


def _pyspy_report(raw: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        python = [f for f in frames if ".py:" in f or ".py)" in f]
        for f in set(python):
            inclusive[f] += n
        if python:
            own[python[-1]] += n
    lines = [f"{total} samples", "", "own (innermost Python frame):"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in own.most_common(top)]
    lines += ["", "inclusive:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in inclusive.most_common(top)]
    return "\n".join(lines)


def _descendant_daemon(root: int, host: str) -> int | None:
    """The pid of the ``mlfabric daemon --host host`` among the descendants of ``root``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                parents[int(entry)] = int(
                    Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]
                )
    for pid in parents:
        q = parents.get(pid, 0)
        while q and q != root:
            q = parents.get(q, 0)
        if q != root:
            continue
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"daemon" in argv and b"--host" in argv and argv[argv.index(b"--host") + 1] == host.encode():
                return pid
    return None


def _allreduce(args: argparse.Namespace) -> int:
    """Record daemon ``args.process`` while four ranks all-reduce ``--mib`` MB through the daemons."""
    script = Path(__file__).resolve().parent / "bench_allreduce_memory.py"
    driver = subprocess.Popen(
        [sys.executable, str(script), "--ranks", "4", "--mb", str(args.mib), "--ops", "100000"],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while (pid := _descendant_daemon(driver.pid, args.process)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no daemon of host {args.process!r} started")
            time.sleep(0.5)
        time.sleep(20)  # the ranks start and warm up
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "profile"
            cmd = ["perf", "record", "-e", "cpu-clock", "-g", "-p", str(pid), "-o", str(out)]
            subprocess.run(["timeout", "-s", "INT", str(args.seconds), *cmd], capture_output=True)
            report = _perf_report(out, args.top)
    finally:
        driver.send_signal(signal.SIGINT)  # the driver's cluster stops its processes
        driver.wait(60)
    print(f"allreduce / {args.process} (pid {pid}), {args.mib} MB, load {os.getloadavg()[0]:.2f}")
    print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=["push", "dataplane", "relay", "sum", "allreduce"], default="push")
    parser.add_argument("--process", default="receiver", help="which process of the case (see above)")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--tool", choices=["perf", "py-spy"], default="perf")
    parser.add_argument("--strace", type=float, default=0.0, help="also count syscalls for this long")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    n = args.mib << 20
    ctx = mp.get_context("spawn")
    starts = {
        "push": lambda: bench.push_session("push", n, ctx),
        "dataplane": lambda: bench.dataplane_session("dataplane", n, ctx, pass_crc=True),
        "relay": lambda: bench.middle_session("relay", n, ctx, role="relay"),
        "sum": lambda: bench.middle_session("sum", n, ctx, role="sum"),
    }
    if args.case == "allreduce":
        return _allreduce(args)
    session = starts[args.case]()
    next(session)  # set up and warm up; the case's processes are in bench.PIDS now
    pid = bench.PIDS[args.process]
    stop = threading.Event()
    count: list[int] = []
    runner = threading.Thread(target=lambda: count.append(_loop(session, stop)))
    runner.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.strace and shutil.which("strace"):
                trace = subprocess.run(
                    ["timeout", "-s", "INT", str(args.strace), "strace", "-c", "-f", "-p", str(pid)],
                    capture_output=True,
                    text=True,
                )
                print(trace.stderr)
            out = Path(tmp) / "profile"
            if args.tool == "perf":
                cmd = ["perf", "record", "-e", "cpu-clock", "-g", "-p", str(pid), "-o", str(out)]
                subprocess.run(["timeout", "-s", "INT", str(args.seconds), *cmd], capture_output=True)
                report = _perf_report(out, args.top)
            else:
                cmd = ["py-spy", "record", "--native", "-r", "200", "-d", str(int(args.seconds))]
                subprocess.run([*cmd, "-f", "raw", "-o", str(out), "-p", str(pid)], capture_output=True)
                report = _pyspy_report(out, args.top)
    finally:
        stop.set()
        runner.join()
        session.close()
    load = f"{os.getloadavg()[0]:.2f}"
    print(f"{args.case} / {args.process} (pid {pid}), {args.mib} MiB, {count[0]} transfers, load {load}")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
