"""Bounded-horizon STF in the service: re-deciding as the plan runs low (DESIGN §4, §8).

Pure parts (:class:`ReplanTrigger` with the dispatcher on a fake clock, the batcher's
requested decisions, ``--stf-horizon``) and the grpc.aio service in-process on
127.0.0.1:0 with a horizon of 4 and 20 updates queued behind one bottleneck.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import pytest

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.proto.v1 import control_pb2_grpc as pb_grpc
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.aggregation import AggregationPolicy
from mlfabric.scheduler.policies.base import Decision, InFlight, Send
from mlfabric.scheduler.policies.dispatch import Dispatcher, ReplanTrigger, low_water_mark
from mlfabric.scheduler.policies.stf import STFPolicy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.cli import build_policy, main
from mlfabric.scheduler.service.core import (
    CLIENT_CHANNEL_OPTIONS,
    SchedulerCore,
    StaticEstimator,
    start_server,
)
from mlfabric.scheduler.service.state import SchedulerState

TIMEOUT = 5.0
#: 100 kB/s: a 100 kB update is expected to take 1 s, far longer than a report's trip (loaded too)
NIC_BPS = 8e5

# ------------------------------------------------------------------ pure: trigger + dispatcher


def _chain(ids: list[str], duration: float) -> Decision:
    """Sends one after another on one bottleneck, each ``duration`` long, from t = 0."""
    sends = [
        Send(uid, "ps", ("a", "ps"), (ids[i - 1],) if i else (), i * duration, (i + 1) * duration)
        for i, uid in enumerate(ids)
    ]
    return Decision(sends=tuple(sends))


def test_trigger_fires_when_the_clock_releases_the_plan_down_to_the_low_water_mark() -> None:
    d, t = Dispatcher(margin=0.0), ReplanTrigger(low_water=1)
    pending = 10  # 4 planned (the horizon), 6 unplanned
    t.decided()
    d.adopt(_chain(["u0", "u1", "u2", "u3"], duration=1.0))
    in_flight: dict[str, InFlight] = {}
    due_at = []
    for now in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0):  # the fake clock
        released = d.release(now, in_flight)
        for r in released:
            in_flight[r.send.update_id] = InFlight(
                r.send.update_id, "j", "ps", r.send.path, 1, r.started_at, r.expected_end
            )
            pending -= 1
            t.moved()
        if t.due(planned=len(d), unplanned=pending - len(d)):
            due_at.append(now)
    # u0 at 0, u1 at 1, u2 at 2 (one planned left: the low-water mark), u3 at 3
    assert due_at == [2.0, 2.5, 3.0]
    assert len(d) == 0 and pending == 6


def test_trigger_waits_for_movement_and_for_unplanned_updates() -> None:
    t = ReplanTrigger(low_water=0)
    t.decided()
    assert not t.due(planned=0, unplanned=3)  # a policy that left them undecided: no spinning
    t.moved()
    assert t.due(planned=0, unplanned=3)  # a report freed a link and nothing is planned
    assert not t.due(planned=1, unplanned=3)
    assert not t.due(planned=0, unplanned=0)
    t.decided()
    assert not t.due(planned=0, unplanned=3)
    with pytest.raises(ValueError, match="low_water"):
        ReplanTrigger(low_water=-1)


def test_low_water_mark_is_a_quarter_of_the_horizon() -> None:
    assert [low_water_mark(h) for h in (None, 0, 3, 4, 10, 256)] == [0, 0, 0, 1, 2, 64]


def test_dispatcher_counts_and_knows_its_planned_sends() -> None:
    d = Dispatcher()
    d.adopt(_chain(["x", "y"], 1.0))
    assert len(d) == 2 and "y" in d and "z" not in d
    d.forget(["y"])
    assert len(d) == 1 and "y" not in d


def test_batcher_request_returns_an_empty_batch_or_joins_the_open_one() -> None:
    async def main_() -> tuple[int, int, int]:
        b = AdaptiveBatcher(window=0.01, max_wait=0.05)
        b.request()
        alone = await b.next_batch()
        b.notify()
        b.request()  # a batch is open: it closes on its own timing and serves the request
        joined = await b.next_batch()
        b.notify()
        third = await asyncio.wait_for(b.next_batch(), 1.0)  # the request was consumed
        return alone, joined, third

    assert asyncio.run(main_()) == (0, 1, 1)


# ---------------------------------------------------------------------------------- CLI


def test_build_policy_passes_the_horizon_to_stf() -> None:
    policy, replan = build_policy("stf", 4)
    assert isinstance(policy, STFPolicy)
    assert (policy.name, policy.horizon, replan.low_water) == ("stf", 4, 1)
    policy, replan = build_policy("stf", 0)
    assert isinstance(policy, STFPolicy)
    assert (policy.horizon, replan.low_water) == (None, 0)
    policy, replan = build_policy("fair", 4)
    assert (policy.name, replan.low_water) == ("fair", 0)
    with pytest.raises(ValueError, match="stf-horizon"):
        build_policy("stf", -1)
    with pytest.raises(ValueError, match="unknown policy 'lifo' "):
        build_policy("lifo")
    policy, replan = build_policy("stf+agg")
    assert isinstance(policy, AggregationPolicy)
    assert (policy.name, policy.sync) == ("stf+agg", False)


def test_stf_horizon_is_documented_and_validated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--stf-horizon N" in out and "default 256" in out
    assert main(["--policy", "stf", "--stf-horizon", "-2"]) == 2
    assert "--stf-horizon must be >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------------ in-process service


class Worker:
    """Host ``a``'s daemon as far as these tests need: ready, directives, reports."""

    def __init__(self, channel: grpc.aio.Channel, host: str) -> None:
        self.host = host
        self.call = pb_grpc.SchedulerStub(channel).Session()
        self.directives: asyncio.Queue[pb.Directive] = asyncio.Queue()
        self.reader: asyncio.Task[None] | None = None

    async def start(self, role: pb.Role, name: str, **extra: Any) -> None:
        await self.call.write(pb.DaemonMessage(hello=pb.Hello(host=self.host, data_address="127.0.0.1:1")))
        assert (await self.call.read()).WhichOneof("kind") == "welcome"
        register = pb.RegisterRole(request_id=1, job="j", role=role, name=name, **extra)
        await self.call.write(pb.DaemonMessage(register_role=register))
        ack = (await self.call.read()).role_ack
        assert ack.ok, ack.error
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while (d := await self.call.read()) is not grpc.aio.EOF:
            self.directives.put_nowait(d)

    async def recv(self, timeout: float = TIMEOUT) -> pb.Directive:
        return await asyncio.wait_for(self.directives.get(), timeout)


@contextlib.asynccontextmanager
async def service(horizon: int) -> AsyncIterator[tuple[SchedulerCore, grpc.aio.Channel]]:
    graph = star(["ps", "a"], NIC_BPS)
    policy, replan = build_policy("stf", horizon)
    core = SchedulerCore(
        SchedulerState(graph),
        policy,
        dispatcher=Dispatcher(margin=0.001),
        batcher=AdaptiveBatcher(window=1.0, max_wait=5.0),  # one batch for all 20, on a loaded machine too
        estimator=StaticEstimator(graph),
        replan=replan,
    )
    server, port = await start_server(core, "127.0.0.1:0")
    task = asyncio.create_task(core.run())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_CHANNEL_OPTIONS)
    try:
        yield core, channel
    finally:
        await channel.close()
        await server.stop(None)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


#: 20 sizes in a scrambled arrival order; STF behind one bottleneck sends them smallest first
SIZES = [100_000 + 10_000 * ((7 * i) % 20) for i in range(20)]


async def _drain(
    core: SchedulerCore, channel: grpc.aio.Channel, tau_max: int
) -> tuple[list[str], dict[str, str], int]:
    """Announce the 20 updates, report each send; returns sends, drops, decisions made."""
    ps, a = Worker(channel, "ps"), Worker(channel, "a")
    await ps.start(pb.ROLE_SERVER, "ps", params=pb.JobParams(tau_max=tau_max), version=3)
    await a.start(pb.ROLE_WORKER, "w")
    for i, size in enumerate(SIZES):
        ready = pb.UpdateReady(
            update_id=f"a/{i}", job="j", server="ps", worker="w", bytes=size, norm=1.0, base_version=3
        )
        await a.call.write(pb.DaemonMessage(update_ready=ready))
    sent: list[str] = []
    dropped: dict[str, str] = {}
    version = 3
    while len(sent) + len(dropped) < len(SIZES):
        d = await a.recv()
        if d.WhichOneof("kind") == "drop":
            dropped[d.drop.update_id] = d.drop.reason
            continue
        uid = d.send.update_id
        # one after another: expected durations are >= 1 s, so only reports release
        assert set(core.state.in_flight) == {uid}, (uid, set(core.state.in_flight))
        sent.append(uid)
        version += 1
        report = pb.TransferReport(
            update_id=uid,
            src_host="a",
            dst_host="ps",
            bytes=SIZES[int(uid.split("/")[1])],
            start=10.0,
            end=10.1,
            ok=True,
            outcome=pb.OUTCOME_APPLIED,
            server_version=version,
        )
        await a.call.write(pb.DaemonMessage(transfer_report=report))
    assert a.directives.empty()
    return sent, dropped, _count(core)


def _count(core: SchedulerCore) -> int:
    """How many decisions the service made (the histogram's count)."""
    return core.stats().decision_seconds.count


def _stf_order() -> list[str]:
    return [f"a/{i}" for i in sorted(range(len(SIZES)), key=lambda i: SIZES[i])]


def test_horizon_4_releases_all_20_updates_in_stf_order_driven_by_reports() -> None:
    async def main_() -> None:
        async with service(horizon=4) as (core, channel):
            sent, dropped, decisions = await _drain(core, channel, tau_max=-1)
            assert sent == _stf_order() and dropped == {}
            # one decision for the batch, then one per 3 reports (low-water mark 1 of 4)
            assert decisions >= 1 + (20 - 4) // 3
            await asyncio.sleep(0.05)
            assert not core.state.pending and len(core.dispatcher) == 0

    run(main_())


def test_horizon_4_still_drops_updates_beyond_it_for_tau_max_at_their_turn() -> None:
    async def main_() -> None:
        async with service(horizon=4) as (core, channel):
            # position k in the STF order has expected delay k (versions applied + in flight)
            sent, dropped, _ = await _drain(core, channel, tau_max=10)
            order = _stf_order()
            assert sent == order[:11]
            assert set(dropped) == set(order[11:])
            assert all("> tau_max 10" in r for r in dropped.values())
            assert not core.state.pending and core.stats().updates_dropped == 9

    run(main_())


def test_without_horizon_one_decision_plans_everything() -> None:
    async def main_() -> None:
        async with service(horizon=0) as (core, channel):
            sent, dropped, decisions = await _drain(core, channel, tau_max=-1)
            assert sent == _stf_order() and dropped == {}
            assert decisions == 1

    run(main_())
