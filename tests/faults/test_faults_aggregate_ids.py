"""Scheduler restarts under ``stf+agg``: aggregate ids of a new run never meet the old run's.

Three workers push through ``stf+agg`` while the aggregator's daemon and the scheduler are
SIGKILLed and started again (real processes, ``experiments/faults.py``). A restarted scheduler
numbers its aggregates from 0 again; were its ids ``agg:<server>:<n>`` as in the run before,
the server daemon would answer them from its de-duplication memory with the earlier
aggregate's verdict and their members would be reported APPLIED without being applied
("lost"). The service scopes the ids with a random incarnation per run (DESIGN §3).
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


def test_scheduler_restarts_under_stf_agg_lose_nothing(tmp_path: Path) -> None:
    cfg = faults.Config(
        seed=7,
        workers=3,
        pushes=3000,
        window=4,
        pace_ms=10,
        faults=4,
        policy="stf+agg",
        kinds=("kill-aggregator-daemon", "kill-scheduler"),
        gap=(0.5, 1.0),
        duration=60.0,
        tail=4.0,
        workdir=tmp_path,
    )
    result = faults.run(cfg)
    total = result["total"]
    detail = f"\n{table(result)}\nexamples: {result['examples']}\nfaults: {result['faults']}"
    assert sum(f["kind"] == "kill-scheduler" for f in result["faults"]) >= 1, detail
    assert total["applied"] > 0, detail
    assert result["model_matches_journal"], detail
    assert (total["lost"], total["twice"], total["false"], total["unres"]) == (0, 0, 0, 0), detail
    assert result["deadline_drops"] == 0, f"{detail}\nreasons: {result['reasons']}"  # none left unplanned
