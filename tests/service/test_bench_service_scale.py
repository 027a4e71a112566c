"""``experiments/bench_service_scale.py``, tiny: 20 daemons for 5 s against the real scheduler process.

The benchmark's machinery measures something real: decisions happened (the scheduler's
histogram), every announced update got its SendDirective (none dropped or missing), and the
RSS, CPU and lag figures are present and finite. Not the timings.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "experiments" / "bench_service_scale.py"

pytestmark = pytest.mark.slow


def test_tiny_run_measures_decisions_lag_and_rss(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    args = ["--daemons", "20", "--servers", "2", "--racks", "4", "--per-rack", "8", "--rate", "40"]
    args += ["--duration", "5", "--window", "2", "--progress", "1", "--drain", "10", "--json", str(out)]
    done = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (run,) = json.loads(out.read_text())
    d = run["done"]
    assert d["announced"] > 100 and d["sends"] == d["announced"]
    assert d["drops"] == 0 and d["missing"] == 0 and d["streams_lost"] == 0
    assert run["decisions"] > 0 and math.isfinite(run["decision_p99"][1])
    assert 10 * 2**20 < run["rss_max"] < 2**32 and run["cpu"] > 0
    windows = run["windows"]
    assert [w["index"] for w in windows] == [1, 2, 3]  # 2 s, 2 s and the last 1 s
    assert sum(w["sends"] for w in windows) <= d["sends"]
    for w in windows:
        assert w["announced"] > 0 and w["decisions"] > 0 and w["rss_max"] > 0
        assert 0 < w["lag_p50"] <= w["lag_p99"] <= w["lag_max"] < 10
    assert "| 20 |" in done.stdout and "lag p50/p99 per window" in done.stdout
