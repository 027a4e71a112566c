"""Fuzzing the control messages (DESIGN §3, §7): any ``DaemonMessage`` at the scheduler.

The core (:class:`~mlfabric.scheduler.service.core.SchedulerCore`, no I/O) gets 1,000
generated sequences of messages, each under one of the policies (fair, stf, stf+agg, stf+tree): from
a forged daemon ``fz`` while the legitimate daemons ``ps`` (server ``ps0`` of job ``job``)
and ``w0`` (its worker) are connected, and from any of the three. Nothing may raise; every
directive must serialize and every drop carry a reason; after a forged daemon's messages
the legitimate roles are intact and a legitimate update is sent. One more run sends
generated streams (``Hello`` first or not, then any messages, some raw bytes that do not
parse) to the real scheduler process over gRPC; it stays up and a normal push is APPLIED
afterwards.
"""

from __future__ import annotations

import types
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.proto.v1 import control_pb2_grpc
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.records import SchedulerError
from mlfabric.scheduler.service.state import SchedulerState

_HOSTS = ["ps", "w0", "fz"]


def _core(policy: str) -> tuple[SchedulerCore, dict[str, Any]]:
    """A core with ``ps`` serving ``ps0`` of ``job`` (8 float64) and ``w0`` its worker."""
    graph = star(_HOSTS, 8e9)
    setup = make_policy(policy, aggregators=_HOSTS)
    core = SchedulerCore(
        SchedulerState(graph),
        setup.policy,
        dispatcher=Dispatcher(),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(graph),
        replan=setup.trigger,
    )
    sessions = {
        h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{9000 + i}", can_aggregate=True))
        for i, h in enumerate(_HOSTS)
    }
    model = [pb.TensorSpec(name="w", dtype="float64", shape=[8])]
    server = pb.RegisterRole(
        job="job", role=pb.ROLE_SERVER, name="ps0", model=model, params=pb.JobParams(tau_max=1000)
    )
    core.on_message(sessions["ps"], pb.DaemonMessage(register_role=server))
    worker = pb.RegisterRole(job="job", role=pb.ROLE_WORKER, name="w0")
    core.on_message(sessions["w0"], pb.DaemonMessage(register_role=worker))
    return core, sessions


def _drain(sessions: dict[str, Any]) -> list[Any]:
    out = []
    for session in sessions.values():
        while not session.queue.empty():
            directive = session.queue.get_nowait()
            if directive is not None:
                directive.SerializeToString()
                if directive.WhichOneof("kind") == "drop":
                    assert directive.drop.reason.strip(), directive
                out.append(directive)
    return out


def _legit_update_is_sent(core: SchedulerCore, sessions: dict[str, Any]) -> None:
    assert ("ps0", "ps") in {(s.name, s.host) for s in core.state.servers("job")}
    ready = pb.UpdateReady(update_id="w0/legit", job="job", server="ps0", worker="w0", bytes=64)
    core.on_message(sessions["w0"], pb.DaemonMessage(update_ready=ready))
    core.decide()
    core.release()
    kinds = []
    while not sessions["w0"].queue.empty():
        d = sessions["w0"].queue.get_nowait()
        if (
            d is not None
            and d.WhichOneof("kind") in ("send", "drop")
            and getattr(d, d.WhichOneof("kind")).update_id == "w0/legit"
        ):
            kinds.append((d.WhichOneof("kind"), d))
    assert [k for k, _ in kinds] == ["send"], f"the legitimate update after forged messages: {kinds}"


def test_any_messages_of_a_forged_daemon_leave_the_core_serving(fz: Any) -> None:
    counts = {"fair": 0, "stf": 0, "stf+agg": 0, "stf+tree": 0}

    @fz.settings
    @given(
        policy=st.sampled_from(sorted(counts)),
        messages=st.lists(fz.proto(pb.DaemonMessage), min_size=1, max_size=6),
        forged_only=st.booleans(),
        senders=st.lists(st.sampled_from(_HOSTS), min_size=6, max_size=6),
        steps=st.lists(st.sampled_from(["none", "decide", "release", "expire"]), min_size=6, max_size=6),
    )
    def run(
        policy: str, messages: list[Any], forged_only: bool, senders: list[str], steps: list[str]
    ) -> None:
        counts[policy] += 1
        core, sessions = _core(policy)
        _drain(sessions)
        for m, sender, step in zip(messages, senders, steps, strict=False):
            core.on_message(sessions["fz" if forged_only else sender], m)
            if step == "decide":
                core.decide()
            elif step == "release":
                core.release()
            elif step == "expire":
                core.expire_stalled()
            _drain(sessions)
        if forged_only:
            _legit_update_is_sent(core, sessions)
        for h in list(sessions):
            core.goodbye(sessions[h])
        _drain(sessions)

    run()
    print(f"control (core): {sum(counts.values())} generated message sequences, by policy {counts}")
    assert sum(counts.values()) >= fz.examples


def test_any_hello_is_accepted_or_refused_naming_the_problem(fz: Any) -> None:
    count = 0

    @fz.settings
    @given(hello=fz.proto(pb.Hello))
    def run(hello: Any) -> None:
        nonlocal count
        count += 1
        core, _sessions = _core("fair")
        try:
            session = core.hello(hello)
        except SchedulerError as exc:
            assert str(exc).strip()
            return
        core.goodbye(session)

    run()
    assert count >= fz.examples


@pytest.mark.slow
def test_generated_streams_at_the_real_scheduler(fuzz_cluster: types.SimpleNamespace, fz: Any) -> None:
    channel = grpc.insecure_channel(fuzz_cluster.scheduler)
    stub = control_pb2_grpc.SchedulerStub(channel)
    raw = channel.stream_stream(
        "/mlfabric.v1.Scheduler/Session", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    codes: dict[str, int] = {}
    count = 0
    hello = pb.DaemonMessage(hello=pb.Hello(host="fz", data_address="127.0.0.1:9", can_aggregate=True))

    @fz.settings
    @given(
        first=st.one_of(st.just(hello), fz.proto(pb.DaemonMessage)),
        messages=st.lists(fz.proto(pb.DaemonMessage), max_size=5),
        garbage=st.lists(st.binary(min_size=1, max_size=40), max_size=1),
    )
    def run(first: Any, messages: list[Any], garbage: list[bytes]) -> None:
        nonlocal count
        count += 1
        if garbage:
            calls = raw(iter([hello.SerializeToString(), *garbage]), timeout=5)
        else:
            calls = stub.Session(iter([first, *messages]), timeout=2)
        try:
            for _directive in calls:
                pass
        except grpc.RpcError as exc:
            code = exc.code()
            codes[code.name] = codes.get(code.name, 0) + 1
            assert code != grpc.StatusCode.UNKNOWN, f"the scheduler raised: {exc.details()}"
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS):
                assert exc.details().strip()

    try:
        run()
    finally:
        channel.close()
    print(f"control (gRPC): {count} generated streams, status codes {codes}")
    assert count >= fz.examples
    fz.healthy(fuzz_cluster)


@pytest.mark.parametrize("role", [-1, 7, pb.ROLE_UNSPECIFIED])
def test_a_role_of_unknown_value_is_refused_naming_it(role: int) -> None:
    """Found by fuzzing: ``RegisterRole{role: -1}`` raised ValueError in the core (ending the stream)."""
    core, sessions = _core("fair")
    _drain(sessions)
    # protobuf takes any int for an enum field; protoc's stub types it Role (the known values only)
    register = pb.RegisterRole(job="job", role=role, name="x")  # type: ignore[arg-type]
    core.on_message(sessions["fz"], pb.DaemonMessage(register_role=register))
    [ack] = _drain(sessions)
    assert not ack.role_ack.ok
    assert f"role {pb.Role.Name(role) if role == 0 else role} is not supported" in ack.role_ack.error
    assert ack.role_ack.code == pb.ERROR_CODE_REFUSED


@pytest.mark.slow
@pytest.mark.parametrize("after_hello", [False, True])
def test_bytes_that_do_not_parse_end_the_stream_as_invalid_argument(
    fuzz_cluster: types.SimpleNamespace, after_hello: bool
) -> None:
    """Found by fuzzing: the stream ended UNKNOWN with the servicer's DecodeError."""
    hello = pb.DaemonMessage(hello=pb.Hello(host="fz", data_address="127.0.0.1:9"))
    with grpc.insecure_channel(fuzz_cluster.scheduler) as channel:
        raw = channel.stream_stream(
            "/mlfabric.v1.Scheduler/Session",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        messages = [hello.SerializeToString()] if after_hello else []
        with pytest.raises(grpc.RpcError) as caught:
            for _ in raw(iter([*messages, b"\xff\xff\xff"]), timeout=5):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed DaemonMessage" in caught.value.details()
