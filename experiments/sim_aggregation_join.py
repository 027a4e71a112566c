"""stf+agg with and without open aggregates (joining), in the simulator (the policy code the service runs).

The testbed's setting without its CPU noise: 8 workers with uplinks 200, 200, 100, 100, 50,
50, 25, 25 Mbit/s (downlinks 1 Gbit/s), the server's ingress 100 Mbit/s, 4.5 MB updates and
models, compute 0.02 s with one 4x straggler (jitter 0.3). Per policy: simulated time until
``--updates`` worker updates are applied (asynchronous) or ``--iterations`` rounds
(synchronous), and payloads into the server per applied worker update.

    python experiments/sim_aggregation_join.py [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import networkx as nx

from mlfabric.scheduler.policies.aggregation import AggregationPolicy
from mlfabric.scheduler.policies.fair import FairPolicy
from mlfabric.scheduler.sim.engine import Simulator
from mlfabric.scheduler.sim.iteration import AsyncSGD, SyncSGD
from mlfabric.scheduler.sim.workload import ComputeModel

UPLINKS = [200, 200, 100, 100, 50, 50, 25, 25]
UPDATE = 4.5e6


def graph() -> nx.DiGraph:
    """The testbed's star: capacities in bytes per second."""
    g = nx.DiGraph()
    g.add_node("tor", kind="switch")
    g.add_node("ps", kind="host")
    g.add_edge("tor", "ps", capacity=100e6 / 8, latency=0.0)
    g.add_edge("ps", "tor", capacity=1000e6 / 8, latency=0.0)
    for i, up in enumerate(UPLINKS):
        g.add_node(f"w{i}", kind="host")
        g.add_edge(f"w{i}", "tor", capacity=up * 1e6 / 8, latency=0.0)
        g.add_edge("tor", f"w{i}", capacity=1000e6 / 8, latency=0.0)
    return g


def run(policy: Any, sync: bool, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """One simulated run; time to the target and server payloads per applied update."""
    workers = [f"w{i}" for i in range(len(UPLINKS))]
    compute = {w: 0.02 for w in workers}
    compute[workers[seed % len(workers)]] = 0.08  # the straggler
    model = ComputeModel(compute, jitter=0.3, seed=seed)
    it: Any = SyncSGD(model, iterations=args.iterations) if sync else AsyncSGD(model)
    until = 10_000.0
    sim = Simulator(
        graph(),
        policy,
        it,
        server_host="ps",
        workers=workers,
        update_bytes=UPDATE,
        model_bytes=UPDATE,
        tau_max=32,
        until=until if sync else args.horizon,
    )
    recs = sim.run()
    applied = sorted(r.arrived_at for r in recs if r.outcome == "applied")
    direct = sum(1 for r in recs if r.outcome == "applied") - sum(len(a.members) for a in sim.aggregates)
    payloads = direct + len(sim.aggregates)
    t = (
        max(applied)
        if sync
        else (applied[args.updates - 1] if len(applied) >= args.updates else float("nan"))
    )
    return {"time": t, "applied": len(applied), "payloads_per_update": payloads / max(1, len(applied))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--updates", type=int, default=200, help="asynchronous: applied updates to time")
    parser.add_argument("--horizon", type=float, default=200.0, help="asynchronous: simulated seconds")
    parser.add_argument("--iterations", type=int, default=20, help="synchronous: rounds")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    systems = {
        "fair": lambda: FairPolicy(),
        "stf+agg (no join)": lambda: AggregationPolicy(sync=False, join=False),
        "stf+agg (join)": lambda: AggregationPolicy(sync=False, join=True),
    }
    print("| mode | system | median time (s) | min-max | vs fair | payloads per applied update |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for sync in (False, True):
        med: dict[str, float] = {}
        for name, make in systems.items():
            rs = [run(make(), sync, s, args) for s in seeds]
            ts = [r["time"] for r in rs]
            med[name] = statistics.median(ts)
            ppu = statistics.median(r["payloads_per_update"] for r in rs)
            print(
                f"| {'sync' if sync else 'async'} | {name} | {med[name]:.1f} | {min(ts):.1f}-{max(ts):.1f} | "
                f"{med['fair'] / med[name]:.2f}x | {ppu:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
