"""The soak, tiny: a few workers for a few seconds; every push APPLIED, the model agrees (DESIGN §5).

``python experiments/soak.py`` is the real one (64 workers, 10 minutes, on a quiet machine);
this runs the same script end to end so that it keeps working, and checks behaviour only (the
exit status says every push resolved APPLIED and the model moved once per push; the report
has a sample row and the targets table), not the timings.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "experiments" / "soak.py"

pytestmark = pytest.mark.slow


def test_short_soak_applies_every_push_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "soak.md"
    args = ["--workers", "4", "--hosts", "3", "--seconds", "6", "--interval", "2", "--warmup", "2"]
    done = subprocess.run(
        [sys.executable, str(SOAK), *args, "--push-timeout", "10", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = out.read_text()
    assert "| 2 |" in report and "RSS growth < 5 %" in report and "no fd growth" in report
    assert "model agrees with" in report and ": yes." in report
    assert "DROPPED" not in report and "UNRESOLVED" not in report
