"""Adaptive batching: the pure window rule (fake times) and the asyncio helper (fake clock)."""

from __future__ import annotations

import asyncio

import pytest

from mlfabric.scheduler.policies.dispatch import BatchWindow
from mlfabric.scheduler.service.batching import AdaptiveBatcher


def test_window_extends_while_notifications_keep_coming() -> None:
    w = BatchWindow(window=1.0, max_wait=10.0)
    assert w.deadline() is None and not w.due(100.0)
    w.arrive(0.0)
    assert w.deadline() == 1.0
    w.arrive(0.9)
    assert w.deadline() == pytest.approx(1.9)
    assert not w.due(1.5) and w.due(1.9)
    assert w.close() == 2 and w.deadline() is None


def test_max_wait_caps_a_steady_stream() -> None:
    w = BatchWindow(window=1.0, max_wait=3.0)
    for t in (0.0, 0.8, 1.6, 2.4, 2.9):
        w.arrive(t)
    assert w.deadline() == 3.0


def test_negative_times_refused() -> None:
    with pytest.raises(ValueError):
        BatchWindow(window=-1.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_batcher_collects_a_burst_then_returns_its_size() -> None:
    async def main() -> list[int]:
        clock = FakeClock()
        b = AdaptiveBatcher(window=0.02, max_wait=1.0, clock=clock)
        sizes: list[int] = []
        task = asyncio.create_task(b.next_batch())
        await asyncio.sleep(0)
        for _ in range(3):  # a burst, each within the window of the previous one
            b.notify()
            clock.now += 0.01
            await asyncio.sleep(0)
        assert not task.done()
        clock.now += 0.02  # quiet for a whole window
        sizes.append(await asyncio.wait_for(task, 1.0))
        task = asyncio.create_task(b.next_batch())
        b.notify()
        clock.now += 0.05
        sizes.append(await asyncio.wait_for(task, 1.0))
        return sizes

    assert asyncio.run(main()) == [3, 1]


def test_batcher_waits_for_the_first_notification() -> None:
    async def main() -> bool:
        b = AdaptiveBatcher(window=0.001)
        task = asyncio.create_task(b.next_batch())
        await asyncio.sleep(0.01)
        waiting = not task.done()
        b.notify()
        assert await asyncio.wait_for(task, 1.0) == 1
        return waiting

    assert asyncio.run(main())


def test_a_cancel_arriving_with_a_notification_stops_the_batcher() -> None:
    """The scheduler's shutdown cancels the decision loop; a notification at that moment must
    not swallow the cancel (``asyncio.wait_for`` on 3.11 did: the loop, and the scheduler's
    exit, then hung)."""

    async def main() -> bool:
        b = AdaptiveBatcher(window=10.0, max_wait=10.0)
        b.notify()  # a batch is open: next_batch waits for the window to pass
        task = asyncio.create_task(b.next_batch())
        for _ in range(3):
            await asyncio.sleep(0)
        b.notify()
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        stopped = task.cancelled()
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        return stopped

    assert asyncio.run(main())
