"""Exactly once through aggregates when the aggregator's daemon process is SIGKILLed mid-aggregate.

The aggregator is a real ``mlfabric daemon`` process; the server's and workers' daemons run in
this process, driven by the in-test scheduler. Updates are integer-valued float64: the final
model must equal the initial one minus exactly the APPLIED updates, asynchronous and synchronous.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlfabric
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
from tests.daemon.test_daemon_processes import Processes

pytestmark = pytest.mark.slow


@pytest.fixture
def scheduler() -> Iterator[AggScheduler]:
    yield from held_scheduler()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    yield group
    group.reap()


@pytest.mark.parametrize("sync_workers", [0, 3])
def test_sigkilled_aggregator_members_are_applied_exactly_once(
    make_daemon: Any, scheduler: AggScheduler, procs: Processes, sockdir: str, sync_workers: int
) -> None:
    c = _cluster(
        make_daemon, mlfabric.Params(tau_max=4, sync_workers=sync_workers), hosts=("ps", "w0", "w1", "w2")
    )
    try:
        procs.start(
            "agg",
            "mlfabric.daemon.cli",
            "--host",
            "agg",
            "--scheduler",
            scheduler.address,
            "--socket",
            os.path.join(sockdir, "agg.sock"),
            "--data-listen",
            "127.0.0.1:0",
            "--send-attempts",
            "2",
        )
        wait_until(lambda: "agg" in scheduler.sessions)
        pushes = [_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(3)]
        (_, r0), (h1, r1), (_, r2) = pushes
        agg_id = "agg:job:k"
        _aggregate(scheduler, agg_id, [r0, r1, r2])
        _send(scheduler, r0.update_id, "agg", agg_id)
        assert wait_until(lambda: scheduler.report_for(r0.update_id))[0].ok  # summed at the aggregator
        procs.kill("agg")  # SIGKILL mid-aggregate: r0 summed, r1 and r2 not yet sent
        _send(scheduler, r1.update_id, "agg", agg_id)
        failed = wait_until(lambda: scheduler.report_for(r1.update_id), timeout=20)[0]
        assert not failed.ok and not h1.done()  # unreachable: the source keeps the payload
        # the scheduler re-plans every unresolved member straight to the server
        for r in (r0, r1, r2):
            _send(scheduler, r.update_id, "ps")
        results = [h.wait(15) for h, _ in pushes]
        assert [x.status for x in results] == [mlfabric.APPLIED] * 3
        applied = [_update(float(i + 1)) for i, x in enumerate(results) if x.applied]
        model = _model(c)
        for k in MODEL:
            np.testing.assert_array_equal(model[k], MODEL[k] - sum(u[k] for u in applied))
        assert c["server"].version == (1 if sync_workers else 3)
    finally:
        _close(c)
