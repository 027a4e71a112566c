"""The simulator drives the real policies over the fluid network (DESIGN §6)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.core.schedule import Update
from mlfabric.scheduler.policies.aggregation import AggregationPolicy
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, Policy, Send, Snapshot
from mlfabric.scheduler.policies.fair import FairPolicy
from mlfabric.scheduler.policies.stf import STFPolicy
from mlfabric.scheduler.sim.engine import SimulationError, Simulator, UpdateRecord
from mlfabric.scheduler.sim.iteration import AsyncSGD, SyncSGD
from mlfabric.scheduler.sim.scenario import Cluster, Scenario, cluster, run_scenario
from mlfabric.scheduler.sim.tracing import flows_to_schedule
from mlfabric.scheduler.sim.workload import BandwidthChange, ComputeModel, pick_stragglers

MB = 1e6


def _bottleneck(n: int, server_bps: float = 8e6, worker_bps: float = 80e6) -> Cluster:
    """n workers behind one switch; the server's 1 MB/s NIC is the bottleneck."""
    workers = [f"w{i}" for i in range(n)]
    g = star(["ps", *workers], {"ps": server_bps, **dict.fromkeys(workers, worker_bps)})
    return Cluster(g, "ps", tuple(workers))


def _one_round(
    c: Cluster,
    policy: Policy,
    *,
    update_bytes: float,
    changes: Sequence[BandwidthChange] = (),
    record_flows: bool = False,
) -> Simulator:
    """One push per worker (no compute time, no batching window), run to the end."""
    compute = ComputeModel(dict.fromkeys(c.workers, 0.0))
    scenario = Scenario(
        c,
        compute,
        update_bytes=update_bytes,
        iterations=1,
        batch_window=0.0,
        batch_max_wait=0.0,
        changes=tuple(changes),
    )
    return run_scenario(scenario, policy, record_flows=record_flows)[1]


@pytest.mark.parametrize("n", [1, 3, 6])
def test_single_bottleneck_fair_ends_all_at_n_t_stf_time_shares(n: int) -> None:
    c = _bottleneck(n)
    t_one = 1.0  # 1 MB over 1 MB/s
    fair = _one_round(c, FairPolicy(), update_bytes=MB)
    assert [r.arrived_at for r in fair.records] == pytest.approx([n * t_one] * n)
    stf = _one_round(c, STFPolicy(), update_bytes=MB)
    arrivals = sorted(r.arrived_at for r in stf.records)
    assert arrivals == pytest.approx([k * t_one for k in range(1, n + 1)])
    assert np.mean(arrivals) == pytest.approx((n + 1) / 2 * t_one, rel=1e-9)
    # the server applies in arrival order: delays 0 .. n-1
    assert sorted(r.delay for r in stf.records) == list(range(n))


def test_bandwidth_change_mid_transfer() -> None:
    c = _bottleneck(1)
    # 1 MB at 1 MB/s; at t = 0.5 the server link drops to 0.25 MB/s: 0.5 MB left -> 2 s more
    changes = [BandwidthChange(0.5, ("sw", "ps"), 0.25 * MB)]
    sim = _one_round(c, FairPolicy(), update_bytes=MB, changes=changes, record_flows=True)
    assert sim.records[0].arrived_at == pytest.approx(2.5)
    # the policy saw the old graph before the change; the run's schedule respects both rates
    schedule = flows_to_schedule(sim.flows)
    update = Update(sim.records[0].update_id, "w0", "ps", MB)
    profiles = {("sw", "ps"): [(0.5, 0.25 * MB)]}
    check_schedule(c.graph, schedule, updates=[update], capacity_profiles=profiles)


def test_nic_changes_mid_run_are_seen_by_the_incremental_stf_as_by_the_full_re_plan() -> None:
    # the engine changes its policy graph in place and says so (Snapshot.graph_version): the
    # book reads the NICs' capacities again then, and only then
    rng = np.random.default_rng(3)
    c = cluster("star", 12, nic_bps=80e6, slow_fraction=0.25, slow_factor=4.0, rng=rng)
    links = [(w, next(iter(c.graph.successors(w)))) for w in c.workers]
    changes = [
        BandwidthChange(0.05 * k, links[(5 * k) % len(links)], (1 + k % 4) * 2 * MB) for k in range(1, 80)
    ]
    compute = ComputeModel(dict.fromkeys(c.workers, 0.002), jitter=0.3, seed=3)
    scenario = Scenario(c, compute, update_bytes=MB, iterations=6, changes=tuple(changes))
    _, incremental = run_scenario(scenario, STFPolicy(horizon=4))
    _, full = run_scenario(scenario, STFPolicy(horizon=4, incremental=False))
    assert _key(incremental.records) == _key(full.records)
    assert incremental.runner.decisions > 20


def _hetero_scenario(seed: int, mode: str = "async", tau_max: int = -1, iterations: int = 4) -> Scenario:
    rng = np.random.default_rng(seed)
    c = cluster("star", 12, nic_bps=80e6, slow_fraction=0.25, slow_factor=4.0, rng=rng)
    mean = pick_stragglers(c.workers, 0.25, 3.0, 0.2, rng)
    return Scenario(
        c, ComputeModel(mean, jitter=0.3, seed=seed), mode=mode, update_bytes=MB, iterations=iterations,
        tau_max=tau_max,
    )  # fmt: skip


def _key(records: Sequence[UpdateRecord]) -> list[tuple[str, int, float, float, str]]:
    return [(r.update_id, r.base_version, r.ready_at, r.arrived_at, r.outcome) for r in records]


def test_deterministic_given_the_seed() -> None:
    a, sim_a = run_scenario(_hetero_scenario(7), STFPolicy())
    b, sim_b = run_scenario(_hetero_scenario(7), STFPolicy())
    assert _key(sim_a.records) == _key(sim_b.records)
    assert a == b
    _, sim_c = run_scenario(_hetero_scenario(8), STFPolicy())
    assert _key(sim_c.records) != _key(sim_a.records)


def test_every_policy_sees_the_same_compute_times() -> None:
    sc = _hetero_scenario(3)
    _, fair = run_scenario(sc, FairPolicy())
    _, stf = run_scenario(sc, STFPolicy())
    # the first push of every worker is ready at the same time under both policies
    first = {r.worker: r.ready_at for r in reversed(fair.records)}
    assert first == {r.worker: r.ready_at for r in reversed(stf.records)}


def test_stf_mean_delay_and_completion_no_worse_than_fair_on_a_bottleneck() -> None:
    sc = _hetero_scenario(1, iterations=5)
    fair, _ = run_scenario(sc, FairPolicy())
    stf, _ = run_scenario(sc, STFPolicy())
    assert fair.applied == stf.applied == fair.pushed
    assert stf.delay_mean <= fair.delay_mean
    assert stf.completion_mean < fair.completion_mean


def test_tau_max_is_never_exceeded_policy_drops_and_server_safety_net() -> None:
    sc = _hetero_scenario(2, tau_max=3, iterations=4)
    fair, fair_sim = run_scenario(sc, FairPolicy())
    stf, stf_sim = run_scenario(sc, STFPolicy())
    for s, sim in ((fair, fair_sim), (stf, stf_sim)):
        assert max(r.delay for r in sim.records if r.outcome == "applied") <= 3
        assert s.applied + s.dropped_policy + s.dropped_server == s.pushed
    assert fair.dropped_server > 0 and fair.dropped_policy == 0  # fair never drops: the server does
    assert stf.dropped_policy > 0


def test_simulated_schedules_pass_the_checker() -> None:
    sc = _hetero_scenario(4, iterations=2)
    for policy in (FairPolicy(), STFPolicy()):
        _, sim = run_scenario(sc, policy, record_flows=True)
        updates = [Update(r.update_id, r.worker, "ps", MB, r.ready_at) for r in sim.records]
        check_schedule(sc.cluster.graph, flows_to_schedule(sim.flows), updates=updates)


def _sync(c: Cluster, jitter: float) -> Scenario:
    compute = ComputeModel(dict.fromkeys(c.workers, 0.05), jitter=jitter, seed=5)
    return Scenario(c, compute, mode="sync", update_bytes=MB, iterations=3)


@pytest.mark.parametrize("jitter", [0.0, 0.3])
def test_sync_makespan_with_aggregation_no_worse_than_without(jitter: float) -> None:
    # the server's ingress is the bottleneck; workers' NICs are 4x faster
    c = _bottleneck(12, server_bps=8e6, worker_bps=32e6)
    sc = _sync(c, jitter)
    plain, _ = run_scenario(sc, STFPolicy())
    agg, sim = run_scenario(sc, AggregationPolicy(), record_flows=True)
    assert plain.iterations == agg.iterations == 3
    assert agg.applied == plain.applied == 36
    assert agg.makespan_mean <= plain.makespan_mean * (1 + 1e-9)
    if jitter == 0.0:
        assert agg.makespan_mean < 0.5 * plain.makespan_mean
        assert sim.aggregates, "expected aggregation groups"
        updates = [Update(r.update_id, r.worker, "ps", MB, r.ready_at) for r in sim.records]
        check_schedule(c.graph, flows_to_schedule(sim.flows, aggregates=sim.aggregates), updates=updates)


def test_sync_iteration_waits_for_the_last_update_and_the_model() -> None:
    c = _bottleneck(4)
    compute = ComputeModel({"w0": 0.5, "w1": 0.0, "w2": 0.0, "w3": 0.0})
    it = SyncSGD(compute, iterations=2)
    sim = Simulator(c.graph, FairPolicy(), it, server_host="ps", workers=c.workers, update_bytes=MB)
    sim.run()
    # three updates share 1 MB/s from t=0, the straggler's joins at 0.5: the last ends at 4
    assert it.makespans == pytest.approx([4.0, 4.0])
    assert sim.version == 2
    # with a 2 MB model sent back at 8 MB/s per worker NIC... the server NIC (1 MB/s) carries 4 copies
    it2 = SyncSGD(compute, iterations=1)
    sim2 = Simulator(
        c.graph, FairPolicy(), it2, server_host="ps", workers=c.workers, update_bytes=MB, model_bytes=MB
    )
    sim2.run()
    assert it2.makespans == pytest.approx([4.0 + 4.0])


def test_async_no_wait_pushes_more_in_the_same_time() -> None:
    c = _bottleneck(3)
    compute = ComputeModel(dict.fromkeys(c.workers, 0.5))
    counts = []
    for wait in (True, False):
        it = AsyncSGD(compute, wait=wait)
        sim = Simulator(
            c.graph, FairPolicy(), it, server_host="ps", workers=c.workers, update_bytes=0.1 * MB, until=5.0
        )
        sim.run()
        counts.append(len(sim.records))
        assert sim.now <= 5.0
    assert counts[1] > counts[0]


class _Rogue:
    name = "rogue"

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        return Decision(sends=(Send("nope", "ps", ("w0", "sw", "ps")),))


def test_a_decision_naming_an_unknown_update_is_an_error() -> None:
    with pytest.raises(SimulationError, match="not pending"):
        _one_round(_bottleneck(1), _Rogue(), update_bytes=MB)


def test_duration_stops_the_run() -> None:
    sc = Scenario(
        _bottleneck(2), ComputeModel({"w0": 0.1, "w1": 0.1}), update_bytes=MB, duration=3.0
    )  # fmt: skip
    stats, sim = run_scenario(sc, FairPolicy())
    assert sim.now <= 3.0 and stats.unresolved >= 1
    assert not math.isnan(stats.completion_mean)
