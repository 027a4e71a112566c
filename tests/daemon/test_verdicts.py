"""Every verdict says what happened: UNKNOWN when nobody can know, never a false DROPPED (DESIGN §3)."""

from __future__ import annotations

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
