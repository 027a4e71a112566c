"""The replication experiment's summary and mode order (no processes, no testbed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

from testbed_replication import mode_order, summarize


def _row(seed: int, mode: str, t: float | None, updates: int | None = 100) -> dict:
    rate = updates / t if updates is not None and t else None
    return {"seed": seed, "mode": mode, "time_to_target": t, "updates": updates, "updates_per_s": rate}


def test_mode_order_rotates_so_every_mode_runs_first_once() -> None:
    orders = [mode_order(i) for i in range(3)]
    assert orders[0] == ["none", "div_max", "chain"]
    assert orders[1] == ["div_max", "chain", "none"]
    assert orders[2] == ["chain", "none", "div_max"]
    assert mode_order(3) == orders[0]
    assert sorted(o[0] for o in orders) == ["chain", "div_max", "none"]


def test_summary_medians_spread_and_ratios_against_no_replica() -> None:
    rows = [
        _row(0, "none", 40.0, 90),
        _row(1, "none", 50.0, 100),
        _row(2, "none", 60.0, 110),
        _row(0, "div_max", 42.0, 95),
        _row(1, "div_max", 50.0, 101),
        _row(2, "div_max", 66.0, 120),
        _row(0, "chain", 80.0, 90),
        _row(1, "chain", 100.0, 100),
        _row(2, "chain", None, 30),  # not reached: not in the times, the ratios or the updates
    ]
    by_mode = {s["mode"]: s for s in summarize(rows)}
    assert list(by_mode) == ["none", "div_max", "chain"]
    none, bounded, chain = by_mode["none"], by_mode["div_max"], by_mode["chain"]
    assert (none["median"], none["min"], none["max"], none["ratio"]) == (50.0, 40.0, 60.0, 1.0)
    assert none["paired_ratio"] == 1.0
    assert bounded["median"] == 50.0 and bounded["ratio"] == 1.0
    assert bounded["paired_ratio"] == pytest.approx(1.05)  # median of 1.05, 1.0, 1.1
    assert bounded["updates"] == 101
    assert (chain["runs"], chain["reached"]) == (3, 2)
    assert chain["median"] == 90.0 and chain["ratio"] == pytest.approx(1.8)
    assert chain["paired_ratio"] == pytest.approx(2.0)  # seeds 0 and 1 only
    assert chain["updates"] == 95
    assert none["rate"] == pytest.approx(2.0)  # median of 2.25, 2.0, 1.833
    assert chain["rate"] == pytest.approx(1.0625)  # median of 1.125, 1.0
    assert chain["rate_ratio"] == pytest.approx(1.0625 / 2.0)


def test_summary_without_a_baseline_that_reached_gives_no_ratio() -> None:
    rows = [_row(0, "none", None), _row(0, "chain", 70.0)]
    by_mode = {s["mode"]: s for s in summarize(rows)}
    assert by_mode["none"]["median"] is None and by_mode["none"]["reached"] == 0
    assert by_mode["chain"]["median"] == 70.0
    assert by_mode["chain"]["ratio"] is None and by_mode["chain"]["paired_ratio"] is None
    assert "div_max" not in by_mode  # no rows: no line
