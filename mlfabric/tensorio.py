"""Named tensors in and out of a memfd: the one copy of a payload (DESIGN §7).

The training process hands an update or a model to its daemon in a memfd passed with the
local message: :func:`encode_pooled` writes an update into a recycled memfd of a
:class:`~mlfabric.wire.memfd.MemfdPool` (``crc=True``: with the payload's CRC-32, computed as the
bytes are copied, so the daemon never reads them), :func:`to_memfd` a model into a new one. The other
end gets them out with :func:`read_memfd` (a copy), :func:`map_memfd` (a view of the pages,
no copy) or :func:`from_fd` (either, from a local message's layouts). The payload's layout
(tensors back to back, no padding) and the dtype checks are :mod:`mlfabric.tensors`.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal, overload

import numpy as np

from mlfabric.wire import _native
from mlfabric.wire.tensors import (
    DTYPES,
    SPARSE_CODECS,
    WORD_DTYPES,
    Encoding,
    Layout,
    TensorError,
    _as_numpy,
    _to_torch,
    decode,
    layouts_from_pb,
    plan_layout,
    words_dtype,
)

__all__ = [
    "encode_pooled",
    "from_fd",
    "map_memfd",
    "read_memfd",
    "to_memfd",
    "write_fd",
]


def to_memfd(
    tensors: Mapping[str, object],
    name: str = "mlfabric-tensors",
    encoded: Mapping[str, tuple[str, tuple[int, ...], Encoding]] | None = None,
) -> tuple[int, list[Layout], int]:
    """Write the tensors into a new memfd (one copy) for passing to a daemon.

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The update or model.
    name : str
        The memfd's name (shows in ``/proc/PID/fd``).
    encoded : Mapping[str, (dtype, shape, Encoding)], optional
        The tensors whose value is a codec's words (:func:`~mlfabric.wire.tensors.plan_layout`;
        a model published with ``Params(model_compression=)``).

    Returns
    -------
    fd : int
        The memfd; the caller owns it and closes it.
    layouts : list of Layout
        Where each tensor sits.
    total : int
        Payload size in bytes.

    Examples
    --------
    >>> fd, layouts, n = to_memfd({"w": np.ones(4, np.float32)})
    >>> read_memfd(fd, layouts)["w"].sum()
    np.float32(4.0)
    >>> os.close(fd)
    """
    layouts, total = plan_layout(tensors, encoded)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        if total:
            os.ftruncate(fd, total)
        write_fd(fd, tensors, layouts)  # pwrite: 2-4x faster than faulting a fresh mmap
    except BaseException:
        os.close(fd)
        raise
    return fd, layouts, total


def write_fd(fd: int, tensors: Mapping[str, object], layouts: Sequence[Layout]) -> None:
    """Copy the tensors' bytes into a file (a reused memfd) at the offsets of ``layouts``.

    One copy per tensor with ``pwrite``: the file must already be at least as large as the
    payload (a pooled memfd, see :class:`mlfabric.wire.memfd.MemfdPool`).

    Parameters
    ----------
    fd : int
        The file (not closed here).
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The tensors, as given to :func:`plan_layout`.
    layouts : sequence of Layout
        From :func:`plan_layout`.

    Examples
    --------
    >>> t = {"w": np.arange(3, dtype=np.float32)}
    >>> layouts, n = plan_layout(t)
    >>> fd = os.memfd_create("x"); os.ftruncate(fd, 64); write_fd(fd, t, layouts)
    >>> read_memfd(fd, layouts)["w"].tolist()
    [0.0, 1.0, 2.0]
    >>> os.close(fd)
    """
    for layout in layouts:
        _pwrite_all(fd, _as_numpy(tensors[layout.name]).reshape(-1).view(np.uint8).data, layout.offset)


@overload
def encode_pooled(
    pool: Any,
    tensors: Mapping[str, object],
    *,
    crc: Literal[False] = False,
    encoded: Mapping[str, tuple[str, tuple[int, ...], Encoding]] | None = None,
) -> tuple[Any, list[Layout], int]: ...


@overload
def encode_pooled(
    pool: Any,
    tensors: Mapping[str, object],
    *,
    crc: Literal[True],
    encoded: Mapping[str, tuple[str, tuple[int, ...], Encoding]] | None = None,
) -> tuple[Any, list[Layout], int, int]: ...


def encode_pooled(
    pool: Any,
    tensors: Mapping[str, object],
    *,
    crc: bool = False,
    encoded: Mapping[str, tuple[str, tuple[int, ...], Encoding]] | None = None,
) -> tuple[Any, ...]:
    """Write the tensors into a recycled memfd from ``pool`` (one copy, no new pages once warm).

    Parameters
    ----------
    pool : mlfabric.wire.memfd.MemfdPool
        Where the buffer comes from.
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The update.
    crc : bool
        Also compute the payload's CRC-32, piece by piece right behind the copy
        (:func:`mlfabric.wire._native.copy_crc`; a fresh buffer is filled with ``pwrite``, which
        faults no pages in, and the CRC-32 read from the tensors).
    encoded : Mapping[str, (dtype, shape, Encoding)], optional
        The tensors whose value is a codec's words (:func:`~mlfabric.wire.tensors.plan_layout`).

    Returns
    -------
    buf : mlfabric.wire.memfd.PooledBuffer
        Holds the payload in its first ``total`` bytes; ``buf.fd`` is its memfd. The caller
        releases it (``buf.release()``) when no reader is left.
    layouts : list of Layout
        Where each tensor sits.
    total : int
        Payload size in bytes.
    crc32 : int
        Only with ``crc``: the payload's CRC-32 (zlib's).

    Examples
    --------
    >>> import zlib
    >>> from mlfabric.wire.memfd import MemfdPool
    >>> pool = MemfdPool()
    >>> buf, layouts, n = encode_pooled(pool, {"w": np.ones(4, np.float32)})
    >>> read_memfd(buf.fd, layouts)["w"].sum(), n
    (np.float32(4.0), 16)
    >>> buf.release()
    >>> buf, layouts, n, crc = encode_pooled(pool, {"w": np.ones(4, np.float32)}, crc=True)
    >>> crc == zlib.crc32(np.ones(4, np.float32).tobytes())
    True
    >>> buf.release(); pool.close()
    """
    layouts, total = plan_layout(tensors, encoded)
    buf = pool.allocate(total)
    checksum = 0
    try:
        if buf.uses > 1 and os.fstat(buf.fd).st_size < total:
            os.ftruncate(buf.fd, total)  # shrunk by someone since its last use: writing would SIGBUS
        with memoryview(buf) as view:
            for layout in layouts:
                src = _as_numpy(tensors[layout.name]).reshape(-1).view(np.uint8)
                dst = view[layout.offset : layout.offset + layout.nbytes]
                if buf.uses == 1:  # fresh pages: pwrite (no page faults), the CRC from the source
                    _pwrite_all(buf.fd, src.data, layout.offset)
                    checksum = _native.crc32(src, checksum) if crc else 0
                elif crc:  # pages this process mapped before: copy, each piece checksummed in cache
                    checksum = _native.copy_crc(dst, src, checksum)
                else:
                    dst[:] = src.data
                dst.release()
    except BaseException:
        buf.release()
        raise
    return (buf, layouts, total, checksum) if crc else (buf, layouts, total)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], offset + done)


def read_memfd(fd: int, layouts: Sequence[Layout], *, as_torch: bool = False) -> dict[str, Any]:
    """Named tensors read out of a memfd (or any file) laid out by ``layouts``.

    Parameters
    ----------
    fd : int
        The file descriptor (not closed here).
    layouts : sequence of Layout
        Where each tensor sits.
    as_torch : bool
        Return torch tensors.

    Returns
    -------
    dict
        name -> tensor, see :func:`decode`; an encoded tensor (a model published with
        ``Params(model_compression=)``) decoded to its own dtype.

    Raises
    ------
    TensorError
        When a tensor lies beyond the end of the file.
    CodecError
        An encoded tensor that does not decode (named).

    Examples
    --------
    >>> fd, layouts, _ = to_memfd({"w": np.zeros(2)})
    >>> list(read_memfd(fd, layouts))
    ['w']
    >>> os.close(fd)
    """
    size = os.fstat(fd).st_size
    arrays: dict[str, np.ndarray] = {}
    for layout in layouts:
        dtype = WORD_DTYPES.get(layout.encoding.words) if layout.encoding else DTYPES.get(layout.dtype)
        if dtype is None:
            raise TensorError(f"tensor {layout.name!r}: unknown dtype {words_dtype(layout)!r}")
        sparse = layout.encoding is not None and layout.encoding.codec in SPARSE_CODECS
        # a sparse tensor's bytes: its values and positions (their count is checked by the decode)
        arr = np.empty(layout.nbytes, np.uint8) if sparse else np.empty(layout.shape, dtype=dtype)
        if arr.nbytes != layout.nbytes or layout.offset + layout.nbytes > size:
            raise TensorError(
                f"tensor {layout.name!r}: layout {layout.shape} {words_dtype(layout)} at offset "
                f"{layout.offset} ({layout.nbytes} bytes) does not fit a {size}-byte payload"
            )
        view = arr.reshape(-1).view(np.uint8).data
        done = 0
        while done < layout.nbytes:  # pread: no page faults of a fresh mapping
            got = os.preadv(fd, [view[done:]], layout.offset + done)
            if got == 0:
                raise TensorError(f"tensor {layout.name!r}: file ended at offset {layout.offset + done}")
            done += got
        if layout.encoding is not None:  # the codec's words: decoded to the tensor's own dtype
            arr = decode(view, [replace(layout, offset=0)])[layout.name]
        arrays[layout.name] = arr
    if not as_torch:
        return arrays
    return {
        name: _to_torch(arr, layout.dtype)
        for (name, arr), layout in zip(arrays.items(), layouts, strict=True)
    }


def map_memfd(fd: int, layouts: Sequence[Layout], *, as_torch: bool = False) -> tuple[dict[str, Any], Any]:
    """Named tensors that view a memfd's pages (shared, writable, pre-faulted): no copy.

    The tensors see whatever the file holds: use them only while its owner keeps it unchanged
    (a server's update until its verdict), copy what must outlive that.

    Parameters
    ----------
    fd : int
        The file descriptor, opened read-write (not closed here; the mapping outlives it).
    layouts : sequence of Layout
        Where each tensor sits.
    as_torch : bool
        Return torch tensors.

    Returns
    -------
    tensors : dict
        name -> tensor, see :func:`decode`.
    mapping : mmap.mmap or None
        The mapping; close it (it refuses while views exist) or drop it when done.

    Raises
    ------
    TensorError
        When a tensor lies beyond the end of the file.

    Examples
    --------
    >>> fd, layouts, _ = to_memfd({"w": np.ones(3)})
    >>> tensors, mapping = map_memfd(fd, layouts)
    >>> os.pwrite(fd, np.zeros(1).tobytes(), 0) and tensors["w"].tolist()
    [0.0, 1.0, 1.0]
    >>> del tensors; mapping.close(); os.close(fd)
    """
    end = max((x.offset + x.nbytes for x in layouts), default=0)
    size = os.fstat(fd).st_size
    if end == 0 or end > size:  # decode names the tensor that does not fit
        return decode(b"" if end == 0 else bytes(size), layouts, as_torch=as_torch), None
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(fd, end, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        return decode(mapping, layouts, as_torch=as_torch, copy=False), mapping
    except BaseException:
        mapping.close()
        raise


def from_fd(messages: Sequence[Any], fd: int | None, *, as_torch: bool = False, mapped: bool = False) -> Any:
    """The tensors of a local message (``TensorLayout`` list + passed memfd), closing ``fd``.

    Parameters
    ----------
    messages : sequence of TensorLayout
        The message's layouts.
    fd : int or None
        The passed memfd (None: no payload); closed here.
    as_torch : bool
        Return torch tensors.
    mapped : bool
        View the memfd (:func:`map_memfd`, returns ``(tensors, mapping)``) instead of copying
        out of it (:func:`read_memfd`, returns ``tensors``).

    Examples
    --------
    >>> from mlfabric.tensors import layouts_to_pb
    >>> fd, layouts, _ = to_memfd({"w": np.ones(2)})
    >>> from_fd(layouts_to_pb(layouts), fd)["w"].tolist()
    [1.0, 1.0]
    """
    layouts = layouts_from_pb(messages)
    if fd is None:
        empty = decode(b"", layouts, as_torch=as_torch)
        return (empty, None) if mapped else empty
    try:
        if mapped:
            return map_memfd(fd, layouts, as_torch=as_torch)
        return read_memfd(fd, layouts, as_torch=as_torch)
    finally:
        os.close(fd)
