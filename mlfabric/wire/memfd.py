"""Recycled memfd-backed buffers for payloads: the one pool the daemon and the client share.

A daemon receives every update into a memfd so that it can pass the fd on to the server process
(DEVELOPERS.md, "shared memory"). Fresh memory is expensive: on loopback, receiving into new
pages (the kernel allocates and zeroes each one on first touch) halves the data plane's rate
compared with receiving into pages already mapped, which is what ``torch.distributed`` and a raw
socket benchmark do when they reuse one tensor. :class:`MemfdPool` keeps released buffers,
mapped and touched, and hands them out again for payloads of the same size class.

Use it as the data plane's allocator::

    pool = MemfdPool(max_idle_bytes=1 << 30)
    listener = DataPlaneListener(addr, handler, limits, alloc=pool.allocate)
    ...
    frame.buffer.fd          # pass this to the server process (payload is the first nbytes)
    frame.buffer.release()   # when nobody reads the payload any more: back to the pool

Workers use a pool the same way for the updates they push (``Worker.push``), releasing a
buffer when its push resolved. :func:`privatize` rescues a mapping whose views outlive the
buffer's turn (a server's ``on_update`` that keeps the update).

A buffer's capacity is ``nbytes`` rounded up to a power of two (at least 64 KiB); its memfd has
that size, and only the first ``nbytes`` bytes belong to the payload (use the tensor layout, not
``fstat``). ``release`` must come after the last reader is done: the next payload overwrites it.

Memory is bounded two ways. A ``budget`` (any object with ``acquire(nbytes, timeout)`` and
``release(nbytes)``, e.g. the daemon's ``ByteBudget``) is charged each payload's size while its
buffer is handed out: :meth:`MemfdPool.allocate` waits for budget (back-pressure). Released
buffers are kept only up to ``max_idle_bytes``, and :meth:`MemfdPool.trim` frees those idle for
longer than ``max_idle_seconds``, so a spike of big payloads gives its memory back to the OS.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["MemfdPool", "PooledBuffer", "allocate", "privatize", "size_class"]

#: Smallest capacity handed out.
MIN_CLASS_BYTES = 64 * 1024


def size_class(nbytes: int) -> int:
    """The capacity of the buffer that serves a payload of ``nbytes`` bytes.

    Examples
    --------
    >>> size_class(1), size_class(65536), size_class(65537), size_class(3 << 20)
    (65536, 65536, 131072, 4194304)
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return max(MIN_CLASS_BYTES, 1 << max(0, nbytes - 1).bit_length())


class PooledBuffer(mmap.mmap):
    """A shared mapping of a memfd; ``fd`` is the memfd, ``release()`` gives it back to its pool.

    The one buffer type payloads travel in (client and daemon). Created by
    :meth:`MemfdPool.allocate`, or by :func:`allocate` for a buffer of its own (no pool:
    ``release()`` frees it), not directly.
    """

    fd: int
    capacity: int
    #: Times the buffer was handed out (1: fresh pages, better filled with ``pwrite`` than mapped).
    uses: int
    _pool: MemfdPool | None
    #: Bytes charged to the pool's budget while handed out; when it was last released.
    _charged: int
    _idle_since: float
    #: made by :func:`allocate`: no pool, ``release()`` frees it
    _own: bool = False

    def release(self) -> None:
        """Return the buffer to its pool (or free it when the pool is full or closed); idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._uncharge(self)
            pool._give_back(self)
        elif self._own:
            self._free()

    def discard(self) -> None:
        """Free the buffer instead of pooling it: for when a reader may still use it; idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._uncharge(self)
        self._free()

    def _free(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(BufferError):  # a view still exists: the mapping goes with it
            self.close()


class MemfdPool:
    """A thread-safe pool of :class:`PooledBuffer` by size class.

    Parameters
    ----------
    max_idle_bytes : int
        Total capacity of released buffers kept for reuse; beyond it released buffers are freed.
    name : str
        Name of the memfds (shows in ``/proc/PID/fd``).
    budget : object, optional
        Charged ``nbytes`` per buffer handed out (``acquire(nbytes, timeout)``, ``release(nbytes)``);
        :meth:`allocate` raises what ``acquire`` raises (a ``MemoryError`` when it cannot wait).
    budget_timeout : float, optional
        Seconds :meth:`allocate` waits for budget (None: as long as it takes).
    max_idle_seconds : float, optional
        :meth:`trim` frees released buffers idle this long (None: kept until :meth:`close`).
    clock : callable
        Monotonic seconds (idle times).

    Examples
    --------
    >>> pool = MemfdPool(max_idle_bytes=1 << 20)
    >>> buf = pool.allocate(1000)
    >>> buf[:5] = b"hello"; os.pread(buf.fd, 5, 0)
    b'hello'
    >>> buf.release()
    >>> pool.allocate(2000) is buf        # same size class: the same memfd, already mapped
    True
    >>> pool.close()

    Idle buffers go back to the OS after ``max_idle_seconds``:

    >>> now = [0.0]
    >>> pool = MemfdPool(1 << 20, max_idle_seconds=5.0, clock=lambda: now[0])
    >>> pool.allocate(1000).release(); pool.idle_bytes
    65536
    >>> now[0] = 4.0; pool.trim(), pool.idle_bytes
    (0, 65536)
    >>> now[0] = 6.0; pool.trim(), pool.idle_bytes
    (65536, 0)
    """

    def __init__(
        self,
        max_idle_bytes: int = 1 << 30,
        name: str = "mlfabric-payload",
        *,
        budget: Any = None,
        budget_timeout: float | None = None,
        max_idle_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_idle = max_idle_bytes
        self._name = name
        self.budget = budget
        self._budget_timeout = budget_timeout
        self._max_idle_seconds = max_idle_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: dict[int, list[PooledBuffer]] = {}
        self._idle_bytes = 0
        self._closed = False
        #: Allocations served from the pool / with a new memfd (for tests and metrics).
        self.reused = 0
        self.created = 0
        #: Bytes of idle buffers freed by :meth:`trim` so far.
        self.trimmed_bytes = 0

    @property
    def idle_bytes(self) -> int:
        """Total capacity of the buffers waiting for reuse."""
        return self._idle_bytes

    def allocate(self, nbytes: int) -> PooledBuffer:
        """A buffer of at least ``nbytes`` bytes (the data plane's ``alloc``).

        Parameters
        ----------
        nbytes : int
            Payload size.

        Returns
        -------
        PooledBuffer
            A writable shared mapping with ``fd`` and ``release()``.
        """
        capacity = size_class(nbytes)
        if self.budget is not None:
            self.budget.acquire(nbytes, self._budget_timeout)
        try:
            return self._allocate(nbytes, capacity)
        except BaseException:
            if self.budget is not None:
                self.budget.release(nbytes)
            raise

    def _allocate(self, nbytes: int, capacity: int) -> PooledBuffer:
        with self._lock:
            idle = self._idle.get(capacity)
            if idle:
                buf = idle.pop()
                self._idle_bytes -= capacity
                self.reused += 1
                buf._pool = self
                buf.uses += 1
                buf._charged = nbytes if self.budget is not None else 0
                return buf
            self.created += 1
        buf = _new_buffer(self._name, capacity)
        buf._pool = self
        buf._charged = nbytes if self.budget is not None else 0
        return buf

    def _uncharge(self, buf: PooledBuffer) -> None:
        charged, buf._charged = buf._charged, 0
        if charged and self.budget is not None:
            self.budget.release(charged)

    def _give_back(self, buf: PooledBuffer) -> None:
        with self._lock:
            if not self._closed and self._idle_bytes + buf.capacity <= self._max_idle:
                buf._idle_since = self._clock()
                self._idle.setdefault(buf.capacity, []).append(buf)
                self._idle_bytes += buf.capacity
                return
        buf._free()

    def trim(self) -> int:
        """Free the released buffers idle for ``max_idle_seconds`` or longer; the bytes freed.

        Without ``max_idle_seconds`` nothing is freed. The daemon calls this periodically.
        """
        if self._max_idle_seconds is None:
            return 0
        cutoff = self._clock() - self._max_idle_seconds
        freed: list[PooledBuffer] = []
        with self._lock:
            for capacity, idle in list(self._idle.items()):
                keep = [b for b in idle if b._idle_since > cutoff]
                freed += [b for b in idle if b._idle_since <= cutoff]
                if keep:
                    self._idle[capacity] = keep
                else:
                    del self._idle[capacity]
            nbytes = sum(b.capacity for b in freed)
            self._idle_bytes -= nbytes
            self.trimmed_bytes += nbytes
        for buf in freed:
            buf._free()
        return nbytes

    def close(self) -> None:
        """Free every idle buffer; buffers released later are freed, not kept."""
        with self._lock:
            self._closed = True
            bufs = [b for idle in self._idle.values() for b in idle]
            self._idle.clear()
            self._idle_bytes = 0
        for buf in bufs:
            buf._free()


def _new_buffer(name: str, capacity: int) -> PooledBuffer:
    """A fresh memfd of ``capacity`` bytes, mapped shared; no pool, nothing charged."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
        buf = PooledBuffer(fd, capacity)
    except BaseException:
        os.close(fd)
        raise
    buf.fd, buf.capacity, buf.uses, buf._pool, buf._charged = fd, capacity, 1, None, 0
    return buf


def allocate(nbytes: int, name: str = "mlfabric-dataplane") -> PooledBuffer:
    """A buffer of its own of ``nbytes`` bytes (at least 1), in no pool: ``release()`` frees it.

    For one-off payloads whose fd goes on to a local process (a model fetched from a peer
    daemon for a ``get``), or an allocator where no pool is wanted (``alloc=allocate``).

    Examples
    --------
    >>> buf = allocate(8)
    >>> buf[:2] = b"hi"; os.pread(buf.fd, 2, 0), len(buf)
    (b'hi', 8)
    >>> buf.release(); buf.fd
    -1
    """
    buf = _new_buffer(name, max(nbytes, 1))
    buf._own = True
    return buf


#: Linux ``MAP_FIXED`` (the mmap module does not export it).
_MAP_FIXED = 0x10


def privatize(mapping: mmap.mmap) -> None:
    """Give a shared mapping private pages holding the same bytes, at the same address.

    For a payload mapping that cannot be closed because views of it escaped (a server's
    ``on_update`` kept the update): the views keep their bytes when the memfd is reused. The
    pages are replaced in place (``MAP_FIXED`` anonymous memory) and refilled, two copies, paid
    only in that case. Linux only, like memfds.

    Parameters
    ----------
    mapping : mmap.mmap
        An open mapping; it then maps the private copy (closing it frees that).

    Examples
    --------
    >>> import numpy as np
    >>> fd = os.memfd_create("x"); os.ftruncate(fd, 4096)
    >>> mapping = mmap.mmap(fd, 4096); mapping[:3] = b"abc"
    >>> view = np.frombuffer(mapping, np.uint8, count=3)
    >>> privatize(mapping); os.pwrite(fd, b"xyz", 0)
    3
    >>> bytes(view), os.pread(fd, 3, 0)
    (b'abc', b'xyz')
    >>> os.close(fd)
    """
    size = len(mapping)
    saved = bytes(mapping)
    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    got = libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap(MAP_FIXED) of {size} bytes failed: {os.strerror(err)}")
    ctypes.memmove(address, saved, size)
