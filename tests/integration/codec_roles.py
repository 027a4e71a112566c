"""Server and worker processes for the compressed-aggregation end-to-end test (run as a script).

``python codec_roles.py server OUT_DIR TAU_MAX CODEC`` is ``agg_roles.py server`` with a
larger integer-valued float64 model (:data:`SHAPES`: 5100 elements, so that updates queue on
the test's slow server link and get aggregated) and ``Params(compression=CODEC)``.
``python codec_roles.py worker OUT_DIR RANK PUSHES`` pushes :func:`update_for` (with the job's
codec), but only the first half until ``OUT_DIR/go`` exists: the test restarts the aggregator
in between. Every verdict is written to ``OUT_DIR/worker<RANK>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.integration
from tests.integration import agg_roles, roles

SHAPES = {"w": (50, 100), "b": (100,)}


def initial_model() -> dict[str, np.ndarray]:
    """The model the server starts from (integer values, float64)."""
    rng = np.random.default_rng(54321)
    return {k: rng.integers(-100, 100, size=s).astype(np.float64) for k, s in SHAPES.items()}


def update_for(rank: int, index: int) -> dict[str, np.ndarray]:
    """The ``index``-th update of worker ``rank`` (integers in [-5, 5], float64): reproducible."""
    rng = np.random.default_rng([rank, index, 26])
    return {k: rng.integers(-5, 6, size=s).astype(np.float64) for k, s in SHAPES.items()}


if __name__ == "__main__":
    if sys.argv[1] == "server":
        agg_roles.server(Path(sys.argv[2]), int(sys.argv[3]), 0, sys.argv[4], initial_model())
    else:
        out = Path(sys.argv[2])
        roles.worker(out, int(sys.argv[3]), int(sys.argv[4]), updates=update_for, gate=out / "go")
