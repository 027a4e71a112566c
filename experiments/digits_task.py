"""The digits task of the testbed experiments: data, model, gradient step, accuracy and its log.

The digits MLP widened to 64-1024-1024-10 (4.5 MB of float32 per update) on scikit-learn's
bundled digits (a fixed 80/20 split); a worker's update is ``lr * gradient`` of a minibatch,
which the server subtracts. ``testbed_e2e.py`` and the experiments built on it
(``testbed_aggregation.py``, ``testbed_codecs.py``, ``testbed_racks.py``, ...) train it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

# one torch thread in this process: every testbed role calls it first, as testbed_ddp's ranks
# always did (torch's default, a thread per core, made 8 workers and a server on 2 cores spin
# their pools against each other and slowed the parameter-server roles' gradient until
# 2026-12-07; DEVELOPERS.md)
from mlfabric.examples.digits import _one_thread as one_thread

__all__ = [
    "HIDDEN",
    "AccuracyLog",
    "accuracy",
    "dataset",
    "gradient",
    "load_numpy",
    "make_model",
    "one_thread",
    "reached",
]

HIDDEN = 1024


def dataset(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """Digits (bundled with scikit-learn), scaled to [0, 1], a fixed 80/20 split."""
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    idx = np.random.default_rng(seed).permutation(len(x))
    train, test = idx[:1437], idx[1437:]
    return (torch.tensor(x[train]), torch.tensor(y[train]), torch.tensor(x[test]), torch.tensor(y[test]))


def make_model(seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 10),
    )


def accuracy(model: Any, x: Any, y: Any) -> float:
    import torch

    with torch.no_grad():
        return int((model(x).argmax(1) == y).sum()) / len(y)  # exact: 342/360 is 0.95


def gradient(model: Any, x: Any, y: Any, batch: int, rng: np.random.Generator, lr: float) -> dict[str, Any]:
    """``lr * grad`` of the loss on one minibatch, per parameter name (float32 numpy)."""
    import torch

    b = torch.as_tensor(rng.integers(0, len(x), size=batch))
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x[b]), y[b]).backward()
    return {k: (lr * p.grad).numpy() for k, p in model.named_parameters()}


def load_numpy(model: Any, tensors: dict[str, np.ndarray]) -> None:
    import torch

    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(torch.as_tensor(np.asarray(tensors[k])))


def reached(acc: float, target: float) -> bool:
    """Whether ``acc`` meets ``target`` (tolerant of float32 rounding: 0.9499999881 is 0.95)."""
    return acc >= target - 1e-6


class AccuracyLog:
    """The server's progress: (seconds since the first update, version, accuracy) rows."""

    def __init__(self, path: Path, target: float) -> None:
        self.path, self.target = path, target
        self.rows: list[dict[str, float]] = []
        self.start: float | None = None
        self.reached: float | None = None

    def record(self, version: int, acc: float, at: float | None = None) -> None:
        """Add a row: ``version`` reached accuracy ``acc``; ``at``: when it was applied (Unix s).

        Without ``at`` the row is timed now. A server that evaluates after ``serve()`` returns
        passes the time of its last apply, so the rows (and the round split read off them) do
        not include the rest of the serve call's wait and the evaluation.
        """
        now = time.time() if at is None else at
        self.start = self.start or now
        self.rows.append({"t": now - self.start, "version": version, "accuracy": acc})
        if self.reached is None and reached(acc, self.target):
            self.reached = now - self.start

    def save(self, extra: dict[str, Any]) -> None:
        """Write the rows, the time to target and ``start`` (Unix seconds of the first row)."""
        body = {"rows": self.rows, "time_to_target": self.reached, "start": self.start, **extra}
        self.path.write_text(json.dumps(body))
