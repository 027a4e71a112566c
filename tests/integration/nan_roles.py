"""A worker for the non-finite end-to-end test (run as a script; the server is ``agg_roles.py``).

``python nan_roles.py OUT_DIR RANK PUSHES`` pushes the integration test's updates
(``roles.update_for``), every third one with a NaN or an infinity in one element
(:func:`poison`), and writes every verdict to ``OUT_DIR/worker<RANK>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import mlfabric

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.integration
from tests.integration.roles import JOB, SERVER, update_for


def poison(rank: int, index: int) -> str | None:
    """The tensor of push ``index`` of worker ``rank`` that holds a non-finite value, or None."""
    return ("w", "b")[(rank + index) % 2] if index % 3 == 1 else None


def update(rank: int, index: int) -> dict[str, np.ndarray]:
    """``update_for(rank, index)``, with NaN/inf in the :func:`poison` tensor."""
    u = update_for(rank, index)
    bad = poison(rank, index)
    if bad is not None:
        u[bad].reshape(-1)[index % u[bad].size] = (np.nan, np.inf, -np.inf)[index % 3]
    return u


def worker(out: Path, rank: int, pushes: int) -> None:
    w = mlfabric.register_as_worker(JOB, name=f"w{rank}", wait=60.0)
    handles = []
    with w:
        for i in range(pushes):
            if i % 4 == 0:
                w.get(SERVER)
            handles.append((i, w.push(SERVER, update(rank, i))))
        results = []
        for i, handle in handles:
            r = handle.wait(timeout=120.0)
            results.append({"index": i, "status": r.status, "reason": r.reason, "update_id": r.update_id})
    (out / f"worker{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
