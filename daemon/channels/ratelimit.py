"""Token buckets that make a daemon enforce its host's NIC rates (DESIGN §6, §9).

On loopback every transfer runs at memory speed, so the demo would have no bottleneck. A daemon
started with ``--enforce-nic-rates`` therefore shares one egress and one ingress
:class:`TokenBucket` between all its data-plane connections: the sender consumes tokens before it
writes a chunk, the receiver after it reads one, and TCP back-pressure slows the peer down. This is
the emulated counterpart of a shaped link in the paper's network settings (MLfabric §7, NS1-NS3);
the namespace testbed shapes real links with ``tc`` instead.

The bucket is a reservation scheme (the virtual-time form of a token bucket): a caller takes its
tokens at once, letting the level go negative, and then sleeps, outside the lock, until the level
would have been refilled to zero. Concurrent callers therefore queue in arrival order and the total
rate stays at ``rate_bytes_per_s`` however many connections share the bucket.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["TokenBucket"]


class TokenBucket:
    """A thread-safe token bucket in bytes; a no-op when ``rate_bytes_per_s`` is None.

    Parameters
    ----------
    rate_bytes_per_s : float or None
        Refill rate in bytes per second, i.e. the emulated link rate. None switches enforcement
        off: :meth:`consume` returns at once.
    burst : float, optional
        Bucket depth in bytes (how much may go at line speed after an idle period). Defaults to
        the larger of 64 KiB and 10 ms worth of ``rate_bytes_per_s``.
    clock : callable, optional
        Monotonic clock in seconds (``time.monotonic``); injectable for tests.
    sleep : callable, optional
        Blocking sleep in seconds (``time.sleep``); injectable for tests.

    Examples
    --------
    >>> now = [0.0]
    >>> bucket = TokenBucket(1000.0, burst=100.0, clock=lambda: now[0],
    ...                      sleep=lambda s: now.__setitem__(0, now[0] + s))
    >>> bucket.consume(100)    # the burst goes at once
    0.0
    >>> bucket.consume(500)    # then the rate applies: 500 bytes at 1000 B/s
    0.5
    >>> TokenBucket(None).consume(10**9)
    0.0
    """

    def __init__(
        self,
        rate_bytes_per_s: float | None,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate_bytes_per_s is not None and rate_bytes_per_s <= 0:
            raise ValueError(f"rate_bytes_per_s must be positive or None, got {rate_bytes_per_s}")
        if burst is None:
            burst = max(64 * 1024.0, 0.01 * rate_bytes_per_s) if rate_bytes_per_s else 0.0
        if burst < 0:
            raise ValueError(f"burst must be >= 0, got {burst}")
        self._rate = rate_bytes_per_s
        self._burst = float(burst)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._last: float | None = None  # clock reading of the last refill; None until first use

    @property
    def rate_bytes_per_s(self) -> float | None:
        """The enforced rate in bytes per second, or None when enforcement is off."""
        return self._rate

    @property
    def burst(self) -> float:
        """The bucket depth in bytes."""
        return self._burst

    @property
    def enabled(self) -> bool:
        """Whether this bucket limits anything."""
        return self._rate is not None

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` tokens now and return how long the caller must wait before using them.

        Parameters
        ----------
        nbytes : int
            Bytes about to be sent or just received (>= 0).

        Returns
        -------
        float
            Seconds to wait (0 when the bucket held enough tokens, or when enforcement is off).

        Examples
        --------
        >>> bucket = TokenBucket(100.0, burst=0.0, clock=lambda: 5.0)
        >>> bucket.reserve(50), bucket.reserve(50)
        (0.5, 1.0)
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        rate = self._rate
        if rate is None or nbytes == 0:
            return 0.0
        with self._lock:
            now = self._clock()
            if self._last is not None:
                self._tokens = min(self._burst, self._tokens + (now - self._last) * rate)
            self._last = now
            self._tokens -= nbytes
            deficit = -self._tokens
        return deficit / rate if deficit > 0 else 0.0

    def consume(self, nbytes: int) -> float:
        """Block until ``nbytes`` may pass at the bucket's rate; return the time slept.

        Parameters
        ----------
        nbytes : int
            Bytes about to be sent or just received (>= 0).

        Returns
        -------
        float
            Seconds slept (0.0 when enforcement is off or tokens were available).

        Examples
        --------
        >>> now = [0.0]
        >>> bucket = TokenBucket(10.0, burst=0.0, clock=lambda: now[0],
        ...                      sleep=lambda s: now.__setitem__(0, now[0] + s))
        >>> bucket.consume(20), now[0]
        (2.0, 2.0)
        """
        wait = self.reserve(nbytes)
        if wait > 0:
            self._sleep(wait)
        return wait
