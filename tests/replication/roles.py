"""Server, replica and worker processes for the replication tests (run as a script).

``python roles.py server OUT DIV_MAX [CODEC]`` serves a float64 model of integer values with
``Params(div_max=DIV_MAX, compression=CODEC)``; ``python roles.py replica OUT`` replicates it (the same
``on_update``; ``python roles.py replica OUT PAUSE`` sleeps PAUSE s after each update;
``python roles.py replica OUT PAUSE READY_FILE N`` SIGKILLs the process whose pid the ready
file names inside its N-th ``on_update``: the server's daemon dies after the replica applied
an update and before the server's daemon could ACK it);
``python roles.py worker OUT RANK PUSHES GAP`` pushes ``PUSHES``
integer-valued float64 updates, one every ``GAP`` seconds, and records every verdict;
``python roles.py flood OUT RANK SECONDS K`` pushes for ``SECONDS`` with ``K`` pushes
unresolved at a time; ``python roles.py big OUT RANK SCALE AFTER`` pushes one update
``SCALE`` times larger after ``AFTER`` seconds.
Each role writes ``<role>.ready`` once registered and, on SIGTERM, its final model and the
ids it applied (a replica also when and why it was promoted).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import mlfabric

JOB, SERVER = "rtest", "ps0"
SHAPES = {"w": (4, 3), "b": (7,)}


def initial_model() -> dict[str, np.ndarray]:
    """The model the server starts from (integer values, float64)."""
    rng = np.random.default_rng(54321)
    return {k: rng.integers(-100, 100, size=s).astype(np.float64) for k, s in SHAPES.items()}


def update_for(rank: int, index: int) -> dict[str, np.ndarray]:
    """The ``index``-th update of worker ``rank`` (integer values, float64): reproducible."""
    rng = np.random.default_rng([rank, index])
    return {k: rng.integers(-5, 6, size=s).astype(np.float64) for k, s in SHAPES.items()}


def _serve(
    srv: mlfabric.Server,
    out: Path,
    role: str,
    extra: dict[str, object],
    pause: float = 0.0,
    kill: tuple[Path, int] | None = None,
) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    applied: list[str] = []

    @srv.on_update
    def apply(update: dict[str, np.ndarray], meta: mlfabric.UpdateMeta) -> None:
        for k, v in update.items():
            srv.model[k] -= v
        applied.append(meta.update_id)
        if kill is not None and len(applied) == kill[1]:
            os.kill(int(json.loads(kill[0].read_text())["pid"]), signal.SIGKILL)
        time.sleep(pause)
        extra.setdefault("first_apply_after_promotion", None)
        if extra.get("promoted_at") is not None and extra["first_apply_after_promotion"] is None:
            extra["first_apply_after_promotion"] = time.time()

    (out / f"{role}.ready").write_text(str(srv.version))
    srv.serve(until=stop)
    np.savez(out / f"{role}.npz", **srv.model)
    (out / f"{role}.json").write_text(json.dumps({"applied": applied, "version": srv.version, **extra}))
    srv.close()


def server(out: Path, div_max: float, compression: str | None = None) -> None:
    params = mlfabric.Params(div_max=div_max, compression=compression)
    srv = mlfabric.register_as_server(JOB, SERVER, initial_model(), params)
    _serve(srv, out, "server", {})


def rejoin(out: Path) -> None:
    """The failed server comes back: ``register_as_server`` makes it the new server's replica."""
    srv = mlfabric.register_as_server(JOB, SERVER, initial_model(), mlfabric.Params(div_max=0.0))
    _serve(
        srv, out, "rejoin", {"is_replica": isinstance(srv, mlfabric.Replica), "start_version": srv.version}
    )


def replica(out: Path, pause: float = 0.0, kill: tuple[Path, int] | None = None) -> None:
    """The replica; ``pause``: seconds it sleeps after each update (a slow replica); ``kill``:
    (ready file, n): SIGKILL the process that ready file names while applying the n-th update."""
    rep = mlfabric.register_as_replica(JOB, SERVER, initial_model())
    extra: dict[str, object] = {"start_version": rep.version, "promoted_at": None, "reason": ""}

    def watch_resync() -> None:
        while rep.resyncs == 0 and not rep.promoted.is_set():
            time.sleep(0.05)
        if rep.resyncs:
            (out / "replica.resynced").write_text(str(rep.version))

    def watch() -> None:
        rep.promoted.wait()
        extra["promoted_at"], extra["reason"] = time.time(), rep.promotion_reason
        (out / "replica.promoted").write_text(str(time.time()))

    threading.Thread(target=watch, daemon=True).start()
    threading.Thread(target=watch_resync, daemon=True).start()
    _serve(rep, out, "replica", extra, pause, kill)
    info = json.loads((out / "replica.json").read_text())
    (out / "replica.json").write_text(json.dumps({**info, "resyncs": rep.resyncs}))


def worker(out: Path, rank: int, pushes: int, gap: float) -> None:
    w = mlfabric.register_as_worker(JOB, name=f"w{rank}", wait=60.0)
    results = []
    with w:
        for i in range(pushes):
            if i % 4 == 0:
                with contextlib.suppress(mlfabric.MlfabricError):  # the replica is being promoted
                    w.get(SERVER, timeout=10)
            try:
                r = w.push(SERVER, update_for(rank, i)).wait(timeout=60.0)
                status, reason, uid = r.status, r.reason, r.update_id
            except mlfabric.MlfabricError as exc:  # refused before it had an id: never applied
                status, reason, uid = "REFUSED", str(exc), ""
            results.append(
                {"index": i, "status": status, "reason": reason, "update_id": uid, "t": time.time()}
            )
            (out / f"worker{rank}.progress").write_text(str(i + 1))
            time.sleep(gap)
    (out / f"worker{rank}.json").write_text(json.dumps(results))


def flood(out: Path, rank: int, seconds: float, outstanding: int) -> None:
    """Push small updates for ``seconds``, keeping ``outstanding`` pushes unresolved (steady traffic)."""
    w = mlfabric.register_as_worker(JOB, name=f"w{rank}", wait=60.0)
    results: list[dict[str, object]] = []
    with w:
        handles: list[tuple[int, Any]] = []
        end, i = time.monotonic() + seconds, 0
        while time.monotonic() < end or handles:
            while time.monotonic() < end and len(handles) < outstanding:
                handles.append((i, w.push(SERVER, update_for(rank, i))))
                i += 1
            index, handle = handles.pop(0)
            r = handle.wait(timeout=120.0)
            results.append(
                {
                    "index": index,
                    "status": r.status,
                    "reason": r.reason,
                    "update_id": r.update_id,
                    "t": time.time(),
                }
            )
            (out / f"worker{rank}.progress").write_text(str(len(results)))
    (out / f"worker{rank}.json").write_text(json.dumps(results))


def big(out: Path, rank: int, scale: float, after: float) -> None:
    """After ``after`` s push one update ``scale`` times ``update_for(rank, 0)``; record its latency."""
    w = mlfabric.register_as_worker(JOB, name=f"w{rank}", wait=60.0)
    with w:
        time.sleep(after)
        t0 = time.time()
        r = w.push(SERVER, {k: v * scale for k, v in update_for(rank, 0).items()}).wait(timeout=120.0)
        result = {"index": 0, "status": r.status, "update_id": r.update_id, "t0": t0, "t": time.time()}
    (out / f"worker{rank}.json").write_text(json.dumps([result]))


if __name__ == "__main__":
    role, out_dir = sys.argv[1], Path(sys.argv[2])
    if role == "server":
        server(out_dir, float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    elif role == "replica":
        kill_at = (Path(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else None
        replica(out_dir, float(sys.argv[3]) if len(sys.argv) > 3 else 0.0, kill_at)
    elif role == "rejoin":
        rejoin(out_dir)
    elif role == "flood":
        flood(out_dir, int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
    elif role == "big":
        big(out_dir, int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
    else:
        worker(out_dir, int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
