"""The CRC-32 of payloads, one implementation choice for the daemon and the client.

Every data-plane frame carries the zlib/IEEE CRC-32 of its payload (``dataplane.proto``); a
worker computes it while it copies a push into its memfd (:mod:`mlfabric.api`), a daemon
while it sends or receives. Both import :func:`crc32` from here, so both use the same
implementation: ISA-L when ``isal`` is installed, else :func:`zlib.crc32`.
"""

from __future__ import annotations

import contextlib
import mmap
import zlib
from collections.abc import Callable

__all__ = ["crc32", "crc32_implementation", "use_crc32"]


#: CRC-32 implementations by name; all compute zlib's checksum (ISA-L's at about 5x less CPU).
_CRC32: dict[str, Callable[..., int]] = {"zlib": zlib.crc32}
with contextlib.suppress(ImportError):
    from isal import isal_zlib

    _CRC32["isal"] = isal_zlib.crc32
_active = ["isal" if "isal" in _CRC32 else "zlib"]


def crc32_implementation() -> str:
    """The name of the CRC-32 implementation in use: ``"isal"`` when installed, else ``"zlib"``.

    Examples
    --------
    >>> crc32_implementation() in ("isal", "zlib")
    True
    """
    return _active[0]


def use_crc32(name: str) -> None:
    """Choose the CRC-32 implementation of this process (``"isal"`` or ``"zlib"``; for benchmarks).

    Examples
    --------
    >>> before = crc32_implementation()
    >>> use_crc32("zlib"); crc32_implementation()
    'zlib'
    >>> use_crc32(before)
    """
    if name not in _CRC32:
        raise ValueError(f"CRC-32 implementation {name!r} not available; have {sorted(_CRC32)}")
    _active[0] = name


def crc32(data: bytes | bytearray | memoryview | mmap.mmap, value: int = 0) -> int:
    """CRC-32 (zlib/IEEE) of ``data``, continuing from ``value``; releases the GIL on large data.

    Uses ISA-L (``pip install isal``) when available: the same checksum as ``zlib.crc32`` at about
    a fifth of the CPU time, which is most of the data plane's own cost per byte.

    Examples
    --------
    >>> crc32(b"world", crc32(b"hello ")) == zlib.crc32(b"hello world")
    True
    """
    return _CRC32[_active[0]](data, value)
