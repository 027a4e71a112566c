"""NaN/inf updates are refused by the receiving daemon, in its CRC pass (issue #16, defect 8).

The server's daemon tests each arriving payload for NaN and infinity while it computes the
CRC-32 (:class:`mlfabric.tensors.FiniteScan`), so a non-finite update is DROPPED there, naming
the tensor, the update and the job option, and the server process never sees it; a finite
update reaches the process marked ``finite_checked``, which then does not read it again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
import mlfabric.tensors


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the server process's own (fallback) NaN/inf pass, ``first_non_finite``."""
    calls: list[int] = []
    real = mlfabric.tensors.first_non_finite

    def spy(tensors: Any) -> str | None:
        calls.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(mlfabric.tensors, "first_non_finite", spy)
    return calls


@pytest.fixture
def served(make_daemon: Any) -> Iterator[dict[str, Any]]:
    """Server ps0 on daemon "ps" recording what its on_update sees; a worker on daemon "w0"."""
    ps, w0 = make_daemon("ps"), make_daemon("w0")
    model = {"w": np.zeros((2, 3)), "b": np.zeros(4, np.float32), "h": np.zeros(8, np.float16)}
    server = mlfabric.register_as_server("job", "ps0", model, daemon=ps.config.socket_path)
    seen: list[str] = []

    @server.on_update
    def apply(update: dict[str, Any], meta: Any) -> None:
        seen.append(meta.update_id)
        for k in update:
            server.model[k] -= update[k]

    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    yield {"server": server, "worker": worker, "seen": seen}
    worker.close()
    server.stop()
    thread.join(5)
    server.close()


def _update(value: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "w": np.full((2, 3), value),
        "b": np.full(4, value, np.float32),
        "h": np.full(8, value, np.float16),
    }


@pytest.mark.parametrize(("tensor", "bad"), [("w", np.nan), ("b", np.inf), ("h", -np.inf)])
def test_refused_by_the_servers_daemon_never_seen_by_the_process(
    served: dict[str, Any], counted: list[int], tensor: str, bad: float
) -> None:
    worker, server, seen = served["worker"], served["server"], served["seen"]
    update = _update()
    update[tensor].reshape(-1)[-1] = bad
    handle = worker.push("ps0", update)
    result = handle.wait(10)
    assert result.status == mlfabric.DROPPED
    assert f"tensor {tensor!r} of {handle.update_id} holds non-finite values" in result.reason
    assert "server 'ps0' refuses them (Params(refuse_non_finite=False) allows them)" in result.reason
    assert seen == [] and server.version == 0 and server.dropped == 0  # the process never saw it
    assert counted == []
    # the same payload again (a retry would carry the same id; a new push gets a new one)
    assert worker.push("ps0", update).wait(10).status == mlfabric.DROPPED
    good = worker.push("ps0", _update(2.0))
    assert good.wait(10).applied
    assert seen == [good.update_id] and server.version == 1
    assert counted == []  # checked in the daemon's CRC pass: the process did not read it for that
    _, model = worker.get("ps0")
    assert all(np.isfinite(v).all() for v in model.values())
