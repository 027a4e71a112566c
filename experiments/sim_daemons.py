"""The simulated daemons of ``bench_service_scale.py``: one process, thousands of ``Session`` streams.

Run by ``bench_service_scale.py --client ADDRESS`` (not on its own): each simulated daemon has
its own grpc.aio channel (its own TCP connection) and stream, says Hello and registers its role
(``register_daemon`` of ``bench_service_decision.py``); the workers announce updates at the
offered rate and report each SendDirective done after its simulated transfer time. What they
see is written to stdout as JSON lines: ``connecting``, ``connected``, a ``tick`` every
``--progress`` s, a ``window`` every ``--window`` s (counts, lag percentiles, updates awaiting a
directive, the event loop's lag) and ``done`` after the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.service.core import CLIENT_CHANNEL_OPTIONS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_service_decision import register_daemon

__all__ = ["Meter", "SimDaemon", "percentiles", "roles", "run_daemons"]

#: each simulated daemon has its own connection (grpc would otherwise share one among channels)
DAEMON_CHANNEL_OPTIONS = [*CLIENT_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
#: simulated daemons saying hello and registering at once
CONNECTING = 16
#: attempts at Hello and RegisterRole per simulated daemon (each failure is counted and printed)
ATTEMPTS = 3


def roles(daemons: int, servers: int, racks: int, per_rack: int) -> tuple[list[str], list[str]]:
    """(server hosts, worker hosts): servers spread over the racks, workers the first other hosts.

    Examples
    --------
    >>> roles(6, 2, 2, 4)
    (['h0', 'h4'], ['h1', 'h2', 'h3', 'h5'])
    """
    if not 0 < servers < daemons <= racks * per_rack:
        raise ValueError(f"need 0 < servers ({servers}) < daemons ({daemons}) <= hosts ({racks * per_rack})")
    srv = [f"h{k * racks * per_rack // servers}" for k in range(servers)]  # evenly spaced
    taken = set(srv)
    workers = [h for i in range(racks * per_rack) if (h := f"h{i}") not in taken][: daemons - servers]
    return srv, workers


def percentiles(values: list[float], qs: tuple[float, ...] = (50, 99, 100)) -> list[float]:
    """The ``qs`` percentiles of ``values`` (NaN for none)."""
    if not values:
        return [math.nan] * len(qs)
    return [float(v) for v in np.percentile(values, qs)]


# ---------------------------------------------------------------- the daemons' process


@dataclass
class Meter:
    """What the simulated daemons see: updates awaiting a directive, lags, counts (one loop)."""

    sent: dict[str, float] = field(default_factory=dict)  # update id -> when announced
    lags: dict[str, list[float]] = field(default_factory=lambda: {"tick": [], "window": []})
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("announced", "sends", "drops", "register_retries", "streams_lost"), 0
        )
    )
    versions: dict[str, int] = field(default_factory=dict)  # server host -> its model version
    loop_lag: dict[str, float] = field(default_factory=lambda: {"tick": 0.0, "window": 0.0})

    def take(self, which: str, last: dict[str, int]) -> dict[str, Any]:
        """The record of the ``which`` period since ``last`` (its counts, updated in place)."""
        lags, self.lags[which] = self.lags[which], []
        loop_lag, self.loop_lag[which] = self.loop_lag[which], 0.0
        p50, p99, top = percentiles(lags)
        out: dict[str, Any] = {k: v - last.get(k, 0) for k, v in self.counts.items()}
        last.update(self.counts)
        out.update(lag_p50=p50, lag_p99=p99, lag_max=top, outstanding=len(self.sent), loop_lag=loop_lag)
        return out


class SimDaemon:
    """One simulated daemon: its stream, a writer draining its queue, a reader serving directives."""

    def __init__(self, host: str, name: str, call: Any, meter: Meter, gbps: float) -> None:
        self.host, self.name, self.call, self.meter, self.gbps = host, name, call, meter, gbps
        self.queue: asyncio.Queue[pb.DaemonMessage] = asyncio.Queue()
        self.sizes: dict[str, int] = {}
        self.k = 0

    def announce(self, server: str, nbytes: int) -> None:
        """Queue an UpdateReady of its worker for ``server``; its lag runs from now."""
        uid = f"{self.host}/{self.k}"
        self.k += 1
        self.sizes[uid] = nbytes
        self.meter.sent[uid] = time.perf_counter()
        self.meter.counts["announced"] += 1
        msg = pb.UpdateReady(update_id=uid, job="j", server=server, worker=self.name, bytes=nbytes, norm=1.0)
        self.queue.put_nowait(pb.DaemonMessage(update_ready=msg))

    async def write(self) -> None:
        """Write what is queued, in order (one writer per stream)."""
        try:
            while True:
                await self.call.write(await self.queue.get())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:  # the reader counts the loss
            print(f"{self.host}: write failed: {exc}", file=sys.stderr)

    async def read(self) -> None:
        """Serve directives until the stream ends (counted as a lost stream: it should not)."""
        try:
            await self._serve()
        except grpc.aio.AioRpcError as exc:
            print(f"{self.host}: stream failed: {exc.code().name} {exc.details()}", file=sys.stderr)
        self.meter.counts["streams_lost"] += 1

    async def _serve(self) -> None:
        """Serve directives until the stream ends: report each send after its transfer time."""
        loop = asyncio.get_running_loop()
        meter = self.meter
        while (d := await self.call.read()) is not grpc.aio.EOF:
            kind = d.WhichOneof("kind")
            if kind == "send":
                s = d.send
                t0 = meter.sent.pop(s.update_id, None)
                if t0 is None:
                    raise RuntimeError(f"{self.host}: a SendDirective for {s.update_id}, not awaited")
                lag = time.perf_counter() - t0
                meter.lags["tick"].append(lag)
                meter.lags["window"].append(lag)
                meter.counts["sends"] += 1
                nbytes = self.sizes.pop(s.update_id)
                seconds = nbytes * 8 / (self.gbps * 1e9)
                start_ = time.time()
                version = meter.versions[s.dst_host] = meter.versions.get(s.dst_host, 0) + 1
                report = pb.TransferReport(
                    update_id=s.update_id,
                    src_host=self.host,
                    dst_host=s.next_hop_host,
                    bytes=nbytes,
                    start=start_,
                    end=start_ + seconds,
                    throughput=nbytes / seconds,
                    ok=True,
                    outcome=pb.OUTCOME_APPLIED,
                    server_version=version,
                )
                loop.call_later(seconds, self.queue.put_nowait, pb.DaemonMessage(transfer_report=report))
            elif kind == "drop":
                meter.sent.pop(d.drop.update_id, None)
                meter.counts["drops"] += 1
                print(f"{self.host}: {d.drop.update_id} dropped: {d.drop.reason}", file=sys.stderr)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


async def _connect(address: str, servers: list[str], workers: list[str], meter: Meter, gbps: float) -> Any:
    gate = asyncio.Semaphore(CONNECTING)
    channels = []

    async def one(host: str, role: pb.Role, name: str) -> SimDaemon:
        for attempt in range(1, ATTEMPTS + 1):
            channel = grpc.aio.insecure_channel(address, options=DAEMON_CHANNEL_OPTIONS)
            async with gate:
                try:
                    call = await register_daemon(channel, host, role, name)
                except grpc.aio.AioRpcError as exc:
                    print(
                        f"{host}: registration {attempt} failed: {exc.code().name} {exc.details()}",
                        file=sys.stderr,
                    )
                    await channel.close()
                    if attempt == ATTEMPTS:
                        raise
                    meter.counts["register_retries"] += 1
                    await asyncio.sleep(1.0)
                    continue
            channels.append(channel)
            return SimDaemon(host, name, call, meter, gbps)
        raise AssertionError("unreachable")

    wrk: list[SimDaemon] = []

    async def progress(t0: float, every: float = 10.0) -> None:
        while True:
            await asyncio.sleep(every)
            _emit({"kind": "connecting", "registered": len(wrk), "seconds": time.perf_counter() - t0})

    ticker = asyncio.create_task(progress(time.perf_counter()))
    srv = [await one(h, pb.ROLE_SERVER, h) for h in servers]  # before the workers: their acks name them
    for done in asyncio.as_completed([one(h, pb.ROLE_WORKER, f"w{i}") for i, h in enumerate(workers)]):
        wrk.append(await done)
    ticker.cancel()
    wrk.sort(key=lambda d: int(d.host[1:]))  # the announcing order follows --seed, not who was first
    return srv, wrk, channels


async def _drive(
    args: argparse.Namespace, servers: list[str], workers: list[SimDaemon], meter: Meter
) -> None:
    """Announce at ``--rate`` for ``--duration`` s, emitting tick and window records; then drain."""
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    interval = len(workers) / args.rate
    order = sorted(((rng.uniform(0, interval), w) for w in workers), key=lambda x: x[0])
    lo, hi = (int(m * (1 << 20)) for m in args.mib)
    t0 = loop.time()
    end = t0 + args.duration

    async def announcer() -> None:
        k = 0
        while True:
            for phase, w in order:
                due = t0 + phase + k * interval
                if due >= end:
                    return
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                w.announce(rng.choice(servers), rng.randint(lo, hi))
            k += 1

    async def periods(which: str, every: float) -> None:
        last: dict[str, int] = {}
        n = 0
        while n * every < args.duration - 1e-9:  # the last period may be shorter
            await asyncio.sleep(max(0.0, min(t0 + (n + 1) * every, end) - loop.time()))
            n += 1
            _emit({"kind": which, "index": n, "elapsed": loop.time() - t0, **meter.take(which, last)})

    async def watch_loop() -> None:
        while True:
            t = loop.time()
            await asyncio.sleep(0.05)
            late = loop.time() - t - 0.05
            for k in meter.loop_lag:
                meter.loop_lag[k] = max(meter.loop_lag[k], late)

    watcher = asyncio.create_task(watch_loop())
    await asyncio.gather(announcer(), periods("tick", args.progress), periods("window", args.window))
    drain_start = loop.time()
    while meter.sent and loop.time() - drain_start < args.drain:
        await asyncio.sleep(0.05)
    watcher.cancel()
    _emit({"kind": "done", **meter.counts, "missing": len(meter.sent), "drain_s": loop.time() - drain_start})


async def run_daemons(args: argparse.Namespace) -> None:
    """The daemons' process: connect, announce and serve for ``args.duration`` s, drain, report."""
    servers, workers = roles(args.daemons[0], args.servers, args.racks, args.per_rack)
    meter = Meter()
    t = time.perf_counter()
    srv, wrk, channels = await _connect(args.client, servers, workers, meter, args.transfer_gbps)
    _emit({"kind": "connected", "daemons": len(srv) + len(wrk), "seconds": time.perf_counter() - t})
    tasks = [asyncio.create_task(c) for d in (*srv, *wrk) for c in (d.read(), d.write())]
    drive = asyncio.create_task(_drive(args, servers, wrk, meter))
    try:
        await drive  # a lost stream is counted (its updates go missing), the run goes on
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*(ch.close() for ch in channels))
