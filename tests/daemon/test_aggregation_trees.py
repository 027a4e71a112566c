"""Multi-level aggregation executed by daemons: an aggregate summed into another aggregate.

In-process daemons ``ps`` (server ps0), ``w0``/``w1``/``w2`` (one worker each), ``agg`` (the
inner aggregator) and ``top`` (the outer one); the in-test scheduler sends the directives the
real one would for ``stf+tree``: the inner aggregate (w0, w1) at ``agg`` goes into the outer
aggregate (w2 and the inner one) at ``top`` (``AggregateDirective.dst_aggregate_id``), which goes
to the server. Updates are integer-valued float64: the model moves by exactly the applied ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.proto.v1 import control_pb2
from tests.daemon.test_aggregation import (
    MODEL,
    AggScheduler,
    _close,
    _cluster,
    _model,
    _push,
    _send,
    _update,
    held_scheduler,
    wait_until,
)

APPLIED = control_pb2.OUTCOME_APPLIED
INNER, OUTER = "agg:job:in", "agg:job:top"


@pytest.fixture
def scheduler() -> Iterator[AggScheduler]:
    yield from held_scheduler()


@pytest.fixture
def tree(make_daemon: Any) -> Iterator[dict[str, Any]]:
    c = _cluster(make_daemon, mlfabric.Params(tau_max=4), hosts=("ps", "w0", "w1", "w2", "agg", "top"))
    yield c
    _close(c)


def _member(r: Any) -> Any:
    return control_pb2.AggregateMember(
        update_id=r.update_id,
        worker=r.worker,
        base_version=r.base_version,
        norm=r.norm,
        src_host=r.update_id.split("/")[0],
        bytes=r.bytes,
    )


def _direct(
    sched: AggScheduler, host: str, agg_id: str, members: list[Any], dst: str, into: str = ""
) -> None:
    directive = control_pb2.AggregateDirective(
        aggregate_id=agg_id,
        job="job",
        server="ps0",
        members=members,
        dst_host=dst,
        dst_address=sched.address_of(dst),
        timeout_seconds=30,
        dst_aggregate_id=into,
    )
    sched.send(host, control_pb2.Directive(aggregate=directive))


def _forward(sched: AggScheduler, agg_id: str, src: str, to: str, into: str = "") -> None:
    send = control_pb2.SendDirective(
        update_id=agg_id,
        next_hop_host=to,
        next_hop_address=sched.address_of(to),
        dst_host="ps",
        aggregate_id=into,
    )
    sched.send(src, control_pb2.Directive(send=send))


def test_an_aggregate_summed_into_another_is_applied_once_with_every_member(
    tree: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = tree
    (h0, r0), (h1, r1), (h2, r2) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(3))
    _direct(scheduler, "agg", INNER, [_member(r0), _member(r1)], "top", into=OUTER)
    nested = control_pb2.AggregateMember(update_id=INNER, src_host="agg", bytes=r0.bytes)
    _direct(scheduler, "top", OUTER, [_member(r2), nested], "ps")
    _send(scheduler, r0.update_id, "agg", INNER)
    _send(scheduler, r1.update_id, "agg", INNER)
    _send(scheduler, r2.update_id, "top", OUTER)
    ready = wait_until(lambda: scheduler.ready_for(INNER))
    assert ready.norm == 3.0 and not scheduler.ready_for(OUTER)

    _forward(scheduler, INNER, "agg", "top", into=OUTER)
    inner = wait_until(lambda: scheduler.report_for(INNER))[0]
    # summed into the parent: no outcome, no member verdicts (the root's report resolves them)
    assert inner.ok and inner.outcome == control_pb2.OUTCOME_UNSPECIFIED and not inner.member_verdicts
    assert (inner.src_host, inner.dst_host) == ("agg", "top")
    ready = wait_until(lambda: scheduler.ready_for(OUTER))
    assert ready.norm == 6.0 and ready.base_version == 0
    assert not any(h.done() for h in (h0, h1, h2))

    _forward(scheduler, OUTER, "top", "ps")
    report = wait_until(lambda: scheduler.report_for(OUTER))[0]
    assert report.ok and report.outcome == APPLIED and report.server_version == 1
    assert [(v.update_id, v.outcome) for v in report.member_verdicts] == [
        (r.update_id, APPLIED) for r in (r2, r0, r1)
    ]
    meta = c["metas"][-1]  # one step at the server, every worker update named once
    assert meta.num_updates == 3 and sorted(meta.member_ids) == sorted(r.update_id for r in (r0, r1, r2))
    assert len(c["metas"]) == 1
    model = _model(c)
    for k in MODEL:
        np.testing.assert_array_equal(
            model[k], MODEL[k] - _update(1.0)[k] - _update(2.0)[k] - _update(3.0)[k]
        )


def test_an_aggregate_carrying_a_member_its_parent_already_expects_is_not_summed(
    tree: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = tree
    (_, r0), (_, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    _direct(scheduler, "agg", INNER, [_member(r0), _member(r1)], "top", into=OUTER)
    nested = control_pb2.AggregateMember(update_id=INNER, src_host="agg", bytes=r0.bytes)
    _direct(scheduler, "top", OUTER, [_member(r0), nested], "ps")  # r0 listed twice in the tree
    _send(scheduler, r0.update_id, "agg", INNER)
    _send(scheduler, r1.update_id, "agg", INNER)
    wait_until(lambda: scheduler.ready_for(INNER))
    _forward(scheduler, INNER, "agg", "top", into=OUTER)
    report = wait_until(lambda: scheduler.report_for(INNER))[0]
    assert not report.ok and not report.outcome and r0.update_id in report.error
    assert "already carries or expects" in report.error
    failed = wait_until(lambda: [f for f in scheduler.failed if f.aggregate_id == INNER])
    assert "already carries or expects" in failed[0].reason
    assert not c["metas"]  # nothing reached the server
