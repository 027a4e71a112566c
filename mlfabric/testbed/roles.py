"""Synthetic server and worker processes for testbed runs (uses only the public API).

Run inside emulated hosts (``MLFABRIC_DAEMON`` points at the host's daemon)::

    python -m mlfabric.testbed.roles server --job j --name ps --update-bytes 4000000 \
        --tau-max 16 --out ps.json
    python -m mlfabric.testbed.roles worker --job j --server ps --name w0 \
        --update-bytes 4000000 --duration 60 --compute-delay 0.1 --out w0.csv

A worker loops until ``--duration`` seconds (or ``--pushes``) are done: ``get`` the model,
compute for ``--compute-delay`` seconds (a compute straggler has a larger one — the paper's
CS settings), ``push`` an update of ``--update-bytes`` and wait for it to resolve. Each
push becomes one CSV row (:data:`PUSH_FIELDS`): wall-clock start and end, status, delay,
server version, reason. The server applies updates (the default ``model -= update``) until
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
from pathlib import Path
from types import FrameType

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


def run_worker(args: argparse.Namespace) -> int:
    """Push updates to ``--server`` until ``--duration`` s or ``--pushes`` pushes; write the CSV."""
    import mlfabric

    worker = mlfabric.register_as_worker(args.job, name=args.name, wait=args.wait)
    update = _update(args.update_bytes, args.seed)
    nbytes = sum(int(v.nbytes) for v in update.values())
    rows: list[dict[str, object]] = []
    started = time.monotonic()
    with worker:
        while True:
            if args.pushes and len(rows) >= args.pushes:
                break
            if args.duration and time.monotonic() - started >= args.duration:
                break
            if not args.no_get:
                worker.get(args.server)
            time.sleep(args.compute_delay)
            start = time.time()
            result = worker.push(args.server, update).wait(timeout=args.push_timeout)
            end = time.time()
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
                }
            )
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
    w.add_argument("--push-timeout", type=float, default=300.0)
    w.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the server to register")
    w.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return run_server(args) if args.role == "server" else run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
