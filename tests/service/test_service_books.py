"""The service's replica and all-reduce books are pure: their calls return effects, no core."""

from __future__ import annotations

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.fair import FairPolicy
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.service.allreduce import AllreduceBook
from mlfabric.scheduler.service.records import JobParams
from mlfabric.scheduler.service.replicas import Replication
from mlfabric.scheduler.service.state import SchedulerState


def _kinds(directives: list[tuple[str, pb.Directive]]) -> list[tuple[str, str | None]]:
    return [(h, d.WhichOneof("kind")) for h, d in directives]


def test_a_promotion_is_returned_as_directives_and_a_requeue() -> None:
    s = SchedulerState(star(["ps", "r", "w"], 8e9))
    for i, h in enumerate(("ps", "r", "w")):
        s.connect(h, f"127.0.0.1:{9000 + i}")
    s.register_server("ps", "j", "ps", (), JobParams(div_max=2.0), version=0)
    s.register_worker("w", "j", "w0")
    s.add_update("w", "w/1", "j", "ps", "w0", 8, 1.0, 0, now=0.0)
    rep = Replication(s, DecisionRunner(FairPolicy()))
    rep.register("r", pb.RegisterRole(job="j", role=pb.ROLE_REPLICA, name="r", replica_of="ps"))
    assert rep.server_lost("j", "ps", "gone") is None  # not confirmed yet: no log at its server
    rep.on_message("replica_status", pb.ReplicaStatus(job="j", server="ps", replica_version=0))
    assert rep.host_lost("w", now=1.0).directives == []  # no server there
    out = rep.host_lost("ps", now=1.0)
    assert _kinds(out.directives) == [("r", "promote"), ("w", "job_update")]
    assert out.directives[1][1].job_update.servers[0].failed_over_from == "ps"
    assert out.requeued == 1 and s.pending["w/1"].dst_host == "r"
    assert s.recorder.replica_promotions == 1 and rep.promotions == 1


def test_an_allreduce_peer_lost_aborts_the_others_through_effects() -> None:
    g = star(["a", "b", "c"], 8e9)
    book = AllreduceBook(lambda: g, lambda h: f"127.0.0.1:{ord(h)}")

    def ready(p: str) -> pb.AllreduceReady:
        t = pb.TensorSpec(name="w", dtype="float32", shape=[4])
        return pb.AllreduceReady(job="j", name="g", seq=1, participant=p, world_size=3, tensors=[t], bytes=16)

    assert book.ready("a", ready("pa"), 0.0).directives == []
    assert book.ready("b", ready("pb"), 0.0).directives == []
    out = book.host_lost("b")
    assert _kinds(out.directives) == [("a", "allreduce_abort")]
    assert out.directives[0][1].allreduce_abort.code == "allreduce_peer_lost"
    assert _kinds(book.ready("c", ready("pc"), 0.1).directives) == [("c", "allreduce_abort")]
