"""The scheduler's all-reduce book for process groups (plan_only): agreement, a plan for the group
(native collective or tree, in process-rank order), kept per operation with an epoch, and pushed
again only when the bandwidth estimates change it."""

from __future__ import annotations

from typing import Any

import networkx as nx

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.service.allreduce import REPLAN_INTERVAL, AllreduceBook

HOSTS = [f"h{i}" for i in range(4)]
UNIFORM = star(HOSTS, 1e9)
HETERO = star(HOSTS, {h: 1e9 if i % 2 == 0 else 0.25e9 for i, h in enumerate(HOSTS)})
MB = 1 << 20


class Graph:
    """The estimates the book plans on; tests swap them."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self.graph = graph

    def __call__(self) -> nx.DiGraph:
        return self.graph


def _ready(rank: int, seq: int = 1, *, nbytes: int = 16 * MB, plan_only: bool = True, **kw: Any) -> Any:
    spec = pb.TensorSpec(name="w", dtype="float32", shape=[nbytes // 4])
    fields: dict[str, Any] = dict(
        job="j", name="g", seq=seq, participant=f"rank{rank}", world_size=4, tensors=[spec], bytes=nbytes
    )
    fields.update(plan_only=plan_only, process_rank=rank, signature=77)
    fields.update(kw)
    return pb.AllreduceReady(**fields)


def _all_ready(book: AllreduceBook, seq: int = 1, now: float = 0.0) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for r in range(4):
        out += book.ready(HOSTS[r], _ready(r, seq), now).directives
    return out


def _book(graph: nx.DiGraph) -> tuple[AllreduceBook, Graph]:
    g = Graph(graph)
    return AllreduceBook(g, lambda h: f"127.0.0.1:{1000 + int(h[1:])}"), g


def test_a_uniform_group_gets_the_native_collective_and_the_operation_is_finished() -> None:
    book, _ = _book(UNIFORM)
    out = _all_ready(book)
    assert sorted(h for h, _ in out) == HOSTS
    for _, d in out:
        a = d.allreduce
        assert (a.executor_kind, a.epoch, a.signature, list(a.parent_ranks)) == ("native", 0, 77, [])
        assert "native collective of 4" in a.plan and a.model_seconds > 0
    assert book.ops == {}  # nothing more to hear about: the processes run it
    assert list(book.kept) == [("j", "g", 77)]
    assert book.plans == {("process_group", "native"): 1}  # the metric mlfabric_allreduce_plans_total


def test_a_heterogeneous_group_gets_a_tree_over_process_ranks() -> None:
    book, _ = _book(HETERO)
    out = _all_ready(book)
    parents = {tuple(d.allreduce.parent_ranks) for _, d in out}
    assert len(parents) == 1 and {d.allreduce.executor_kind for _, d in out} == {"tree"}
    (tree,) = parents
    assert tree.count(-1) == 1  # one root
    assert all(tree[r] in (-1, 0, 2) for r in range(4))  # the slow ranks 1 and 3 have no children
    assert 1 not in tree and 3 not in tree


def test_a_later_call_with_the_same_plan_keeps_its_epoch() -> None:
    book, _ = _book(HETERO)
    _all_ready(book, seq=1)
    again = _all_ready(book, seq=2)
    assert {d.allreduce.epoch for _, d in again} == {0}


def test_disagreements_abort_naming_them() -> None:
    book, _ = _book(UNIFORM)
    book.ready("h0", _ready(0), 0.0)
    mixed = book.ready("h1", _ready(1, plan_only=False), 0.0).directives
    assert {d.allreduce_abort.code for _, d in mixed} == {"allreduce_mismatch"}
    assert "through the daemons" in mixed[0][1].allreduce_abort.reason
    book.ready("h0", _ready(0, seq=2), 0.0)
    twice = book.ready("h1", _ready(0, seq=2, participant="rank1"), 0.0).directives
    assert {d.allreduce_abort.code for _, d in twice} == {"allreduce_mismatch"}
    assert "process rank 0" in twice[0][1].allreduce_abort.reason


def test_replanning_pushes_a_new_epoch_only_when_the_plan_changes() -> None:
    book, graph = _book(HETERO)
    _all_ready(book)
    assert book.replan(10.0).directives == []  # unchanged estimates: nothing to push
    graph.graph = UNIFORM
    assert book.replan(10.0 + REPLAN_INTERVAL / 2).directives == []  # too soon
    pushed = book.replan(10.0 + 2 * REPLAN_INTERVAL).directives
    assert sorted(h for h, _ in pushed) == HOSTS
    for _, d in pushed:
        a = d.allreduce
        assert (a.seq, a.epoch, a.executor_kind, a.signature) == (0, 1, "native", 77)
    assert book.replan(10.0 + 4 * REPLAN_INTERVAL).directives == []
    # a reload replans at once
    graph.graph = HETERO
    assert {d.allreduce.epoch for _, d in book.replan(10.0 + 4 * REPLAN_INTERVAL, force=True).directives} == {
        2
    }


def test_a_lost_host_forgets_the_kept_plans() -> None:
    book, _ = _book(UNIFORM)
    _all_ready(book)
    book.host_lost("h2")
    assert book.kept == {}
