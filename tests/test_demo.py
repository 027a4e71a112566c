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


def test_the_table_and_the_progress_lines_name_their_drops() -> None:
    """Issue 27 item 3: the table's "dropped" (every DROPPED push: mostly the scheduler's tau_max
    drops) contradicted the progress lines' (the server's own) under the same name."""
    from mlfabric.demo import TABLE_NOTE, _progress

    result = PolicyResult("stf", 7.9, 122, 90, 2.59, 8, 0.911, 0.953, 212, 0, server_dropped=1)
    header, _, row = format_table([result]).splitlines()
    assert "pushes dropped" in header and "server drops" in header and "  dropped" not in header
    assert row.split()[4:6] == ["90", "1"]
    line = _progress("stf", {"version": 3, "applied": 3, "dropped": 1, "accuracy": 0.5}, 0.0, 0.95)
    assert "dropped by the server   1" in line
    assert "pushes dropped" in TABLE_NOTE and "server drops" in TABLE_NOTE and "tau_max" in TABLE_NOTE


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
    # it says what it does (issue 27 item 2): each phase, how long it took, what it waits for
    for said in (
        "policy stf (1 of 1): starting the scheduler and 3 daemons",
        "[stf] scheduler and 3 daemons ready in",
        "[stf] parameter server ready in",
        "[stf] 2 workers ready in",
        "[stf] target reached at",
        "s for this policy",
    ):
        assert said in out.stdout, (said, out.stdout)
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
