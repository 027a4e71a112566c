"""The replication policy and the scheduler's replica books (pure; docs/replication.md)."""

from __future__ import annotations

import pytest

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, ReplicaView, Snapshot
from mlfabric.scheduler.policies.replication import ReplicationPolicy
from mlfabric.scheduler.service.records import (
    DuplicateReplica,
    JobParams,
    ModelMismatch,
    SchedulerError,
    TensorSpec,
    UnknownJob,
)
from mlfabric.scheduler.service.replicas import REREGISTER_GRACE, ReplicaBook
from mlfabric.scheduler.service.state import SchedulerState

G = star(["h0", "h1", "h2"], 1e9)
LOG = (("u1", 1, 1.0), ("u2", 2, 1.0))


def _decide(view: ReplicaView, pending=(), in_flight=()) -> list[str]:
    snap = Snapshot(0.0, G, in_flight=tuple(in_flight), replicas={("j", "ps"): view})
    return [r.update_id for r in ReplicationPolicy().decide(snap, list(pending)).replicas]


def _pending(norm: float) -> PendingUpdate:
    return PendingUpdate("h2/1", "j", "ps", "w", "h2", "h0", 8, norm, 0, 0.0)


INTO_REPLICA_HOST = PendingUpdate("h2/2", "j2", "ps2", "w", "h2", "h1", 8, 0.1, 0, 0.0)


def test_chain_replication_sends_at_once_even_on_busy_links() -> None:
    view = ReplicaView("j", "ps", "h0", "h1", 0.0, 0, 0, LOG)
    assert _decide(view, [_pending(0.1)]) == ["u1", "u2"]


def test_bounded_replication_waits_while_within_div_max_and_links_are_busy() -> None:
    view = ReplicaView("j", "ps", "h0", "h1", 10.0, 0, 0, LOG)
    assert _decide(view, [_pending(0.1), INTO_REPLICA_HOST]) == []
    # pushes into the server's host do not compete with copies out of it: spare
    assert _decide(view, [_pending(0.1)]) == ["u1", "u2"]
    # the next pending update would break the bound: urgent
    assert _decide(view, [_pending(8.5), INTO_REPLICA_HOST]) == ["u1", "u2"]
    # the server waits for its replica: urgent
    blocked = ReplicaView("j", "ps", "h0", "h1", 10.0, 0, 0, LOG, blocked=True)
    assert _decide(blocked, [INTO_REPLICA_HOST]) == ["u1", "u2"]


def test_spare_bandwidth_moves_the_log_unless_a_transfer_shares_the_path() -> None:
    view = ReplicaView("j", "ps", "h0", "h1", 10.0, 0, 0, LOG)
    assert _decide(view) == ["u1", "u2"]
    busy = InFlight("x", "j", "ps", ("h2", "sw", "h1"), 10, 0.0, 1.0)  # into the replica's host
    assert _decide(view, in_flight=[busy]) == []


def test_entries_already_directed_or_at_the_replica_are_not_sent_again() -> None:
    assert _decide(ReplicaView("j", "ps", "h0", "h1", 0.0, 1, 1, LOG)) == ["u2"]
    assert _decide(ReplicaView("j", "ps", "h0", "h1", 0.0, 0, 2, LOG)) == []


def _book() -> tuple[SchedulerState, ReplicaBook]:
    s = SchedulerState(star(["h0", "h1", "h2"], 8e9))
    for i, h in enumerate(("h0", "h1", "h2")):
        s.connect(h, f"127.0.0.1:{9000 + i}")
    s.register_server("h0", "j", "ps", (TensorSpec("w", "float32", (2,)),), JobParams(div_max=2.0), version=3)
    return s, ReplicaBook(s)


def test_book_tracks_the_log_and_coalesces_sends_into_one_directive_per_server() -> None:
    s, book = _book()
    ((host, attach),) = book.register(
        "h1", "j", "ps", "r", [pb.TensorSpec(name="w", dtype="float32", shape=[2])]
    )
    assert host == "h0" and attach.replicate.div_max == 2.0 and attach.replicate.replica_host == "h1"
    for v, uid in ((4, "a"), (5, "b"), (6, "c")):
        book.applied(pb.ServerApplied(job="j", server="ps", update_id=uid, version=v, norm=0.5))
    assert book.records[("j", "ps")].divergence() == 1.5
    view = book.views()[("j", "ps")]
    assert [e[0] for e in view.log] == ["a", "b", "c"] and view.replica_version == 3
    snap = Snapshot(0.0, s.graph, replicas=book.views())
    ((host, d),) = book.execute(ReplicationPolicy().decide(snap, []).replicas)
    assert host == "h0" and d.replicate.up_to_version == 6
    assert book.execute(ReplicationPolicy().decide(snap, []).replicas) == []  # directed already
    assert not book.records[("j", "ps")].confirmed  # no log at the server yet
    book.status(pb.ReplicaStatus(job="j", server="ps", replica_version=5))
    assert book.records[("j", "ps")].confirmed
    assert book.records[("j", "ps")].divergence() == 0.5
    ((host, detach),) = book.remove("j", "ps")
    assert host == "h0" and detach.replicate.detach


def test_book_refuses_bad_replicas_naming_them() -> None:
    _, book = _book()
    with pytest.raises(UnknownJob, match="nojob"):
        book.register("h1", "nojob", "ps", "r", [])
    with pytest.raises(SchedulerError, match="own host"):
        book.register("h0", "j", "ps", "r", [])
    with pytest.raises(ModelMismatch, match="tensor 'w'"):
        book.register("h1", "j", "ps", "r", [pb.TensorSpec(name="w", dtype="float64", shape=[2])])


def test_promotion_moves_the_server_and_reroutes_its_pending_updates() -> None:
    s, _ = _book()
    s.register_worker("h2", "j", "w")
    s.add_update("h2", "h2/1", "j", "ps", "w", 8, 1.0, 3, now=0.0)
    assert s.promote("j", "ps", "h1", 7) == ["h2/1"]
    assert s.pending["h2/1"].dst_host == "h1"
    assert s.server_role("j", "ps").host == "h1" and s.server_role("j", "ps").version == 7
    s.disconnect("h0")  # the old server's host going away no longer drops them
    assert "h2/1" in s.pending


def test_a_replica_whose_daemon_lost_its_session_is_kept_for_the_grace_then_detached() -> None:
    """Re-registered within REREGISTER_GRACE from the same host: attached as it was (the server's
    daemon kept its log); not: detached; another replica may replace one whose daemon is away."""
    _, book = _book()
    book.register("h1", "j", "ps", "r", [])
    book.applied(pb.ServerApplied(job="j", server="ps", update_id="a", version=4, norm=0.5))
    book.status(pb.ReplicaStatus(job="j", server="ps", replica_version=3))
    book.lost("h1", now=100.0)
    assert book.next_deadline() == 100.0 + REREGISTER_GRACE
    assert book.expire(100.0 + REREGISTER_GRACE / 2) == []
    ((host, again),) = book.register("h1", "j", "ps", "r", [])
    assert host == "h0" and again.replicate.replica_address == "127.0.0.1:9001"
    with pytest.raises(DuplicateReplica):  # its daemon is back: the replica is taken again
        book.register("h1", "j", "ps", "r", [])
    rec = book.records[("j", "ps")]
    assert rec.lost_at is None and rec.confirmed and rec.divergence() == 0.5  # kept as it was
    book.lost("h1", now=200.0)
    ((host, detach),) = book.expire(200.0 + REREGISTER_GRACE)
    assert host == "h0" and detach.replicate.detach and ("j", "ps") not in book.records
    book.register("h1", "j", "ps", "r", [])
    book.lost("h1", now=300.0)
    (d1, d2) = book.register("h2", "j", "ps", "r2", [])  # replaces the one whose daemon is away
    assert d1[1].replicate.detach and d2[1].replicate.replica_host == "h2"
    assert book.records[("j", "ps")].host == "h2" and book.next_deadline() is None


def test_a_replica_registered_again_after_the_grace_is_resynced_not_confirmed_until_its_log_reports() -> None:
    """The grace is the book's (configurable); a replica its daemon registers again (``rejoin``)
    after it was detached gets a new record marked re-syncing and a ``resync`` attach directive;
    it is confirmed (promotable) only once the new log reports."""
    s, _ = _book()
    book = ReplicaBook(s, grace=1.5)
    book.register("h1", "j", "ps", "r", [])
    book.status(pb.ReplicaStatus(job="j", server="ps", replica_version=3))
    book.lost("h1", now=100.0)
    assert book.next_deadline() == 101.5
    ((_, detach),) = book.expire(101.5)
    assert detach.replicate.detach and ("j", "ps") not in book.records
    ((host, d),) = book.register("h1", "j", "ps", "r", [], rejoin=True)
    rec = book.records[("j", "ps")]
    assert host == "h0" and d.replicate.resync and d.replicate.replica_address == "127.0.0.1:9001"
    assert rec.resyncing and not rec.confirmed
    book.status(pb.ReplicaStatus(job="j", server="ps", replica_version=9))
    assert not rec.resyncing and rec.confirmed and rec.version == 9
    book.lost("h1", now=200.0)  # back within the grace: taken back as it was, no re-sync
    ((_, again),) = book.register("h1", "j", "ps", "r", [], rejoin=True)
    assert not again.replicate.resync and book.records[("j", "ps")].confirmed


def test_the_service_takes_the_grace_from_its_config_and_shows_a_resync_in_its_metrics() -> None:
    from mlfabric.scheduler.policies.dispatch import Dispatcher
    from mlfabric.scheduler.policies.fair import FairPolicy
    from mlfabric.scheduler.service.batching import AdaptiveBatcher
    from mlfabric.scheduler.service.core import SchedulerCore, StaticEstimator

    g = star(["h0", "h1"], 8e9)
    core = SchedulerCore(
        SchedulerState(g), FairPolicy(), dispatcher=Dispatcher(), batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(g), replica_grace=0.25,
    )  # fmt: skip
    assert core.replication.book.grace == 0.25
    ps = core.hello(pb.Hello(host="h0", data_address="127.0.0.1:9000"))
    rep = core.hello(pb.Hello(host="h1", data_address="127.0.0.1:9001"))
    msg = pb.DaemonMessage
    core.on_message(ps, msg(register_role=pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name="ps")))
    again = pb.RegisterRole(job="j", role=pb.ROLE_REPLICA, name="r", replica_of="ps", rejoin=True)
    core.on_message(rep, msg(register_role=again))
    assert core.stats().replica_resyncing[("j", "ps")] == 1
    directives = [ps.queue.get_nowait() for _ in range(ps.queue.qsize())]
    replicates = [d.replicate for d in directives if d is not None and d.WhichOneof("kind") == "replicate"]
    assert any(r.resync for r in replicates)
    core.on_message(ps, msg(replica_status=pb.ReplicaStatus(job="j", server="ps", replica_version=0)))
    assert core.stats().replica_resyncing[("j", "ps")] == 0
    assert core.replication.book.records[("j", "ps")].confirmed
