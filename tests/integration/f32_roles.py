"""``agg_roles.py`` with float32 models and updates (run as a script; same arguments).

Pipelined aggregation (``--pipelined-aggregates``) sums raw float32 members as they land; the
integer values of :mod:`tests.integration.roles` stay exact in float32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.integration
from tests.integration.agg_roles import server
from tests.integration.roles import initial_model, update_for, worker


def f32_model() -> dict[str, np.ndarray]:
    """:func:`~tests.integration.roles.initial_model` as float32."""
    return {k: v.astype(np.float32) for k, v in initial_model().items()}


def f32_update(rank: int, index: int) -> dict[str, np.ndarray]:
    """:func:`~tests.integration.roles.update_for` as float32."""
    return {k: v.astype(np.float32) for k, v in update_for(rank, index).items()}


if __name__ == "__main__":
    role, out_dir = sys.argv[1], Path(sys.argv[2])
    if role == "server":
        server(out_dir, int(sys.argv[3]), int(sys.argv[4]), model=f32_model())
    else:
        worker(out_dir, int(sys.argv[3]), int(sys.argv[4]), updates=f32_update)
