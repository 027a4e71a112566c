"""The fault-injection harness, short: two faults of each loopback kind, nothing lost (DESIGN §3).

Three workers push integer-valued float64 one-hot updates through ``stf+agg`` while worker,
server and aggregator daemons, the server process and the scheduler are SIGKILLed or
SIGTERMed and started again, and daemons are stalled with SIGSTOP. The final model, fetched
with ``get()``, must show every push reported APPLIED exactly once and no push reported
DROPPED (or failed) applied; every push must resolve. ``python experiments/faults.py`` is
the long version.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import faults  # noqa: E402
from faults_report import table  # noqa: E402

pytestmark = pytest.mark.slow


def test_two_faults_of_each_kind_lose_nothing(tmp_path: Path) -> None:
    cfg = faults.Config(
        seed=7,
        workers=3,
        pushes=4000,
        window=4,
        pace_ms=10,
        faults=2 * len(faults.LOOPBACK_KINDS),
        gap=(0.1, 0.3),
        duration=180.0,  # a budget: the run ends with its faults (~80 s when quiet), later under load
        tail=4.0,
        workdir=tmp_path,
    )
    result = faults.run(cfg)
    total = result["total"]
    detail = f"\n{table(result)}\nexamples: {result['examples']}\nfaults: {result['faults']}"
    assert len(result["faults"]) == cfg.faults, detail
    assert total["applied"] > 0, detail
    assert result["model_matches_journal"], detail
    assert not result["dead_processes"], detail
    assert (total["lost"], total["twice"], total["false"], total["unres"]) == (0, 0, 0, 0), detail
    assert result["deadline_drops"] == 0, f"{detail}\nreasons: {result['reasons']}"  # none left unplanned
    assert not [f for f in result["faults"] if f["note"]], detail  # e.g. a SIGTERM that did not stop it
