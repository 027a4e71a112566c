"""A pipelined aggregate's sum, computed piece by piece while its members land (cut-through).

Store-and-forward aggregation forwards a sum once every member is in whole, so a tree of
``d`` levels costs ``d`` update times on the way up. A pipelined aggregate
(``AggregateDirective.pipelined``) forwards each piece of its sum as soon as that piece of
every member is in: its forward costs about one update time on the most loaded link plus one
piece per hop (docs/aggregation-trees.md). :class:`SumStream` is the meeting point: the
listener's threads report each member's bytes as they land (:meth:`SumStream.progress`), the
forward's thread asks for the sum up to a point (:meth:`SumStream.wait`) and gets it computed
from what is in.

The last piece is released only when every member's frame has been received whole and
accepted (its CRC-32 checked, no NaN or infinity where the job refuses them:
:meth:`SumStream.accepted`), so the forward's CRC trailer — without which its receiver discards
the frame — never goes out for a sum of bytes that failed a check. A member that breaks off or
is refused aborts the stream (:meth:`SumStream.abort`): the forward raises
:class:`~mlfabric.daemon.channels.payloadio.PayloadAborted` and is cut off.

Only raw float32 payloads are summed this way (:func:`streamable`); the others go
store-and-forward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from mlfabric.daemon.channels.payloadio import PayloadAborted

__all__ = ["SumStream", "streamable"]

_F32 = np.dtype("<f4")


def streamable(tensors: Sequence[Any], payload_bytes: int) -> bool:
    """Whether a payload of these ``TensorLayout`` messages can be summed piece by piece.

    Every tensor raw float32 (no encoding) at a 4-byte aligned offset, so the payload is a
    run of float32 words (gaps between tensors, if any, are summed too and ignored).

    Examples
    --------
    >>> from mlfabric.proto.v1 import dataplane_pb2
    >>> t = dataplane_pb2.TensorLayout(name="w", dtype="float32", shape=[2], offset=0, nbytes=8)
    >>> streamable([t], 8), streamable([t], 10)
    (True, False)
    """
    if payload_bytes <= 0 or payload_bytes % _F32.itemsize:
        return False
    for t in tensors:
        if (
            t.dtype != "float32"
            or t.HasField("encoding")
            or t.offset % _F32.itemsize
            or t.nbytes % _F32.itemsize
        ):
            return False
    return True


class SumStream:
    """The sum of ``members``' payloads into ``out``, as far as all of them have arrived (thread-safe).

    Parameters
    ----------
    out : memoryview
        Writable, the payload's size: where the sum is written (what the forward sends).
    members : iterable of str
        The member ids the sum waits for.
    clock : callable
        Monotonic seconds (for :meth:`wait`'s deadline).

    Examples
    --------
    >>> a = np.arange(4, dtype="<f4").tobytes()
    >>> out = memoryview(bytearray(16))
    >>> s = SumStream(out, ["m1", "m2"])
    >>> s.begin("m1", memoryview(a)), s.begin("m2", memoryview(a))
    (False, True)
    >>> s.progress("m1", 16); s.progress("m2", 8)
    >>> s.wait(8, deadline=float("inf"))   # the first two words of both are in
    >>> np.frombuffer(out, "<f4")[:2].tolist()
    [0.0, 2.0]
    >>> s.progress("m2", 16); s.accepted("m1"); s.accepted("m2")
    >>> s.wait(16, deadline=float("inf"))
    >>> np.frombuffer(out, "<f4").tolist()
    [0.0, 2.0, 4.0, 6.0]
    """

    def __init__(
        self, out: memoryview, members: Iterable[str], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.out = out
        self.size = out.nbytes
        self.members = tuple(members)
        self._clock = clock
        self._changed = threading.Condition()
        self._views: dict[str, memoryview] = {}
        self._got: dict[str, int] = {}
        self._accepted: set[str] = set()
        self._done = 0  # bytes of ``out`` that hold the final sum
        self.failed: str | None = None

    def begin(self, member: str, view: memoryview) -> bool:
        """``member``'s payload lands in ``view``; True when every member has begun."""
        with self._changed:
            self._views[member] = view
            self._got[member] = 0
            self._changed.notify_all()
            return all(m in self._views for m in self.members)

    def relist(self, members: Iterable[str]) -> bool:
        """Wait for ``members`` instead (a re-issued directive); False once any of the sum was computed.

        Those that have begun must stay listed (the caller checks): only members still to come
        may join or leave.
        """
        with self._changed:
            if self._done:
                return False
            self.members = tuple(members)
            self._changed.notify_all()
            return True

    def begun(self, member: str) -> bool:
        """Whether ``member`` has begun to arrive."""
        with self._changed:
            return member in self._views

    def progress(self, member: str, got: int) -> None:
        """The first ``got`` bytes of ``member``'s payload are in."""
        with self._changed:
            self._got[member] = got
            self._changed.notify_all()

    def accepted(self, member: str) -> None:
        """``member``'s frame arrived whole and passed its checks."""
        with self._changed:
            self._accepted.add(member)
            self._changed.notify_all()

    def abort(self, reason: str) -> None:
        """The sum will never be complete: :meth:`wait` raises ``PayloadAborted`` (the first reason)."""
        with self._changed:
            if self.failed is None:
                self.failed = reason
            self._changed.notify_all()

    def _available(self) -> int:
        """Bytes every member has delivered (held ``_changed``): the sum can be computed that far."""
        if any(m not in self._views for m in self.members):
            return 0
        got = min(self._got[m] for m in self.members)
        if got >= self.size and all(m in self._accepted for m in self.members):
            return self.size
        return min(got, self.size - 1) // _F32.itemsize * _F32.itemsize  # the last byte: once accepted

    def wait(self, upto: int, deadline: float) -> None:
        """Block until ``out[:upto]`` holds the final sum, computing it from what has arrived.

        Raises
        ------
        PayloadAborted
            The stream was aborted, or ``deadline`` (of the clock) passed first (the stream is
            then aborted).
        """
        upto = min(upto, self.size)
        while True:
            with self._changed:
                while True:
                    if self.failed is not None:
                        raise PayloadAborted(self.failed)
                    if self._done >= upto:
                        return
                    start, end = self._done, self._available()
                    if end > start:
                        views = [self._views[m] for m in self.members]
                        break
                    left = deadline - self._clock()
                    if left <= 0:
                        self.failed = "the members did not arrive before the aggregate's deadline"
                        self._changed.notify_all()
                        raise PayloadAborted(self.failed)
                    self._changed.wait(min(left, 1.0))
            self._sum(views, start, end)  # outside the lock: members' bytes keep landing
            with self._changed:
                self._done = max(self._done, end)

    def _sum(self, views: list[memoryview], start: int, end: int) -> None:
        count, offset = (end - start) // _F32.itemsize, start
        total = np.frombuffer(self.out, _F32, count, offset)
        first = np.frombuffer(views[0], _F32, count, offset)
        if len(views) == 1:
            np.copyto(total, first)
            return
        np.add(first, np.frombuffer(views[1], _F32, count, offset), out=total)
        for view in views[2:]:
            np.add(total, np.frombuffer(view, _F32, count, offset), out=total)

    def release(self) -> None:
        """Forget the members' views (their frames are released by their owner)."""
        with self._changed:
            self._views.clear()
