"""Adaptive batching of update-ready notifications (DESIGN §3, paper §4).

A burst of pushes should be scheduled together: ordering one update at a time would send
the first straight away even when a shorter one arrives a few microseconds later. The
scheduler therefore keeps collecting notifications while another arrives within a small
``window`` of the previous one, and decides when the window passes without one — or when
``max_wait`` has passed since the first, so a steady stream cannot postpone decisions
forever.

:class:`BatchWindow` is the pure timing rule (times passed in); :class:`AdaptiveBatcher`
applies it on an asyncio event loop. The service may also :meth:`AdaptiveBatcher.request`
a decision without a notification (bounded-horizon planning: the planned sends are
running out); an open batch still closes on its own timing, and its decision serves the
request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_WAIT", "DEFAULT_WINDOW", "AdaptiveBatcher", "BatchWindow"]

#: seconds of quiet after the latest notification that close a batch
DEFAULT_WINDOW = 300e-6
#: seconds after the first notification at which a batch closes regardless
DEFAULT_MAX_WAIT = 5e-3


@dataclass
class BatchWindow:
    """The open batch: when it started, when its latest notification came, how many.

    Parameters
    ----------
    window : float
        Quiet time (s) after the latest arrival that closes the batch.
    max_wait : float
        Longest time (s) a batch stays open after its first arrival.

    Examples
    --------
    >>> w = BatchWindow(window=0.001, max_wait=0.005)
    >>> w.arrive(0.0); w.arrive(0.0008); w.deadline()
    0.0018
    >>> w.due(0.0017), w.due(0.0018)
    (False, True)
    """

    window: float = DEFAULT_WINDOW
    max_wait: float = DEFAULT_MAX_WAIT
    first: float | None = None
    last: float | None = None
    count: int = 0

    def __post_init__(self) -> None:
        if self.window < 0 or self.max_wait < 0:
            raise ValueError(f"window and max_wait must be >= 0, got {self.window}, {self.max_wait}")

    def arrive(self, now: float) -> None:
        """Count a notification arriving at ``now`` (opens the batch if none is open)."""
        if self.first is None:
            self.first = now
        self.last = now
        self.count += 1

    def deadline(self) -> float | None:
        """When the open batch closes if nothing else arrives (``None``: no batch open)."""
        if self.first is None or self.last is None:
            return None
        return min(self.last + self.window, self.first + self.max_wait)

    def due(self, now: float) -> bool:
        """Whether the open batch is to be decided at ``now``."""
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def close(self) -> int:
        """Close the batch; returns how many notifications it held."""
        count = self.count
        self.first = self.last = None
        self.count = 0
        return count


class AdaptiveBatcher:
    """Collect notifications on an asyncio loop and hand them over in batches.

    Parameters
    ----------
    window, max_wait : float
        See :class:`BatchWindow`.
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
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=deadline - now)
            except TimeoutError:
                continue
            self._arrived.clear()
