"""``mlfabric plan``: the table, --out JSON, --trace, --plot, errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlfabric.cli import main
from mlfabric.scheduler.core.trace import trace_events
from mlfabric.scheduler.plan.instance import two_tier_instance

EXAMPLE = Path(__file__).resolve().parents[2] / "experiments" / "instances" / "example.json"


def test_all_solvers_table_json_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, trace = tmp_path / "plan.json", tmp_path / "plan.trace.json"
    code = main(
        [
            *("plan", str(EXAMPLE), "--solver", "all", "--time-limit", "30", "--workers", "2"),
            *("--out", str(out), "--trace", str(trace)),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    for name in (
        "== ilp ==",
        "== stf ==",
        "== aggregation ==",
        "== tree ==",
        "== fair ==",
        "gap to ILP bound",
    ):
        assert name in text
    plans = {p["solver"]: p for p in json.loads(out.read_text())["plans"]}
    assert set(plans) == {"ilp", "stf", "aggregation", "tree", "fair"}
    for p in plans.values():
        assert set(p) >= {"objective", "bound", "gap", "status", "solver", "updates"}
        assert sorted(u["id"] for u in p["updates"]) == [f"u{i}" for i in range(6)]
        for u in p["updates"]:
            assert set(u) == {"id", "route", "start", "finish"}
            assert u["route"][0].startswith("w") and u["route"][-1] == "s0"
            assert u["start"] < u["finish"]
        # the printed table carries the same objective
        assert f"{p['objective']:.6g}" in text
    # the summary table's columns line up (issue 27 item 10: a long solver name shifted its row)
    table = text[text.index("solver ") :].splitlines()[:6]
    assert [line.split()[0] for line in table[1:]] == ["ilp", "stf", "aggregation", "tree", "fair"]
    assert len({len(line) for line in table}) == 1
    objective_ends = {
        line.index(f"{plans[line.split()[0]]['objective']:.6g}")
        + len(f"{plans[line.split()[0]]['objective']:.6g}")
        for line in table[1:]
    }
    assert len(objective_ends) == 1
    ilp, stf, fair = plans["ilp"], plans["stf"], plans["fair"]
    assert ilp["objective"] <= min(stf["objective"], plans["aggregation"]["objective"])
    assert stf["objective"] <= fair["objective"]
    assert stf["bound"] == fair["bound"] == ilp["bound"]
    assert stf["gap"] == pytest.approx((stf["objective"] - ilp["bound"]) / stf["objective"])
    mean = sum(u["finish"] for u in ilp["updates"]) / len(ilp["updates"])
    assert ilp["objective"] == pytest.approx(mean)  # the example's objective is mean completion
    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"ilp", "stf", "aggregation", "tree", "fair"}
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert (1, "tor_s->s0") in tracks  # the server's ingress, in the ILP's plan


def test_tree_solver_reports_the_bound_parts_and_a_two_level_route(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.plan.test_plan_ilp_levels import two_racks_slow_server

    inst, out = tmp_path / "inst.json", tmp_path / "plan.json"
    inst.write_text(json.dumps(two_racks_slow_server()))
    assert main(["plan", str(inst), "--solver", "tree", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    # 0.04 s: one update's own path into the 2.5 Gbit/s server; the ingress bound: one payload
    # (0.04 s) after five of the six worker hosts went into the two aggregators' NICs (0.025 s)
    assert "lower bound 0.065 s (ingress): own path 0.04 s, server ingress 0.065 s" in text
    plan = json.loads(out.read_text())
    assert plan["objective"] == pytest.approx(0.08) and plan["bound"] == pytest.approx(0.065)
    assert plan["gap"] == pytest.approx(0.1875)
    assert max(len(u["route"]) for u in plan["updates"]) == 4  # worker > a1 > a0 > server


def test_single_solver_json_is_one_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "stf.json"
    assert main(["plan", str(EXAMPLE), "--solver", "stf", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["solver"] == "stf" and doc["bound"] is None and doc["gap"] is None
    assert "== stf ==" in capsys.readouterr().out


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["plan", str(EXAMPLE), "--solver", "fair", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_invalid_instance_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(EXAMPLE.read_text())
    data["updates"][3]["bytes"] = 0
    bad = tmp_path / "bad.json"
    data["topology"] = str(EXAMPLE.parent / data["topology"])
    bad.write_text(json.dumps(data))
    assert main(["plan", str(bad)]) == 2
    assert "updates[3].bytes: must be a positive integer" in capsys.readouterr().err


def test_trace_events_one_track_per_link() -> None:
    from mlfabric.scheduler.core.schedule import Schedule, Transfer

    a = Transfer.at_rate("a", ("w1", "sw", "s"), start=0.0, bytes=2.0, rate=1.0)
    b = Transfer.at_rate("b", ("w2", "sw", "s"), start=2.0, bytes=1.0, rate=1.0)
    events = trace_events(Schedule(transfers=(a, b)), capacities={("sw", "s"): 2.0})
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["sw->s", "w1->sw", "w2->sw"]
    ingress = [e for e in events if e["ph"] == "X" and names[e["tid"]] == "sw->s"]
    assert [(e["name"], e["ts"], e["dur"], e["args"]["share"]) for e in ingress] == [
        ("a", 0.0, 2e6, 0.5),
        ("b", 2e6, 1e6, 0.5),
    ]


@pytest.mark.slow
def test_ctrl_c_returns_the_best_plan_so_far(tmp_path: Path) -> None:
    inst = tmp_path / "big.json"
    # 12x3: CP-SAT's stop after Ctrl-C waits for its workers' next check (1-1.5 s on 16x4 under
    # load, 0.1-0.2 s here); the behaviour under test is the same
    inst.write_text(json.dumps(two_tier_instance(random.Random(0), 12, 3)))
    out = tmp_path / "plan.json"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "mlfabric.cli", "plan", str(inst), "--time-limit", "120"),
            *("--workers", "2", "--progress-every", "0", "--out", str(out)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        assert proc.stderr is not None
        while "best 0" not in line and time.monotonic() < deadline:  # a plan exists
            line = proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "== ilp ==" in stdout
    doc = json.loads(out.read_text())
    assert doc["status"] in ("FEASIBLE", "OPTIMAL", "INTERRUPTED") and len(doc["updates"]) == 12
