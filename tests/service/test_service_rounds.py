"""The service and the simulator plan a synchronous round the same way (issue 23, docs/rounds.md).

One decision runner, one policy: the scheduler core (fake daemons, a fake clock) and the
simulator see the same round — four workers of a synchronous job on two racks, ready at the
same staggered times — and make the same decisions, expected members and holds included.
"""

from __future__ import annotations

from typing import Any

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import parse_topology
from mlfabric.scheduler.policies.base import Decision, PlannedAggregate, RoundSpec, Send
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.policies.tree_policy import TreePolicy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.records import JobParams
from mlfabric.scheduler.service.state import SchedulerState
from mlfabric.scheduler.sim.engine import APPLIED, Simulator
from mlfabric.scheduler.sim.iteration import SyncSGD
from mlfabric.scheduler.sim.workload import ComputeModel
from tests.service.test_service_trees import TOPOLOGY, Clock, FakeDaemons

WORKERS = ["a0", "b0", "a1", "b1"]
READY = {"a0": 0.0, "b0": 0.01, "a1": 0.02, "b1": 0.03}
POOL = ["a0", "a1", "bx"]


def fake_cluster(
    topology: dict[str, Any],
    policy: Any,
    *,
    margin: float = 0.0,
    trigger: Any = None,
    aggregators: Any = None,
) -> tuple[SchedulerCore, FakeDaemons, Clock]:
    """A scheduler core on ``topology`` with ``policy``, fake daemons of every host and a fake
    clock (``aggregators``: the hosts that may aggregate; default all)."""
    graph = parse_topology(topology)
    clock = Clock()
    core = SchedulerCore(
        SchedulerState(graph),
        policy,
        dispatcher=Dispatcher(margin=margin),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(graph),
        replan=trigger,
        clock=clock,
    )
    sessions = {
        h: core.hello(
            pb.Hello(
                host=h,
                data_address=f"127.0.0.1:{9000 + i}",
                can_aggregate=aggregators is None or h in aggregators,
            )
        )
        for i, h in enumerate(topology["hosts"])
    }
    return core, FakeDaemons(core, sessions), clock


def normal(d: Decision, worker_of: dict[str, str]) -> tuple[Any, ...]:
    """A decision with worker names for update ids (the two name updates differently)."""

    def name(x: str) -> str:
        return worker_of.get(x, x)

    sends = tuple((name(s.update_id), s.next_hop) for s in d.sends)
    aggs = tuple(
        (a.aggregate_id, a.aggregator, tuple(sorted(map(name, a.members))), a.dst, round(a.hold_until, 9))
        for a in d.aggregates
    )
    return sends, aggs


def service_decisions() -> list[tuple[Any, ...]]:
    trigger = make_policy("stf+tree").trigger
    core, fake, clock = fake_cluster(
        TOPOLOGY, TreePolicy(aggregators=POOL), trigger=trigger, aggregators=POOL
    )
    params = pb.JobParams(tau_max=-1, sync_workers=len(WORKERS))
    fake.say("ps", register_role=pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name="s", params=params))
    for w in WORKERS:
        fake.say(w, register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name=w))
    assert core.state.rounds() == {("j", "s"): RoundSpec({w: w for w in WORKERS})}
    out = []
    for w in WORKERS:
        clock.now = READY[w]
        ready = pb.UpdateReady(update_id=f"{w}/0", job="j", server="s", worker=w, bytes=80_000)
        fake.say(w, update_ready=ready)
        out.append(normal(core.decide(), {f"{x}/0": x for x in WORKERS}))
        fake.step()
    return out


def simulator_decisions() -> list[tuple[Any, ...]]:
    graph = parse_topology(TOPOLOGY)
    policy = TreePolicy(aggregators=POOL)
    out: list[tuple[Any, ...]] = []
    decide = policy.decide
    worker_of: dict[str, str] = {}

    def recorded(snapshot: Any, pending: Any) -> Decision:
        d = decide(snapshot, pending)
        worker_of.update({p.update_id: p.worker for p in pending})
        out.append(normal(d, worker_of))
        return d

    policy.decide = recorded  # type: ignore[method-assign]
    sim = Simulator(
        graph,
        policy,
        SyncSGD(ComputeModel(READY), iterations=1),
        server_host="ps",
        workers=WORKERS,
        update_bytes=80_000,
        job="j",
        server="s",
    )
    assert all(r.outcome == APPLIED for r in sim.run())
    return out[: len(WORKERS)]


def test_the_service_and_the_simulator_make_the_same_round_decisions() -> None:
    service = service_decisions()
    assert service == simulator_decisions()
    # the first decision planned the whole round: a0's rack aggregate held for a1 and for rack B
    (sends, aggs) = service[0]
    assert sends == (("a0", "a0"),) or all(hop in POOL for _, hop in sends)
    assert any(hold > 0 for *_, hold in aggs)
    # the last one: every member in, nothing held
    assert all(hold == 0 for *_, hold in service[-1][1])


def test_a_job_whose_workers_are_not_all_registered_has_no_round_membership() -> None:
    state = SchedulerState(parse_topology(TOPOLOGY))
    for i, h in enumerate(TOPOLOGY["hosts"]):
        state.connect(h, f"127.0.0.1:{9000 + i}")
    state.register_server("ps", "j", "s", (), JobParams(tau_max=-1, sync_workers=3), 0)
    state.register_worker("a0", "j", "a0")
    state.register_worker("b0", "j", "b0")
    assert state.rounds() == {}
    state.register_worker("a1", "j", "a1")
    assert state.rounds() == {("j", "s"): RoundSpec({"a0": "a0", "b0": "b0", "a1": "a1"})}


class AfterDirect:
    """``a0``'s update straight to the server; ``b0``'s summed at ``bx``, leaving after it."""

    name = "after-direct"

    def decide(self, snapshot: Any, pending: Any) -> Decision:
        ids = {p.worker: p.update_id for p in pending}
        if set(ids) != {"a0", "b0"}:
            return Decision()
        agg = PlannedAggregate("agg:ps:0", "bx", (ids["b0"],), 80_000, "ps", after=(ids["a0"],))
        return Decision(
            sends=(
                Send(ids["a0"], "ps", ("a0", "ra", "core", "ps"), (), 0.0, 0.064),
                Send(ids["b0"], "bx", ("b0", "rb", "bx")),
            ),
            aggregates=(agg,),
        )


def test_an_aggregate_ready_behind_a_send_whose_report_is_held_wakes_the_release_loop() -> None:
    """A synchronous round's server holds the report of ``a0``'s direct send until the round is
    applied, which needs ``bx``'s aggregate, planned after that send: once the aggregate's
    member is in, the release loop must be told to wake at the send's expected end (not at
    the stall deadline, 30 s later: the racks testbed's stalls)."""
    core, fake, clock = fake_cluster(TOPOLOGY, AfterDirect(), aggregators={"bx"})
    sessions = fake.sessions
    params = pb.JobParams(tau_max=-1, sync_workers=2)
    fake.say("ps", register_role=pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name="s", params=params))
    for w in ("a0", "b0"):
        fake.say(w, register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name=w))
        fake.say(
            w, update_ready=pb.UpdateReady(update_id=f"{w}/0", job="j", server="s", worker=w, bytes=80_000)
        )
    core.decide()
    direct = core.state.in_flight["a0/0"]  # released; its report is held (never sent here)
    assert "b0/0" in core.state.in_flight and clock.now < direct.expected_end
    core._wake.clear()
    fake.report("b0", "b0/0", "bx")  # the member is in at bx, which announces the aggregate
    fake.say("bx", update_ready=pb.UpdateReady(update_id="agg:ps:0", job="j", server="s"))
    assert not fake.forwards and core.runner.next_wakeup(core.state.in_flight) == direct.expected_end
    assert core._wake.is_set()  # the loop recomputes its timer: it wakes at the send's end
    clock.now = direct.expected_end
    core.release()
    queued = []
    while sessions["bx"].queue.qsize():
        queued.append(sessions["bx"].queue.get_nowait())
    assert [d.send.update_id for d in queued if d is not None and d.HasField("send")] == ["agg:ps:0"]


RACKS: dict[str, Any] = {
    "hosts": ["ps", *(f"w{i}" for i in range(8))],
    "switches": ["core", "tor0", "tor1"],
    "links": [
        {"a": "ps", "b": "core", "mbps": 1000},
        {"a": "tor0", "b": "core", "mbps": 1000},
        {"a": "tor1", "b": "core", "mbps": 1000},
        *({"a": f"w{i}", "b": f"tor{i // 4}", "mbps": 1000} for i in range(8)),
    ],
}


def test_an_aggregate_that_joins_its_parent_after_the_parent_started_is_summed_into_it() -> None:
    """The racks testbed's rounds (two racks of four, 4:1 uplinks, 4.5 MB updates): in a
    round's second decision rack B's tree is one parent at ``w4`` with ``w4+w5``'s aggregate;
    ``w6+w7``'s aggregate joins that parent once ``w6`` is there, after the parent's first
    member was sent. When ``w6+w7``'s aggregate leaves for the parent it must be summed into
    it (the parent's directive re-issued with it), not failed as "its parent is gone" (which
    planned ``w6`` and ``w7`` afresh, after the round: the testbed's 60 s rounds)."""
    setup = make_policy("stf+tree", sync=True)
    core, fake, clock = fake_cluster(RACKS, setup.policy, margin=0.002, trigger=setup.trigger)
    workers = [f"w{i}" for i in range(8)]
    params = pb.JobParams(tau_max=-1, sync_workers=len(workers))
    fake.say("ps", register_role=pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name="s", params=params))
    for w in workers:
        fake.say(w, register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name=w))
    for version, start in ((0, 0.0), (1, 10.0)):
        ids = [f"{w}/{version}" for w in workers]
        for k, w in enumerate(workers):  # 2 ms apart, in rack order
            clock.now = start + 0.002 * k
            ready = pb.UpdateReady(
                update_id=f"{w}/{version}",
                job="j",
                server="s",
                worker=w,
                bytes=4_505_640,
                base_version=version,
            )
            fake.say(w, update_ready=ready)
            core.decide()
            while fake.step():
                pass
        while clock.now < start + 2.0:  # the release loop; no decision: nothing is planned afresh
            clock.now += 0.005
            core.expire_stalled()
            core.release()
            while fake.step():
                pass
        assert not core.state.pending, f"round {version}: planned afresh after the round"
        assert {u: fake.resolved.get(u) for u in ids} == {u: [pb.OUTCOME_APPLIED] for u in ids}
    nested = [(a, into) for a, _, into in fake.forwards if into]
    assert len(nested) >= 2 and len({into for _, into in nested}) < len(nested)  # two into one parent


class Relisted:
    """``b0``'s update to aggregate ``agg:ps:0`` at ``bx``; then, once it left, ``b1``'s update
    planned into an aggregate of the same id (a plan that did not see it leave)."""

    name = "relisted"

    def decide(self, snapshot: Any, pending: Any) -> Decision:
        ids = {p.worker: p.update_id for p in pending}
        w = "b0" if "b0" in ids else "b1"
        if w not in ids:
            return Decision()
        agg = PlannedAggregate("agg:ps:0", "bx", (ids[w],), 80_000, "ps")
        return Decision(sends=(Send(ids[w], "bx", (w, "rb", "bx")),), aggregates=(agg,))


def test_an_update_that_cannot_join_its_aggregate_is_planned_afresh_at_once() -> None:
    """A member released to an aggregate that already left (or that did not take it) is not
    sent; the runner has let it go, so only a decision plans it again: the service asks for
    one at once — in a synchronous round no other arrival would come to trigger it (the
    racks testbed's 60 s rounds, the server's round timeout)."""
    core, fake, _ = fake_cluster(TOPOLOGY, Relisted(), aggregators={"bx"})
    fake.say("ps", register_role=pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name="s"))
    for w in ("b0", "b1"):
        fake.say(w, register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name=w))
    fake.say(
        "b0", update_ready=pb.UpdateReady(update_id="b0/0", job="j", server="s", worker="b0", bytes=80_000)
    )
    core.decide()
    fake.step()  # b0's update in at bx; the aggregate is told to leave (not done yet)
    assert core.aggregates.executions["agg:ps:0"].forwarded and not fake.forwards
    fake.say(
        "b1", update_ready=pb.UpdateReady(update_id="b1/0", job="j", server="s", worker="b1", bytes=80_000)
    )
    core.batcher._batch = type(core.batcher._batch)(0.0, 0.0)  # no batch open: see what asks
    core.batcher._arrived.clear()
    core.decide()  # b1's update released to agg:ps:0, which is gone
    assert "b1/0" in core.state.pending and "b1/0" not in core.state.in_flight
    assert core.batcher._arrived.is_set()  # a decision is asked for
    assert core.runner.gathering == ()  # and nothing waits for b1's update at bx
    while fake.step():
        pass
    assert fake.forwards == [("agg:ps:0", "bx", "")]  # with b0's update only
    assert fake.resolved.get("b1/0") is None  # b1's was not sent: it waits for that decision
    core.decide()
    while fake.step():
        pass
    assert fake.resolved["b1/0"] == [pb.OUTCOME_APPLIED]
