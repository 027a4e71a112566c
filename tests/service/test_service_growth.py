"""What the scheduler service keeps does not grow with the updates it has seen (issue 24).

A 10-minute run at 100 updates/s (``experiments/bench_service_scale.py``) gained ~10 MiB a
minute and its control-stream lag and decision time grew: the trace ring's records and the
outcomes were objects the cyclic collector tracks (a full collection walked more of them
every minute), and the activity behind ``Admin.Status`` kept up to 4,096 events per link
whatever their age. No processes, no clocks: a fake clock drives the core.
"""

from __future__ import annotations

import gc
import itertools

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.codec_advice import CodecBook
from mlfabric.scheduler.service.core import DaemonSession, SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.observe import Activity, Recorder
from mlfabric.scheduler.service.records import OutcomeKind, OutcomeLog, UpdateOutcome
from mlfabric.scheduler.service.state import MAX_OUTCOMES, SchedulerState
from mlfabric.scheduler.service.tracelog import Kind, TraceLog, TraceRecord

MSG = pb.DaemonMessage


def _tracked(objects: object) -> list[object]:
    gc.collect()
    gc.collect()  # a tuple is untracked once what it holds is (inner ones first)
    return [o for o in objects if gc.is_tracked(o)]  # type: ignore[attr-defined]


def test_the_trace_rings_events_are_left_to_reference_counting() -> None:
    log = TraceLog(capacity=64, clock=lambda: 0.0, wall=lambda: 100.0)
    for i in range(10):
        uid = f"h1/{i}"
        log.ready(uid, "j", "ps", "w0", ("h1", "h0"), 8, base_version=i, codec="int8")
        log.planned(uid, "j", "ps", ("h1", "sw", "h0"), 8, 1.0, 2.0, aggregate=i % 2 == 0)
        log.measured(uid, "j", "ps", ("h1", "sw", "h0"), 8, 99.0, 99.5, ok=True, outcome="applied")
        log.verdict(uid, "dropped", "delay 9 > tau_max 8", version=3)
        log.codec("j", "ps", ("h1", "sw", "h0"), 8, "int8", 1e9, 0.1, 0.2)
    assert not _tracked(log._events)
    events, _, _ = log.since(0)
    assert len(events) == 50 and all(type(e) is TraceRecord for e in events)
    assert [e.kind for e in events[:5]] == [Kind.READY, Kind.PLANNED, Kind.MEASURED, Kind.VERDICT, Kind.CODEC]
    assert all(type(e.kind) is Kind for e in events)
    assert (events[0].codec, events[1].aggregate, events[3].reason) == ("int8", True, "delay 9 > tau_max 8")
    assert log.reply(0, 5).events[4].codec == "int8"


def test_outcomes_are_bounded_and_left_to_reference_counting() -> None:
    s = SchedulerState(star(2, 8e9))
    n = MAX_OUTCOMES + 500
    for i in range(n):
        s.record(f"h1/{i}", OutcomeKind.APPLIED, "", 1, i)
    s.record("h1/7", OutcomeKind.DROPPED, "why", 0, 0)  # forgotten already: recorded anew, newest
    assert len(s.outcomes) == MAX_OUTCOMES <= 10_000
    assert "h1/0" not in s.outcomes and "h1/500" not in s.outcomes and "h1/501" in s.outcomes
    assert s.outcomes[f"h1/{n - 1}"] == UpdateOutcome(f"h1/{n - 1}", OutcomeKind.APPLIED, "", 1, n - 1)
    assert list(s.outcomes)[-1] == "h1/7" and s.outcomes["h1/7"].kind is OutcomeKind.DROPPED
    assert s.recorder.updates_resolved == {"applied": n, "dropped": 1}  # every one counted
    assert not _tracked(s.outcomes._rows.values())
    log = OutcomeLog(2)
    for uid in "aba":
        log.record(UpdateOutcome(uid, OutcomeKind.UNKNOWN, "gone"))
    assert list(log) == ["b", "a"] and log.get("c") is None and log["a"].reason == "gone"


def test_the_activity_keeps_its_history_not_every_event() -> None:
    act = Activity(history=10.0)
    for t in range(1000):  # a new worker and a new link every second, each seen once
        act.push("j", f"w{t}", float(t))
        act.transfer((f"h{t}", "sw", "h0"), 100, float(t))
        act.push("j", "busy", float(t))
    kept = sum(map(len, act._pushes.values())) + sum(map(len, act._links.values()))
    assert len(act._pushes) <= 2 * 10 + 1 and len(act._links) <= 2 * 10 + 2
    assert kept <= 2 * (3 * 10 + 2) + 1
    # what a window within the history reads is what it read before
    assert act.worker_rate("j", "busy", now=999.0, window=5.0) == (6 / 5.0, 1.0, 6)
    assert act.link_bytes(("sw", "h0"), now=999.0, window=5.0) == 600
    assert act.worker_rate("j", "w990", now=999.0, window=10.0)[2] == 1
    assert act.span(now=999.0, window=60.0) == 10.0  # a longer window is cut to the history


def test_the_codec_books_push_times_are_compact_and_untracked() -> None:
    book = CodecBook(SchedulerState(star(["ps", "a"], 1e9)))
    for i in range(100):
        book.note_ready("a", "j", "ps", 0.0, i * 0.5)
    times = book._pushes[("a", "j", "ps")]
    assert len(times) == 21 and times[0] == 39.5  # the window's (10 s) behind the latest push
    assert book.push_rate("a", "j", "ps") == 2.0
    assert not _tracked([times])  # one per (worker host, job, server): 32,000 at 4,000 daemons


def _core(clock: list[float]) -> tuple[SchedulerCore, dict[str, DaemonSession]]:
    g = star(["ps", "a", "b", "c"], 8e9)
    setup = make_policy("stf")
    trace = TraceLog(clock=lambda: clock[0], wall=lambda: clock[0] + 1e9)
    core = SchedulerCore(
        SchedulerState(g, Recorder(trace)),
        setup.policy,
        dispatcher=Dispatcher(),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(g),
        replan=setup.trigger,
        clock=lambda: clock[0],
    )
    hosts = ("ps", "a", "b", "c")
    sessions = {
        h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{9000 + i}")) for i, h in enumerate(hosts)
    }
    params = pb.JobParams(tau_max=-1)
    core.on_message(
        sessions["ps"],
        MSG(register_role=pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name="ps", params=params)),
    )
    for h in "abc":
        core.on_message(sessions[h], MSG(register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name=h)))
    return core, sessions


def _run(core: SchedulerCore, sessions: dict[str, DaemonSession], clock: list[float], ids: range) -> None:
    """Announce ``ids`` round-robin, decide, and report every send applied (10 ms apart)."""
    version = itertools.count(1)
    for i, h in zip(ids, itertools.cycle("abc"), strict=False):
        clock[0] += 0.01
        ready = pb.UpdateReady(update_id=f"{h}/{i}", job="j", server="ps", worker=h, bytes=1 << 20)
        core.on_message(sessions[h], MSG(update_ready=ready))
        core.decide()
        for host in "abc":
            q = sessions[host].queue
            while not q.empty():
                d = q.get_nowait()
                assert d is not None and d.WhichOneof("kind") in ("send", "role_ack"), d
                if d.WhichOneof("kind") != "send":
                    continue
                t = clock[0] + 1e9
                report = pb.TransferReport(
                    update_id=d.send.update_id,
                    src_host=host,
                    dst_host="ps",
                    bytes=1 << 20,
                    start=t,
                    end=t + 0.001,
                    ok=True,
                    outcome=pb.OUTCOME_APPLIED,
                    server_version=next(version),
                )
                core.on_message(sessions[host], MSG(transfer_report=report))


def test_the_objects_the_collector_tracks_do_not_grow_with_the_updates_seen() -> None:
    clock = [1000.0]
    core, sessions = _core(clock)
    _run(core, sessions, clock, range(0, 600))  # warm up: the caches, the workers, the links
    before = len(_tracked(gc.get_objects()))
    _run(core, sessions, clock, range(600, 2400))
    after = len(_tracked(gc.get_objects()))
    assert core.stats().updates_applied == 2400 and not core.state.pending and not core.state.in_flight
    assert len(core.state.outcomes) == 2400 and len(core.recorder.trace._events) >= 4 * 2400  # type: ignore[union-attr]
    # before issue 24: +1,800 outcomes and +7,200 trace records, all tracked
    assert after - before < 200, (before, after)
