"""The push deadline resolves a push in every state that waits for the scheduler (DESIGN §12).

A push waits for a directive twice: READY, for its send directive; HELD (sent to an
aggregator), for its aggregate's verdict (a ``ResolveDirective``) or a new send directive.
Either wait is bounded by the push deadline (``push_timeout``); before, only the first was,
and a held push whose verdict was lost waited for ever (``tests/faults``: a worker daemon
killed just after an aggregator summed its member, before its report reached the scheduler,
left the scheduler's aggregate complete and never released, and three pushes of the other
workers unresolved). A HELD push resolves UNKNOWN if its aggregator summed it or may have
(the aggregate may still reach the server), DROPPED only if it certainly never reached one;
the scheduler is told, and a verdict arriving later is ignored. A SENDING push is left to its
transfer, which ends by itself.
"""

from __future__ import annotations

import os
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
from mlfabric.daemon.roles.worker.pushes import PendingPush, PushState
from mlfabric.proto.v1 import control_pb2, dataplane_pb2

SERVER, AGGREGATOR = "127.0.0.1:2", "127.0.0.1:3"
TIMEOUT = 60.0
_ACK, _ERROR = dataplane_pb2.FRAME_KIND_ACK, dataplane_pb2.FRAME_KIND_ERROR


class Reply:
    """A peer's answer: an ACK (summed, no outcome), or an ERROR."""

    def __init__(self, kind: Any) -> None:
        self.header = FrameHeader(kind=kind, reason="" if kind == _ACK else "not a member")

    def timing(self) -> tuple[float, float, float]:
        return 0.0, 0.0, 0.0


class Aggregator:
    """``deliver`` answers ``reply`` (None: none), saying whether an attempt may have arrived."""

    def __init__(self, reply: Reply | None, maybe_arrived: bool = False) -> None:
        self.reply = reply
        self.maybe_arrived = maybe_arrived
        self.sent: list[str] = []

    def deliver(self, address: str, header: Any, span: Any, **kw: Any) -> Delivery:
        self.sent.append(address)
        errors = [] if self.reply is not None else ["connect: refused"]
        return Delivery(address, 3, cast(Any, self.reply), errors, maybe_arrived=self.maybe_arrived)


class Owner:
    """The pushing process: the events its push got."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def send(self, event: Any) -> None:
        self.events.append(event)


class Env:
    """A worker role (fake clock, fake peers) whose scheduler never answers, and one push."""

    def __init__(self, peers: Aggregator) -> None:
        self.now = 0.0
        self.to_scheduler: list[Any] = []
        ctx = RoleContext("w", "127.0.0.1:7077", send=self._send, clock=lambda: self.now)
        directory = Directory()
        directory.add("j", ServerLocation("ps0", "ps", SERVER, {}, 0))
        self.peers = peers
        self.role = WorkerRole(
            ctx,
            Registrar(ctx, directory),
            directory,
            cast(PeerPool, peers),
            cast(ModelRelays, None),
            ByteBudget(1 << 20),
            lambda report: None,
            limits=FrameLimits(),
            fallback_after=None,
            push_timeout=TIMEOUT,
            budget_timeout=None,
        )
        self.role.scheduler_connected()
        fd = os.memfd_create("payload")
        os.write(fd, b"\0" * 8)
        self.owner = Owner()
        self.push = PendingPush("w/x/1", "j", "ps0", "w0", fd, [], 8, 1.0, 0, self.now, 7, self.owner)
        self.role.outgoing.add(self.push)

    def _send(self, message: Any) -> bool:
        self.to_scheduler.append(message)
        return True

    def send_to_aggregator(self) -> None:
        self.role.on_send(
            control_pb2.SendDirective(
                update_id="w/x/1", next_hop_host="x", next_hop_address=AGGREGATOR, aggregate_id="agg:ps:0"
            )
        )

    def at(self, now: float) -> int:
        """Apply the deadline at ``now``; how many pushes it resolved."""
        self.now = now
        return self.role.expire_pushes()

    def result(self) -> Any:
        [event] = self.owner.events
        return event.push_result

    def resolved(self) -> list[Any]:
        return [m.update_resolved for m in self.to_scheduler if m.WhichOneof("kind") == "update_resolved"]


@pytest.mark.parametrize(
    ("reply", "maybe_arrived", "outcome", "says"),
    [
        (Reply(_ACK), False, control_pb2.OUTCOME_UNKNOWN, "was summed into aggregate agg:ps:0 at host 'x'"),
        (Reply(_ERROR), True, control_pb2.OUTCOME_UNKNOWN, "may have been summed by an aggregator"),
        (None, True, control_pb2.OUTCOME_UNKNOWN, "may have been summed by an aggregator"),
        (Reply(_ERROR), False, control_pb2.OUTCOME_DROPPED, "never reached an aggregator"),
        (None, False, control_pb2.OUTCOME_DROPPED, "never reached an aggregator"),
    ],
    ids=["summed", "refused-after-an-unanswered-attempt", "unanswered", "refused", "unreachable"],
)
def test_a_held_push_whose_verdict_never_comes_resolves_at_the_deadline(
    reply: Reply | None, maybe_arrived: bool, outcome: Any, says: str
) -> None:
    env = Env(Aggregator(reply, maybe_arrived))
    env.at(30.0)
    env.send_to_aggregator()
    assert env.push.state is PushState.HELD and env.owner.events == []
    assert env.at(30.0 + TIMEOUT - 1) == 0  # the deadline counts from the hold, not the push
    assert env.owner.events == [] and env.role.outgoing.get("w/x/1") is not None
    assert env.at(30.0 + TIMEOUT) == 1
    result = env.result()
    assert result.outcome == outcome and says in result.reason and "push deadline" in result.reason
    [told] = env.resolved()
    assert (told.update_id, told.outcome, told.reason) == ("w/x/1", outcome, result.reason)
    assert len(env.role.outgoing) == 0 and env.peers.sent == [AGGREGATOR]  # never sent elsewhere


def test_a_verdict_after_the_deadline_is_ignored() -> None:
    env = Env(Aggregator(Reply(_ACK)))
    env.send_to_aggregator()
    env.at(TIMEOUT)
    late = control_pb2.ResolveDirective(update_id="w/x/1", outcome=control_pb2.OUTCOME_APPLIED)
    assert env.role.sender.resolve(late) is False
    assert env.result().outcome == control_pb2.OUTCOME_UNKNOWN  # one verdict, the first
    env.role.on_send(control_pb2.SendDirective(update_id="w/x/1", next_hop_address=SERVER))
    assert env.peers.sent == [AGGREGATOR]  # its payload is gone: never sent again


def test_a_ready_push_still_resolves_dropped_at_the_deadline() -> None:
    env = Env(Aggregator(Reply(_ACK)))
    assert env.at(TIMEOUT - 1) == 0 and env.at(TIMEOUT) == 1
    result = env.result()
    assert result.outcome == control_pb2.OUTCOME_DROPPED
    assert result.reason == (
        "push deadline: w/x/1 got no directive from the scheduler at 127.0.0.1:7077 within 60 s"
    )
    assert env.resolved()[0].outcome == control_pb2.OUTCOME_DROPPED


def test_a_push_being_sent_is_left_to_its_transfer() -> None:
    env = Env(Aggregator(Reply(_ACK)))
    assert env.role.outgoing.start_sending("w/x/1") is env.push
    assert env.at(10 * TIMEOUT) == 0 and env.owner.events == []


def test_a_push_sent_again_gets_a_new_deadline() -> None:
    env = Env(Aggregator(Reply(_ACK)))
    env.send_to_aggregator()  # held at 0
    env.at(50.0)
    env.send_to_aggregator()  # its aggregate failed; planned afresh into another: held at 50
    assert env.at(TIMEOUT) == 0 and env.at(50.0 + TIMEOUT) == 1
    assert env.result().outcome == control_pb2.OUTCOME_UNKNOWN
