"""The scheduler service with thousands of daemons: decision time, control-stream lag, RSS (issue 24).

The scheduler is the real one, a separate process (``python -m mlfabric scheduler --topology
F --policy stf --metrics-port 0``), on a two-tier graph of ``--racks`` x ``--per-rack`` hosts
(default 128 x 32 = 4,096, NICs 10 Gbit/s, rack uplinks 4:1 oversubscribed). ``--daemons N``
simulated daemons run in one other process (asyncio + grpc.aio), each with its own channel
(its own TCP connection, as separate daemons have) and one ``Session`` stream: Hello and
RegisterRole (``register_daemon`` of ``bench_service_decision.py``), then they serve
directives. ``--servers`` of them are servers of the one job (spread over the racks), the
rest workers. Each worker announces an update every ``workers / --rate`` seconds (random
phase; sizes uniform in ``--mib``), so the scheduler sees ``--rate`` updates a second in
all; each SendDirective is reported done (``TransferReport``, ok, APPLIED) after the
update's simulated transfer time at ``--transfer-gbps``.

Measured, per ``--window`` (default 60 s) and for the run:

- decision time: the scheduler's ``mlfabric_decision_seconds`` histogram (the policy's time
  per decision, from ``/metrics``); quantiles are bucket-bounded, printed as the bucket
  ``(lo, hi]`` they fall in (bounds ... 5, 10, 20, 50 ms ...);
- the scheduler's RSS (``VmRSS``, sampled every 0.5 s; the maximum) and CPU share;
- control-stream lag: from an UpdateReady queued by a daemon to its SendDirective read by
  that daemon (the client's clock), p50/p99/max per window, the updates still without a
  directive at each window's end, and the trend: a least-squares slope of the windows' p99
  and the last/first window ratio. The client's own event-loop lag is printed beside it (a
  busy client delays what it reads, which would show as lag too).

After ``--duration`` the daemons stop announcing and wait up to ``--drain`` s for the
directives still due; every announced update must get its directive (a drop or a missing
one is reported and makes the run exit 1).

Run (the target: 4,000 daemons, 10 minutes; one run at a time on a shared machine)::

    nice -n 19 python experiments/bench_service_scale.py --daemons 1000 4000 --duration 600

A short run::

    nice -n 19 python experiments/bench_service_scale.py --daemons 1000 4000 --duration 120 --window 30

Measured (2 shared cores, other work running; load average given):

    (see the report of the run this docstring is updated with)
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import pstats
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
import numpy as np

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.service.core import CLIENT_CHANNEL_OPTIONS
from mlfabric.testbed.topologies import to_toml, two_tier

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_service_decision import register_daemon
from harness import cpu_seconds, decision_buckets, proc_stats, quantile_bound, start, stop_all

NIC_MBPS = 10_000.0
OVERSUB = 4.0
#: each simulated daemon has its own connection (grpc would otherwise share one among channels)
DAEMON_CHANNEL_OPTIONS = [*CLIENT_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
#: simulated daemons saying hello and registering at once
CONNECTING = 16
#: attempts at Hello and RegisterRole per simulated daemon (each failure is counted and printed)
ATTEMPTS = 3


def topology(racks: int, per_rack: int) -> dict[str, Any]:
    """The two-tier topology table: hosts ``h0..``, 10 Gbit/s NICs, uplinks 4:1 oversubscribed.

    Examples
    --------
    >>> t = topology(2, 4)
    >>> len(t["hosts"]), t["links"][-1]
    (8, {'a': 'tor1', 'b': 'core', 'mbps': 10000.0})
    """
    nics = [{f"h{r * per_rack + j}": NIC_MBPS for j in range(per_rack)} for r in range(racks)]
    return two_tier(nics, [per_rack * NIC_MBPS / OVERSUB] * racks)


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


async def _client(args: argparse.Namespace) -> None:
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


# -------------------------------------------------------------- the orchestrator


@dataclass
class Sampler:
    """Samples the scheduler's RSS every ``every`` s on a thread: the maximum per period and overall."""

    pid: int
    every: float = 0.5
    period_max: int = 0
    overall_max: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopped: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                rss = proc_stats(self.pid)[0]
            except FileNotFoundError:  # the scheduler exited; the run reports it
                return
            with self.lock:
                self.period_max = max(self.period_max, rss)
                self.overall_max = max(self.overall_max, rss)

    def take(self) -> int:
        with self.lock:
            out, self.period_max = self.period_max, 0
        return out


def _bucket(before: dict[float, float], after: dict[float, float], q: float) -> tuple[float, float]:
    """The ``(lo, hi]`` decision-time bucket, in ms, that the ``q`` quantile falls in."""
    hi, n = quantile_bound(before, after, q)
    if n == 0:
        return math.nan, math.nan
    lower = [b for b in sorted(after) if b < hi]
    return (lower[-1] * 1e3 if lower else 0.0), hi * 1e3


def _fmt_bucket(b: tuple[float, float]) -> str:
    return "-" if math.isnan(b[1]) else f"({b[0]:g}, {b[1]:g}]"


def _client_cmd(args: argparse.Namespace, n: int, address: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--client", address, "--daemons", str(n)]
    for name in ("servers", "rate", "duration", "window", "progress", "seed", "racks", "per_rack"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += [
        "--mib",
        *map(str, args.mib),
        "--transfer-gbps",
        str(args.transfer_gbps),
        "--drain",
        str(args.drain),
    ]
    return cmd


def _fds_for(n: int) -> None:
    """Raise the open-file limit (the scheduler and the client inherit it) to hold ``n`` connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * n + 256
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise RuntimeError(f"{n} daemons need {need} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run with ``n`` daemons; the windows' records and the run's figures."""
    _fds_for(n)
    work = Path(tempfile.mkdtemp(prefix="mlfabric-svc-scale-"))
    topo = work / "topology.toml"
    topo.write_text(to_toml(topology(args.racks, args.per_rack)))
    cmd = ["scheduler", "--listen", "127.0.0.1:0", "--topology", str(topo), "--policy", "stf"]
    profile = Path(args.profile).resolve() / f"scheduler-{n}.prof" if args.profile else None
    proc, info = start(
        [*cmd, "--metrics-port", "0"], work / "s.json", work / "s.log", timeout=120.0, profile=profile
    )
    port = int(info["metrics_port"])
    sampler = Sampler(proc.pid)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    out: dict[str, Any] = {"daemons": n, "windows": [], "load": os.getloadavg()}
    client = subprocess.Popen(_client_cmd(args, n, info["address"]), stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None
        _follow(n, client.stdout, proc.pid, port, sampler, out)
        if client.wait() != 0 or "done" not in out:
            raise RuntimeError(
                f"the daemons' process failed (exit {client.returncode}); see its stderr above"
            )
        if proc.poll() is not None:
            raise RuntimeError(f"the scheduler exited ({proc.returncode})")
    except RuntimeError as exc:
        tail = (work / "s.log").read_text()[-3000:]
        raise RuntimeError(f"{exc}\nscheduler log ({work / 's.log'}), tail:\n{tail}") from exc
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        sampler.stopped.set()
        thread.join()
        stop_all([proc])
    out["rss_max"] = sampler.overall_max
    out["load_end"] = os.getloadavg()
    if profile is not None:
        _print_profile(profile)
    return out


def _print_profile(path: Path, top: int = 30) -> None:
    """The scheduler's hottest functions (``--profile``), by own time and by cumulative time."""
    text = io.StringIO()
    stats = pstats.Stats(str(path), stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    path.with_suffix(".txt").write_text(text.getvalue())
    print(f"scheduler profile: {path} (top {top}: {path.with_suffix('.txt')})", flush=True)


def _follow(n: int, lines: IO[str], pid: int, port: int, sampler: Sampler, out: dict[str, Any]) -> None:
    """Read the client's records; scrape the scheduler at each window; fill ``out``."""
    first = prev = decision_buckets(port)
    cpu0 = cpu_prev = cpu_seconds(pid)
    t_prev = t_first = time.monotonic()
    tick_at = 0.0
    for line in lines:
        rec = json.loads(line)
        kind = rec.pop("kind")
        if kind == "connecting":  # registration takes a while with thousands of daemons
            print(f"[N={n}] {rec['registered']} workers registered in {rec['seconds']:.0f} s", flush=True)
        elif kind == "connected":
            out["connect_s"] = rec["seconds"]
            first = prev = decision_buckets(port)
            cpu0 = cpu_prev = cpu_seconds(pid)
            t_prev = t_first = time.monotonic()
            sampler.take()
            print(f"[N={n}] {rec['daemons']} daemons connected in {rec['seconds']:.1f} s", flush=True)
        elif kind == "tick":
            secs = rec["elapsed"] - tick_at
            tick_at = rec["elapsed"]
            print(
                f"[N={n}] {rec['elapsed']:6.0f} s  {rec['announced'] / secs:5.0f} updates/s  "
                f"{rec['sends'] / secs:5.0f} sends/s  lag p50 {rec['lag_p50'] * 1e3:6.1f} ms  "
                f"p99 {rec['lag_p99'] * 1e3:6.1f} ms  awaiting {rec['outstanding']:4d}  "
                f"client loop lag {rec['loop_lag'] * 1e3:5.1f} ms  "
                f"scheduler RSS {proc_stats(pid)[0] / 2**20:5.0f} MiB",
                flush=True,
            )
        elif kind == "window":
            now, cpu = decision_buckets(port), cpu_seconds(pid)
            t = time.monotonic()
            rec.update(
                decisions=int(now[math.inf] - prev[math.inf]),
                decision_p50=_bucket(prev, now, 0.5),
                decision_p99=_bucket(prev, now, 0.99),
                cpu=(cpu - cpu_prev) / (t - t_prev),
                rss_max=sampler.take(),
            )
            prev, cpu_prev, t_prev = now, cpu, t
            out["windows"].append(rec)
            print(f"[N={n}] window {rec['index']}: {_window_line(rec)}", flush=True)
        elif kind == "done":
            now = decision_buckets(port)
            out["done"] = rec
            out["decisions"] = int(now[math.inf] - first[math.inf])
            out["decision_p50"] = _bucket(first, now, 0.5)
            out["decision_p99"] = _bucket(first, now, 0.99)
            out["cpu"] = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t_first)


def _window_line(w: dict[str, Any]) -> str:
    return (
        f"{w['announced']} announced, {w['decisions']} decisions p50 {_fmt_bucket(w['decision_p50'])} "
        f"p99 {_fmt_bucket(w['decision_p99'])} ms; lag p50 {w['lag_p50'] * 1e3:.1f} p99 "
        f"{w['lag_p99'] * 1e3:.1f} max {w['lag_max'] * 1e3:.1f} ms; awaiting {w['outstanding']}; "
        f"scheduler CPU {w['cpu']:.0%}, RSS max {w['rss_max'] / 2**20:.0f} MiB; "
        f"client loop lag {w['loop_lag'] * 1e3:.1f} ms"
    )


def trend(windows: list[dict[str, Any]]) -> tuple[float, float]:
    """(slope of the windows' lag p99 in ms per minute, last/first window p99); NaN if < 2 windows.

    Examples
    --------
    >>> w = [{"elapsed": 60.0, "lag_p99": 0.010}, {"elapsed": 120.0, "lag_p99": 0.012}]
    >>> [round(x, 3) for x in trend(w)]
    [2.0, 1.2]
    """
    pts = [(w["elapsed"] / 60.0, w["lag_p99"] * 1e3) for w in windows if not math.isnan(w["lag_p99"])]
    if len(pts) < 2:
        return math.nan, math.nan
    x, y = np.array(pts).T
    return float(np.polyfit(x, y, 1)[0]), float(y[-1] / y[0])


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The side-by-side table and each run's lag series."""
    lines = [
        f"two-tier {args.racks}x{args.per_rack} hosts, policy stf, {args.servers} servers, "
        f"{args.rate:g} updates/s offered, {args.mib[0]:g}-{args.mib[1]:g} MiB at {args.transfer_gbps:g} "
        f"Gbit/s, {args.duration:g} s, window {args.window:g} s, seed {args.seed}",
        "",
        "| daemons | updates/s | decisions | decision p50 ms | decision p99 ms | RSS max MiB | sched CPU "
        "| lag p50 ms | lag p99 ms | p99 slope ms/min | p99 last/first | awaiting at end | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        ws, d = r["windows"], r["done"]
        p50 = float(np.median([w["lag_p50"] for w in ws])) if ws else math.nan
        p99 = max((w["lag_p99"] for w in ws), default=math.nan)
        slope, ratio = trend(ws)
        load = "/".join(f"{x:.1f}" for x in r["load_end"])
        lines.append(
            f"| {r['daemons']} | {d['announced'] / args.duration:.0f} | {r['decisions']} | "
            f"{_fmt_bucket(r['decision_p50'])} | {_fmt_bucket(r['decision_p99'])} | "
            f"{r['rss_max'] / 2**20:.0f} | {r['cpu']:.0%} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} | "
            f"{slope:+.2f} | {ratio:.2f} | {ws[-1]['outstanding'] if ws else '-'} | {load} |"
        )
    lines.append("")
    for r in runs:
        ws, d = r["windows"], r["done"]
        series = " ".join(f"{w['lag_p50'] * 1e3:.1f}/{w['lag_p99'] * 1e3:.1f}" for w in ws)
        lines.append(f"N={r['daemons']}: lag p50/p99 per window, ms: {series}")
        lines.append(
            f"N={r['daemons']}: connected in {r['connect_s']:.1f} s; {d['announced']} announced, "
            f"{d['sends']} sends, {d['drops']} drops, {d['missing']} without a directive after "
            f"{d['drain_s']:.1f} s of drain; {d['streams_lost']} streams lost, "
            f"{d['register_retries']} registrations retried; client loop lag max "
            f"{max((w['loop_lag'] for w in ws), default=math.nan) * 1e3:.1f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--daemons", type=int, nargs="+", default=[1000, 4000], help="N per run (default 1000 4000)"
    )
    parser.add_argument("--servers", type=int, default=8, help="server daemons of the job (default 8)")
    parser.add_argument(
        "--rate", type=float, default=300.0, help="updates a second, all workers (default 300)"
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of announcing (default 600)")
    parser.add_argument("--window", type=float, default=60.0, help="measurement window, s (default 60)")
    parser.add_argument("--progress", type=float, default=10.0, help="progress line every S s (default 10)")
    parser.add_argument("--mib", type=float, nargs=2, default=[0.25, 4.0], metavar=("LO", "HI"))
    parser.add_argument(
        "--transfer-gbps", type=float, default=10.0, help="simulated transfer rate (default 10)"
    )
    parser.add_argument(
        "--drain", type=float, default=30.0, help="s to wait for the last directives (default 30)"
    )
    parser.add_argument("--racks", type=int, default=128)
    parser.add_argument("--per-rack", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="also write the runs' records as JSON")
    parser.add_argument(
        "--profile", metavar="DIR", help="run the scheduler under cProfile: DIR/scheduler-N.prof and .txt"
    )
    parser.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)  # the daemons' process
    args = parser.parse_args(argv)
    if args.client:
        asyncio.run(_client(args))
        return 0
    runs = []
    for n in args.daemons:
        print(f"[N={n}] load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
        try:
            runs.append(measure(n, args))
        except RuntimeError as exc:
            print(f"bench_service_scale: N={n}: {exc}", file=sys.stderr)
            return 1
    print()
    print(report(runs, args))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    ok = all(r["done"][k] == 0 for r in runs for k in ("drops", "missing", "streams_lost"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
