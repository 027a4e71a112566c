"""The character LM experiment's summary (no processes): medians, spread, the baseline difference."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

from train_charlm import summary, topology


def _row(seed: int, mode: str, system: str, loss: float | None) -> dict:
    if loss is None:
        return {"seed": seed, "mode": mode, "system": system, "loss": None, "load1": 1.0}
    return {
        "seed": seed,
        "mode": mode,
        "system": system,
        "loss": loss,
        "perplexity": 2.0**loss,
        "worker_updates": 600,
        "payloads": 600 if mode == "async" else 150,
        "dropped": 0,
        "unresolved": 0,
        "mean_delay": 0.0,
        "wall": 10.0,
        "load1": 2.5,
    }


def test_summary_gives_medians_spread_and_the_difference_to_the_baseline() -> None:
    args = argparse.Namespace(
        quick=False, layers=2, d_model=64, context=64, budget=1000, workers=4, pushes=150, batch=16,
        lr=0.3, tau_max=16, server_mbps=100.0, seeds="0,1,2", modes="async,sync", systems="fair", tag="",
    )  # fmt: skip
    rows = [_row(s, "async", "baseline", 2.0 + s / 10) for s in range(3)]
    rows += [_row(s, "async", "fair", 2.5 + s / 10) for s in range(3)]
    rows += [_row(0, "sync", "fair", None)]
    text = summary(rows, args, "abc")
    assert "| async | baseline | 3 | 2.100 | 2.000-2.200 |" in text
    assert "| async | fair | 3 | 2.600 | 2.500-2.700 |" in text and "| +0.500 |" in text
    assert "| sync | fair | 0 | - |" in text
    assert "Failed runs: sync fair seed 0." in text
    assert "sha256 abc" in text and "9600 sequences" in text


def test_topology_makes_the_server_ingress_the_bottleneck() -> None:
    text = topology(2, 100)
    assert 'hosts = ["ps", "w0", "w1"]' in text and "mbps_ba = 100" in text and text.count("[[links]]") == 3
