"""Server and worker processes for the aggregation end-to-end test (run as a script).

``python agg_roles.py server OUT_DIR TAU_MAX SYNC_WORKERS [COMPRESSION]`` serves the integration test's
integer-valued float64 model; every payload it applies (an update, an aggregate or a
synchronous round) is recorded with its members and their delays; the third payload
applied touches ``OUT_DIR/progress``; on SIGTERM it writes the final model.
``python agg_roles.py worker OUT_DIR RANK PUSHES`` pushes like ``roles.py`` (the same
updates) and writes every verdict.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import numpy as np

import mlfabric

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.integration
from tests.integration.roles import JOB, SERVER, initial_model, worker


def server(
    out: Path,
    tau_max: int,
    sync_workers: int,
    compression: str | None = None,
    model: dict[str, np.ndarray] | None = None,
) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    params = mlfabric.Params(tau_max=tau_max, sync_workers=sync_workers, compression=compression)
    srv = mlfabric.register_as_server(JOB, SERVER, initial_model() if model is None else model, params)
    applied: list[dict[str, object]] = []

    @srv.on_update
    def apply(update: dict[str, np.ndarray], meta: mlfabric.UpdateMeta) -> None:
        for k, v in update.items():
            srv.model[k] -= v
        applied.append(
            {
                "update_id": meta.update_id,
                "members": list(meta.member_ids),
                "delays": list(meta.member_delays),
                "num_updates": meta.num_updates,
            }
        )
        if len(applied) == 3:
            (out / "progress").touch()

    (out / "server.ready").touch()
    with srv:
        srv.serve(until=stop)
    np.savez(out / "final.npz", **srv.model)
    (out / "server.json").write_text(json.dumps({"applied": applied, "version": srv.version}))


if __name__ == "__main__":
    role, out_dir = sys.argv[1], Path(sys.argv[2])
    if role == "server":
        server(out_dir, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else None)
    else:
        worker(out_dir, int(sys.argv[3]), int(sys.argv[4]))
