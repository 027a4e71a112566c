"""A member joins an aggregate being gathered (re-issued directive with more members).

The aggregator's daemon re-opens an aggregate that was complete but not yet forwarded when
the scheduler re-issues its directive with an extra member; a joining member's frame that
arrives before that directive waits for it. The sum forwarded holds every member exactly
once (integer-valued float64 updates, so the model's arithmetic is exact).
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
    _aggregate,
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


@pytest.fixture
def scheduler() -> Iterator[AggScheduler]:
    yield from held_scheduler()


@pytest.fixture
def cluster(make_daemon: Any) -> Iterator[dict[str, Any]]:
    c = _cluster(make_daemon, mlfabric.Params(tau_max=4))
    yield c
    _close(c)


def _ready_count(sched: AggScheduler, agg_id: str) -> int:
    with sched.lock:
        return sum(r.update_id == agg_id for r in sched.ready)


def test_member_joins_a_complete_aggregate_before_it_is_forwarded(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = cluster
    (_h0, r0), (_h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    agg_id = "agg:job:10"
    _aggregate(scheduler, agg_id, [r0, r1])
    for r in (r0, r1):
        _send(scheduler, r.update_id, "agg", agg_id)
    first = wait_until(lambda: scheduler.ready_for(agg_id))
    assert first.norm == 3.0
    # a third update joins: the directive is re-issued with it, the aggregate opens again
    _h2, r2 = _push(c, scheduler, "w2", 4.0)
    _aggregate(scheduler, agg_id, [r0, r1, r2])
    _send(scheduler, r2.update_id, "agg", agg_id)
    wait_until(lambda: _ready_count(scheduler, agg_id) == 2)
    with scheduler.lock:
        again = [r for r in scheduler.ready if r.update_id == agg_id][-1]
    assert again.norm == 7.0
    _send(scheduler, agg_id, "ps")
    report = wait_until(lambda: scheduler.report_for(agg_id))[0]
    assert report.ok and report.outcome == APPLIED
    assert sorted(v.update_id for v in report.member_verdicts) == sorted(r.update_id for r in (r0, r1, r2))
    meta = c["metas"][-1]
    assert meta.num_updates == 3
    model = _model(c)
    for k in MODEL:
        expected = MODEL[k] - _update(1.0)[k] - _update(2.0)[k] - _update(4.0)[k]
        np.testing.assert_array_equal(model[k], expected)


def test_joining_frame_before_its_directive_waits_for_it(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = cluster
    (_h0, r0), (_h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    agg_id = "agg:job:11"
    _aggregate(scheduler, agg_id, [r0])
    _send(scheduler, r0.update_id, "agg", agg_id)
    wait_until(lambda: scheduler.ready_for(agg_id))
    _send(scheduler, r1.update_id, "agg", agg_id)  # the member's send overtakes the directive
    _aggregate(scheduler, agg_id, [r0, r1])
    rep = wait_until(lambda: scheduler.report_for(r1.update_id))[0]
    assert rep.ok and rep.outcome == control_pb2.OUTCOME_UNSPECIFIED
    wait_until(lambda: _ready_count(scheduler, agg_id) == 2)
    _send(scheduler, agg_id, "ps")
    report = wait_until(lambda: scheduler.report_for(agg_id))[0]
    assert report.ok and report.outcome == APPLIED and len(report.member_verdicts) == 2
    model = _model(c)
    for k in MODEL:
        np.testing.assert_array_equal(model[k], MODEL[k] - _update(1.0)[k] - _update(2.0)[k])


def test_member_not_listed_by_any_directive_is_refused_after_the_wait(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = cluster
    (_h0, r0), (_h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    agg_id = "agg:job:12"
    _aggregate(scheduler, agg_id, [r0])
    _send(scheduler, r1.update_id, "agg", agg_id)
    rep = wait_until(lambda: scheduler.report_for(r1.update_id), timeout=20)[0]
    assert not rep.ok and "not a member" in rep.error


def test_a_send_for_an_aggregate_the_daemon_cannot_forward_is_reported_failed(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    """A send directive the aggregator cannot carry out gets a failed report, not silence.

    Silence left the members unresolved until the scheduler's forward timeout; a failed report
    with no outcome (the frame never left) makes the scheduler plan them afresh.
    """
    c = cluster
    (h0, r0), (h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    _send(scheduler, "agg:job:20", "ps")  # never directed to this daemon
    unknown = wait_until(lambda: scheduler.report_for("agg:job:20"))[0]
    assert not unknown.ok and "does not hold it" in unknown.error
    assert unknown.outcome == control_pb2.OUTCOME_UNSPECIFIED
    agg_id = "agg:job:21"
    _aggregate(scheduler, agg_id, [r0, r1])
    _send(scheduler, r0.update_id, "agg", agg_id)
    wait_until(lambda: scheduler.report_for(r0.update_id))
    _send(scheduler, agg_id, "ps")  # r1 has not arrived: the aggregate is still collecting
    early = wait_until(lambda: scheduler.report_for(agg_id))[0]
    assert not early.ok and "collecting" in early.error
    # both members re-planned straight to the server from the payloads their sources kept
    _send(scheduler, r0.update_id, "ps")
    _send(scheduler, r1.update_id, "ps")
    assert [h.wait(10).status for h in (h0, h1)] == [mlfabric.APPLIED] * 2
    np.testing.assert_array_equal(_model(c)["w"], MODEL["w"] - 3.0)
