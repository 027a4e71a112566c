"""Server and worker processes for the end-to-end integration test (run as a script).

``python roles.py server OUT_DIR TAU_MAX`` serves a float64 model of integer values and, on
SIGTERM, writes the final model and the ids and delays of every update it applied.
``python roles.py worker OUT_DIR RANK PUSHES`` pushes ``PUSHES`` integer-valued float64
updates (a fresh ``get`` every few pushes, so base versions vary and some delays exceed
tau_max), waits for every verdict and writes them.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

import mlfabric

JOB, SERVER = "itest", "ps0"
SHAPES = {"w": (4, 3), "b": (7,)}


def initial_model() -> dict[str, np.ndarray]:
    """The model the server starts from (integer values, float64)."""
    rng = np.random.default_rng(12345)
    return {k: rng.integers(-100, 100, size=s).astype(np.float64) for k, s in SHAPES.items()}


def update_for(rank: int, index: int) -> dict[str, np.ndarray]:
    """The ``index``-th update of worker ``rank`` (integer values, float64): reproducible."""
    rng = np.random.default_rng([rank, index])
    return {k: rng.integers(-5, 6, size=s).astype(np.float64) for k, s in SHAPES.items()}


def server(out: Path, tau_max: int) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    srv = mlfabric.register_as_server(JOB, SERVER, initial_model(), mlfabric.Params(tau_max=tau_max))
    applied: list[dict[str, object]] = []

    @srv.on_update
    def apply(update: dict[str, np.ndarray], meta: mlfabric.UpdateMeta) -> None:
        for k, v in update.items():
            srv.model[k] -= v
        applied.append({"update_id": meta.update_id, "delay": meta.delay})

    (out / "server.ready").touch()
    with srv:
        srv.serve(until=stop)
    np.savez(out / "final.npz", **srv.model)
    (out / "server.json").write_text(json.dumps({"applied": applied, "version": srv.version}))


def worker(
    out: Path,
    rank: int,
    pushes: int,
    updates: Callable[[int, int], dict[str, np.ndarray]] | None = None,
    gate: Path | None = None,
) -> None:
    """Push ``updates(rank, i)`` (default :func:`update_for`) ``pushes`` times; write the verdicts.

    With ``gate``, the second half of the pushes waits until that file exists.
    """
    make = update_for if updates is None else updates
    w = mlfabric.register_as_worker(JOB, name=f"w{rank}", wait=60.0)
    handles = []
    pause = threading.Event()
    with w:
        for i in range(pushes):
            while gate is not None and i >= pushes // 2 and not gate.exists():
                pause.wait(0.02)
            if i % 4 == 0:
                w.get(SERVER)
            handles.append((i, w.push(SERVER, make(rank, i))))
        results = []
        for i, handle in handles:
            r = handle.wait(timeout=120.0)
            results.append(
                {
                    "index": i,
                    "status": r.status,
                    "delay": r.delay,
                    "reason": r.reason,
                    "update_id": r.update_id,
                }
            )
    (out / f"worker{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    role, out_dir = sys.argv[1], Path(sys.argv[2])
    if role == "server":
        server(out_dir, int(sys.argv[3]))
    else:
        worker(out_dir, int(sys.argv[3]), int(sys.argv[4]))
