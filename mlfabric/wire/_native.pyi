"""Types of the C extension mlfabric/wire/_native.c (the data plane's per-byte loops)."""

import mmap
from typing import Any, TypeAlias

import numpy as np

#: Anything with a contiguous buffer (the C functions take the buffer protocol).
Data: TypeAlias = bytes | bytearray | memoryview | mmap.mmap | np.ndarray[Any, Any]
Writable: TypeAlias = bytearray | memoryview | mmap.mmap | np.ndarray[Any, Any]

def crc32(data: Data, value: int = 0, /) -> int: ...
def check(data: Data, start: int, end: int, value: int, layout: Data, /) -> tuple[int, int]: ...
def copy_crc(dst: Writable, src: Data, value: int = 0, /) -> int: ...
def implementation() -> str: ...
