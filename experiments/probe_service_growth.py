"""What the scheduler service keeps as the updates it has seen add up (issue 24), in-process.

Drives :class:`~mlfabric.scheduler.service.core.SchedulerCore` on a simulated clock, without
gRPC: ``--workers`` worker daemons and ``--servers`` server daemons on a two-tier graph of
``--racks`` x 32 hosts (10 Gbit/s NICs, uplinks 4:1), ``--rate`` updates a second of
0.25-4 MiB, a decision every 50 ms of simulated time, each send reported APPLIED after its
transfer time at 10 Gbit/s. At each checkpoint (updates announced) it prints the process's
RSS, the objects the cyclic garbage collector tracks, the time of one full collection, the
mean decision time since the last checkpoint, and the sizes of the service's containers that
could grow with the updates seen. The same script runs against another tree's code with
``PYTHONPATH`` (the APIs it uses predate issue 24)::

    nice -n 19 python experiments/probe_service_growth.py --checkpoints 10000 40000 70000 100000
    PYTHONPATH=/path/to/main nice -n 19 python experiments/probe_service_growth.py ...

Measured: ``experiments/results/service_growth.md``.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import random
import time
from typing import Any

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.estimation import BandwidthEstimator
from mlfabric.scheduler.core.graph import parse_topology
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import DaemonSession, SchedulerCore
from mlfabric.scheduler.service.observe import Recorder
from mlfabric.scheduler.service.state import SchedulerState
from mlfabric.scheduler.service.tracelog import TraceLog
from mlfabric.testbed.topologies import two_tier

MSG = pb.DaemonMessage
PER_RACK = 32
DECIDE_EVERY = 0.05


def rss_mib() -> float:
    """This process's resident set size, MiB (``VmRSS``)."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kib / 1024


def containers(core: SchedulerCore) -> dict[str, int]:
    """Sizes of what could grow with the updates seen: outcomes, trace ring, activity, codec pushes."""
    act: Any = core.recorder.activity
    trace: Any = core.recorder.trace
    return {
        "outcomes": len(core.state.outcomes),
        "trace": len(trace._events),
        "activity events": sum(map(len, act._pushes.values())) + sum(map(len, act._links.values())),
        "codec pairs": len(core.codecs._pushes),
    }


def build(args: argparse.Namespace, clock: list[float]) -> tuple[SchedulerCore, dict[str, DaemonSession]]:
    """The core, its daemons connected and their roles registered."""
    nics = [{f"h{r * PER_RACK + j}": 10_000.0 for j in range(PER_RACK)} for r in range(args.racks)]
    graph = parse_topology(two_tier(nics, [PER_RACK * 10_000.0 / 4] * args.racks))
    trace = TraceLog(clock=lambda: clock[0])
    setup = make_policy("stf")
    core = SchedulerCore(
        SchedulerState(graph, Recorder(trace)),
        setup.policy,
        dispatcher=Dispatcher(),
        batcher=AdaptiveBatcher(),
        estimator=BandwidthEstimator(graph),
        replan=setup.trigger,
        clock=lambda: clock[0],
    )
    n = args.racks * PER_RACK
    servers = [f"h{k * n // args.servers}" for k in range(args.servers)]
    workers = [h for i in range(n) if (h := f"h{i}") not in servers][: args.workers]
    sessions = {
        h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{10_000 + i}"))
        for i, h in enumerate(servers + workers)
    }
    params = pb.JobParams(tau_max=-1)
    for h in servers:
        reg = pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name=h, params=params)
        core.on_message(sessions[h], MSG(register_role=reg))
    for h in workers:
        core.on_message(sessions[h], MSG(register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name=h)))
    return core, sessions


def run(args: argparse.Namespace) -> None:
    """Announce, decide, release and report until the last checkpoint; print each checkpoint."""
    clock = [1000.0]
    core, sessions = build(args, clock)
    servers = sorted(h for h in sessions if core.state.jobs["j"].servers.get(h))
    workers = sorted(core.state.jobs["j"].workers)
    rng = random.Random(args.seed)
    reports: list[tuple[float, int, str, pb.TransferReport]] = []
    sizes: dict[str, int] = {}
    versions: dict[str, int] = dict.fromkeys(servers, 0)
    seq = itertools.count()
    wall = time.time() - clock[0]
    last_decision, spent, decisions = clock[0], 0.0, 0
    checkpoints = sorted(args.checkpoints)
    for k in range(1, checkpoints[-1] + 1):
        clock[0] += 1.0 / args.rate
        w = rng.choice(workers)
        uid = f"{w}/{k}"
        sizes[uid] = rng.randint(1 << 18, 4 << 20)
        ready = pb.UpdateReady(
            update_id=uid, job="j", server=rng.choice(servers), worker=w, bytes=sizes[uid], norm=1.0
        )
        core.on_message(sessions[w], MSG(update_ready=ready))
        while reports and reports[0][0] <= clock[0]:
            _, _, host, report = heapq.heappop(reports)
            core.on_message(sessions[host], MSG(transfer_report=report))
        if clock[0] - last_decision >= DECIDE_EVERY:
            last_decision = clock[0]
            t0 = time.perf_counter()
            core.decide()
            spent += time.perf_counter() - t0
            decisions += 1
        core.release()
        for host, session in sessions.items():
            while not session.queue.empty():
                d = session.queue.get_nowait()
                if d is None or d.WhichOneof("kind") != "send":
                    continue
                nbytes = sizes.pop(d.send.update_id)
                seconds = nbytes * 8 / 10e9
                versions[d.send.dst_host] += 1
                start = clock[0] + wall
                report = pb.TransferReport(
                    update_id=d.send.update_id,
                    src_host=host,
                    dst_host=d.send.next_hop_host,
                    bytes=nbytes,
                    start=start,
                    end=start + seconds,
                    ok=True,
                    outcome=pb.OUTCOME_APPLIED,
                    server_version=versions[d.send.dst_host],
                )
                heapq.heappush(reports, (clock[0] + seconds, next(seq), host, report))
        if k in checkpoints:
            t0 = time.perf_counter()
            gc.collect()
            full = time.perf_counter() - t0
            sizes_now = ", ".join(f"{name} {n}" for name, n in containers(core).items())
            print(
                f"{k:7d} updates ({clock[0] - 1000.0:5.0f} s simulated): RSS {rss_mib():6.1f} MiB, "
                f"tracked {len(gc.get_objects()):7d}, full collection {full * 1e3:5.1f} ms, "
                f"decision {spent / max(decisions, 1) * 1e3:5.2f} ms (mean of {decisions}); {sizes_now}",
                flush=True,
            )
            spent, decisions = 0.0, 0


def main() -> None:
    """Parse the arguments and run."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--racks", type=int, default=8, help="racks of 32 hosts (default 8)")
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--rate", type=float, default=100.0, help="updates a simulated second (default 100)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--checkpoints", type=int, nargs="+", default=[10_000, 40_000, 70_000, 100_000], metavar="N"
    )
    run(parser.parse_args())


if __name__ == "__main__":
    main()
