"""A non-finite member is refused by the aggregator's daemon before it is summed (issue #16, 8).

In-process daemons as in ``test_aggregation.py`` (server ``ps``, workers ``w0..w2``, aggregator
``agg``; the test plays the scheduler). The aggregator tests each member for NaN and infinity in
its CRC pass: a bad member is ACKed DROPPED naming the tensor, the update and the job option,
never summed, and its push resolves DROPPED at its source; the aggregate re-issued without it
(the scheduler's member-drop path, checked on the service core below) is applied with the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
import mlfabric.tensors
from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.service.records import OutcomeKind
from tests.daemon.test_aggregation import (
    MODEL,
    AggScheduler,
    _aggregate,
    _close,
    _cluster,
    _model,
    _send,
    _update,
    held_scheduler,
    wait_until,
)
from tests.service.test_service_aggregates import drain, members_in, report
from tests.service.test_service_aggregates import env as env


@pytest.fixture
def scheduler() -> Iterator[AggScheduler]:
    yield from held_scheduler()


def _push(c: dict[str, Any], sched: AggScheduler, worker: str, update: dict[str, Any]) -> tuple[Any, Any]:
    def mine() -> list[Any]:
        with sched.lock:
            return [r for r in sched.ready if r.worker == worker]

    n = len(mine())
    handle = c["workers"][worker].push("ps0", update, norm=1.0)
    wait_until(lambda: len(mine()) > n)
    return handle, mine()[-1]


def test_non_finite_member_refused_before_it_is_summed(
    make_daemon: Any, scheduler: AggScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    fallback: list[int] = []
    real = mlfabric.tensors.first_non_finite

    def spy(tensors: Any) -> str | None:
        fallback.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(mlfabric.tensors, "first_non_finite", spy)
    c = _cluster(make_daemon, mlfabric.Params(tau_max=4))
    try:
        bad = _update(2.0)
        bad["b"][1] = np.nan
        (h0, r0), (h1, r1), (h2, r2) = (
            _push(c, scheduler, "w0", _update(1.0)),
            _push(c, scheduler, "w1", bad),
            _push(c, scheduler, "w2", _update(3.0)),
        )
        agg_id = "agg:job:nan"
        _aggregate(scheduler, agg_id, [r0, r1, r2])
        for r in (r0, r1, r2):
            _send(scheduler, r.update_id, "agg", agg_id)
        # the bad member: ACKed DROPPED by the aggregator, its push resolved DROPPED at its source
        result = h1.wait(10)
        assert result.status == mlfabric.DROPPED
        assert f"tensor 'b' of {r1.update_id} holds non-finite values" in result.reason
        assert f"aggregator 'agg' (aggregate {agg_id})" in result.reason
        assert "Params(refuse_non_finite=False) allows them" in result.reason
        rep = wait_until(lambda: scheduler.report_for(r1.update_id))[0]
        assert rep.ok and rep.outcome == pb.OUTCOME_DROPPED and rep.reason == result.reason
        # the others were summed; the aggregate waits for its re-issue without the bad member
        wait_until(lambda: scheduler.report_for(r0.update_id) and scheduler.report_for(r2.update_id))
        assert scheduler.ready_for(agg_id) is None and not h0.done() and not h2.done()
        _aggregate(scheduler, agg_id, [r0, r2])
        ready = wait_until(lambda: scheduler.ready_for(agg_id))
        assert ready.norm == 2.0
        _send(scheduler, agg_id, "ps")
        agg_report = wait_until(lambda: scheduler.report_for(agg_id))[0]
        assert agg_report.outcome == pb.OUTCOME_APPLIED
        assert [v.update_id for v in agg_report.member_verdicts] == [r0.update_id, r2.update_id]
        meta = c["metas"][-1]
        assert meta.member_ids == (r0.update_id, r2.update_id) and len(c["metas"]) == 1
        model = _model(c)
        for k in MODEL:  # exactly the two finite members, and nothing of the bad one
            np.testing.assert_array_equal(model[k], MODEL[k] - _update(1.0)[k] - _update(3.0)[k])
        assert fallback == []  # the aggregate was checked in the server daemon's CRC pass
    finally:
        _close(c)


def test_non_finite_member_allowed_when_the_job_allows_it(make_daemon: Any, scheduler: AggScheduler) -> None:
    c = _cluster(make_daemon, mlfabric.Params(tau_max=4, refuse_non_finite=False))
    try:
        bad = _update(2.0)
        bad["w"][0, 0] = np.inf
        (_h0, r0), (_h1, r1) = _push(c, scheduler, "w0", _update(1.0)), _push(c, scheduler, "w1", bad)
        agg_id = "agg:job:inf"
        directive = pb.AggregateDirective(
            aggregate_id=agg_id,
            job="job",
            server="ps0",
            members=[
                pb.AggregateMember(update_id=r.update_id, worker=r.worker, src_host=r.worker, bytes=r.bytes)
                for r in (r0, r1)
            ],
            dst_host="ps",
            dst_address=scheduler.address_of("ps"),
            timeout_seconds=30,
            allow_non_finite=True,
        )
        scheduler.send("agg", pb.Directive(aggregate=directive))  # with the job's option
        for r in (r0, r1):
            _send(scheduler, r.update_id, "agg", agg_id)
        wait_until(lambda: scheduler.ready_for(agg_id))
        _send(scheduler, agg_id, "ps")
        assert wait_until(lambda: scheduler.report_for(agg_id))[0].outcome == pb.OUTCOME_APPLIED
        assert np.isinf(_model(c)["w"][0, 0])
    finally:
        _close(c)


def test_the_scheduler_reissues_the_aggregate_without_a_refused_member(env: dict[str, Any]) -> None:
    """The member-drop path: a member report DROPPED (ok) resolves it and shrinks the aggregate."""
    core, s = env["core"], env["s"]
    out = drain(s)
    [(kind, directive)] = out["x"]
    assert kind == "aggregate" and directive.allow_non_finite is False  # the job's default
    report(core, s["w1"], "u1", "x")
    reason = "tensor 'b' of u2 holds non-finite values (NaN or inf); aggregator 'x' refuses them"
    report(core, s["w2"], "u2", "x", outcome=pb.OUTCOME_DROPPED, reason=reason)
    [(kind, directive)] = drain(s)["x"]
    assert kind == "aggregate" and [m.update_id for m in directive.members] == ["u1", "u3"]
    assert core.state.outcomes["u2"].kind is OutcomeKind.DROPPED
    assert core.state.outcomes["u2"].reason == reason
    assert "u2" not in core.state.pending and "u2" not in core.state.in_flight
    members_in(env, ("u3",))
    report(core, s["w0"], "u0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=1)
    [(kind, send)] = drain(s)["x"]
    assert (kind, send.update_id) == ("send", "agg:ps:0")


def test_sync_round_member_refused_before_the_sum_and_an_overflowing_sum_by_the_process(
    make_daemon: Any, scheduler: AggScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synchronous round's sum is made in the server's daemon, not received as a frame: its
    own NaN/inf test is the server process's fallback (a sum of finite updates can overflow)."""
    fallback: list[int] = []
    real = mlfabric.tensors.first_non_finite

    def spy(tensors: Any) -> str | None:
        fallback.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(mlfabric.tensors, "first_non_finite", spy)
    c = _cluster(make_daemon, mlfabric.Params(tau_max=4, sync_workers=2), round_timeout=30.0)
    try:
        bad = _update(1.0)
        bad["w"][1, 1] = np.nan
        huge = {"w": np.full((2, 3), 1e308), "b": np.zeros(4)}  # finite; two of them sum to inf
        (h0, r0), (h1, r1) = _push(c, scheduler, "w0", bad), _push(c, scheduler, "w1", huge)
        _send(scheduler, r0.update_id, "ps")
        result = h0.wait(10)  # refused by the daemon at once, never summed into the round
        assert result.status == mlfabric.DROPPED and f"tensor 'w' of {r0.update_id}" in result.reason
        assert "server 'ps0' refuses them" in result.reason and not h1.done()
        (h2, r2) = _push(c, scheduler, "w2", huge)
        _send(scheduler, r1.update_id, "ps")
        _send(scheduler, r2.update_id, "ps")
        results = [h.wait(10) for h in (h1, h2)]  # finite each, their sum overflows to inf
        assert [r.status for r in results] == [mlfabric.DROPPED] * 2
        assert all("holds non-finite values" in r.reason and "round:" in r.reason for r in results)
        assert fallback == [2] and c["metas"] == [] and c["server"].version == 0
        np.testing.assert_array_equal(_model(c)["w"], MODEL["w"])
    finally:
        _close(c)
