"""``mlfabric demo``, the README's first command, runs end to end (small and short)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlfabric.demo import PolicyResult, format_table


def test_table_shows_accuracy_at_target_and_final() -> None:
    reached = PolicyResult("stf", 7.9, 122, 6, 2.59, 8, 0.911, 0.953, 128, 0)
    missed = PolicyResult("fair", None, 80, 0, 2.0, 4, 0.9, None, 80, 0)
    lines = format_table([reached, missed]).splitlines()
    assert lines[0].split()[-4:] == ["at", "target", "final", "accuracy"]
    assert lines[2].split()[-2:] == ["0.953", "0.911"]
    assert lines[3].split()[-2:] == ["-", "0.900"]
    assert "not reached" in lines[3]


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_trains_to_a_low_target_and_resolves_every_push(tmp_path: Path) -> None:
    """Run as a new user with the clone at ``~/mlfabric`` who runs from ``~`` (issue 27 item 1):
    the working directory holds a folder named ``mlfabric`` (the clone), and every child the
    demo starts must still import the installed package, not that folder."""
    (tmp_path / "mlfabric").symlink_to(ROOT, target_is_directory=True)
    workdir = tmp_path / "demo"
    out = subprocess.run(
        [
            sys.executable, "-P", "-m", "mlfabric", "demo",
            "--policies", "stf", "--workers", "2", "--hidden", "64",
            "--target-accuracy", "0.5", "--compute-seconds", "0.01",
            "--time-limit", "60", "--workdir", str(workdir),
        ],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.strip().startswith("stf "))
    assert "not reached" not in row
    status = json.loads((workdir / "stf" / "server-status.json").read_text())
    assert status["accuracy_at_target"] >= 0.5
    assert status["reached_at"] is not None
    pushes = [
        p
        for rank in range(2)
        for p in json.loads((workdir / "stf" / f"worker{rank}.json").read_text())["pushes"]
    ]
    assert pushes and all(p["status"] in ("APPLIED", "DROPPED") for p in pushes)
    assert status["applied"] == sum(p["status"] == "APPLIED" for p in pushes)
