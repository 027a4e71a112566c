"""The CRC-32 of payloads, one implementation for the daemon and the client.

Every data-plane frame carries the zlib/IEEE CRC-32 of its payload (``dataplane.proto``); a
worker computes it while it copies a push into its memfd (:func:`mlfabric.tensorio.encode_pooled`),
a daemon while it receives a frame or, when the sender did not know it, while it sends. Both
sides use the C extension :mod:`mlfabric.wire._native` (PCLMULQDQ folding where the CPU has
it, about 0.09 CPU seconds per GB; built by ``pip install``): :func:`crc32` here, and the
extension's fused ``check`` (CRC-32 with the NaN/inf test) and ``copy_crc`` (copy with CRC-32).
"""

from __future__ import annotations

import mmap

import numpy as np

from mlfabric.wire import _native

__all__ = ["crc32"]


def crc32(data: bytes | bytearray | memoryview | mmap.mmap | np.ndarray, value: int = 0) -> int:
    """CRC-32 (zlib/IEEE) of ``data``, continuing from ``value``; releases the GIL.

    Examples
    --------
    >>> import zlib
    >>> crc32(b"world", crc32(b"hello ")) == zlib.crc32(b"hello world")
    True
    """
    return _native.crc32(data, value)
