"""Bounded in-flight payload memory per daemon (DESIGN §3).

A daemon holds payloads in memfds: the updates its workers pushed until each resolves, and
the payloads it receives (updates for a server here, members of an aggregate, models fetched
for a ``get``) until they are handed on. Without a bound, a burst of big pushes takes as much
memory as it brings. :class:`ByteBudget` is that bound (``--max-inflight-bytes``): whoever
needs payload memory waits for budget — back-pressure, not an out-of-memory kill — and a
single payload larger than the whole budget is refused at once with an error naming both
sizes (it could never fit).

A daemon keeps two budgets of the same size, one for pushes and one for receives, so that
pushes waiting for their receivers can never hold up the receives that would let them
finish (two daemons pushing to each other cannot deadlock).
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["DEFAULT_MAX_INFLIGHT_BYTES", "BudgetExceeded", "BudgetTimeout", "ByteBudget"]

_LOG = logging.getLogger("mlfabric.daemon")

#: Default ``--max-inflight-bytes``: 2 GiB of pushes held and 2 GiB of receives.
DEFAULT_MAX_INFLIGHT_BYTES = 2 << 30


class BudgetExceeded(MemoryError):
    """A single payload larger than the whole budget: it could never be admitted."""


class BudgetTimeout(MemoryError):
    """No budget came free within the wait allowed."""


class ByteBudget:
    """A counting semaphore over bytes: :meth:`acquire` waits until ``nbytes`` fit.

    Parameters
    ----------
    limit : int
        Bytes that may be in use at once (> 0).
    name : str
        What the budget bounds, for messages (e.g. ``"receive"``).

    Examples
    --------
    >>> b = ByteBudget(100, "receive")
    >>> b.acquire(60); b.try_acquire(50), b.in_use
    (False, 60)
    >>> b.release(60); b.try_acquire(50), b.in_use
    (True, 50)
    >>> try:
    ...     b.acquire(101)
    ... except BudgetExceeded as exc:
    ...     print(exc)
    a payload of 101 bytes exceeds this daemon's receive budget of 100 bytes (--max-inflight-bytes)
    >>> try:
    ...     b.acquire(60, timeout=0.01)
    ... except BudgetTimeout as exc:
    ...     print(exc)
    no receive budget for 60 bytes within 0.01 s (50 of 100 bytes in use)
    """

    def __init__(self, limit: int, name: str = "in-flight") -> None:
        if limit <= 0:
            raise ValueError(f"budget limit must be > 0 bytes, got {limit}")
        self.limit = limit
        self.name = name
        self._cond = threading.Condition()
        self._in_use = 0
        #: Highest ``in_use`` seen, and how many acquisitions had to wait.
        self.peak = 0
        self.waits = 0

    @property
    def in_use(self) -> int:
        """Bytes acquired and not yet released."""
        return self._in_use

    def check(self, nbytes: int) -> None:
        """Raise :class:`BudgetExceeded` when ``nbytes`` can never fit."""
        if nbytes > self.limit:
            raise BudgetExceeded(
                f"a payload of {nbytes} bytes exceeds this daemon's {self.name} budget of "
                f"{self.limit} bytes (--max-inflight-bytes)"
            )

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit now; never waits."""
        self.check(nbytes)
        with self._cond:
            if self._in_use + nbytes > self.limit:
                return False
            self._take(nbytes)
            return True

    def acquire(
        self, nbytes: int, timeout: float | None = None, cancel: threading.Event | None = None
    ) -> None:
        """Take ``nbytes``, waiting until they fit (``timeout`` seconds at most; None: forever).

        A set ``cancel`` event (e.g. the daemon stopping) ends the wait like a timeout.

        Raises
        ------
        BudgetExceeded
            ``nbytes`` is larger than the whole budget.
        BudgetTimeout
            They did not fit within ``timeout``.
        """
        self.check(nbytes)
        with self._cond:
            if self._in_use + nbytes > self.limit:
                self.waits += 1
                _LOG.info(
                    "%s budget: %d bytes wait (%d of %d in use)", self.name, nbytes, self._in_use, self.limit
                )
                deadline = None if timeout is None else time.monotonic() + timeout
                while self._in_use + nbytes > self.limit:
                    left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
                    if left <= 0 or (cancel is not None and cancel.is_set()):
                        break
                    self._cond.wait(left)
                if self._in_use + nbytes > self.limit:
                    cancelled = cancel is not None and cancel.is_set()
                    waited = "(the wait was cancelled)" if cancelled else f"within {timeout:g} s"
                    raise BudgetTimeout(
                        f"no {self.name} budget for {nbytes} bytes {waited} "
                        f"({self._in_use} of {self.limit} bytes in use)"
                    )
            self._take(nbytes)

    def _take(self, nbytes: int) -> None:
        self._in_use += nbytes
        self.peak = max(self.peak, self._in_use)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken before."""
        with self._cond:
            self._in_use = max(0, self._in_use - nbytes)
            self._cond.notify_all()
