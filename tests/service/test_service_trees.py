"""The service executes ``stf+tree``'s multi-level aggregates through daemons' directives.

The core runs without gRPC against fake daemons (:class:`FakeDaemons`) that act on the
directives as the real ones do: sources send, aggregators sum the members listed (nested
aggregates bring the worker updates they carry), forward into a parent aggregate or to the
server, and refuse a re-issued member list that drops a member already summed. Topology: two
racks behind 40 Mbit/s uplinks, the server ``ps`` behind 10 Mbit/s; rack B's workers may not
aggregate, its aggregator is ``bx``; ``stf+tree`` sums rack B at ``bx`` and forwards that sum
into rack A's aggregate at ``a0``, which goes to the server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import parse_topology
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import DaemonSession, SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.state import SchedulerState

WORKERS = ["a0", "a1", "b0", "b1"]
AGGREGATORS = {"a0", "a1", "bx"}
TOPOLOGY: dict[str, Any] = {
    "hosts": ["ps", "a0", "a1", "b0", "b1", "bx"],
    "switches": ["core", "ra", "rb"],
    "links": [
        {"a": "ps", "b": "core", "mbps": 10},
        {"a": "ra", "b": "core", "mbps": 40},
        {"a": "rb", "b": "core", "mbps": 40},
        *({"a": h, "b": "ra" if h[0] == "a" else "rb", "mbps": 1000} for h in ["a0", "a1", "b0", "b1", "bx"]),
    ],
}
msg = pb.DaemonMessage


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeDaemons:
    """The daemons' side of the directives, in memory (see the module docstring)."""

    def __init__(self, core: SchedulerCore, sessions: dict[str, DaemonSession]) -> None:
        self.core, self.sessions = core, sessions
        self.aggs: dict[str, dict[str, Any]] = {}  # aggregate id -> host, members, parent, summed
        self.applied: list[tuple[str, list[str]]] = []  # payload id, worker updates, at the server
        self.resolved: dict[str, list[Any]] = {}  # worker update -> its verdicts (once, we check)
        self.forwards: list[tuple[str, str, str]] = []  # aggregate, from host, into aggregate ("" server)
        self.dead: set[str] = set()
        self.kill_on_forward = ""  # an aggregator host whose daemon dies when told to forward
        self.deliver_then_die = False  # ... after its sum reached the parent (before its report)
        self.directed: list[tuple[str, list[str]]] = []  # aggregate, members: every directive
        self.raw: list[tuple[str, Any]] = []  # host, AggregateDirective

    def say(self, host: str, **kw: Any) -> None:
        self.core.on_message(self.sessions[host], msg(**kw))

    def report(self, host: str, uid: str, dst: str, **kw: Any) -> None:
        kw.setdefault("ok", True)
        m = pb.TransferReport(update_id=uid, dst_host=dst, bytes=80_000, start=0.0, end=0.01, **kw)
        self.say(host, transfer_report=m)

    def step(self) -> bool:
        """Act on every queued directive; whether there was any."""
        queued = []
        for host, session in self.sessions.items():
            while session.queue.qsize():
                d = session.queue.get_nowait()
                if d is not None and host not in self.dead:
                    queued.append((host, d.WhichOneof("kind"), d))
        # a member frame waits for its aggregate's directive at the aggregator (early_wait)
        queued.sort(key=lambda q: q[1] != "aggregate")
        for host, kind, d in queued:
            if host not in self.dead:
                getattr(self, f"on_{kind}", lambda h, m: None)(host, getattr(d, kind))
        return bool(queued)

    def on_aggregate(self, host: str, d: Any) -> None:
        """As ``AggregatorRole.on_directive``: create, re-open for a joiner, shrink, or give up."""
        members = [m.update_id for m in d.members]
        a = self.aggs.get(d.aggregate_id)
        self.directed.append((d.aggregate_id, members))
        self.raw.append((host, d))
        if a is None or a["state"] in ("abandoned", "gone"):  # the daemon no longer holds it
            if members:
                self.aggs[d.aggregate_id] = {
                    "host": host,
                    "members": members,
                    "summed": {},
                    "state": "collecting",
                }
            return
        if a["state"] == "ready" and members and set(members) > set(a["members"]):
            a["state"] = "collecting"
        if a["state"] == "collecting" and not members:
            a["state"] = "abandoned"  # cancelled: no message
            return
        if a["state"] != "collecting" or any(m not in members for m in a["summed"]):
            if a["state"] == "ready" and set(members) == set(a["members"]):
                return
            self.fail(d.aggregate_id)  # re-issued while ready, or without a member summed
            return
        a["members"] = members
        self.complete(d.aggregate_id)

    def fail(self, aid: str) -> None:
        """The daemon gives ``aid`` up and tells the scheduler (``AggregateFailed``)."""
        a = self.aggs[aid]
        a["state"] = "abandoned"
        self.say(a["host"], aggregate_failed=pb.AggregateFailed(aggregate_id=aid, reason="given up"))

    def kill(self, host: str) -> None:
        """SIGKILL the daemon of ``host``: its aggregates are gone, its stream ends."""
        self.dead.add(host)
        for a in self.aggs.values():
            if a["host"] == host:
                a["state"] = "abandoned"
        self.core.goodbye(self.sessions[host])

    def complete(self, aid: str) -> None:
        a = self.aggs[aid]
        if a["state"] == "collecting" and all(m in a["summed"] for m in a["members"]):
            a["state"] = "ready"
            self.say(a["host"], update_ready=pb.UpdateReady(update_id=aid, job="j", server="s"))

    def deliver(self, aid: str, member: str, carried: list[str]) -> bool:
        a = self.aggs.get(aid)
        if a is None or a["host"] in self.dead or a["state"] != "collecting" or member not in a["members"]:
            return False
        a["summed"][member] = carried
        self.complete(aid)
        return True

    def carried(self, aid: str) -> list[str]:
        return [w for ws in self.aggs[aid]["summed"].values() for w in ws]

    def on_send(self, host: str, s: Any) -> None:
        uid = s.update_id
        if not uid.startswith("agg:"):  # a worker update from its source
            if s.aggregate_id:
                ok = self.deliver(s.aggregate_id, uid, [uid])
                self.report(host, uid, s.next_hop_host, ok=ok, error="" if ok else "refused")
            else:  # straight to the server: its daemon's ACK resolves the push at the source
                self.applied.append((uid, [uid]))
                self.resolved.setdefault(uid, []).append(pb.OUTCOME_APPLIED)
                self.report(host, uid, "ps", outcome=pb.OUTCOME_APPLIED, server_version=len(self.applied))
            return
        if host == self.kill_on_forward and s.aggregate_id:
            if self.deliver_then_die:
                self.deliver(s.aggregate_id, uid, self.carried(uid))
            self.kill(host)
            return
        a = self.aggs.get(uid)
        if a is None or a["state"] != "ready":  # as _cannot_forward: it never left this daemon
            self.report(host, uid, s.next_hop_host, ok=False, error="cannot forward")
            if a is not None and a["state"] == "collecting":
                a["state"] = "abandoned"
            return
        a["state"] = "gone"
        self.forwards.append((uid, host, s.aggregate_id))
        workers = self.carried(uid)
        if s.aggregate_id:  # into the parent aggregate
            ok = s.next_hop_host not in self.dead and self.deliver(s.aggregate_id, uid, workers)
            self.report(host, uid, s.next_hop_host, ok=ok, error="" if ok else "refused")
            return
        self.applied.append((uid, workers))
        verdicts = [pb.MemberVerdict(update_id=w, outcome=pb.OUTCOME_APPLIED) for w in workers]
        self.report(host, uid, "ps", outcome=pb.OUTCOME_APPLIED, member_verdicts=verdicts)

    def on_resolve(self, host: str, r: Any) -> None:
        self.resolved.setdefault(r.update_id, []).append(r.outcome)

    def on_drop(self, host: str, d: Any) -> None:
        if d.update_id in self.aggs:
            self.aggs[d.update_id]["state"] = "abandoned"
        else:
            self.resolved.setdefault(d.update_id, []).append(pb.OUTCOME_DROPPED)


def run(
    kill: str = "",
    pushes: int = 1,
    deliver_then_die: bool = False,
    *,
    topology: dict[str, Any] = TOPOLOGY,
    aggregators: set[str] = AGGREGATORS,
    workers: list[str] = WORKERS,
    chaos: Callable[[FakeDaemons], None] | None = None,
) -> FakeDaemons:
    """Push ``pushes`` updates per worker and play the daemons until every one resolved.

    ``chaos(fake)`` runs before every step (it may kill daemons or fail aggregates).
    """
    graph = parse_topology(topology)
    clock = Clock()
    setup = make_policy("stf+tree")
    core = SchedulerCore(
        SchedulerState(graph),
        setup.policy,
        dispatcher=Dispatcher(margin=0.0),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(graph),
        replan=setup.trigger,
        clock=clock,
    )
    hosts: list[str] = topology["hosts"]
    sessions = {
        h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{9000 + i}", can_aggregate=h in aggregators))
        for i, h in enumerate(hosts)
    }
    fake = FakeDaemons(core, sessions)
    fake.kill_on_forward, fake.deliver_then_die = kill, deliver_then_die
    server = pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name="s", params=pb.JobParams(tau_max=-1))
    fake.say("ps", register_role=server)
    for w in workers:
        fake.say(w, register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name=f"w{w}"))
    for s in sessions.values():
        while s.queue.qsize():
            s.queue.get_nowait()
    for k in range(pushes):
        for w in workers:
            ready = pb.UpdateReady(update_id=f"{w}/{k}", job="j", server="s", worker=f"w{w}", bytes=80_000)
            fake.say(w, update_ready=ready)
    core.decide()
    for _ in range(400):
        clock.now += 0.05
        if chaos is not None:
            chaos(fake)
        if core.state.pending:
            core.decide()
        core.release()
        core._execute(core.aggregates.expire(clock.now))
        fake.step()
        if len(fake.resolved) == len(workers) * pushes and not core.state.pending:
            break
    return fake


def check_exactly_once(fake: FakeDaemons, pushes: int, workers: list[str] = WORKERS) -> None:
    ids = {f"{w}/{k}" for w in workers for k in range(pushes)}
    assert set(fake.resolved) == ids
    assert all(v == [pb.OUTCOME_APPLIED] for v in fake.resolved.values()), fake.resolved
    applied = [w for _, ws in fake.applied for w in ws]
    assert sorted(applied) == sorted(ids)  # each worker update reached the server once


@pytest.mark.parametrize("pushes", [1, 2])
def test_a_two_level_tree_is_executed_and_every_update_resolves_once(pushes: int) -> None:
    fake = run(pushes=pushes)
    check_exactly_once(fake, pushes)
    nested = [(aid, host, parent) for aid, host, parent in fake.forwards if parent]
    assert nested, fake.forwards  # rack B's sum went into another aggregate, not to the server
    assert any(host == "bx" for _, host, _ in nested)
    [(_, workers)] = [(p, ws) for p, ws in fake.applied if p.startswith("agg:")]
    assert sorted(workers) == sorted(f"{w}/{k}" for w in WORKERS for k in range(pushes))  # one payload
    assert not fake.core.aggregates.executions


def test_the_tree_becomes_directives_that_name_the_parent_aggregate() -> None:
    fake = run()
    inner = next(d for h, d in fake.raw if h == "bx")
    top, outer = next((h, d) for h, d in fake.raw if any(m.update_id.startswith("agg:") for m in d.members))
    # bx sums rack B and sends the sum into the aggregate at rack A's aggregator, not the server
    assert [m.update_id for m in inner.members] == ["b0/0", "b1/0"]
    assert (inner.dst_aggregate_id, inner.dst_host) == (outer.aggregate_id, top)
    assert inner.dst_address == f"127.0.0.1:{9000 + TOPOLOGY['hosts'].index(top)}"
    nested = [m for m in outer.members if m.update_id == inner.aggregate_id]
    assert [(m.src_host, m.worker) for m in nested] == [("bx", "")]
    assert (outer.dst_aggregate_id, outer.dst_host) == ("", "ps")
    # its release: a send of the inner aggregate from bx to the outer's aggregator, naming it
    assert (inner.aggregate_id, "bx", outer.aggregate_id) in fake.forwards
    assert (outer.aggregate_id, top, "") in fake.forwards


@pytest.mark.parametrize("summed", [False, True], ids=["before-the-parent-summed-it", "after"])
def test_an_inner_aggregator_lost_while_forwarding_replans_its_members_exactly_once(summed: bool) -> None:
    fake = run(kill="bx", deliver_then_die=summed)
    assert "bx" in fake.dead
    check_exactly_once(fake, 1)
    assert not fake.core.aggregates.executions and fake.core.aggregates.failures >= 1
    assert not any(host == "bx" for _, host, _ in fake.forwards)  # bx's sum never went on
    # not summed yet: the parent at a0 is re-issued without bx's aggregate and goes on with rack
    # A's updates; summed (its daemon had all members in): it is given up whole (its daemon
    # would refuse the shorter list), every update planned afresh
    parent = next(aid for aid, ms in fake.directed if any(m.startswith("agg:") for m in ms))
    shorter = [ms for aid, ms in fake.directed if aid == parent and not any(m.startswith("agg:") for m in ms)]
    assert bool(shorter) is not summed, fake.directed
    assert fake.aggs[parent]["state"] == ("abandoned" if summed else "gone")
