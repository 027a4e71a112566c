"""The learning-quality experiment per codec (experiments/quality_codecs.py, issue 26).

The table's arithmetic on made-up rows (no processes), and a quick run of the digits task through
real local clusters that checks the output's structure (not the numbers): a row per system,
every push resolved APPLIED, local SGD with H = 2 making half the pushes, the CSV and the plot.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import quality_codecs as qc  # noqa: E402


def _row(seed: int, system: str, accuracy: float | None) -> dict:
    if accuracy is None:
        return {"seed": seed, "system": system, "error": "boom", "load1": 1.0}
    pushes = 4 if "@h2" in system else 8
    return {
        "seed": seed,
        "system": system,
        "accuracy": accuracy,
        "pushes": pushes,
        "applied": pushes,
        "worker_updates": pushes,
        "payloads": pushes,
        "dropped": 0,
        "unresolved": 0,
        "mean_delay": 0.5,
        "wall": 3.0,
        "load1": 2.0,
    }


def test_summary_compares_each_seed_with_the_uncompressed_run_and_the_baseline() -> None:
    args = qc.parse(["--task", "digits", "--quick", "--seeds", "0,1"])
    rows = [_row(s, "baseline", 0.9) for s in (0, 1)]
    rows += [_row(0, "stf+agg", 0.80), _row(1, "stf+agg", 0.90)]
    rows += [_row(0, "stf+agg@int8+ef", 0.82), _row(1, "stf+agg@int8+ef", 0.86)]
    rows += [_row(0, "stf+agg@h2", None)]
    text = qc.summary(rows, args, "cmd")
    # int8+ef: +0.02 and -0.04 against the same seed's uncompressed run; the medians: 0.84 vs 0.9
    assert (
        "| stf+agg@int8+ef | 2 | 0.8400 [0.8200-0.8600] | -0.0100 [-0.0400-+0.0200] | -0.0600 | 4 |" in text
    )
    assert "| stf+agg | 2 | 0.8500 [0.8000-0.9000] | - | -0.0500 | 4 |" in text
    assert "| stf+agg@h2 | 0 |" in text and "Failed runs: stf+agg@h2 seed 0 (boom)." in text


def test_systems_split_and_parse_for_any_codec_spec() -> None:
    import train_charlm as tc

    systems = tc.split_systems("stf+agg,stf+agg@topk:ratio=0.01+ef@h4,stf+agg@int8:bound=6,stochastic=0")
    assert systems == ["stf+agg", "stf+agg@topk:ratio=0.01+ef@h4", "stf+agg@int8:bound=6,stochastic=0"]
    assert tc.parse_system(systems[1]) == (
        "stf+agg",
        ["--codec", "topk:ratio=0.01+ef", "--local-period", "4"],
    )
    assert qc.uncompressed(systems[2]) == "stf+agg"


@pytest.mark.slow
@pytest.mark.parametrize(
    "task", ["digits"]
)  # charlm's quick run: ~150 s under load, its clusters in test_charlm
def test_a_quick_run_writes_a_row_per_system_the_csv_and_the_plot(tmp_path: Path, task: str) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out = subprocess.run(
        [
            sys.executable,
            str(EXPERIMENTS / "quality_codecs.py"),
            "--task",
            task,
            "--quick",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    name = f"quality_codecs_{task}_quick"
    with open(tmp_path / f"{name}.csv") as f:
        rows = {r["system"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["baseline", *qc.QUICK_SYSTEMS.split(",")]
    metric = qc.TASKS[task]["metric"]
    assert all(r[metric] for r in rows.values()), rows  # no failed run
    for system, row in rows.items():
        if system != "baseline":  # 2 workers x 8 steps; H = 2: half the pushes, each applied
            pushes = 8 if system.endswith("@h2") else 16
            assert (int(row["pushes"]), int(row["applied"]), int(row["worker_updates"])) == (pushes,) * 3
    text = (tmp_path / f"{name}.md").read_text()
    assert all(f"| {s} | 1 |" in text for s in rows)
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
