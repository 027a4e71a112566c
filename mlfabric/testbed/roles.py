"""Synthetic server and worker processes for testbed runs (uses only the public API).

Run inside emulated hosts (``MLFABRIC_DAEMON`` points at the host's daemon)::

    python -m mlfabric.testbed.roles server --job j --name ps --update-bytes 4000000 \
        --tau-max 16 --out ps.json
    python -m mlfabric.testbed.roles worker --job j --server ps --name w0 \
        --update-bytes 4000000 --duration 60 --compute-delay 0.1 --out w0.csv

A worker loops until ``--duration`` seconds (or ``--pushes``) are done: ``get`` the model,
compute for ``--compute-delay`` seconds (a compute straggler has a larger one — the paper's
CS settings), ``push`` an update of ``--update-bytes``. With ``--window 1`` (the default) it
waits for each push to resolve before the next iteration; with ``--window N`` it pushes
asynchronously and keeps up to N pushes outstanding: an iteration starts (``get``) only
when fewer than N are, so a worker's transfers overlap its compute and each other. Each
push becomes one CSV row (:data:`PUSH_FIELDS`): wall-clock start (the push call) and end
(when it resolved), status, delay, server version, reason; pushes still unresolved at the
end are waited for. The server applies updates (the default ``model -= update``) until
SIGTERM or ``--duration``, then writes a JSON summary.
"""

from __future__ import annotations

import argparse
import csv
import json
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

__all__ = ["PUSH_FIELDS", "main", "run_server", "run_worker"]

#: Columns of a worker's CSV of push results.
PUSH_FIELDS = [
    "worker",
    "update_id",
    "status",
    "delay",
    "version",
    "reason",
    "bytes",
    "start",
    "end",
    "seconds",
    "compute_delay",
    "window",
]


def _update(nbytes: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.integers(-3, 4, size=max(nbytes // 4, 1)).astype(np.float32)}


def run_server(args: argparse.Namespace) -> int:
    """Serve one model of ``--update-bytes`` float32 until SIGTERM or ``--duration``."""
    import mlfabric

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    model = {"w": np.zeros(max(args.update_bytes // 4, 1), dtype=np.float32)}
    params = mlfabric.Params(tau_max=None if args.tau_max < 0 else args.tau_max)
    server = mlfabric.register_as_server(args.job, args.name, model, params)
    if args.ready_file:
        Path(args.ready_file).write_text(json.dumps({"name": args.name}))
    handled = 0
    deadline = time.monotonic() + args.duration if args.duration else None
    with server:
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            handled += server.serve(until=stop, timeout=1.0)
        summary = {"name": args.name, "version": server.version, "applied": server.applied}
        summary |= {"dropped": server.dropped, "handled": handled}
    if args.out:
        Path(args.out).write_text(json.dumps(summary))
    return 0


def _resolve(handle: Any, timeout: float) -> tuple[Any, float]:
    """Wait for one push; its result and the wall-clock time it resolved."""
    result = handle.wait(timeout=timeout)
    return result, time.time()


def run_worker(args: argparse.Namespace) -> int:
    """Push updates to ``--server`` until ``--duration`` s or ``--pushes`` pushes; write the CSV.

    Up to ``--window`` pushes are outstanding at once (see the module docstring).
    """
    import mlfabric

    worker = mlfabric.register_as_worker(args.job, name=args.name, wait=args.wait)
    update = _update(args.update_bytes, args.seed)
    nbytes = sum(int(v.nbytes) for v in update.values())
    window = max(1, args.window)
    rows: list[dict[str, object]] = []
    outstanding: set[Future[tuple[Any, float]]] = set()
    started = time.monotonic()
    pushed = 0

    def record(future: Future[tuple[Any, float]], start: float) -> None:
        result, end = future.result()
        rows.append(
            {
                "worker": args.name,
                "update_id": result.update_id,
                "status": result.status,
                "delay": result.delay,
                "version": result.version,
                "reason": result.reason,
                "bytes": nbytes,
                "start": f"{start:.6f}",
                "end": f"{end:.6f}",
                "seconds": f"{end - start:.6f}",
                "compute_delay": args.compute_delay,
                "window": window,
            }
        )

    starts: dict[Future[tuple[Any, float]], float] = {}
    with worker, ThreadPoolExecutor(max_workers=window, thread_name_prefix="push-wait") as waiters:
        while True:
            if args.pushes and pushed >= args.pushes:
                break
            if args.duration and time.monotonic() - started >= args.duration:
                break
            while len(outstanding) >= window:
                done, outstanding = wait(outstanding, return_when=FIRST_COMPLETED)
                for future in done:
                    record(future, starts.pop(future))
            if not args.no_get:
                worker.get(args.server)
            time.sleep(args.compute_delay)
            start = time.time()
            future = waiters.submit(_resolve, worker.push(args.server, update), args.push_timeout)
            starts[future] = start
            outstanding.add(future)
            pushed += 1
        for future in outstanding:
            record(future, starts.pop(future))
    rows.sort(key=lambda r: float(str(r["start"])))
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PUSH_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m mlfabric.testbed.roles", description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    for role in ("server", "worker"):
        p = sub.add_parser(role)
        p.add_argument("--job", required=True)
        p.add_argument("--name", required=True)
        p.add_argument("--update-bytes", type=int, required=True)
        p.add_argument("--duration", type=float, default=0.0, help="seconds (0: no limit)")
        p.add_argument("--out", required=role == "worker")
    s = sub.choices["server"]
    s.add_argument("--tau-max", type=int, default=-1)
    s.add_argument("--ready-file")
    w = sub.choices["worker"]
    w.add_argument("--server", required=True)
    w.add_argument("--pushes", type=int, default=0, help="stop after this many pushes (0: no limit)")
    w.add_argument("--compute-delay", type=float, default=0.0, help="seconds of 'compute' per iteration")
    w.add_argument("--no-get", action="store_true", help="do not pull the model before each push")
    w.add_argument("--window", type=int, default=1, help="pushes outstanding at once (1: wait for each push)")
    w.add_argument("--push-timeout", type=float, default=300.0)
    w.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the server to register")
    w.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return run_server(args) if args.role == "server" else run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
