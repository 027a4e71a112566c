"""How the fault-injection harness judges pushes against the final model (no processes).

Synthetic worker records, a server journal and a "fetched" model: each failure class is
counted under the right fault, and a model that disagrees with the journal fails the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

from faults_report import Fault, analyse
from faults_roles import replay

WORKERS, PUSHES = 2, 8


def _write(out: Path, records: dict[int, list[dict]], applied: list[tuple[int, int]]) -> None:
    for rank, rows in records.items():
        (out / f"worker{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [
        json.dumps({"id": f"u{n}", "members": [], "version": n + 1, "cells": [[r * PUSHES + i, 1.0]]})
        for n, (r, i) in enumerate(applied)
    ]
    (out / "journal.jsonl").write_text("".join(line + "\n" for line in lines))


def _rec(index: int, status: str, t: float) -> dict:
    return {"index": index, "t0": t - 0.5, "t1": t, "status": status, "reason": "r"}


def _final(out: Path) -> dict:
    model, version = replay(out / "journal.jsonl", WORKERS, PUSHES)
    return {"version": version, "model": model, "survivors": []}


def test_each_failure_is_counted_under_the_fault_before_it_resolved(tmp_path: Path) -> None:
    records = {
        0: [
            _rec(0, "APPLIED", 1.0),  # before any fault, fine
            _rec(1, "APPLIED", 11.0),  # lost (in no model)
            _rec(2, "DROPPED", 12.0),  # false (applied)
            _rec(3, "UNKNOWN", 13.0),  # unk+
            _rec(4, "ERROR:disconnected", 21.0),  # conn-
            _rec(5, "APPLIED", 22.0),  # twice
        ],
        1: [_rec(0, "UNRESOLVED", 23.0), _rec(1, "DROPPED", 24.0)],  # unres, dropped
    }
    applied = [(0, 0), (0, 2), (0, 3), (0, 5), (0, 5), (1, 6)]  # (1, 6): applied, never recorded
    _write(tmp_path, records, applied)
    faults = [Fault("kill-server", "server", 10.0, 10.5), Fault("stall-peer", "daemon-a", 20.0, 20.8)]
    result = analyse(tmp_path, WORKERS, PUSHES, faults, _final(tmp_path), started=0.0)
    rows = result["rows"]
    assert (rows["none"]["applied"], rows["none"]["unres"]) == (1, 1)  # (1, 6) without a record
    kill = rows["kill-server"]
    assert (kill["faults"], kill["lost"], kill["false"], kill["unk+"]) == (1, 1, 1, 1)
    stall = rows["stall-peer"]
    assert (stall["conn-"], stall["twice"], stall["unres"], stall["dropped"]) == (1, 1, 1, 1)
    total = result["total"]
    assert (total["lost"], total["twice"], total["false"], total["unres"]) == (1, 1, 1, 2)
    assert result["model_matches_journal"] and not result["ok"]


def test_a_clean_run_passes_and_a_model_other_than_the_journal_fails(tmp_path: Path) -> None:
    _write(tmp_path, {0: [_rec(0, "APPLIED", 1.0), _rec(1, "DROPPED", 2.0)], 1: []}, [(0, 0)])
    final = _final(tmp_path)
    assert analyse(tmp_path, WORKERS, PUSHES, [], final, started=0.0)["ok"]
    final["model"] = {"count": np.zeros((WORKERS, PUSHES))}  # the fetched model lost the push
    result = analyse(tmp_path, WORKERS, PUSHES, [], final, started=0.0)
    assert not result["model_matches_journal"] and not result["ok"]
    assert result["total"]["lost"] == 1


def test_replay_cuts_a_torn_last_line(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    whole = json.dumps({"id": "u", "members": [], "version": 1, "cells": [[3, 1.0]]}) + "\n"
    journal.write_text(whole + '{"id": "v", "cel')  # killed while writing the second
    model, version = replay(journal, WORKERS, PUSHES)
    assert version == 1 and model["count"].reshape(-1)[3] == 1.0
    assert journal.read_text() == whole
