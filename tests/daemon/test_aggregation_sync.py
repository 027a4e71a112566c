"""Synchronous rounds at the server's daemon: N updates summed, one step, all pushes resolve with it."""

from __future__ import annotations

import threading
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
def sync3(make_daemon: Any) -> Iterator[dict[str, Any]]:
    c = _cluster(make_daemon, mlfabric.Params(tau_max=2, sync_workers=3), round_timeout=30.0)
    yield c
    _close(c)


def test_round_waits_for_every_worker_then_applies_one_step(
    sync3: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = sync3
    pushes = [_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(3)]
    _send(scheduler, pushes[0][1].update_id, "ps")
    _send(scheduler, pushes[1][1].update_id, "ps")
    pause = threading.Event()
    pause.wait(0.3)
    assert not any(h.done() for h, _ in pushes) and c["server"].version == 0  # 2 of 3: the round is open
    _send(scheduler, pushes[2][1].update_id, "ps")
    results = [h.wait(10) for h, _ in pushes]
    assert [(r.status, r.delay, r.version) for r in results] == [(mlfabric.APPLIED, 0, 1)] * 3
    assert c["server"].version == 1 and len(c["metas"]) == 1
    meta = c["metas"][0]
    assert meta.num_updates == 3 and sorted(meta.workers) == ["w0", "w1", "w2"] and not meta.partial_round
    model = _model(c)
    for k in MODEL:
        np.testing.assert_array_equal(
            model[k], MODEL[k] - _update(1.0)[k] - _update(2.0)[k] - _update(3.0)[k]
        )


def test_round_counts_the_members_of_an_aggregate(sync3: dict[str, Any], scheduler: AggScheduler) -> None:
    c = sync3
    (_h0, r0), (_h1, r1), (h2, r2) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(3))
    agg_id = "agg:job:s0"
    _aggregate(scheduler, agg_id, [r0, r1])
    _send(scheduler, r0.update_id, "agg", agg_id)
    _send(scheduler, r1.update_id, "agg", agg_id)
    wait_until(lambda: scheduler.ready_for(agg_id))
    _send(scheduler, agg_id, "ps")
    _send(scheduler, r2.update_id, "ps")
    assert h2.wait(10).status == mlfabric.APPLIED
    report = wait_until(lambda: scheduler.report_for(agg_id))[0]
    assert report.outcome == APPLIED and report.server_version == 1
    assert [(v.update_id, v.outcome) for v in report.member_verdicts] == [
        (r0.update_id, APPLIED),
        (r1.update_id, APPLIED),
    ]
    assert c["server"].version == 1 and c["metas"][0].num_updates == 3
    np.testing.assert_array_equal(_model(c)["w"], MODEL["w"] - 6.0)


def test_round_times_out_with_the_updates_it_has(make_daemon: Any, scheduler: AggScheduler) -> None:
    c = _cluster(make_daemon, mlfabric.Params(sync_workers=3), round_timeout=0.5)
    try:
        (h0, r0), (h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
        _send(scheduler, r0.update_id, "ps")
        _send(scheduler, r1.update_id, "ps")  # w2 never pushes (it vanished)
        assert [h.wait(10).version for h in (h0, h1)] == [1, 1]
        meta = c["metas"][0]
        assert meta.num_updates == 2 and meta.partial_round
        np.testing.assert_array_equal(_model(c)["w"], MODEL["w"] - 3.0)
    finally:
        _close(c)
