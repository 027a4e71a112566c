"""Service-level decision latency with 1,000 pending updates, ``--stf-horizon`` 256 vs 0.

An in-process grpc.aio scheduler on a 1,024-host two-tier graph (32 racks x 32 hosts, 4:1
oversubscribed uplinks, as ``experiments/bench_decision.py``), 4 servers and 250 worker
daemons, each announcing 4 updates within one batch: the first decision sees 1,000 pending
updates. The test daemons report every send at once, so with a horizon the service keeps
re-deciding (at the low-water mark) until everything is released. Measured per decision:
the policy's time (the ``mlfabric_decision_seconds`` histogram) and the whole of
``SchedulerCore.decide`` (snapshot, policy, drops, adopting and releasing).

Not collected by pytest (no ``test_`` prefix). Run::

    python experiments/bench_service_decision.py                  # horizons 256 and 0
    python experiments/bench_service_decision.py --nics mixed --horizon 256 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from typing import Any

import grpc

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.proto.v1 import control_pb2_grpc as pb_grpc
from mlfabric.scheduler.core.graph import hosts, two_tier
from mlfabric.scheduler.policies.base import Decision
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.cli import build_policy
from mlfabric.scheduler.service.core import (
    CLIENT_CHANNEL_OPTIONS,
    SchedulerCore,
    StaticEstimator,
    start_server,
)
from mlfabric.scheduler.service.state import SchedulerState

RACKS, PER_RACK, OVERSUB = 32, 32, 4.0
SERVERS = ("h0", "h33", "h66", "h99")
WORKERS, PER_WORKER = 250, 4


async def register_daemon(channel: grpc.aio.Channel, host: str, role: pb.Role, name: str) -> Any:
    """A simulated daemon of ``host``: its ``Session`` stream, after Hello and RegisterRole (job ``j``).

    Raises ``RuntimeError`` naming the problem if the scheduler refuses the role.
    (``bench_service_scale.py`` connects its daemons this way too.)
    """
    call = pb_grpc.SchedulerStub(channel).Session()
    await call.write(pb.DaemonMessage(hello=pb.Hello(host=host, data_address="127.0.0.1:1")))
    await call.read()
    reg = pb.RegisterRole(request_id=1, job="j", role=role, name=name, params=pb.JobParams(tau_max=-1))
    await call.write(pb.DaemonMessage(register_role=reg))
    ack = (await call.read()).role_ack
    if not ack.ok:
        raise RuntimeError(f"{host}: role {name} refused: {ack.error}")
    return call


async def _daemon(
    channel: grpc.aio.Channel, host: str, role: pb.Role, name: str, updates: list[tuple[str, str, int]]
) -> tuple[Any, asyncio.Task[int]]:
    call = await register_daemon(channel, host, role, name)

    async def serve() -> int:
        """Report every send at once; returns how many sends and drops it got."""
        done = 0
        while done < len(updates) and (d := await call.read()) is not grpc.aio.EOF:
            if d.WhichOneof("kind") == "send":
                s = d.send
                r = pb.TransferReport(
                    update_id=s.update_id, src_host=host, dst_host=s.dst_host, ok=True, start=0.0, end=0.0
                )
                await call.write(pb.DaemonMessage(transfer_report=r))
                done += 1
            elif d.WhichOneof("kind") == "drop":
                done += 1
        return done

    return call, asyncio.create_task(serve())


async def measure(horizon: int, nics: str, seed: int = 1) -> dict[str, float]:
    """Announce 1,000 updates and drain them; returns decision statistics in ms."""
    rng = random.Random(seed)
    names = [f"h{i}" for i in range(RACKS * PER_RACK)]
    nic: float | dict[str, float] = 10e9
    if nics == "mixed":
        nic = {h: rng.choice((1e9, 10e9, 25e9)) for h in names}
    graph = two_tier(RACKS, PER_RACK, nic, OVERSUB)
    workers = [h for h in hosts(graph) if h not in SERVERS][:WORKERS]
    policy, replan = build_policy("stf", horizon)
    whole: list[tuple[int, float]] = []

    class TimedCore(SchedulerCore):
        """The service's core, timing each whole decision: (pending updates, seconds)."""

        def decide(self) -> Decision:
            n = len(self.state.pending)
            t0 = time.perf_counter()
            out = super().decide()
            whole.append((n, time.perf_counter() - t0))
            return out

    core = TimedCore(
        SchedulerState(graph),
        policy,
        dispatcher=Dispatcher(),
        batcher=AdaptiveBatcher(window=0.5, max_wait=30.0),
        estimator=StaticEstimator(graph),
        replan=replan,
    )
    server, port = await start_server(core, "127.0.0.1:0")
    task = asyncio.create_task(core.run())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_CHANNEL_OPTIONS)
    try:
        for s in SERVERS:
            await _daemon(channel, s, pb.ROLE_SERVER, s, [])
        clients = []
        for i, w in enumerate(workers):
            ups = [(f"{w}/{k}", SERVERS[(i + k) % len(SERVERS)], rng.randint(1, 8) << 20) for k in range(4)]
            clients.append((await _daemon(channel, w, pb.ROLE_WORKER, f"w{i}", ups), ups))
        for i, ((call, _), ups) in enumerate(clients):
            for uid, srv, size in ups:
                msg = pb.UpdateReady(update_id=uid, job="j", server=srv, worker=f"w{i}", bytes=size, norm=1.0)
                await call.write(pb.DaemonMessage(update_ready=msg))
        t0 = time.perf_counter()
        done = await asyncio.wait_for(asyncio.gather(*(t for (_, t), _ in clients)), 600)
        drain = time.perf_counter() - t0
        assert sum(done) == WORKERS * PER_WORKER and not core.state.pending
    finally:
        await channel.close()
        await server.stop(None)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    decisions = core.stats().decision_seconds
    real = [(n, t) for n, t in whole if n]
    first_n, first_t = real[0]
    return {
        "decisions": len(real),
        "first_pending": first_n,
        "first_ms": first_t * 1e3,
        "median_ms": statistics.median(t for _, t in real) * 1e3,
        "max_ms": max(t for _, t in real) * 1e3,
        "policy_mean_ms": decisions.sum / decisions.count * 1e3,
        "drain_s": drain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--horizon", type=int, nargs="+", default=[256, 0])
    parser.add_argument("--nics", choices=["uniform", "mixed"], default="uniform")
    parser.add_argument("--repeat", type=int, default=3, help="runs per horizon; medians shown (default 3)")
    args = parser.parse_args()
    print(f"nics={args.nics}: 1,000 pending updates, 1,024-host two-tier graph, 4 servers")
    print("median over runs, ms: first decision (1,000 pending) | median decision | policy mean")
    for h in args.horizon:
        runs = [asyncio.run(measure(h, args.nics, seed=1 + k)) for k in range(args.repeat)]

        def med(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        print(
            f"horizon {h:>4}: {med('decisions'):>3.0f} decisions; first {med('first_ms'):.1f} | "
            f"median {med('median_ms'):.1f} | policy {med('policy_mean_ms'):.1f}; "
            f"drained in {med('drain_s'):.2f} s"
        )


if __name__ == "__main__":
    main()
