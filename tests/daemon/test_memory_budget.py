"""Bounded in-flight payload memory per daemon (DESIGN §3): back-pressure, never out of memory.

A receive waits for budget while the payloads before it are still with the server process; a
push larger than the whole budget is refused naming both sizes, at the worker's daemon (push
budget) or at the receiving daemon (receive budget); pooled receive buffers go back to the OS
after they were idle for ``pool_idle_seconds``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.daemon.channels.budget import BudgetExceeded, BudgetTimeout, ByteBudget
from mlfabric.wire.memfd import MemfdPool

MIB = 1 << 20


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_pool_allocation_waits_for_budget_until_a_buffer_is_released() -> None:
    budget = ByteBudget(3 * MIB, "receive")
    pool = MemfdPool(0, budget=budget)
    first = pool.allocate(2 * MIB)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(pool.allocate(2 * MIB)))
    waiter.start()
    wait_until(lambda: budget.waits == 1)
    assert not got and budget.in_use == 2 * MIB
    first.release()
    waiter.join(5)
    assert got and budget.in_use == 2 * MIB and budget.peak <= budget.limit
    got[0].discard()
    assert budget.in_use == 0
    pool.close()


def test_pool_allocation_too_large_or_timed_out_is_a_memory_error_naming_the_budget() -> None:
    pool = MemfdPool(0, budget=ByteBudget(MIB, "receive"), budget_timeout=0.05)
    with pytest.raises(BudgetExceeded, match=f"{2 * MIB} bytes exceeds .* receive budget of {MIB} bytes"):
        pool.allocate(2 * MIB)
    held = pool.allocate(MIB)
    with pytest.raises(BudgetTimeout, match="no receive budget"):
        pool.allocate(1)
    held.release()
    assert pool.budget.in_use == 0
    pool.close()


def test_a_wait_for_budget_ends_when_cancelled() -> None:
    budget, stopping = ByteBudget(MIB, "push"), threading.Event()
    budget.acquire(MIB)
    threading.Timer(0.1, stopping.set).start()
    with pytest.raises(BudgetTimeout, match="the wait was cancelled"):
        budget.acquire(1, None, stopping)
    assert budget.in_use == MIB


def test_idle_buffers_are_freed_after_the_idle_time() -> None:
    now = [0.0]
    pool = MemfdPool(64 * MIB, max_idle_seconds=10.0, clock=lambda: now[0])
    bufs = [pool.allocate(4 * MIB) for _ in range(3)]
    for b in bufs:
        b.release()
    assert pool.idle_bytes == 12 * MIB and pool.trim() == 0
    now[0] = 11.0
    assert pool.trim() == 12 * MIB and pool.idle_bytes == 0
    assert all(b.fd == -1 for b in bufs)  # the memfds are closed: the memory is the OS's again
    pool.close()


@pytest.fixture
def blocked_server(make_daemon: Any) -> Iterator[dict[str, Any]]:
    """Daemons "ps" (receive budget 3 MiB) and "w0"; ps0's updates wait for ``gate``."""
    ps, w0 = make_daemon("ps", max_inflight_bytes=3 * MIB), make_daemon("w0")
    gate = threading.Event()
    server = mlfabric.register_as_server(
        "job", "ps0", {"w": np.zeros(MIB // 4, np.float32)}, daemon=ps.config.socket_path
    )

    @server.on_update
    def _apply(update: dict[str, Any], meta: Any) -> None:
        gate.wait(30)
        server.model["w"] -= update["w"]

    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    yield {"ps": ps, "w0": w0, "server": server, "worker": worker, "gate": gate}
    gate.set()
    worker.close()
    server.stop()
    thread.join(5)
    server.close()


def test_receives_wait_for_budget_while_earlier_updates_are_with_the_server(
    blocked_server: dict[str, Any], scheduler: Any
) -> None:
    ps, worker = blocked_server["ps"], blocked_server["worker"]
    update = {"w": np.ones(MIB // 4, np.float32)}  # 1 MiB
    handles = [worker.push("ps0", update) for _ in range(5)]
    wait_until(lambda: ps.receive_budget.waits >= 1)  # the 4th receive waits: 3 MiB are in use
    assert ps.receive_budget.in_use <= 3 * MIB
    blocked_server["gate"].set()
    results = [h.wait(20) for h in handles]
    assert [r.status for r in results] == [mlfabric.APPLIED] * 5
    assert ps.receive_budget.peak <= 3 * MIB
    wait_until(lambda: ps.receive_budget.in_use == 0)
    np.testing.assert_array_equal(blocked_server["server"].model["w"], np.full(MIB // 4, -5.0, np.float32))


def test_payload_over_the_receive_budget_is_dropped_naming_it(make_daemon: Any, scheduler: Any) -> None:
    ps, w0 = make_daemon("ps", max_inflight_bytes=3 * MIB), make_daemon("w0")
    model = {"w": np.zeros(MIB, np.float32)}  # 4 MiB: more than ps may receive at once
    server = mlfabric.register_as_server("job", "ps0", model, daemon=ps.config.socket_path)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    try:
        result = worker.push("ps0", {"w": np.ones(MIB, np.float32)}).wait(20)
        assert result.status == mlfabric.DROPPED
        # the receiver answers with an ERROR naming its budget and closes; under load the
        # sender may meet the closed socket (broken pipe) before it reads that answer
        assert (
            f"exceeds this daemon's receive budget of {3 * MIB} bytes" in result.reason
            or "Broken pipe" in result.reason
        ), result.reason
        assert server.version == 0 and ps.receive_budget.in_use == 0
    finally:
        worker.close()
        server.stop()
        thread.join(5)
        server.close()


def test_push_over_the_push_budget_is_refused_naming_it(make_daemon: Any, scheduler: Any) -> None:
    ps, w0 = make_daemon("ps"), make_daemon("w0", max_inflight_bytes=MIB)
    server = mlfabric.register_as_server(
        "job", "ps0", {"w": np.zeros(MIB // 2, np.float32)}, daemon=ps.config.socket_path
    )
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    try:
        with pytest.raises(mlfabric.MlfabricError) as info:
            worker.push("ps0", {"w": np.ones(MIB // 2, np.float32)}).wait(10)
        assert info.value.code == "too_large"
        assert f"a payload of {2 * MIB} bytes exceeds this daemon's push budget of {MIB} bytes" in str(
            info.value
        )
        assert server.version == 0 and w0.push_budget.in_use == 0
    finally:
        worker.close()
        server.stop()
        thread.join(5)
        server.close()
