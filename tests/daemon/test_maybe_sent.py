"""A frame that may have reached the server's daemon is never resent: the push resolves UNKNOWN.

``PeerUnavailable(sent=True)`` means the peer may have the whole frame (and may have applied
it) before it went away; a retry would reach a restarted daemon that cannot know, so a worker's
direct push (:class:`~mlfabric.daemon.roles.worker.sender.PushSender`) and an aggregator's forward
(:class:`~mlfabric.daemon.roles.aggregator.role.AggregatorRole`) both deliver through
:meth:`~mlfabric.daemon.channels.peers.PeerPool.deliver`, which stops there; they say UNKNOWN,
naming why. A peer that certainly got nothing (connection refused) is retried as before.
"""

from __future__ import annotations

import os
from typing import Any

from mlfabric.daemon.channels.frames import FrameLimits
from mlfabric.daemon.channels.peers import PeerPool, PeerUnavailable
from mlfabric.daemon.roles.aggregator.role import AggregatorRole
from mlfabric.daemon.roles.aggregator.state import Aggregate
from mlfabric.daemon.roles.base import RoleContext
from mlfabric.daemon.roles.directory import Directory
from mlfabric.daemon.roles.worker.pushes import OutgoingPushes, PendingPush
from mlfabric.daemon.roles.worker.sender import PushSender
from mlfabric.proto.v1 import control_pb2

ADDRESS = "127.0.0.1:1"


class Peer:
    """``request``: the first call fails as ``first``, later ones are refused (a dead daemon)."""

    def __init__(self, first: PeerUnavailable) -> None:
        self.first = first
        self.calls = 0

    def __call__(self, address: str, header: Any, payload: Any = None, **kw: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise self.first
        raise PeerUnavailable(address, "connect: [Errno 111] Connection refused")


class _PoolTo(PeerPool):
    """A pool whose every attempt goes to ``peer`` (3 attempts, no backoff)."""

    def __init__(self, peer: Peer) -> None:
        super().__init__(FrameLimits(), send_attempts=3, retry_backoff=0.0)
        self._peer = peer

    def request(self, address: str, header: Any, payload: Any = None, **kw: Any) -> Any:
        return self._peer(address, header, payload, **kw)


def _pool(peer: Peer) -> PeerPool:
    """A pool whose every attempt goes to ``peer`` (3 attempts, no backoff)."""
    return _PoolTo(peer)


class Owner:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def send(self, event: Any) -> None:
        self.events.append(event)


def _push(sender: PushSender) -> Owner:
    fd = os.memfd_create("payload")
    os.write(fd, b"\0" * 8)
    owner = Owner()
    push = PendingPush("w/x/1", "j", "ps0", "w0", fd, [], 8, 1.0, 0, 0.0, 7, owner)
    sender.outgoing.add(push)
    sender.outgoing.start_sending(push.update_id)
    send = control_pb2.SendDirective(
        update_id=push.update_id, next_hop_host="ps", next_hop_address=ADDRESS, dst_host="ps"
    )
    sender.transfer(push, send)
    return owner


def test_a_push_that_may_have_reached_the_server_is_not_resent_and_resolves_unknown() -> None:
    reports: list[Any] = []
    peer = Peer(PeerUnavailable(ADDRESS, "peer closed the connection before replying", sent=True))
    sender = PushSender(RoleContext("w"), _pool(peer), OutgoingPushes("w"), reports.append, Directory())
    owner = _push(sender)
    assert peer.calls == 1
    [report] = reports
    assert (report.ok, report.outcome) == (False, control_pb2.OUTCOME_UNKNOWN)
    assert "may have reached host 'ps'" in report.reason and "before replying" in report.reason
    [event] = owner.events
    assert event.push_result.outcome == control_pb2.OUTCOME_UNKNOWN
    assert event.push_result.reason == report.reason


def test_a_push_the_server_never_got_is_retried_and_then_dropped() -> None:
    reports: list[Any] = []
    peer = Peer(PeerUnavailable(ADDRESS, "connect: [Errno 111] Connection refused"))
    sender = PushSender(RoleContext("w"), _pool(peer), OutgoingPushes("w"), reports.append, Directory())
    owner = _push(sender)
    assert peer.calls == 3
    [report] = reports
    assert report.outcome == control_pb2.OUTCOME_DROPPED and "after 3 attempts" in report.reason
    assert owner.events[0].push_result.outcome == control_pb2.OUTCOME_DROPPED


def _forward(peer: Peer) -> tuple[list[Any], list[Any]]:
    reports: list[Any] = []
    failed: list[Any] = []
    role = AggregatorRole(
        RoleContext("x"),
        bytearray,
        lambda m: True,
        failed.append,
        reports.append,
        _pool(peer).deliver,
    )
    members = {
        u: control_pb2.AggregateMember(update_id=u, worker=f"w{i}", base_version=1, norm=1.0, bytes=8)
        for i, u in enumerate(("u1", "u2"))
    }
    agg = Aggregate("agg:ps:0", "j", "ps0", "ps", ADDRESS, members, 1e9, arrived=list(members))
    agg.payload_bytes, agg.buffer, agg.state = 8, bytearray(8), "ready"
    role._aggregates[agg.aggregate_id] = agg
    role.forward(
        control_pb2.SendDirective(update_id="agg:ps:0", next_hop_host="ps", next_hop_address=ADDRESS)
    )
    return reports, failed


def test_an_aggregate_that_may_have_reached_the_server_is_not_resent_and_resolves_unknown() -> None:
    peer = Peer(PeerUnavailable(ADDRESS, "receive failed: reset", sent=True))
    reports, failed = _forward(peer)
    assert peer.calls == 1
    [report] = reports
    assert (report.ok, report.outcome) == (False, control_pb2.OUTCOME_UNKNOWN)
    assert [(v.update_id, v.outcome) for v in report.member_verdicts] == [
        ("u1", control_pb2.OUTCOME_UNKNOWN),
        ("u2", control_pb2.OUTCOME_UNKNOWN),
    ]
    assert all("may have reached host 'ps'" in v.reason for v in report.member_verdicts)
    assert not failed  # AggregateFailed would have the members re-planned


def test_an_aggregate_the_server_never_got_is_retried_and_then_fails() -> None:
    peer = Peer(PeerUnavailable(ADDRESS, "connect: [Errno 111] Connection refused"))
    reports, failed = _forward(peer)
    assert peer.calls == 3
    [report] = reports
    assert not report.ok and report.outcome == control_pb2.OUTCOME_UNSPECIFIED and not report.member_verdicts
    [f] = failed
    assert f.aggregate_id == "agg:ps:0"


def test_a_push_whose_daemon_stops_between_attempts_resolves_dropped_naming_it() -> None:
    """Shutting down during the retry back-off ended the attempts with no verdict (UnboundLocalError)."""
    reports: list[Any] = []
    peer = Peer(PeerUnavailable(ADDRESS, "connect: [Errno 111] Connection refused"))
    pool = _pool(peer)
    pool.stop("daemon of host 'w' is stopping")
    sender = PushSender(RoleContext("w"), pool, OutgoingPushes("w"), reports.append, Directory())
    owner = _push(sender)
    assert peer.calls == 1
    [report] = reports
    assert not report.ok and "daemon shutting down" in report.error
    [event] = owner.events
    assert event.push_result.outcome == control_pb2.OUTCOME_DROPPED
    assert "daemon shutting down" in event.push_result.reason
