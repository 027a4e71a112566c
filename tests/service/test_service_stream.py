"""The grpc.aio scheduler service, in-process on 127.0.0.1:0, driven by test daemons."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import grpc
import networkx as nx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.proto.v1 import control_pb2_grpc as pb_grpc
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import (
    CLIENT_CHANNEL_OPTIONS,
    SchedulerCore,
    StaticEstimator,
    start_server,
)
from mlfabric.scheduler.service.state import SchedulerState

TIMEOUT = 5.0
NIC_BPS = 8e6  # 1 MB/s per NIC: a 1 MB update takes a second on the server's ingress


class FakeDaemon:
    """Speaks the Session stream like a host daemon."""

    def __init__(self, channel: grpc.aio.Channel, host: str) -> None:
        self.host = host
        self.call = pb_grpc.SchedulerStub(channel).Session()
        # a cancelled read cancels the whole call: read in the background, wait on a queue
        self.directives: asyncio.Queue[pb.Directive | BaseException] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while (d := await self.call.read()) is not grpc.aio.EOF:
                self.directives.put_nowait(d)
        except grpc.aio.AioRpcError as exc:
            self.directives.put_nowait(exc)

    async def send(self, **kind: Any) -> None:
        await self.call.write(pb.DaemonMessage(**kind))

    async def recv(self, timeout: float = TIMEOUT) -> pb.Directive:
        d = await asyncio.wait_for(self.directives.get(), timeout)
        if isinstance(d, BaseException):
            raise d
        return d

    async def hello(self) -> pb.Welcome:
        await self.send(hello=pb.Hello(host=self.host, data_address=f"127.0.0.1:{1000 + len(self.host)}"))
        return (await self.recv()).welcome

    async def register(
        self, role: pb.Role, name: str, job: str = "j", request_id: int = 1, **extra: Any
    ) -> pb.RoleAck:
        await self.send(
            register_role=pb.RegisterRole(request_id=request_id, job=job, role=role, name=name, **extra)
        )
        d = await self.recv()
        assert d.WhichOneof("kind") == "role_ack", d
        return d.role_ack

    async def ready(
        self, uid: str, nbytes: int, worker: str, server: str = "ps", job: str = "j", base_version: int = 3
    ) -> None:
        msg = pb.UpdateReady(
            update_id=uid,
            job=job,
            server=server,
            worker=worker,
            bytes=nbytes,
            norm=1.0,
            base_version=base_version,
        )
        await self.send(update_ready=msg)

    async def report(self, uid: str, dst: str, version: int, nbytes: int = 1000) -> None:
        r = pb.TransferReport(
            update_id=uid,
            src_host=self.host,
            dst_host=dst,
            bytes=nbytes,
            start=100.0,
            end=100.5,
            ok=True,
            outcome=pb.OUTCOME_APPLIED,
            delay=0,
            server_version=version,
        )
        await self.send(transfer_report=r)


class Cluster:
    def __init__(self, core: SchedulerCore, channel: grpc.aio.Channel) -> None:
        self.core = core
        self.channel = channel

    async def daemon(self, host: str) -> FakeDaemon:
        d = FakeDaemon(self.channel, host)
        await d.hello()
        return d

    async def until(self, predicate: Callable[[], bool]) -> None:
        for _ in range(int(TIMEOUT / 0.01)):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not reached")


class RecordingEstimator(StaticEstimator):
    def __init__(self, graph: nx.DiGraph) -> None:
        super().__init__(graph)
        self.observed: list[tuple[tuple[str, ...], int, float, int]] = []
        self.asked = 0

    def observe(
        self, path: Sequence[str], nbytes: int, duration: float, now: float, *, shared: int = 1
    ) -> None:
        self.observed.append((tuple(path), nbytes, duration, shared))

    def estimated_graph(self) -> nx.DiGraph:
        self.asked += 1
        return super().estimated_graph()


@contextlib.asynccontextmanager
async def cluster(policy: str = "fair", window: float = 0.05) -> AsyncIterator[Cluster]:
    graph = star(["ps", "a", "b"], NIC_BPS)
    setup = make_policy(policy)
    core = SchedulerCore(
        SchedulerState(graph),
        setup.policy,
        dispatcher=Dispatcher(margin=0.001),
        batcher=AdaptiveBatcher(window=window, max_wait=0.2),
        estimator=RecordingEstimator(graph),
        replan=setup.trigger,
    )
    server, port = await start_server(core, "127.0.0.1:0")
    task = asyncio.create_task(core.run())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_CHANNEL_OPTIONS)
    try:
        yield Cluster(core, channel)
    finally:
        await channel.close()
        await server.stop(None)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def _job(c: Cluster) -> tuple[FakeDaemon, FakeDaemon, FakeDaemon]:
    """Server 'ps' on host ps, worker 'wa' on host a, worker 'wb' on host b."""
    ps, a, b = await c.daemon("ps"), await c.daemon("a"), await c.daemon("b")
    model = [pb.TensorSpec(name="w", dtype="float32", shape=[1000, 1000])]  # 4 MB: updates up to it
    ack = await ps.register(pb.ROLE_SERVER, "ps", model=model, params=pb.JobParams(tau_max=4), version=3)
    assert ack.ok, ack.error
    for d, name in ((a, "wa"), (b, "wb")):
        ack = await d.register(pb.ROLE_WORKER, name)
        assert ack.ok, ack.error
        assert [(s.name, s.host, s.version) for s in ack.servers] == [("ps", "ps", 3)]
    return ps, a, b


def test_hello_must_come_first() -> None:
    async def main() -> None:
        async with cluster() as c:
            d = FakeDaemon(c.channel, "a")
            await d.send(update_ready=pb.UpdateReady(update_id="x"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await d.recv()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Hello" in (err.value.details() or "")

    run(main())


def test_hello_from_unknown_or_duplicate_host_is_refused() -> None:
    async def main() -> None:
        async with cluster() as c:
            d = FakeDaemon(c.channel, "nowhere")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await d.hello()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "'nowhere'" in (err.value.details() or "")
            welcome = await (first := FakeDaemon(c.channel, "a")).hello()
            assert welcome.policy == "fair"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await FakeDaemon(c.channel, "a").hello()
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert first.host in c.core.sessions

    run(main())


def test_worker_of_unknown_job_gets_error_naming_it() -> None:
    async def main() -> None:
        async with cluster() as c:
            a = await c.daemon("a")
            ack = await a.register(pb.ROLE_WORKER, "wa", job="nojob", request_id=42)
            assert (ack.ok, ack.request_id) == (False, 42)
            assert "nojob" in ack.error

    run(main())


def test_server_registration_announces_servers_to_worker_daemons() -> None:
    async def main() -> None:
        async with cluster() as c:
            ps, a, _ = await _job(c)
            ack = await ps.register(
                pb.ROLE_SERVER, "ps2", model=[], params=pb.JobParams(tau_max=4), request_id=2
            )
            assert ack.ok and [s.name for s in ack.servers] == ["ps", "ps2"]
            d = await a.recv()
            assert d.WhichOneof("kind") == "job_update"
            assert [s.name for s in d.job_update.servers] == ["ps", "ps2"]
            assert d.job_update.servers[0].model[0].shape == [1000, 1000]
            dup = await ps.register(
                pb.ROLE_SERVER, "ps", model=[], params=pb.JobParams(tau_max=4), request_id=3
            )
            assert not dup.ok and "'ps'" in dup.error

    run(main())


def test_fair_sends_every_ready_update_at_once_to_its_source_daemon() -> None:
    async def main() -> None:
        async with cluster("fair", window=0.001) as c:
            _, a, b = await _job(c)
            await a.ready("a/1", 3_000_000, "wa")
            await b.ready("b/1", 1_000_000, "wb")
            sa, sb = (await a.recv()).send, (await b.recv()).send
            assert (sa.update_id, sa.next_hop_host, sa.dst_host) == ("a/1", "ps", "ps")
            assert (sb.update_id, sb.next_hop_address) == ("b/1", c.core.state.address("ps"))
            await asyncio.sleep(0.1)  # both in flight together for (almost) all of a/1's time
            await a.report("a/1", "ps", version=4)
            await c.until(lambda: c.core.state.server_versions()[("j", "ps")] == 4)
            estimator = c.core.estimator
            assert isinstance(estimator, RecordingEstimator)
            # b/1 was in flight to the same server the whole time: the link was shared by two
            assert estimator.observed == [(("a", "sw", "ps"), 1000, 0.5, 2)] and estimator.asked >= 1
            assert c.core.stats().updates_applied == 1

    run(main())


def test_update_for_unknown_server_is_dropped_with_reason() -> None:
    async def main() -> None:
        async with cluster() as c:
            _, a, _ = await _job(c)
            await a.ready("a/1", 10, "wa", server="nosuch")
            d = await a.recv()
            assert d.drop.update_id == "a/1" and "'nosuch'" in d.drop.reason

    run(main())


def test_stf_releases_two_updates_behind_one_bottleneck_one_after_the_other() -> None:
    async def main() -> None:
        async with cluster("stf") as c:
            _, a, b = await _job(c)
            await a.ready("a/big", 3_000_000, "wa")
            await b.ready("b/small", 1_000_000, "wb")
            first = (await b.recv()).send
            assert first.update_id == "b/small"
            # the big one waits behind the small one on the server's ingress (~1 s expected)
            with pytest.raises(TimeoutError):
                await a.recv(timeout=0.3)
            assert list(c.core.state.pending) == ["a/big"]
            await b.report("b/small", "ps", version=4, nbytes=1_000_000)
            second = (await a.recv(timeout=0.5)).send
            assert second.update_id == "a/big"
            assert c.core.state.server_versions()[("j", "ps")] == 4

    run(main())


def test_server_daemon_leaving_drops_pending_updates_and_updates_workers() -> None:
    async def main() -> None:
        async with cluster("stf") as c:
            ps, a, b = await _job(c)
            await a.ready("a/big", 3_000_000, "wa")
            await b.ready("b/small", 1_000_000, "wb")
            assert (await b.recv()).send.update_id == "b/small"
            await ps.call.done_writing()
            drop = (await a.recv()).drop
            assert drop.update_id == "a/big" and "server 'ps' left" in drop.reason
            for d in (a, b):
                update = (await d.recv()).job_update
                assert update.job == "j" and list(update.servers) == []
            await c.until(lambda: "ps" not in c.core.sessions)
            assert not c.core.state.pending and not c.core.state.in_flight

    run(main())


def test_worker_daemon_leaving_removes_its_roles_and_updates() -> None:
    async def main() -> None:
        async with cluster("stf") as c:
            _, a, b = await _job(c)
            await a.ready("a/big", 3_000_000, "wa")
            await b.ready("b/small", 1_000_000, "wb")
            assert (await b.recv()).send.update_id == "b/small"
            a.call.cancel()
            await c.until(lambda: "a" not in c.core.state.daemons)
            assert c.core.state.worker_hosts("j") == {"b"}
            assert not c.core.state.pending
            assert "disconnected" in c.core.state.outcomes["a/big"].reason

    run(main())


def test_health_check_reports_serving() -> None:
    async def main() -> None:
        async with cluster() as c:
            stub = health_pb2_grpc.HealthStub(c.channel)
            for service in ("", "mlfabric.v1.Scheduler"):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

    run(main())


def test_stf_drops_an_update_too_stale_for_tau_max() -> None:
    async def main() -> None:
        async with cluster("stf") as c:
            _, a, b = await _job(c)  # server version 3, tau_max 4
            await a.ready("a/stale", 1000, "wa", base_version=-2)
            await b.ready("b/fresh", 1000, "wb", base_version=3)
            drop = (await a.recv()).drop
            assert drop.update_id == "a/stale" and "tau_max 4" in drop.reason
            assert (await b.recv()).send.update_id == "b/fresh"
            assert c.core.stats().updates_dropped == 1

    run(main())


def test_update_resolved_and_unregister_server() -> None:
    async def main() -> None:
        async with cluster("stf") as c:
            ps, a, b = await _job(c)
            await a.ready("a/big", 3_000_000, "wa")
            await b.ready("b/small", 1_000_000, "wb")
            assert (await b.recv()).send.update_id == "b/small"
            resolved = pb.UpdateResolved(update_id="a/big", outcome=pb.OUTCOME_DROPPED, reason="cancelled")
            await a.send(update_resolved=resolved)
            await c.until(lambda: not c.core.state.pending)
            assert c.core.dispatcher.planned == ()
            await b.ready("b/2", 1_000, "wb")
            await ps.send(unregister_role=pb.UnregisterRole(job="j", role=pb.ROLE_SERVER, name="ps"))
            # b/2 waits behind b/small on b's uplink, so it is still pending: dropped
            drop = (await b.recv()).drop
            assert drop.update_id == "b/2" and "unregistered" in drop.reason
            assert list((await b.recv()).job_update.servers) == []
            assert "j" not in {j for j, _ in c.core.state.server_versions()}

    run(main())


def test_stf_releases_the_next_transfer_by_the_clock_when_no_report_comes() -> None:
    async def main() -> None:
        async with cluster("stf") as c:
            _, a, b = await _job(c)
            await a.ready("a/big", 300_000, "wa")
            await b.ready("b/small", 100_000, "wb")  # expected to take 0.1 s on ps's ingress
            assert (await b.recv()).send.update_id == "b/small"
            t0 = asyncio.get_running_loop().time()
            assert (await a.recv(timeout=2.0)).send.update_id == "a/big"
            waited = asyncio.get_running_loop().time() - t0
            assert 0.05 < waited < 1.0, waited
            assert set(c.core.state.in_flight) == {"a/big", "b/small"}

    run(main())
