"""The scheduler's trace ring and its feed from the service state (no processes)."""

from __future__ import annotations

import tracemalloc

import pytest

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.stf import STFPolicy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.observe import Recorder
from mlfabric.scheduler.service.state import SchedulerState
from mlfabric.scheduler.service.tracelog import Kind, TraceLog
from mlfabric.trace_cli import build_trace


def _fill(log: TraceLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        log.planned(f"h1/{i}", "j", "ps", ("h1", "sw", "h0"), 1024, float(i), float(i) + 0.5)


def test_the_ring_is_bounded_and_a_reader_learns_what_it_lost() -> None:
    log = TraceLog(capacity=100, clock=lambda: 0.0, wall=lambda: 0.0)
    _fill(log, 30)
    events, cursor, lost = log.since(0, limit=10)
    assert [e.seq for e in events] == list(range(1, 11)) and (cursor, lost) == (11, 0)
    _fill(log, 1000, start=30)
    assert len(log._events) == 100
    events, cursor, lost = log.since(cursor)
    assert lost == 1030 - 100 - 10  # seqs 11..930 were overwritten before being read
    assert [e.seq for e in events] == list(range(931, 1031)) and cursor == 1031
    assert log.since(cursor) == ([], 1031, 0)
    assert log.since(10**9)[0][0].seq == 931  # a cursor of an earlier incarnation reads from the oldest


def test_recording_does_not_grow_memory_past_the_ring() -> None:
    tracemalloc.start()
    try:
        log = TraceLog(capacity=2000, clock=lambda: 0.0, wall=lambda: 0.0)
        _fill(log, 2000)
        before, _ = tracemalloc.get_traced_memory()
        _fill(log, 20000, start=2000)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the update ids are new strings each time but replace the ones they overwrite
    assert before > 2000 * 100  # the full ring was traced
    assert after - before < 20_000, f"the ring grew by {after - before} bytes over 20000 events"


def test_a_report_from_a_clock_ahead_is_placed_at_its_receipt() -> None:
    log = TraceLog(clock=lambda: 0.0, wall=lambda: 1000.0)
    log.measured("u", "j", "ps", ("a", "b"), 8, 1500.0, 1502.0, ok=True)
    log.measured("v", "j", "ps", ("a", "b"), 8, 999.0, 999.5, ok=True)
    (far, near), _, _ = log.since(0)
    assert (far.start, far.end, far.clock_from_receipt) == (998.0, 1000.0, True)
    assert (near.start, near.end, near.clock_from_receipt) == (999.0, 999.5, False)


def test_the_core_records_ready_planned_measured_and_verdict() -> None:
    g = star(["ps", "a"], 8e9)
    t = [50.0]
    log = TraceLog(clock=lambda: t[0], wall=lambda: t[0] + 1e6)
    state = SchedulerState(g, Recorder(log))
    core = SchedulerCore(
        state,
        STFPolicy(),
        dispatcher=Dispatcher(),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(g),
        clock=lambda: t[0],
    )
    ps = core.hello(pb.Hello(host="ps", data_address="127.0.0.1:9000"))
    a = core.hello(pb.Hello(host="a", data_address="127.0.0.1:9001"))
    msg = pb.DaemonMessage
    core.on_message(
        ps,
        msg(
            register_role=pb.RegisterRole(
                job="j", role=pb.ROLE_SERVER, name="ps", params=pb.JobParams(tau_max=-1)
            )
        ),
    )
    core.on_message(a, msg(register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name="w")))
    for uid, codec in (("a/1", "int8"), ("a/2", "")):
        ready = pb.UpdateReady(update_id=uid, job="j", server="ps", worker="w", bytes=8000, codec=codec)
        core.on_message(a, msg(update_ready=ready))
    core.decide()
    t[0] = 51.0
    report = pb.TransferReport(
        update_id="a/1",
        dst_host="ps",
        bytes=8000,
        ok=True,
        start=1e6 + 50.2,
        end=1e6 + 50.7,
        outcome=pb.OUTCOME_APPLIED,
    )
    core.on_message(a, msg(transfer_report=report))
    resolved = pb.UpdateResolved(update_id="a/2", outcome=pb.OUTCOME_DROPPED, reason="push deadline")
    core.on_message(a, msg(update_resolved=resolved))
    events, _, _ = log.since(0)
    got = [(e.kind, e.update_id) for e in events]
    assert got == [
        (Kind.READY, "a/1"),
        (Kind.READY, "a/2"),
        (Kind.PLANNED, "a/1"),
        (Kind.PLANNED, "a/2"),
        (Kind.VERDICT, "a/1"),  # the report resolves the push (state.report), then it is traced measured
        (Kind.MEASURED, "a/1"),
        (Kind.VERDICT, "a/2"),
    ]
    assert [e.codec for e in events[:2]] == ["int8", ""]  # the codec a READY update travels with
    assert events[0].to_pb().codec == "int8"
    planned = events[2]
    assert planned.path == ("a", "sw", "ps") and planned.start == pytest.approx(1e6 + 50.0)
    assert planned.end == pytest.approx(planned.start + 8000 / 1e9) and planned.bytes == 8000  # 8 Gbit/s
    measured = events[5]
    assert (measured.start, measured.end, measured.ok, measured.outcome) == (
        1e6 + 50.2,
        1e6 + 50.7,
        True,
        "applied",
    )
    assert [(e.outcome, e.reason) for e in events if e.kind == Kind.VERDICT] == [
        ("applied", ""),
        ("dropped", "push deadline"),
    ]
    trace, meta = build_trace(events)
    link = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    track = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    slices = [
        (link[e["pid"]], track[(e["pid"], e["tid"])], e["name"])
        for e in trace
        if e["ph"] == "X" and e["cat"] == "transfer"
    ]
    assert ("a->sw", "measured", "a/1") in slices and ("sw->ps", "measured", "a/1") in slices
    # a/2 was released with a/1 (within the release margin), so it overlaps it: a second lane
    assert {("a->sw", "planned", "a/1"), ("a->sw", "planned (2)", "a/2")} <= set(slices)
    assert meta["verdicts"] == {"applied": 1, "dropped": 1}


def test_an_aggregate_leaving_its_aggregator_is_traced_planned_and_measured() -> None:
    from mlfabric.scheduler.policies.base import InFlight
    from mlfabric.scheduler.service.records import OutcomeKind, TransferResult

    log = TraceLog(clock=lambda: 0.0, wall=lambda: 10.0)
    state = SchedulerState(star(["ps", "a", "b"], 8e9), Recorder(log))
    f = InFlight("agg:ps.x:1", "j", "ps", ("a", "sw", "ps"), 4000, 1.0, 2.0)
    state.track(f)
    result = TransferResult("agg:ps.x:1", "a", "ps", 4000, 9.0, 9.5, outcome=OutcomeKind.APPLIED)
    assert state.report(result) is f
    planned, verdict, measured = log.since(0)[0]
    assert (planned.kind, planned.aggregate, planned.start, planned.end) == (Kind.PLANNED, True, 11.0, 12.0)
    assert (verdict.kind, verdict.outcome) == (Kind.VERDICT, "applied")
    assert (measured.kind, measured.aggregate, measured.path, measured.start) == (
        Kind.MEASURED,
        True,
        ("a", "sw", "ps"),
        9.0,
    )
    trace, _ = build_trace([planned, verdict, measured])
    names = {e["name"] for e in trace if e["ph"] == "X" and e["cat"] == "update"}
    assert names == {"planned aggregate", "measured"}
