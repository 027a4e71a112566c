"""Adaptive batching of update-ready notifications (DESIGN §3, paper §4).

A burst of pushes should be scheduled together: ordering one update at a time would send
the first straight away even when a shorter one arrives a few microseconds later. The
scheduler therefore keeps collecting notifications while another arrives within a small
``window`` of the previous one, and decides when the window passes without one — or when
``max_wait`` has passed since the first, so a steady stream cannot postpone decisions
forever.

The pure timing rule is :class:`~mlfabric.scheduler.policies.dispatch.BatchWindow` (times
passed in; the simulator applies it on simulated time); :class:`AdaptiveBatcher` applies it
on an asyncio event loop. The service may also :meth:`AdaptiveBatcher.request`
a decision without a notification (bounded-horizon planning: the planned sends are
running out); an open batch still closes on its own timing, and its decision serves the
request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from mlfabric.scheduler.policies.dispatch import DEFAULT_MAX_WAIT, DEFAULT_WINDOW, BatchWindow

__all__ = ["AdaptiveBatcher"]


class AdaptiveBatcher:
    """Collect notifications on an asyncio loop and hand them over in batches.

    Parameters
    ----------
    window, max_wait : float
        See :class:`~mlfabric.scheduler.policies.dispatch.BatchWindow`.
    clock : callable
        Monotonic seconds; injectable for tests.

    Examples
    --------
    >>> async def main():
    ...     b = AdaptiveBatcher(window=0.001)
    ...     b.notify(); b.notify()
    ...     return await b.next_batch()
    >>> asyncio.run(main())
    2
    >>> async def requested():
    ...     b = AdaptiveBatcher(window=0.001)
    ...     b.request()
    ...     return await b.next_batch()
    >>> asyncio.run(requested())
    0
    """

    def __init__(
        self,
        window: float = DEFAULT_WINDOW,
        max_wait: float = DEFAULT_MAX_WAIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._batch = BatchWindow(window, max_wait)
        self._clock = clock
        self._arrived = asyncio.Event()
        self._requested = False

    def request(self) -> None:
        """Ask for a decision now even without a notification (call from the loop's thread)."""
        self._requested = True
        self._arrived.set()

    def notify(self) -> None:
        """Record one notification now (call from the loop's thread)."""
        self._batch.arrive(self._clock())
        self._arrived.set()

    async def next_batch(self) -> int:
        """Wait for a batch to open and close, or for a :meth:`request`.

        Returns
        -------
        int
            The number of notifications in the batch; 0 for a requested decision with
            no batch open.
        """
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            deadline = self._batch.deadline()
            if deadline is not None:
                break
            if self._requested:
                self._requested = False
                return 0
        while True:
            now = self._clock()
            deadline = self._batch.deadline()
            if deadline is None or now >= deadline:
                self._requested = False  # the batch's decision serves the request too
                return self._batch.close()
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that arrives as
            # a notification does, and the scheduler's decision loop then never stops
            try:
                async with asyncio.timeout(deadline - now):
                    await self._arrived.wait()
            except TimeoutError:
                continue
            self._arrived.clear()
