"""Server and worker processes of the fault-injection harness (run as a script by ``faults.py``).

The model is one float64 tensor ``count`` of shape (workers, pushes per worker), zero at
first. Push ``i`` of worker ``r`` adds 1 at ``[r, i]`` and nowhere else, so the final model
says exactly which pushes were applied, and how often (integer-valued float64: exact).

``python faults_roles.py server OUT TAU_MAX WORKERS PUSHES`` serves the model as ``ps0``.
Every applied payload (an update or an aggregate) is appended to ``OUT/journal.jsonl``
(its non-zero cells) *before* the verdict is sent, so a server process that was killed and
started again rebuilds the model it had and registers at the version it had. When its
daemon goes away it registers again with the daemon that comes back on the same socket.
SIGTERM ends it cleanly (exit 0).

``python faults_roles.py worker OUT RANK WORKERS PUSHES WINDOW PACE_MS`` pushes its ``PUSHES``
updates keeping up to ``WINDOW`` in flight and ``PACE_MS`` ms apart (a ``get`` every 4
pushes, so base versions move), and appends one JSON line per push to
``OUT/worker<RANK>.jsonl``: index, status
(APPLIED, DROPPED, UNKNOWN; ERROR:<code> when the push failed, e.g. ``disconnected`` when
its own daemon went away; UNRESOLVED when no verdict came within the resolve timeout),
reason, version, update_id, submit and resolve times (``time.time()``). A broken daemon
connection is re-opened (the daemon is restarted on the same socket); the pushes that were
in flight are not pushed again (their indices stay in the record as they resolved). It
stops after its last push resolved, or when ``OUT/stop`` exists.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

import mlfabric
from mlfabric import MlfabricError

JOB, SERVER = "faults", "ps0"
#: seconds a push may take to resolve before it counts as UNRESOLVED: beyond the daemons' push
#: deadline (60 s, ``--push-timeout``), after which a push never planned resolves DROPPED, and one
#: held for a lost aggregate verdict UNKNOWN, naming it (counted apart, ``deadline_drops``), so
#: the two are never confused
RESOLVE_TIMEOUT = 90.0


def initial_model(workers: int, pushes: int) -> dict[str, np.ndarray]:
    """The all-zero model (one cell per push of every worker)."""
    return {"count": np.zeros((workers, pushes), dtype=np.float64)}


def update_for(rank: int, index: int, workers: int, pushes: int) -> dict[str, np.ndarray]:
    """Push ``index`` of worker ``rank``: 1 at ``[rank, index]``."""
    update = initial_model(workers, pushes)
    update["count"][rank, index] = 1.0
    return update


def replay(journal: Path, workers: int, pushes: int) -> tuple[dict[str, np.ndarray], int]:
    """The model and version that the journal's complete lines make (a torn last line is cut off)."""
    model = initial_model(workers, pushes)
    if not journal.exists():
        return model, 0
    data = journal.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):  # killed while writing: the payload was not verdicted APPLIED
        with open(journal, "r+b") as f:
            f.truncate(len(whole))
    version = 0
    flat = model["count"].reshape(-1)
    for line in whole.decode().splitlines():
        entry = json.loads(line)
        for cell, value in entry["cells"]:
            flat[cell] += value
        version += 1
    return model, version


def _journaled_apply(srv: mlfabric.Server, journal: IO[str]) -> Any:
    """``on_update``: add the update, then journal its non-zero cells (before the verdict goes out)."""

    def apply(update: dict[str, np.ndarray], meta: mlfabric.UpdateMeta) -> None:
        flat = update["count"].reshape(-1)
        cells = np.flatnonzero(flat)
        srv.model["count"] += update["count"]
        entry = {"id": meta.update_id, "members": list(meta.member_ids), "version": srv.version + 1}
        entry["cells"] = [[int(c), float(flat[c])] for c in cells]
        journal.write(json.dumps(entry) + "\n")  # the page cache outlives a SIGKILL

    return apply


def server(out: Path, tau_max: int, workers: int, pushes: int) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    journal_path = out / "journal.jsonl"
    model, version = replay(journal_path, workers, pushes)
    params = mlfabric.Params(tau_max=tau_max if tau_max >= 0 else None)
    journal = open(journal_path, "a", buffering=1)  # noqa: SIM115 - one line per applied payload
    print(f"server starting at version {version}", flush=True)
    while not stop.is_set():
        try:
            srv = mlfabric.register_as_server(JOB, SERVER, model, params, version=version)
        except MlfabricError as exc:  # daemon restarting, or the old role not yet released
            print(f"register: {exc.code}: {exc}", flush=True)
            time.sleep(0.2)
            continue

        srv.on_update(_journaled_apply(srv, journal))
        (out / "server.ready").touch()
        try:
            srv.serve(until=stop)
        except MlfabricError as exc:  # the daemon went away: register with the next one
            print(f"serve: {exc.code}: {exc}", flush=True)
        model, version = srv.model, srv.version
        srv.close()
    journal.close()


class _Record:
    def __init__(self, path: Path) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, index: int, t0: float, status: str, **fields: Any) -> None:
        self._file.write(
            json.dumps({"index": index, "t0": t0, "t1": time.time(), "status": status, **fields}) + "\n"
        )

    def close(self) -> None:
        self._file.close()


def _resolve(record: _Record, index: int, t0: float, handle: Any) -> bool:
    """Wait for one push and record it; False when the daemon connection broke."""
    try:
        r = handle.wait(timeout=RESOLVE_TIMEOUT)
    except TimeoutError:
        record.write(index, t0, "UNRESOLVED", update_id=handle.update_id)
        return True
    except MlfabricError as exc:
        record.write(index, t0, f"ERROR:{exc.code}", reason=str(exc), update_id=handle.update_id)
        if exc.code == "disconnected":
            return False
        time.sleep(0.1)  # e.g. the server is away: do not spend the indices at once
        return True
    record.write(
        index, t0, r.status, reason=r.reason, version=r.version, update_id=r.update_id, delay=r.delay
    )
    if r.status != mlfabric.APPLIED:
        time.sleep(0.02)  # drops come fast while a role re-registers: do not spend the indices at once
    return True


def worker(out: Path, rank: int, workers: int, pushes: int, window: int, pace_ms: int = 0) -> None:
    record = _Record(out / f"worker{rank}.jsonl")
    stop = out / "stop"
    index = 0
    while index < pushes and not stop.exists():
        try:
            w = mlfabric.register_as_worker(JOB, name=f"w{rank}", wait=5.0)
        except MlfabricError as exc:
            print(f"register: {exc.code}: {exc}", flush=True)
            time.sleep(0.2)
            continue
        pending: collections.deque[tuple[int, float, Any]] = collections.deque()
        connected = True
        while connected and index < pushes and not stop.exists():
            while connected and len(pending) >= window:
                connected = _resolve(record, *pending.popleft())
            if not connected:
                break
            if index % 4 == 0:
                try:
                    w.get(SERVER, timeout=5.0)
                except (MlfabricError, TimeoutError) as exc:  # server away: keep the old base version
                    if getattr(exc, "code", "") == "disconnected":
                        break
            t0 = time.time()
            try:
                handle = w.push(SERVER, update_for(rank, index, workers, pushes))
            except MlfabricError as exc:
                record.write(index, t0, f"ERROR:{exc.code}", reason=str(exc))
                index += 1
                if exc.code == "disconnected":
                    break
                time.sleep(0.1)  # e.g. the server is away: do not spend the indices at once
                continue
            pending.append((index, t0, handle))
            index += 1
            time.sleep(pace_ms / 1000)
        while pending:
            _resolve(record, *pending.popleft())
        w.close()
    record.close()


if __name__ == "__main__":
    role, out_dir = sys.argv[1], Path(sys.argv[2])
    args = [int(a) for a in sys.argv[3:]]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks where a stuck one is
    if role == "server":
        server(out_dir, *args)
    else:
        worker(out_dir, *args)
