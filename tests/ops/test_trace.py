"""``mlfabric trace`` against a running scheduler and two daemons: pushes planned and measured per link."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def _trace(address: str, out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mlfabric", "trace", "--scheduler", address, "--out", str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_ready(address: str, known: int, timeout: float = 60.0) -> None:
    """Until the scheduler has traced more than ``known`` ready updates."""
    import grpc

    from mlfabric.proto.v1 import admin_pb2, admin_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        while time.monotonic() < deadline:
            events = stub.Trace(admin_pb2.TraceRequest(), timeout=10).events
            if sum(e.kind == admin_pb2.TRACE_EVENT_KIND_READY for e in events) > known:
                return
            time.sleep(0.02)
    raise AssertionError(f"no new update ready at the scheduler within {timeout} s")


def _slices(trace: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(process name, track name) -> its complete events."""
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    tracks = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] in ("X", "i"):
            track = re.sub(r" \(\d+\)$", "", tracks[(e["pid"], e["tid"])])  # "planned (2)": a lane of planned
            out.setdefault((procs[e["pid"]], track), []).append(e)
    return out


def _overlapping(trace: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Complete events that overlap another on their track without nesting (viewers mis-draw them)."""
    by_track: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    bad = []
    for track, spans in by_track.items():
        open_: list[tuple[float, float, str]] = []  # the enclosing slices, innermost last
        for span in sorted(spans, key=lambda x: (x[0], -x[1])):
            while open_ and open_[-1][1] <= span[0]:
                open_.pop()
            if open_ and span[1] > open_[-1][1]:
                bad.append((track, open_[-1], span))
            open_.append(span)
    return bad


def test_trace_shows_the_pushes_planned_and_measured_per_link(ops_cluster: Any, tmp_path: Path) -> None:
    c = ops_cluster
    before = c.push("h0", "h1", 4)  # kept in the scheduler's ring: the trace starts with them
    out = tmp_path / "run.trace.json"
    pushing = subprocess.Popen(
        [sys.executable, str(HERE / "pushes.py"), c.daemons["h0"]["socket"], c.daemons["h1"]["socket"], "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_ready(c.scheduler["address"], known=4)  # the first of these pushes reached the scheduler
        tracer = _trace(c.scheduler["address"], out, "--seconds", "2")
        _, err = tracer.communicate(timeout=60)
        during = json.loads(pushing.communicate(timeout=120)[0].splitlines()[-1])
    finally:
        if pushing.poll() is None:
            pushing.kill()
            pushing.wait()
    assert tracer.returncode == 0, err
    assert before["applied"] == 4 and during["applied"] == 3, (before, during)
    assert "mlfabric trace: 0/2 s" in err and "ui.perfetto.dev" in err
    trace = json.loads(out.read_text())
    assert trace["otherData"]["verdicts"] == {"applied": 7} and trace["otherData"]["lost"] == 0

    slices = _slices(trace)
    assert _overlapping(trace) == []
    # the worker on h1 pushes to the server on h0 through the switch: both links, both tracks
    for link in ("h1->sw", "sw->h0"):
        planned = [e for e in slices[(link, "planned")] if e["ph"] == "X"]
        measured = [e for e in slices[(link, "measured")] if e["ph"] == "X"]
        assert len(planned) == len(measured) == 7, link
        assert {e["name"] for e in planned} == {e["name"] for e in measured}
        for e in planned + measured:
            assert e["dur"] > 0 and e["args"]["bytes"] == pytest.approx(256 * 1024, rel=1e-6)
            assert e["args"]["share"] > 0  # of the configured 1 Gbit/s
        # the plan never reserves more than the configured rate (loopback runs faster than that)
        assert max(e["args"]["share"] for e in planned) == pytest.approx(1.0, rel=1e-3)
    assert not any(link in ("h0->sw", "sw->h1") for link, _ in slices)  # nothing flowed that way
    updates = {e["name"] for e in slices[("h1->sw", "planned")]}
    for uid in updates:
        track = slices[("updates of job ops", f"{uid} measured")]
        assert [e["name"] for e in track if e["ph"] == "i"] == ["applied"]
        assert [e["name"] for e in track if e["ph"] == "X"] == ["measured"]
        assert [e["name"] for e in slices[("updates of job ops", f"{uid} planned")]] == ["queued", "planned"]
    # measured transfers start after they were planned (released), on the scheduler's time axis
    first_planned = {e["name"]: e["ts"] for e in slices[("h1->sw", "planned")]}
    for e in slices[("h1->sw", "measured")]:
        assert e["ts"] >= first_planned[e["name"]] - 50_000  # clocks of one machine: within 50 ms


def test_trace_from_now_leaves_out_the_history(ops_cluster: Any, tmp_path: Path) -> None:
    c = ops_cluster
    c.push("h0", "h1", 2)
    out = tmp_path / "now.trace.json"
    tracer = _trace(c.scheduler["address"], out, "--seconds", "0", "--from-now", "--quiet")
    _, err = tracer.communicate(timeout=60)
    assert tracer.returncode == 0 and err == ""
    trace = json.loads(out.read_text())
    assert trace["traceEvents"] == [] and trace["otherData"]["events"] == 0


def test_trace_of_no_scheduler_fails_naming_it(tmp_path: Path) -> None:
    tracer = _trace("127.0.0.1:1", tmp_path / "x.json", "--seconds", "1", "--timeout", "2")
    _, err = tracer.communicate(timeout=60)
    assert tracer.returncode == 1
    assert "mlfabric trace: error: scheduler 127.0.0.1:1: UNAVAILABLE" in err
    assert not (tmp_path / "x.json").exists()


def test_trace_splits_the_time_between_synchronous_rounds(ops_cluster: Any, tmp_path: Path) -> None:
    """Issue 23: a synchronous server's rounds, each split into verdicts, model + compute and
    transfers + apply, on a track of their own and summarised in the file and on stderr."""
    c = ops_cluster
    out = tmp_path / "rounds.trace.json"
    run = subprocess.run(
        [sys.executable, str(HERE / "rounds.py"), c.daemons["h0"]["socket"], c.daemons["h1"]["socket"], "4"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == {"applied": 8, "version": 4}
    tracer = _trace(c.scheduler["address"], out, "--seconds", "0")  # the ring holds the run
    _, err = tracer.communicate(timeout=60)
    assert tracer.returncode == 0, err
    trace = json.loads(out.read_text())
    summary = trace["otherData"]["rounds"]["rounds/ps0"]
    assert summary["rounds"] == 4  # versions 1-4, two members each
    assert all(summary[k] is not None and summary[k] >= 0 for k in ("verdicts_ms", "model_compute_ms"))
    assert summary["transfers_apply_ms"] is not None  # rounds 1-3 have a next apply
    assert "mlfabric trace: rounds of rounds/ps0: 4, medians: verdicts" in err
    slices = _slices(trace)[("rounds of rounds/ps0", "between applies")]
    names = [e["name"] for e in slices]
    assert names[:3] == ["verdicts (v1)", "model + compute (v1)", "transfers + apply (v1)"]
    assert "verdicts (v4)" in names and all(e["args"]["members"] == 2 for e in slices)
    assert _overlapping(trace) == []
