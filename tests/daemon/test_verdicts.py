"""Every verdict says what happened: UNKNOWN when nobody can know, never a false DROPPED (DESIGN §3)."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

import mlfabric
from tests.daemon.test_bad_input import served  # noqa: F401 - the fixture


def test_server_gone_after_the_hand_off_resolves_unknown(served: dict[str, Any]) -> None:  # noqa: F811
    worker, server = served["worker"], served["server"]
    handed, release = threading.Event(), threading.Event()

    @server.on_update
    def apply(update: Any, meta: Any) -> None:
        handed.set()
        release.wait(10)  # the process goes away before it sends its verdict

    handle = worker.push("ps0", {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)})
    assert handed.wait(10)
    server.close()
    result = handle.wait(10)
    release.set()
    assert result.status == mlfabric.UNKNOWN
    assert "disconnected" in result.reason and "unknown" in result.reason


def test_memfd_shrunk_after_accept_resolves_dropped_quickly(served: dict[str, Any], scheduler: Any) -> None:  # noqa: F811
    """The pushing process truncates its update's memfd after the daemon accepted the push."""
    worker, w0, server = served["worker"], served["w0"], served["server"]
    scheduler.hold = True
    handle = worker.push("ps0", {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)})
    for _ in range(500):
        if scheduler.ready:
            break
        threading.Event().wait(0.01)
    ready = scheduler.ready[-1]
    pending = w0.worker.outgoing._pushes[ready.update_id]
    os.ftruncate(pending.fd, 8)  # same file as the process's memfd: what a shrink does
    scheduler.send_to_server(ready)
    result = handle.wait(10)
    assert result.status == mlfabric.DROPPED
    assert "memfd" in result.reason and "8 bytes" in result.reason
    assert server.version == 0
    scheduler.hold = False
    assert worker.push("ps0", {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)}).wait(10).applied


def test_push_never_scheduled_resolves_dropped_at_the_push_deadline(make_daemon: Any, scheduler: Any) -> None:
    ps, w0 = make_daemon("ps"), make_daemon("w0", push_timeout=0.5)
    server = mlfabric.register_as_server("job", "ps0", {"w": np.zeros(2)}, daemon=ps.config.socket_path)
    worker = mlfabric.register_as_worker("job", daemon=w0.config.socket_path, wait=5)
    try:
        scheduler.hold = True  # the scheduler never answers
        result = worker.push("ps0", {"w": np.ones(2)}).wait(10)
        assert result.status == mlfabric.DROPPED
        assert "push deadline" in result.reason and "0.5 s" in result.reason
        assert len(w0.worker.outgoing) == 0
    finally:
        worker.close()
        server.close()
