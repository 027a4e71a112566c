"""Every error the scheduler returns to a daemon carries the ErrorCode its exception class declares."""

from __future__ import annotations

from typing import Any

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.service import records
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import DaemonSession, SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.records import SchedulerError
from mlfabric.scheduler.service.state import SchedulerState


def _error_classes() -> list[type[SchedulerError]]:
    found = [SchedulerError]
    for cls in found:
        found.extend(c for c in cls.__subclasses__() if c.__module__ == records.__name__)
    return found


def test_every_scheduler_error_declares_its_own_wire_code() -> None:
    classes = _error_classes()
    assert len(classes) > 5
    codes = {}
    for cls in classes:
        assert "code" in vars(cls), f"{cls.__name__} declares no code"
        codes[cls.code] = cls
        pb.ErrorCode.Value(f"ERROR_CODE_{cls.code}")  # raises if the proto has no such code
    assert len(codes) == len(classes), "two exception classes share a code"
    wire = {name.removeprefix("ERROR_CODE_") for name in pb.ErrorCode.DESCRIPTOR.values_by_name} - {
        "UNSPECIFIED"
    }
    assert wire == set(codes), "every wire code belongs to one exception class"


def _core() -> tuple[SchedulerCore, dict[str, DaemonSession]]:
    graph = star(["ps", "a"], 1e9)
    setup = make_policy("fair")
    core = SchedulerCore(
        SchedulerState(graph),
        setup.policy,
        dispatcher=Dispatcher(margin=0.001),
        batcher=AdaptiveBatcher(window=0.05, max_wait=0.2),
        estimator=StaticEstimator(graph),
        replan=setup.trigger,
    )
    sessions = {
        h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{i + 7000}"))
        for i, h in enumerate(["ps", "a"])
    }
    return core, sessions


def _directives(session: DaemonSession) -> list[Any]:
    out = []
    while not session.queue.empty():
        out.append(session.queue.get_nowait())
    return out


def _register(core: SchedulerCore, session: DaemonSession, request_id: int, **role: Any) -> Any:
    core.on_message(session, pb.DaemonMessage(register_role=pb.RegisterRole(request_id=request_id, **role)))
    (ack,) = [d.role_ack for d in _directives(session) if d.WhichOneof("kind") == "role_ack"]
    return ack


def test_refused_registrations_carry_the_code_and_keep_the_message() -> None:
    core, s = _core()
    worker = _register(core, s["a"], 1, job="nojob", name="w", role=pb.ROLE_WORKER)
    assert (worker.ok, worker.code, worker.request_id) == (False, pb.ERROR_CODE_UNKNOWN_JOB, 1)
    assert "nojob" in worker.error
    ps = {"job": "j", "role": pb.ROLE_SERVER, "params": pb.JobParams(tau_max=4)}
    assert _register(core, s["ps"], 2, name="ps", **ps).ok
    dup = _register(core, s["ps"], 3, name="ps", **ps)
    assert (dup.ok, dup.code) == (False, pb.ERROR_CODE_DUPLICATE_SERVER) and "'ps'" in dup.error
    other = _register(
        core, s["ps"], 4, job="j", name="ps2", role=pb.ROLE_SERVER, params=pb.JobParams(tau_max=9)
    )
    assert (other.ok, other.code) == (False, pb.ERROR_CODE_PARAMS_MISMATCH)
    nameless = _register(core, s["ps"], 5, **ps)
    assert (nameless.ok, nameless.code) == (False, pb.ERROR_CODE_REFUSED) and "name" in nameless.error
    assert (
        _register(core, s["a"], 6, job="j", name="w", role=pb.ROLE_WORKER).code == pb.ERROR_CODE_UNSPECIFIED
    )


def test_update_refused_by_the_scheduler_is_dropped_with_the_code() -> None:
    core, s = _core()
    _register(core, s["ps"], 1, job="j", name="ps", role=pb.ROLE_SERVER, params=pb.JobParams(tau_max=4))
    _register(core, s["a"], 2, job="j", name="w", role=pb.ROLE_WORKER)
    ready = pb.UpdateReady(update_id="a/1", job="j", server="nope", worker="w", bytes=8)
    core.on_message(s["a"], pb.DaemonMessage(update_ready=ready))
    (drop,) = [d.drop for d in _directives(s["a"]) if d.WhichOneof("kind") == "drop"]
    assert (drop.update_id, drop.code) == ("a/1", pb.ERROR_CODE_UNKNOWN_SERVER) and "nope" in drop.reason
