"""The simulator and the scheduler service decide through the same runner, with the same result.

The same ready updates (same ids, hosts, sizes, times) are given to the service's core
(no gRPC: its methods are called directly, on a frozen clock) and to the simulator; both
hand them to a :class:`DecisionRunner` built from ``make_policy``, so the policy sees the
same snapshot and pending updates and returns the same decision, and the same sends are
released at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx
import pytest

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, Policy, Snapshot
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.state import SchedulerState
from mlfabric.scheduler.sim.engine import Simulator
from mlfabric.scheduler.sim.iteration import AsyncSGD
from mlfabric.scheduler.sim.workload import ComputeModel

MB = 10**6
WORKERS = ["w0", "w1", "w2", "w3", "w4"]


def graph() -> nx.DiGraph:
    """The server's NIC is the bottleneck; workers' NICs differ, so STF has an order to find."""
    nics = {
        "ps": 8 * MB,
        "w0": 2 * MB,
        "w1": 16 * MB,
        "w2": 4 * MB,
        "w3": 32 * MB,
        "w4": 3 * MB,
        "x": 64 * MB,
    }
    return star(["ps", *WORKERS, "x"], {h: 8 * bps for h, bps in nics.items()})


class Recording:
    """A policy wrapper keeping every (snapshot, pending, decision)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.calls: list[tuple[Snapshot, tuple[PendingUpdate, ...], Decision]] = []

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        decision = self.policy.decide(snapshot, pending)
        self.calls.append((snapshot, tuple(pending), decision))
        return decision


def simulate(name: str) -> tuple[Recording, Simulator]:
    setup = make_policy(name, horizon=2, aggregators=["x"])
    policy = Recording(setup.policy)
    it = AsyncSGD(ComputeModel(dict.fromkeys(WORKERS, 0.0), jitter=0.0), iterations=1)
    sim = Simulator(
        graph(), policy, it, server_host="ps", workers=WORKERS, update_bytes=MB, replan=setup.trigger
    )
    sim.run()
    return policy, sim


def serve(name: str, pending: Sequence[PendingUpdate]) -> tuple[Recording, SchedulerCore]:
    setup = make_policy(name, horizon=2, aggregators=["x"])
    policy = Recording(setup.policy)
    g = graph()
    core = SchedulerCore(
        SchedulerState(g),
        policy,
        dispatcher=Dispatcher(margin=0.0),  # the simulator's default: no control latency to hide
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(g),
        replan=setup.trigger,
        clock=lambda: 0.0,
    )
    sessions = {
        h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{9000 + i}", can_aggregate=True))
        for i, h in enumerate(["ps", *WORKERS, "x"])
    }
    msg = pb.DaemonMessage
    params = pb.JobParams(tau_max=-1)
    role = pb.RegisterRole(job="job", role=pb.ROLE_SERVER, name="ps", params=params)
    core.on_message(sessions["ps"], msg(register_role=role))
    for w in WORKERS:
        core.on_message(
            sessions[w], msg(register_role=pb.RegisterRole(job="job", role=pb.ROLE_WORKER, name=w))
        )
    for u in pending:
        ready = pb.UpdateReady(
            update_id=u.update_id, job=u.job, server=u.server, worker=u.worker, bytes=u.bytes, norm=u.norm
        )
        core.on_message(sessions[u.src_host], msg(update_ready=ready))
    core.decide()
    return policy, core


def _same_snapshot(a: Snapshot, b: Snapshot) -> None:
    assert (a.now, a.in_flight, dict(a.server_versions), dict(a.tau_max)) == (
        b.now,
        b.in_flight,
        dict(b.server_versions),
        dict(b.tau_max),
    )
    assert sorted(a.graph.edges(data="capacity")) == sorted(b.graph.edges(data="capacity"))


@pytest.mark.parametrize("name", ["fair", "stf", "stf+agg"])
def test_service_and_simulator_make_the_same_first_decision(name: str) -> None:
    sim_policy, sim = simulate(name)
    assert isinstance(sim.runner, DecisionRunner)
    snapshot, pending, sim_decision = sim_policy.calls[0]
    assert [p.worker for p in pending] == WORKERS  # every worker pushed at t=0: one batch

    service_policy, core = serve(name, pending)
    assert isinstance(core.runner, DecisionRunner)
    (service_snapshot, service_pending, service_decision), *_ = service_policy.calls
    assert service_pending == pending
    _same_snapshot(service_snapshot, snapshot)
    assert service_decision == sim_decision
    assert service_decision.sends  # something to compare
    assert bool(service_decision.aggregates) == (name == "stf+agg")

    # the same sends leave at once: in the service as send directives, in the simulator as flows
    sent = sorted(uid for uid, _ in core.state.in_flight.items())
    started = sorted(r.update_id for r in sim.records if r.released_at == 0.0)
    assert sent == started


def test_the_horizon_runs_in_the_simulator() -> None:
    """``stf`` with a horizon of 2 plans 2 of the 5 updates per decision; the trigger re-plans."""
    policy, sim = simulate("stf")
    assert [len(d.sends) for _, _, d in policy.calls][:1] == [2]
    assert len(policy.calls) >= 3  # 5 updates, 2 planned per decision
    assert all(r.outcome == "applied" and not math.isnan(r.arrived_at) for r in sim.records)
    # the greedy STF head does not change when the tail is planned later: the same order
    # as planning everything at once
    full = make_policy("stf", horizon=0)
    it = AsyncSGD(ComputeModel(dict.fromkeys(WORKERS, 0.0), jitter=0.0), iterations=1)
    whole = Simulator(graph(), full.policy, it, server_host="ps", workers=WORKERS, update_bytes=MB)
    order = sorted(whole.run(), key=lambda r: r.arrived_at)
    assert [r.update_id for r in order] == [
        r.update_id for r in sorted(sim.records, key=lambda r: r.arrived_at)
    ]
    assert whole.decisions == 1
