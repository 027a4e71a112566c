"""The simulator's pipelined aggregates (scheduler/sim/pipelines.py, ``--pipelined-aggregates``)."""

from __future__ import annotations

import networkx as nx
import pytest

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.core.graph import star, two_tier
from mlfabric.scheduler.core.schedule import Update
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.sim.engine import APPLIED, Simulator
from mlfabric.scheduler.sim.iteration import SyncSGD
from mlfabric.scheduler.sim.tracing import flows_to_schedule
from mlfabric.scheduler.sim.workload import ComputeModel

MB = 1_000_000


def run(
    graph: nx.DiGraph, workers: list[str], pipelined: bool, jitter: float = 0.0
) -> tuple[list[float], Simulator]:
    setup = make_policy("stf+tree", sync=True, pipelined_aggregates=pipelined)
    it = SyncSGD(ComputeModel(dict.fromkeys(workers, 0.05), jitter=jitter, seed=1), iterations=3)
    sim = Simulator(
        graph,
        setup.policy,
        it,
        server_host="ps",
        workers=workers,
        update_bytes=MB,
        replan=setup.trigger,
        batch_window=300e-6,
        batch_max_wait=5e-3,
        record_flows=True,
    )
    sim.run()
    return it.makespans, sim


def every_update_once(sim: Simulator, workers: list[str]) -> None:
    """Every update applied, and summed into exactly one payload that reached the server."""
    assert len(sim.records) == 3 * len(workers)
    assert all(r.outcome == APPLIED for r in sim.records)
    made = {a.aggregate_id: a for a in sim.aggregates}
    inner = {m for a in sim.aggregates for m in a.members}

    def leaves(pid: str) -> list[str]:
        a = made.get(pid)
        return [pid] if a is None else [u for m in a.members for u in leaves(m)]

    tops = [f.flow_id for f in sim.flows if f.kind != "model" and f.flow_id not in inner]
    got = [u for t in tops for u in leaves(t)]
    assert sorted(got) == sorted(r.update_id for r in sim.records)  # none lost, none twice


@pytest.mark.parametrize("jitter", [0.0, 0.1])
def test_pipelined_round_beats_store_and_forward_on_a_star(jitter: float) -> None:
    # 4 workers + the server on one switch, 1 MB/s NICs, 1 MB updates: store-and-forward needs
    # 3 update times per round (log2 of 5 payloads into the server), pipelined about one
    g = star(["ps", "a", "b", "c", "d"], 8e6)
    workers = ["a", "b", "c", "d"]
    saf, s1 = run(g, workers, pipelined=False, jitter=jitter)
    pipe, s2 = run(g, workers, pipelined=True, jitter=jitter)
    every_update_once(s1, workers)
    every_update_once(s2, workers)
    assert max(pipe) < 0.6 * min(saf)
    if jitter == 0.0:
        assert min(saf) == pytest.approx(0.05 + 3.0, rel=0.02)
        assert max(pipe) < 0.05 + 1.35  # one update time, a chunk per hop, an aggregate's last chunk


def test_pipelined_run_respects_the_members_arrivals() -> None:
    # two racks of two behind uplinks of one NIC; the run's transfers, as a schedule, pass the
    # checker with its aggregates pipelined: none forwarded more than a member had delivered
    g = two_tier(2, 2, 8e6, oversubscription=2)
    g.add_node("ps", kind="host")
    g.add_edge("ps", "core", capacity=1e6)
    g.add_edge("core", "ps", capacity=1e6)
    workers = ["h0", "h1", "h2", "h3"]
    _, sim = run(g, workers, pipelined=True, jitter=0.1)
    every_update_once(sim, workers)
    assert sim.aggregates
    ready = {r.update_id: r for r in sim.records}
    updates = [
        Update(u, r.worker, "ps", MB, ready_at=r.ready_at, base_version=r.base_version)
        for u, r in ready.items()
    ]
    schedule = flows_to_schedule(sim.flows, aggregates=sim.aggregates)
    check_schedule(
        g, schedule, updates=updates, pipelined={a.aggregate_id for a in sim.aggregates}, rtol=1e-5
    )
