"""An update reaching a server's daemon after its process died is refused, not DROPPED in an ACK.

Such an update was certainly not applied (it never reached the process), so the daemon answers
as a host without that server does (an ERROR frame); the sender's daemon then treats the
transfer as unanswered and, if the server fails over, re-announces the update to the promoted
replica (docs/replication.md) instead of resolving it DROPPED. Found by
experiments/failover_training.py: SIGKILL of the server process while workers train dropped
the pushes that reached its daemon in the moment before it noticed the process was gone.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np

from mlfabric import tensors as tcodec
from mlfabric.daemon.channels.frames import Frame, FrameHeader, FrameLimits, TransferStats
from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.roles.base import RoleContext, Verdict
from mlfabric.daemon.roles.directory import Directory
from mlfabric.daemon.roles.registrar import Registrar
from mlfabric.daemon.roles.server.handoff import ServerHandoff
from mlfabric.daemon.roles.server.serving import ServerRoles
from mlfabric.params import Params
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.replica import Replica


def _update(update_id: str) -> Frame:
    header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id=update_id, job="j", server="ps0")
    return Frame(header, memoryview(b""), None, TransferStats(bytes=0, start=0.0, end=0.0))


def test_an_update_for_a_dead_server_process_gets_an_error_frame_not_a_dropped_ack() -> None:
    ctx, directory = RoleContext("ps"), Directory()
    roles = ServerRoles(ctx, Registrar(ctx, directory), directory, FrameLimits(), verdict_timeout=5.0)
    mine, theirs = socket.socketpair()
    conn = LocalConnection(1, mine)
    register = local_pb2.RegisterServerRequest(job="j", name="ps0", version=3)
    assert roles.add(conn, register) is None
    theirs.close()
    conn.closed = True  # the process was SIGKILLed; the daemon has not removed its role yet
    try:
        reply = roles.on_frame(_update("w/1")).header
    finally:
        mine.close()
    assert reply.kind == dataplane_pb2.FRAME_KIND_ERROR, reply  # was: an ACK saying DROPPED
    assert "ps0" in reply.reason and "unreachable" in reply.reason and reply.update_id == "w/1"


def test_a_closed_hand_off_says_the_update_was_never_handed_over() -> None:
    handoff = ServerHandoff("j", "ps0", {}, 5, lambda *_: None)
    handoff.close("server process 'ps0' disconnected")
    v = handoff.handle("w/2", FrameHeader(update_id="w/2"), -1, timeout=1.0)
    assert v.outcome == control_pb2.OUTCOME_DROPPED and not v.handed_over and "disconnected" in v.reason
    assert Verdict.dropped("tau_max").handed_over  # a verdict of the process: it had it


class _Client:
    """A stand-in for the daemon connection: records what the process sends."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, request: Any, fd: int | None = None) -> None:
        self.sent.append(request)  # a published model's fd stays the process's


def _deliver(update_id: str, base_version: int, value: float) -> tuple[Any, int]:
    update = {"w": np.full(3, value)}
    layouts, total = tcodec.plan_layout(update)
    fd = os.memfd_create("test-update")
    os.write(fd, update["w"].tobytes())
    deliver = local_pb2.DeliverUpdate(
        update_id=update_id, worker="w0", base_version=base_version, norm=1.0, num_updates=1,
        tensors=tcodec.layouts_to_pb(layouts), payload_bytes=total, has_payload=True,
    )  # fmt: skip
    return deliver, fd


def test_a_promoted_replica_applies_an_update_based_on_the_failed_servers_later_model() -> None:
    """Its base version (from the failed server, which had updates the replica lacked) is ahead:
    applied with delay 0 once promoted (was: DROPPED "base version ... is ahead"); refused before."""
    client = _Client()
    replica = Replica(client, "j", "ps0", {"w": np.zeros(3)}, Params(tau_max=2), version=5)  # type: ignore[arg-type]
    replica._registered = True
    replica._handle(*_deliver("w0/1", 7, 1.0))
    refused = [r.verdict for r in client.sent if r.WhichOneof("kind") == "verdict"][-1]
    assert refused.outcome == control_pb2.OUTCOME_DROPPED and "ahead" in refused.reason  # not promoted yet
    replica.promoted.set()
    replica._handle(*_deliver("w0/2", 7, 2.0))
    verdict = [r.verdict for r in client.sent if r.WhichOneof("kind") == "verdict"][-1]
    assert verdict.outcome == control_pb2.OUTCOME_APPLIED and verdict.delay == 0 and verdict.version == 6
    assert np.array_equal(replica.model["w"], np.full(3, -2.0))
    replica._handle(*_deliver("w0/3", 2, 1.0))  # an old one still meets tau_max: delay 4 > 2
    stale = [r.verdict for r in client.sent if r.WhichOneof("kind") == "verdict"][-1]
    assert stale.outcome == control_pb2.OUTCOME_DROPPED and "tau_max" in stale.reason


def test_a_resent_update_goes_whole_to_its_server_never_into_an_aggregate_nor_dropped() -> None:
    """Announced again after its server failed over (issue 27), an update may be applied at the
    promoted replica already: summed with fresh updates, the aggregate was refused there and the
    fresh members DROPPED. The runner sends it straight to the server, first, even if stale."""
    from dataclasses import replace

    from mlfabric.scheduler.core.graph import star
    from mlfabric.scheduler.policies.base import PendingUpdate, Snapshot
    from mlfabric.scheduler.policies.registry import make_policy
    from mlfabric.scheduler.policies.runner import DecisionRunner

    hosts = ["ps", "w0", "w1", "w2", "w3", "x"]
    graph = star(hosts, {"ps": 8e6, **{h: 32e6 for h in hosts[1:]}})
    mk = lambda i: PendingUpdate(f"u{i}", "j", "s", f"w{i}", f"w{i}", "ps", 10**6, 1.0, 0, 0.0)  # noqa: E731
    snapshot = Snapshot(0.0, graph, server_versions={("j", "s"): 50}, tau_max={"j": 4})
    fresh = DecisionRunner(make_policy("stf+agg", aggregators=["x"], sync=False).policy)
    plan = fresh.decide(replace(snapshot, server_versions={("j", "s"): 0}), [mk(i) for i in range(4)])
    assert any("u2" in a.members for a in plan.aggregates)  # as planned when not resent
    runner = DecisionRunner(make_policy("stf+agg", aggregators=["x"], sync=False).policy)
    updates = [replace(mk(i), base_version=49) for i in range(4)]
    updates[2] = replace(updates[2], resent=True, base_version=0)  # stale: 50 - 0 > tau_max
    d = runner.decide(snapshot, updates)
    assert (d.sends[0].update_id, d.sends[0].next_hop, d.sends[0].after) == ("u2", "ps", ())
    assert not any("u2" in a.members for a in d.aggregates) and "u2" not in {x.update_id for x in d.drops}


def test_a_member_planned_afresh_after_a_failover_goes_to_the_promoted_host() -> None:
    """An aggregate bound for the failed server fails with it; its members, made pending again,
    were still bound for the old host (DROPPED "host 'ps' has no connected daemon")."""
    from mlfabric.scheduler.core.graph import star
    from mlfabric.scheduler.service.records import JobParams
    from mlfabric.scheduler.service.state import SchedulerState

    s = SchedulerState(star(["ps", "rep", "w"], 8e9))
    for i, h in enumerate(("ps", "rep", "w")):
        s.connect(h, f"127.0.0.1:{9000 + i}")
    s.register_server("ps", "j", "ps0", (), JobParams(), version=0)
    s.register_worker("w", "j", "w0")
    u = s.add_update("w", "w/1", "j", "ps0", "w0", 8, 1.0, 0, now=0.0)
    s.release("w/1", ("w", "sw", "x"), 0.0, 1.0)  # into an aggregate at x, say
    s.promote("j", "ps0", "rep", 0)
    s.in_flight.pop("w/1")  # its aggregate failed
    assert s.requeue(u).dst_host == "rep" and s.pending["w/1"].dst_host == "rep"
