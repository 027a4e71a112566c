"""The service executes stf+agg aggregates through daemons' directives (paper §5, Fig. 6).

The core runs without gRPC: each test plays the daemons' messages and reads the directives
queued for them. Hosts: server ``ps`` (1 MB/s NIC), workers ``w0..w3`` and aggregator ``x``
(4 MB/s NICs); while ``u0`` goes to ``ps`` directly, ``u1..u3`` are summed at ``x``.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import DaemonSession, SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.records import OutcomeKind
from mlfabric.scheduler.service.state import SchedulerState

HOSTS = ["ps", "w0", "w1", "w2", "w3", "x"]
msg = pb.DaemonMessage


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env() -> dict[str, Any]:
    graph = star(HOSTS, {"ps": 8e6, **{h: 32e6 for h in HOSTS[1:]}})
    clock = Clock()
    setup = make_policy("stf+agg", sync=False)
    core = SchedulerCore(
        SchedulerState(graph),
        setup.policy,
        dispatcher=Dispatcher(margin=0.0),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(graph),
        replan=setup.trigger,
        clock=clock,
    )
    sessions = {
        h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{9000 + i}", can_aggregate=h == "x"))
        for i, h in enumerate(HOSTS)
    }
    core.on_message(
        sessions["ps"],
        msg(
            register_role=pb.RegisterRole(
                job="j", role=pb.ROLE_SERVER, name="s", params=pb.JobParams(tau_max=-1)
            )
        ),
    )
    for i in range(4):
        reg = pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name=f"w{i}")
        core.on_message(sessions[f"w{i}"], msg(register_role=reg))
    drain(sessions)
    for i in range(4):
        ready = pb.UpdateReady(update_id=f"u{i}", job="j", server="s", worker=f"w{i}", bytes=10**6)
        core.on_message(sessions[f"w{i}"], msg(update_ready=ready))
    core.decide()
    return {"core": core, "s": sessions, "clock": clock}


def drain(sessions: dict[str, DaemonSession]) -> dict[str, list[Any]]:
    """host -> the directives queued for it (as (kind, message) pairs), emptying the queues."""
    out: dict[str, list[Any]] = {}
    for h, s in sessions.items():
        while s.queue.qsize():
            d = s.queue.get_nowait()
            if d is not None:
                kind = d.WhichOneof("kind")
                out.setdefault(h, []).append((kind, getattr(d, kind)))
    return out


def report(core: SchedulerCore, s: DaemonSession, uid: str, dst: str, **kw: Any) -> None:
    kw.setdefault("ok", True)
    m = pb.TransferReport(update_id=uid, dst_host=dst, bytes=10**6, start=0.0, end=0.25, **kw)
    core.on_message(s, msg(transfer_report=m))


def members_in(env: dict[str, Any], ids: tuple[str, ...] = ("u1", "u2", "u3")) -> None:
    core, s = env["core"], env["s"]
    for uid in ids:
        report(core, s[f"w{uid[1]}"], uid, "x")
    core.on_message(s["x"], msg(update_ready=pb.UpdateReady(update_id="agg:ps:0", job="j", server="s")))


def test_an_aggregate_is_directed_forwarded_and_resolves_each_member(env: dict[str, Any]) -> None:
    core, s = env["core"], env["s"]
    out = drain(s)
    assert out["w0"] == [
        (
            "send",
            pb.SendDirective(
                update_id="u0", next_hop_host="ps", next_hop_address="127.0.0.1:9000", dst_host="ps"
            ),
        )
    ]
    [(kind, directive)] = out["x"]
    assert kind == "aggregate" and directive.aggregate_id == "agg:ps:0"
    assert [m.update_id for m in directive.members] == ["u1", "u2", "u3"]
    assert (directive.dst_host, directive.dst_address, directive.timeout_seconds) == (
        "ps",
        "127.0.0.1:9000",
        60,
    )
    [(kind, send)] = out["w1"]  # the members share x's downlink: one after the other
    assert (send.next_hop_host, send.aggregate_id) == ("x", "agg:ps:0")
    for i in (2, 3):
        report(core, s[f"w{i - 1}"], f"u{i - 1}", "x")
        [(kind, send)] = drain(s)[f"w{i}"]
        assert (send.update_id, send.next_hop_host, send.aggregate_id) == (f"u{i}", "x", "agg:ps:0")
    members_in(env, ("u3",))
    assert "x" not in drain(s)  # after u0, which is still on the server's link
    report(core, s["w0"], "u0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=1)
    [(kind, send)] = drain(s)["x"]
    assert (kind, send.update_id, send.next_hop_host) == ("send", "agg:ps:0", "ps")
    verdicts = [
        pb.MemberVerdict(update_id="u1", outcome=pb.OUTCOME_APPLIED, delay=1),
        pb.MemberVerdict(update_id="u2", outcome=pb.OUTCOME_APPLIED, delay=1),
        pb.MemberVerdict(update_id="u3", outcome=pb.OUTCOME_DROPPED, delay=9, reason="stale"),
    ]
    report(
        core, s["x"], "agg:ps:0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=2, member_verdicts=verdicts
    )
    out = drain(s)
    resolves = {h: d[0][1] for h, d in out.items()}
    assert {h: (r.update_id, r.outcome, r.delay) for h, r in resolves.items()} == {
        "w1": ("u1", pb.OUTCOME_APPLIED, 1),
        "w2": ("u2", pb.OUTCOME_APPLIED, 1),
        "w3": ("u3", pb.OUTCOME_DROPPED, 9),
    }
    outcomes = core.state.outcomes
    assert [outcomes[u].kind for u in ("u0", "u1", "u2", "u3")] == [OutcomeKind.APPLIED] * 3 + [
        OutcomeKind.DROPPED
    ]
    assert outcomes["u3"].reason == "stale"
    assert not core.aggregates.executions and not core.state.in_flight and not core.state.pending


def test_a_member_whose_source_leaves_is_removed_from_the_directive(env: dict[str, Any]) -> None:
    core, s = env["core"], env["s"]
    drain(s)
    core.goodbye(s["w2"])
    [(kind, directive)] = drain(s)["x"]
    assert kind == "aggregate" and [m.update_id for m in directive.members] == ["u1", "u3"]
    members_in(env, ("u1", "u3"))
    report(core, s["w0"], "u0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=1)
    assert drain(s)["x"][0][1].update_id == "agg:ps:0"


def test_a_complete_aggregate_whose_member_source_leaves_unreported_is_planned_afresh(
    env: dict[str, Any],
) -> None:
    # tests/faults: a worker's daemon killed after the aggregator summed its member, before its
    # report came; the aggregate was complete (no deadline), its release waited for that report
    # for ever, and the pushes summed with it (and all planned after it) never resolved
    core, s = env["core"], env["s"]
    drain(s)
    for i in (1, 2):
        report(core, s[f"w{i}"], f"u{i}", "x")
        drain(s)  # u3's send directive is out after u2's report
    core.on_message(s["x"], msg(update_ready=pb.UpdateReady(update_id="agg:ps:0", job="j", server="s")))
    core.goodbye(s["w3"])
    assert [(k, d.update_id) for k, d in drain(s)["x"]] == [("drop", "agg:ps:0")]
    assert not core.aggregates.executions and set(core.state.pending) == {"u1", "u2"}
    report(core, s["w0"], "u0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=1)
    core.decide()
    sent = {h: [(k, d.update_id) for k, d in ds] for h, ds in drain(s).items() if h in ("w1", "w2")}
    assert sent == {"w1": [("send", "u1")], "w2": [("send", "u2")]}  # from their sources, once more


def test_an_aggregate_whose_members_all_leave_is_cancelled(env: dict[str, Any]) -> None:
    core, s = env["core"], env["s"]
    drain(s)
    for h in ("w1", "w2", "w3"):
        core.goodbye(s[h])
    directives = drain(s)["x"]
    kind, last = directives[-1]
    assert kind == "aggregate" and last.aggregate_id == "agg:ps:0" and not last.members
    assert not core.aggregates.executions


def test_a_lost_aggregator_has_its_members_sent_directly(env: dict[str, Any]) -> None:
    core, s = env["core"], env["s"]
    drain(s)
    report(core, s["w1"], "u1", "x")  # in at x; u2 on its way, u3 not released
    core.goodbye(s["x"])
    assert set(core.state.pending) == {"u1", "u3"}
    report(core, s["w2"], "u2", "x", ok=False, error="connection refused")
    assert set(core.state.pending) == {"u1", "u2", "u3"}
    report(core, s["w0"], "u0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=1)
    drain(s)
    decision = core.decide()
    assert [(d.update_id, d.next_hop) for d in decision.sends] == [("u1", "ps"), ("u2", "ps"), ("u3", "ps")]
    assert not decision.aggregates  # no host may aggregate any more
    [(kind, send)] = drain(s)["w1"]
    assert (kind, send.update_id, send.next_hop_host, send.aggregate_id) == ("send", "u1", "ps", "")


def test_aggregate_failed_replans_the_members(env: dict[str, Any]) -> None:
    core, s = env["core"], env["s"]
    drain(s)
    members_in(env)
    failed = pb.AggregateFailed(aggregate_id="agg:ps:0", reason="timeout", arrived=["u1", "u2", "u3"])
    core.on_message(s["x"], msg(aggregate_failed=failed))
    assert set(core.state.pending) == {"u1", "u2", "u3"}
    assert core.aggregates.failures == 1 and not core.aggregates.executions


def test_the_scheduler_gives_up_an_aggregate_after_its_timeout(env: dict[str, Any]) -> None:
    core, s, clock = env["core"], env["s"], env["clock"]
    drain(s)
    for uid in ("u1", "u2"):
        report(core, s[f"w{uid[1]}"], uid, "x")
    clock.now = 1000.0
    core._execute(core.aggregates.expire(clock.now))
    out = drain(s)
    assert out["x"] == [("drop", pb.DropDirective(update_id="agg:ps:0", reason=out["x"][0][1].reason))]
    assert "timed out" in out["x"][0][1].reason
    assert set(core.state.pending) == {"u1", "u2"}  # u3 goes back when its source reports
    report(core, s["w3"], "u3", "x")
    assert set(core.state.pending) == {"u1", "u2", "u3"}


def test_a_member_staler_than_tau_max_is_dropped_not_summed() -> None:
    graph = star(HOSTS, {"ps": 8e6, **{h: 32e6 for h in HOSTS[1:]}})
    setup = make_policy("stf+agg", sync=False)
    core = SchedulerCore(
        SchedulerState(graph),
        setup.policy,
        dispatcher=Dispatcher(margin=0.0),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(graph),
    )
    s = {h: core.hello(pb.Hello(host=h, data_address="127.0.0.1:1", can_aggregate=True)) for h in HOSTS}
    params = pb.JobParams(tau_max=2)
    reg = pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name="s", params=params, version=10)
    core.on_message(s["ps"], msg(register_role=reg))
    for i in range(4):
        core.on_message(
            s[f"w{i}"], msg(register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name=f"w{i}"))
        )
    for i, base in enumerate((10, 9, 7, 10)):
        ready = pb.UpdateReady(
            update_id=f"u{i}", job="j", server="s", worker=f"w{i}", bytes=10**6, base_version=base
        )
        core.on_message(s[f"w{i}"], msg(update_ready=ready))
    decision = core.decide()
    assert [d.update_id for d in decision.drops] == ["u2"]
    assert all("u2" not in a.members for a in decision.aggregates)


def test_online_the_next_group_is_gathered_while_the_servers_ingress_is_busy() -> None:
    from mlfabric.scheduler.policies.aggregation import AggregationPolicy
    from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, Snapshot

    graph = star(HOSTS, {"ps": 8e6, **{h: 32e6 for h in HOSTS[1:]}})
    flying = InFlight("u0", "j", "s", ("w0", "sw", "ps"), 10**6, 0.0, 1.0)
    pending = [PendingUpdate(f"u{i}", "j", "s", f"w{i}", f"w{i}", "ps", 10**6, 1.0, 0, 0.0) for i in (1, 2)]
    decision = AggregationPolicy(sync=False, aggregators=["x"]).decide(
        Snapshot(0.0, graph, in_flight=(flying,)), pending
    )
    assert [(s.update_id, s.next_hop) for s in decision.sends] == [("u1", "x"), ("u2", "x")]
    [agg] = decision.aggregates
    assert agg.members == ("u1", "u2")
    # without the transfer in flight, the first update would go directly
    alone = AggregationPolicy(sync=False, aggregators=["x"]).decide(Snapshot(0.0, graph), pending)
    assert alone.sends[0].next_hop == "ps"


def test_a_topology_host_with_aggregator_false_never_aggregates() -> None:
    from mlfabric.scheduler.core.graph import TopologyError, parse_topology
    from mlfabric.scheduler.policies.fair import FairPolicy
    from mlfabric.scheduler.policies.runner import DecisionRunner
    from mlfabric.scheduler.service.aggregates import AggregateBook

    links = [{"a": h, "b": "sw", "mbps": 100} for h in ("ps", "a", "b")]
    hosts = ["ps", {"name": "a", "aggregator": False}, {"name": "b"}]
    state = SchedulerState(parse_topology({"hosts": hosts, "switches": ["sw"], "links": links}))
    book = AggregateBook(state, DecisionRunner(FairPolicy()))
    for h in ("ps", "a", "b"):
        state.connect(h, "127.0.0.1:1")
        book.hello(h, can_aggregate=True)
    assert book.eligible() == {"ps", "b"}
    with pytest.raises(TopologyError, match="host 'a': aggregator must be true or false"):
        parse_topology({"hosts": [{"name": "a", "aggregator": "no"}], "links": []})


def test_an_aggregate_leaves_once_its_after_transfer_is_past_its_expected_end(env: dict[str, Any]) -> None:
    # synchronous rounds: u0's report is held until the round is applied, which needs the aggregate
    core, s, clock = env["core"], env["s"], env["clock"]
    drain(s)
    for i in (1, 2):
        report(core, s[f"w{i}"], f"u{i}", "x")
    members_in(env, ("u3",))
    assert "x" not in drain(s)  # u0 is still expected on the server's link
    clock.now = core.state.in_flight["u0"].expected_end + 0.01
    core.release()
    [(kind, send)] = drain(s)["x"]
    assert (kind, send.update_id, send.next_hop_host) == ("send", "agg:ps:0", "ps")


def forwarded(env: dict[str, Any]) -> None:
    """Every member in at ``x``, ``u0`` applied: the aggregate is released to the server."""
    core, s = env["core"], env["s"]
    drain(s)
    members_in(env)
    report(core, s["w0"], "u0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=1)
    [(kind, send)] = drain(s)["x"]
    assert (kind, send.update_id) == ("send", "agg:ps:0")


def member_resolves(env: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """worker host -> (update id, outcome) of the ResolveDirective queued for it."""
    out = drain(env["s"])
    return {h: (d.update_id, d.outcome) for h, ds in out.items() for kind, d in ds if kind == "resolve"}


MEMBERS = {"w1": "u1", "w2": "u2", "w3": "u3"}


def test_a_forwarded_aggregate_outlives_its_servers_daemon_and_resolves_on_its_report(
    env: dict[str, Any],
) -> None:
    core, s = env["core"], env["s"]
    forwarded(env)
    core.goodbye(s["ps"])  # after the server applied the aggregate, before the aggregator's report
    assert not {"u1", "u2", "u3"} & set(core.state.pending)
    assert not {"u1", "u2", "u3"} & set(core.state.outcomes)  # neither re-planned nor dropped
    verdicts = [pb.MemberVerdict(update_id=u, outcome=pb.OUTCOME_APPLIED) for u in ("u1", "u2", "u3")]
    report(core, s["x"], "agg:ps:0", "ps", outcome=pb.OUTCOME_APPLIED, member_verdicts=verdicts)
    assert member_resolves(env) == {h: (u, pb.OUTCOME_APPLIED) for h, u in MEMBERS.items()}
    assert {core.state.outcomes[u].kind for u in MEMBERS.values()} == {OutcomeKind.APPLIED}


def test_a_forward_that_may_have_reached_the_server_resolves_its_members_unknown(
    env: dict[str, Any],
) -> None:
    core, s = env["core"], env["s"]
    forwarded(env)
    core.goodbye(s["ps"])
    why = "aggregate agg:ps:0 may have reached host 'ps', which gave no verdict: peer closed"
    verdicts = [
        pb.MemberVerdict(update_id=u, outcome=pb.OUTCOME_UNKNOWN, reason=why) for u in MEMBERS.values()
    ]
    report(
        core, s["x"], "agg:ps:0", "ps", ok=False, error=why, outcome=pb.OUTCOME_UNKNOWN, reason=why,
        member_verdicts=verdicts,
    )  # fmt: skip
    assert member_resolves(env) == {h: (u, pb.OUTCOME_UNKNOWN) for h, u in MEMBERS.items()}
    outcomes = [core.state.outcomes[u] for u in MEMBERS.values()]
    assert {(o.kind, o.reason) for o in outcomes} == {(OutcomeKind.UNKNOWN, why)}
    assert not core.state.pending and not core.aggregates.executions


def test_a_forward_that_never_left_the_aggregator_replans_its_members(env: dict[str, Any]) -> None:
    core, s = env["core"], env["s"]
    forwarded(env)
    report(core, s["x"], "agg:ps:0", "ps", ok=False, error="connect: [Errno 111] Connection refused")
    assert set(core.state.pending) == {"u1", "u2", "u3"}


def test_a_lost_aggregator_after_the_forward_resolves_its_members_unknown(env: dict[str, Any]) -> None:
    core, s = env["core"], env["s"]
    forwarded(env)
    core.goodbye(s["x"])
    assert member_resolves(env) == {h: (u, pb.OUTCOME_UNKNOWN) for h, u in MEMBERS.items()}
    outcomes = [core.state.outcomes[u] for u in MEMBERS.values()]
    assert {o.kind for o in outcomes} == {OutcomeKind.UNKNOWN}
    assert all("may have reached the server" in o.reason for o in outcomes)
    assert not core.state.pending
    assert core.stats().updates_unknown == 3


def test_a_forwarded_aggregate_without_a_report_resolves_its_members_unknown(env: dict[str, Any]) -> None:
    core, clock = env["core"], env["clock"]
    forwarded(env)
    clock.now = 10_000.0
    core._execute(core.aggregates.expire(clock.now))
    assert member_resolves(env) == {h: (u, pb.OUTCOME_UNKNOWN) for h, u in MEMBERS.items()}
    assert not core.state.pending


def test_an_aggregate_announced_again_after_its_release_is_not_dropped(env: dict[str, Any]) -> None:
    """A re-opened aggregate announced ready again after the send was released keeps its send.

    Dropping it there left its members unresolved until the forward timeout (the aggregator
    discarded the sum, then got the send directive for an aggregate it no longer held).
    """
    core, s = env["core"], env["s"]
    forwarded(env)
    core.on_message(s["x"], msg(update_ready=pb.UpdateReady(update_id="agg:ps:0", job="j", server="s")))
    assert "x" not in drain(s)
    verdicts = [pb.MemberVerdict(update_id=u, outcome=pb.OUTCOME_APPLIED, delay=1) for u in MEMBERS.values()]
    report(
        core, s["x"], "agg:ps:0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=2, member_verdicts=verdicts
    )
    assert member_resolves(env) == {h: (u, pb.OUTCOME_APPLIED) for h, u in MEMBERS.items()}
