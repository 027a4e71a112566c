"""A daemon's model cache: the newest model of each (job, server) fetched or relayed here.

Each entry is a :class:`~mlfabric.daemon.roles.server.handoff.ModelSnapshot`: the memfd the
model arrived in (a local ``get`` passes its fd to the process, as the server's daemon does
with the published model) and a read-only mapping of it (a peer's GET is answered from the
mapping, which outlives the fd when a newer model replaces the entry meanwhile). One version
per server, the newest: an older model never replaces a newer one. The bytes are held against
the daemon's byte budget when it has one; a model that does not fit is answered from once and
not kept. Fetches are single-flight: :meth:`ModelCache.begin` makes the first caller the
leader, the others wait for its flight (docs/model-relays.md).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlfabric.daemon.channels.budget import ByteBudget
from mlfabric.daemon.roles.relay.pieces import Growing
from mlfabric.daemon.roles.server.handoff import ModelSnapshot
from mlfabric.wire.memfd import PooledBuffer
from mlfabric.wire.tensors import Layout

__all__ = ["Flight", "Key", "ModelCache"]

#: (job, server)
Key = tuple[str, str]
_T = TypeVar("_T")


@dataclass
class Flight:
    """One fetch under way for a key: its leader's floor, the model arriving, and how it ended."""

    min_version: int
    done: threading.Event = field(default_factory=threading.Event)
    #: why it failed (None: it succeeded, or has not ended)
    error: str | None = None
    #: notified when a piece arrives and when the fetch ends
    cond: threading.Condition = field(default_factory=threading.Condition)
    #: the model while it arrives in pieces (a fetch in pieces, once its first piece is in)
    growing: Growing | None = None

    def release_growing(self) -> None:
        """Give back the buffer of the model that was arriving (a fetch in pieces that failed)."""
        g = self.growing
        if g is not None:
            g.release()

    def wait_piece(self, floor: int, end: int, timeout: float) -> Growing | None:
        """Wait until the model arriving holds ``[0, end)`` (cut at its size) or the fetch ends.

        Returns the growing model if it holds that much and is at or above ``floor``; None
        when the fetch ended first, or the time ran out.
        """

        def ready() -> bool:
            g = self.growing
            return self.done.is_set() or (g is not None and g.have >= min(end, g.model_bytes))

        with self.cond:
            self.cond.wait_for(ready, timeout=max(0.0, timeout))
            g = self.growing
        if g is not None and g.version >= floor and g.have >= min(end, g.model_bytes):
            return g
        return None


class ModelCache:
    """The models kept by this daemon, one (the newest) per (job, server) (thread-safe).

    Parameters
    ----------
    budget : ByteBudget, optional
        Cached bytes are held against it (``try_acquire``: never waits).

    Examples
    --------
    >>> from mlfabric.wire.memfd import allocate
    >>> cache = ModelCache()
    >>> buf = allocate(4); buf[:4] = b"abcd"
    >>> cache.keep(("j", "ps"), 3, [], 4, buf) is None   # kept
    True
    >>> cache.version(("j", "ps")), cache.with_entry(("j", "ps"), 2, lambda s: bytes(s.mapping))
    (3, b'abcd')
    >>> cache.with_entry(("j", "ps"), 4, lambda s: s.version) is None   # below the floor
    True
    >>> old = allocate(4)
    >>> cache.keep(("j", "ps"), 2, [], 4, old) is None   # older: dropped, never replaces 3
    True
    >>> cache.version(("j", "ps"))
    3
    >>> cache.close()
    """

    def __init__(self, budget: ByteBudget | None = None) -> None:
        self._budget = budget
        self._lock = threading.Lock()
        self._entries: dict[Key, ModelSnapshot] = {}
        self._flights: dict[Key, Flight] = {}
        #: models not kept because the budget had no room for them
        self.not_kept = 0

    def version(self, key: Key) -> int | None:
        """The cached version for ``key``, or None."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.version

    def with_entry(self, key: Key, min_version: int, fn: Callable[[ModelSnapshot], _T]) -> _T | None:
        """``fn(entry)`` while no replacement can close the entry's fd, if its version >= ``min_version``.

        None when nothing at or above ``min_version`` is cached.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.version < min_version:
                return None
            return fn(entry)

    def keep(
        self, key: Key, version: int, layouts: list[Layout], payload_bytes: int, buffer: PooledBuffer
    ) -> ModelSnapshot | None:
        """Take a fetched model (its memfd ``buffer``, released here).

        Returns None when the cache now holds it or a newer one (answer from
        :meth:`with_entry`), or the model as a snapshot the caller answers from and then
        closes when the budget had no room for it.
        """
        mapping = mmap.mmap(buffer.fd, payload_bytes, prot=mmap.PROT_READ) if payload_bytes else None
        snap = ModelSnapshot(version, layouts, payload_bytes, os.dup(buffer.fd), mapping)
        buffer.release()
        with self._lock:
            old = self._entries.get(key)
            if old is not None and old.version >= version:
                snap.close()  # never backwards: the newer one stays
                return None
            if old is not None:
                del self._entries[key]
                self._give_back(old.payload_bytes)
            if self._budget is not None and not self._budget.try_acquire(payload_bytes):
                self.not_kept += 1
                kept = False
            else:
                self._entries[key] = snap
                kept = True
        if old is not None:
            old.close()
        return None if kept else snap

    def _give_back(self, nbytes: int) -> None:
        if self._budget is not None:
            self._budget.release(nbytes)

    def begin(self, key: Key, min_version: int) -> tuple[bool, Flight | None]:
        """Join the fetch under way for ``key``, or start one: (whether the caller leads it, the flight).

        ``(False, None)`` when a version at or above ``min_version`` is cached by now (checked
        under the same lock, so a fetch that just ended is never started again).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.version >= min_version:
                return False, None
            flight = self._flights.get(key)
            if flight is not None:
                return False, flight
            flight = self._flights[key] = Flight(min_version)
            return True, flight

    def end(self, key: Key, flight: Flight, error: str | None = None) -> None:
        """The leader's fetch ended (``error``: why it failed); its waiters wake."""
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]
        with flight.cond:
            flight.error = error
            flight.done.set()
            flight.cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """Entries and cached bytes now."""
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": sum(e.payload_bytes for e in self._entries.values()),
            }

    def close(self) -> None:
        """Drop every entry (the daemon stops)."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            for entry in entries:
                self._give_back(entry.payload_bytes)
        for entry in entries:
            entry.close()
