"""A push held after its scheduler session ended is let go, never kept waiting for that session.

A push sent to an aggregator stays HELD until the scheduler that planned the aggregate
resolves it. When the scheduler restarts, each worker registers again and its held pushes
are made ready (UNKNOWN if the aggregator summed them, else announced anew; ``unhold``). A
transfer to an aggregator still under way at that moment ends *after* it: the push was held
for a session that no longer exists and nobody would ever resolve it (the fault-injection
test's ``kill-scheduler`` runs once left one push unresolved). The sender notices (the push
records the session that sent it) and hands it on; it goes exactly once, whichever of the
re-registration and the late hold comes first.
"""

from __future__ import annotations

import os
import threading
from typing import Any, cast

import pytest

from mlfabric.daemon.channels.budget import ByteBudget
from mlfabric.daemon.channels.frames import FrameHeader, FrameLimits
from mlfabric.daemon.channels.peers import Delivery, PeerPool
from mlfabric.daemon.roles.base import RoleContext
from mlfabric.daemon.roles.directory import Directory, ServerLocation
from mlfabric.daemon.roles.registrar import Registrar
from mlfabric.daemon.roles.relay.role import ModelRelays
from mlfabric.daemon.roles.worker.intake import WorkerRole
from mlfabric.daemon.roles.worker.pushes import OutgoingPushes, PendingPush, PushState
from mlfabric.daemon.roles.worker.sender import PushSender
from mlfabric.proto.v1 import control_pb2, dataplane_pb2

ADDRESS = "127.0.0.1:1"


class Reply:
    """A peer's answer: an ACK (with ``outcome``), or an ERROR."""

    def __init__(self, kind: Any, outcome: Any = 0) -> None:
        self.header = FrameHeader(
            kind=kind, outcome=outcome, reason="no such aggregate" if not outcome else ""
        )

    def timing(self) -> tuple[float, float, float]:
        return 0.0, 0.0, 0.0


class SlowAggregator:
    """``deliver`` waits until ``go`` is set, then answers ``reply`` (a transfer under way)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.entered = threading.Event()
        self.go = threading.Event()

    def deliver(self, address: str, header: Any, span: Any, **kw: Any) -> Delivery:
        self.entered.set()
        assert self.go.wait(5)
        return Delivery(address, 3, cast(Any, self.reply))


class Owner:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def send(self, event: Any) -> None:
        self.events.append(event)


def sending(pool: SlowAggregator, on_stale_hold: Any) -> tuple[PushSender, PendingPush, Owner]:
    """A sender in its first session, and a push it is sending (its directive's session recorded)."""
    sender = PushSender(
        RoleContext("w"),
        cast(PeerPool, pool),
        OutgoingPushes("w"),
        lambda r: None,
        Directory(),
        on_stale_hold=on_stale_hold,
    )
    sender.new_session()
    fd = os.memfd_create("payload")
    os.write(fd, b"\0" * 8)
    owner = Owner()
    push = PendingPush("w/x/1", "j", "ps0", "w0", fd, [], 8, 1.0, 0, 0.0, 7, owner)
    sender.outgoing.add(push)
    assert sender.outgoing.start_sending(push.update_id, session=sender.session) is push
    return sender, push, owner


def held_across_a_restart(reply: Reply, registered_first: bool) -> tuple[PushSender, Owner, list[Any]]:
    """Send a push to an aggregator under session 1; the scheduler restarts while it is on its way.

    ``registered_first``: the worker's registration with session 2 (its ``unhold``) comes
    before the transfer ends (else after). Returns the sender, the pushing process and the
    ``UpdateReady`` messages announced.
    """
    pool = SlowAggregator(reply)
    announced: list[Any] = []
    registered = threading.Event()
    sender: PushSender

    def stale(push: PendingPush) -> None:  # the worker role's rule: only once registered again
        if registered.is_set():
            ready = sender.unhold_one(push.update_id)
            if ready is not None:
                announced.append(ready)

    sender, push, owner = sending(pool, stale)
    send = control_pb2.SendDirective(
        update_id=push.update_id, next_hop_host="x", next_hop_address=ADDRESS, aggregate_id="agg:ps:0"
    )
    t = threading.Thread(target=sender.transfer, args=(push, send))
    t.start()
    assert pool.entered.wait(5)
    sender.new_session()  # the scheduler restarted; the worker re-registers with the new one
    if registered_first:
        registered.set()
        announced += sender.unhold("j", "w0")  # nothing held yet: the transfer is under way
        pool.go.set()
        t.join(5)
    else:
        pool.go.set()
        t.join(5)
        assert push.state is PushState.HELD  # held until the re-registration lets it go
        registered.set()
        announced += sender.unhold("j", "w0")
    return sender, owner, announced


@pytest.mark.parametrize("registered_first", [True, False], ids=["registered-first", "held-first"])
def test_a_push_its_aggregator_summed_resolves_unknown_once(registered_first: bool) -> None:
    sender, owner, announced = held_across_a_restart(Reply(dataplane_pb2.FRAME_KIND_ACK), registered_first)
    assert announced == [] and len(sender.outgoing) == 0
    [event] = owner.events
    assert event.push_result.outcome == control_pb2.OUTCOME_UNKNOWN
    assert "summed into aggregate agg:ps:0" in event.push_result.reason


@pytest.mark.parametrize("registered_first", [True, False], ids=["registered-first", "held-first"])
def test_a_push_its_aggregator_never_summed_is_announced_again_once(registered_first: bool) -> None:
    sender, owner, announced = held_across_a_restart(Reply(dataplane_pb2.FRAME_KIND_ERROR), registered_first)
    assert [m.update_id for m in announced] == ["w/x/1"] and owner.events == []
    assert sender.outgoing.waiting("w/x/1") is not None  # ready for the new session's directive


def test_a_push_held_under_the_current_session_waits_for_it() -> None:
    calls: list[str] = []
    pool = SlowAggregator(Reply(dataplane_pb2.FRAME_KIND_ACK))
    pool.go.set()
    sender, push, _ = sending(pool, lambda p: calls.append(p.update_id))
    sender.transfer(
        push, control_pb2.SendDirective(update_id="w/x/1", next_hop_address=ADDRESS, aggregate_id="a")
    )
    assert push.state is PushState.HELD and calls == []


class Peers:
    """The aggregator at ``AGGREGATOR`` answers ``at_aggregator``; the server's daemon applies."""

    def __init__(self, at_aggregator: Reply) -> None:
        self.at_aggregator = at_aggregator
        self.sent: list[str] = []

    def deliver(self, address: str, header: Any, span: Any, **kw: Any) -> Delivery:
        self.sent.append(address)
        if address == AGGREGATOR:
            return Delivery(address, 3, cast(Any, self.at_aggregator))
        applied = Reply(dataplane_pb2.FRAME_KIND_ACK, control_pb2.OUTCOME_APPLIED)
        return Delivery(address, 3, cast(Any, applied))


AGGREGATOR = "127.0.0.1:3"


@pytest.mark.parametrize("summed", [True, False], ids=["summed", "refused"])
def test_falling_back_a_held_push_is_let_go(summed: bool) -> None:
    """The scheduler went away for good while a push waited for its aggregate's verdict: once
    the daemon falls back (``fallback_after``), no session will resolve it, so it goes as a new
    session's ``unhold`` would send it — UNKNOWN if summed, else straight to its server."""
    now = [0.0]
    ctx = RoleContext("w", "127.0.0.1:7077", clock=lambda: now[0])
    directory = Directory()
    directory.add("j", ServerLocation("ps0", "ps", ADDRESS, {}, 0))
    peers = Peers(Reply(dataplane_pb2.FRAME_KIND_ACK) if summed else Reply(dataplane_pb2.FRAME_KIND_ERROR))
    role = WorkerRole(
        ctx,
        Registrar(ctx, directory),
        directory,
        cast(PeerPool, peers),
        cast(ModelRelays, None),  # no get here
        ByteBudget(1 << 20),
        lambda r: None,
        limits=FrameLimits(),
        fallback_after=2.0,
        push_timeout=60.0,
        budget_timeout=None,
    )
    role.scheduler_connected()
    fd = os.memfd_create("payload")
    os.write(fd, b"\0" * 8)
    owner = Owner()
    role.outgoing.add(PendingPush("w/x/1", "j", "ps0", "w0", fd, [], 8, 1.0, 0, 0.0, 7, owner))
    role.on_send(
        control_pb2.SendDirective(
            update_id="w/x/1", next_hop_host="x", next_hop_address=AGGREGATOR, aggregate_id="agg:ps:0"
        )
    )
    assert role.outgoing.get("w/x/1") is not None and owner.events == []  # held for the verdict
    role.scheduler_lost("the stream ended")
    now[0] = 1.0
    role.tick()
    assert owner.events == []  # not yet falling back: the scheduler may come back
    now[0] = 2.5
    role.tick()
    [event] = owner.events
    expected = control_pb2.OUTCOME_UNKNOWN if summed else control_pb2.OUTCOME_APPLIED
    assert event.push_result.outcome == expected and len(role.outgoing) == 0
    assert peers.sent == [AGGREGATOR] if summed else peers.sent == [AGGREGATOR, ADDRESS]
