"""Coverage-guided fuzz target: ``DaemonMessage`` bytes into the scheduler's core (DESIGN §3, §7).

Run: ``python fuzz/fuzz_control.py -max_total_time=180 [corpus_dir]``. One
:class:`~mlfabric.scheduler.service.core.SchedulerCore` (stf+agg) with a server ``ps0`` of job
``job`` on host ``ps`` and its worker on ``w0``; each input is parsed as a ``DaemonMessage``
(unparsable inputs are what gRPC refuses before the core) and handled as if the daemon of
host ``fz`` or ``w0`` sent it, followed by a decision and a release. Nothing may raise; every
directive must serialize. Every 500 inputs the legitimate server must still be registered
(other daemons may register more servers of the job: that is legitimate).
"""

from __future__ import annotations

import logging
import sys

import atheris

with atheris.instrument_imports(include=["mlfabric"]):
    from google.protobuf.message import DecodeError

    from mlfabric.proto.v1 import control_pb2 as pb
    from mlfabric.scheduler.core.graph import star
    from mlfabric.scheduler.policies.dispatch import Dispatcher
    from mlfabric.scheduler.policies.registry import make_policy
    from mlfabric.scheduler.service.batching import AdaptiveBatcher
    from mlfabric.scheduler.service.core import SchedulerCore, StaticEstimator
    from mlfabric.scheduler.service.state import SchedulerState

_HOSTS = ["ps", "w0", "fz"]


def _core() -> tuple[SchedulerCore, dict]:
    graph = star(_HOSTS, 8e9)
    setup = make_policy("stf+agg", aggregators=_HOSTS)
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
    server = pb.RegisterRole(job="job", role=pb.ROLE_SERVER, name="ps0", model=model)
    core.on_message(sessions["ps"], pb.DaemonMessage(register_role=server))
    worker = pb.RegisterRole(job="job", role=pb.ROLE_WORKER, name="w0")
    core.on_message(sessions["w0"], pb.DaemonMessage(register_role=worker))
    return core, sessions


CORE, SESSIONS = _core()
COUNT = [0]


def test_one_input(data: bytes) -> None:
    if not data:
        return
    try:
        message = pb.DaemonMessage.FromString(data[1:])
    except DecodeError:
        return
    sender = "w0" if data[0] & 1 else "fz"
    CORE.on_message(SESSIONS[sender], message)
    CORE.decide()
    CORE.release()
    CORE.expire_stalled()
    for session in SESSIONS.values():
        while not session.queue.empty():
            directive = session.queue.get_nowait()
            if directive is not None:
                directive.SerializeToString()
    COUNT[0] += 1
    if COUNT[0] % 500 == 0 and ("ps0", "ps") not in {(s.name, s.host) for s in CORE.state.servers("job")}:
        raise AssertionError("messages of other daemons removed server ps0 of host ps")


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # the core logs every ignored message
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
