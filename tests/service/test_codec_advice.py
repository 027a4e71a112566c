"""The scheduler's codec advice (``auto``, issue 26): per worker host and server; trace, metrics."""

from __future__ import annotations

from typing import Any

import pytest

from mlfabric.params import Params
from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.fair import FairPolicy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.codec_advice import CodecBook, path_shares
from mlfabric.scheduler.service.core import DaemonSession, SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.observe import Recorder
from mlfabric.scheduler.service.records import JobParams
from mlfabric.scheduler.service.state import SchedulerState
from mlfabric.scheduler.service.tracelog import Kind, TraceLog

MODEL = [pb.TensorSpec(name="w", dtype="float32", shape=[1_125_000])]  # 4.5 MB


def _graph() -> Any:
    """A star at 100 Gbit/s where host 'slow' has a 25 Mbit/s NIC."""
    g = star(["ps", "fast", "slow", "fast2"], 100e9)
    g.edges["slow", "sw"]["capacity"] = g.edges["sw", "slow"]["capacity"] = 25e6 / 8
    return g


def _core(policy: Any = None) -> SchedulerCore:
    g = _graph()
    return SchedulerCore(
        SchedulerState(g, Recorder(TraceLog())),
        policy or FairPolicy(),
        dispatcher=Dispatcher(),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(g),
    )


def _drain(session: DaemonSession) -> list[Any]:
    out = []
    while not session.queue.empty():
        d = session.queue.get_nowait()
        if d is not None:
            out.append(d)
    return out


def _register(core: SchedulerCore, session: DaemonSession, role: int, name: str, params: Params) -> None:
    msg = pb.RegisterRole(job="j", role=role, name=name)  # type: ignore[arg-type]
    if role == pb.ROLE_SERVER:
        msg.model.extend(MODEL)
        msg.params.CopyFrom(params.to_pb())
    core.on_message(session, pb.DaemonMessage(register_role=msg))


def _sessions(core: SchedulerCore) -> dict[str, DaemonSession]:
    hosts = ["ps", "fast", "slow", "fast2"]
    return {
        h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{9000 + i}")) for i, h in enumerate(hosts)
    }


def test_a_worker_on_a_slow_path_is_advised_a_codec_before_its_ack() -> None:
    core = _core()
    sessions = _sessions(core)
    _register(core, sessions["ps"], pb.ROLE_SERVER, "ps0", Params(compression="auto"))
    _drain(sessions["ps"])
    for host in ("fast", "slow"):
        _register(core, sessions[host], pb.ROLE_WORKER, f"w-{host}", Params())
    kinds = {h: [d.WhichOneof("kind") for d in _drain(sessions[h])] for h in ("fast", "slow")}
    # the advice comes first on the stream, so the worker's first push can follow it; a host
    # whose pushes go uncompressed (as without advice) is not told
    assert kinds["slow"][:2] == ["codec_advice", "role_ack"] and "codec_advice" not in kinds["fast"]
    core2 = _core()
    s2 = _sessions(core2)
    _register(core2, s2["ps"], pb.ROLE_SERVER, "ps0", Params(compression="auto"))
    _register(core2, s2["slow"], pb.ROLE_WORKER, "w", Params())
    _register(core2, s2["fast"], pb.ROLE_WORKER, "w2", Params())
    (slow,) = [d.codec_advice for d in _drain(s2["slow"]) if d.WhichOneof("kind") == "codec_advice"]
    assert (slow.job, slow.server, slow.codec, slow.bytes) == ("j", "ps0", "int8", 4_500_000)
    assert slow.bandwidth == pytest.approx(25e6 / 8) and slow.seconds < slow.seconds_none
    assert core2.codecs.sent[("fast", "j", "ps0")] == ""  # chosen, none: nothing to send
    # visible: a CODEC trace event with the inputs, a counter by codec
    trace = core2.state.recorder.trace
    assert trace is not None
    (event,) = [e for e in trace.since(0)[0] if e.kind == Kind.CODEC]
    assert event.codec == "int8" and event.path == ("slow", "sw", "ps") and event.bytes == 4_500_000
    wire = event.to_pb()
    assert wire.codec == "int8" and wire.bandwidth == pytest.approx(25e6 / 8) and wire.seconds_none > 1.0
    assert wire.end - wire.start == pytest.approx(slow.seconds)
    assert core2.stats().codec_choices == {"int8": 1}


def test_the_budget_and_the_policy_narrow_the_choice() -> None:
    core = _core()
    sessions = _sessions(core)
    _register(core, sessions["ps"], pb.ROLE_SERVER, "ps0", Params(compression="auto:budget=0.001"))
    _register(core, sessions["slow"], pb.ROLE_WORKER, "w", Params())
    (advice,) = [d.codec_advice for d in _drain(sessions["slow"]) if d.WhichOneof("kind") == "codec_advice"]
    assert advice.codec == "fp16"
    # an aggregating policy: only codecs an aggregator sums (int8 with a shared bound here)
    book = CodecBook(core.state, must_sum=True)
    core.state.jobs["j"].params = JobParams(compression="auto:bound=6.0")
    (d,) = [d for h, d in book.refresh(core.state.graph).directives if h == "slow"]
    assert d.codec_advice.codec == "int8:bound=6.0"


def test_advice_follows_the_bandwidth_and_a_new_session_gets_it_again() -> None:
    core = _core()
    sessions = _sessions(core)
    _register(core, sessions["ps"], pb.ROLE_SERVER, "ps0", Params(compression="auto"))
    _register(core, sessions["fast"], pb.ROLE_WORKER, "w", Params())
    _drain(sessions["fast"])
    g = core.state.graph.copy()
    book = core.codecs
    assert book.refresh(g).directives == []  # nothing changed
    g.edges["fast", "sw"]["capacity"] = 50e6 / 8  # its NIC estimated at 50 Mbit/s now
    ((host, d),) = book.refresh(g).directives
    assert host == "fast" and d.codec_advice.codec == "int8"
    g.edges["fast", "sw"]["capacity"] = 100e9 / 8  # back: none again, at most once per interval
    assert [d.codec_advice.codec for _, d in book.refresh_due(1e9, lambda: g).directives] == [""]
    g.edges["fast", "sw"]["capacity"] = 50e6 / 8
    assert book.refresh_due(1e9 + 0.5, lambda: g).directives == []  # within the interval: later
    assert [d.codec_advice.codec for _, d in book.refresh_due(1e9 + 1.0, lambda: g).directives] == ["int8"]
    # its daemon reconnects: the new session is advised again when its worker registers
    core.estimator = StaticEstimator(g)
    core.goodbye(sessions["fast"])
    again = core.hello(pb.Hello(host="fast", data_address="127.0.0.1:9100"))
    _register(core, again, pb.ROLE_WORKER, "w", Params())
    assert [d.WhichOneof("kind") for d in _drain(again)][:2] == ["codec_advice", "role_ack"]


def test_shares_divide_a_shared_link_among_the_hosts_crossing_it() -> None:
    g = _graph()
    paths = {"fast": ["fast", "sw", "ps"], "fast2": ["fast2", "sw", "ps"], "slow": ["slow", "sw", "ps"]}
    shares = path_shares(g, paths)
    assert shares["fast"] == shares["fast2"] == pytest.approx(100e9 / 8 / 3)  # the server's link
    assert shares["slow"] == pytest.approx(25e6 / 8)


def test_a_bad_auto_spec_from_a_daemon_gets_no_advice_and_breaks_nothing() -> None:
    core = _core()
    sessions = _sessions(core)
    bad = pb.RegisterRole(
        job="j", role=pb.ROLE_SERVER, name="ps0", params=pb.JobParams(compression="auto:x=1")
    )
    bad.model.extend(MODEL)
    core.on_message(sessions["ps"], pb.DaemonMessage(register_role=bad))
    _register(core, sessions["slow"], pb.ROLE_WORKER, "w", Params())
    kinds = [d.WhichOneof("kind") for d in _drain(sessions["slow"])]
    assert "role_ack" in kinds and "codec_advice" not in kinds


def _uniform_core(gbit: float) -> tuple[SchedulerCore, dict[str, DaemonSession], list[float]]:
    """Hosts ps, fast, fast2 (and slow) on a star of ``gbit`` Gbit/s links; a settable clock."""
    g = star(["ps", "fast", "slow", "fast2"], gbit * 1e9)
    now = [0.0]
    core = SchedulerCore(
        SchedulerState(g, Recorder(TraceLog())),
        FairPolicy(),
        dispatcher=Dispatcher(),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(g),
        clock=lambda: now[0],
    )
    return core, _sessions(core), now


def _announce(core: SchedulerCore, session: DaemonSession, n: int, worker: str, load: float) -> None:
    ready = pb.UpdateReady(
        update_id=f"{session.host}/{n}", job="j", server="ps0", worker=worker, bytes=4_500_000, cpu_load=load
    )
    core.on_message(session, pb.DaemonMessage(update_ready=ready))


def test_measured_load_and_busy_cores_turn_a_codec_off_where_it_would_not_pay() -> None:
    # Two hosts push 4.5 MB updates across the server's 1 Gbit/s link. Judged as saturated (no
    # rate measured yet) each has half of it and int8 is advised. Measured: 2 pushes/s each,
    # 18 MB/s of 125 (14 %), cores shared 10 to 1: a push takes 42 ms uncompressed, int8 would
    # take 85 ms (75 of them encoding and decoding) -- none again.
    core, sessions, now = _uniform_core(1.0)
    _register(core, sessions["ps"], pb.ROLE_SERVER, "ps0", Params(compression="auto"))
    for host in ("fast", "fast2"):
        _register(core, sessions[host], pb.ROLE_WORKER, f"w-{host}", Params())
    advised = {
        h: [d.codec_advice.codec for d in _drain(sessions[h]) if d.HasField("codec_advice")]
        for h in ("fast", "fast2")
    }
    assert advised == {"fast": ["int8"], "fast2": ["int8"]}
    for n in range(6):
        now[0] = 10.0 + 0.5 * n
        for host in ("fast", "fast2"):
            _announce(core, sessions[host], n, f"w-{host}", 10.0)
    assert core.codecs.push_rate("fast", "j", "ps0") == pytest.approx(2.0)
    refreshed = core.codecs.refresh(core.state.graph)
    assert sorted((h, d.codec_advice.codec) for h, d in refreshed.directives) == [("fast", ""), ("fast2", "")]
    # the same pushes on quiet cores (load 0.5 per core): int8 saves more than a quarter again
    for n in range(6, 12):
        now[0] = 10.0 + 0.5 * n
        for host in ("fast", "fast2"):
            _announce(core, sessions[host], n, f"w-{host}", 0.5)
    refreshed = core.codecs.refresh(core.state.graph)
    assert sorted((h, d.codec_advice.codec) for h, d in refreshed.directives) == [
        ("fast", "int8"),
        ("fast2", "int8"),
    ]
