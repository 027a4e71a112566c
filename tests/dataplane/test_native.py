"""The data plane's per-byte loops in C (mlfabric/wire/_native.c): zlib's CRC-32 at every length
and alignment, the fused CRC + NaN/inf test of a range, and the copy with its CRC.

The extension is built by the README's install command; CI must exercise it, so these tests
fail (not skip) when it is missing."""

from __future__ import annotations

import itertools
import os
import struct
import zlib

import numpy as np
import pytest

from mlfabric.wire import _native as native

KINDS = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4}
BAD = {
    "float32": np.array([np.inf], np.float32).view(np.uint8),
    "float64": np.array([np.nan], np.float64).view(np.uint8),
    "float16": np.array([-np.inf], np.float16).view(np.uint8),
    "bfloat16": np.array([0x7FC0], np.uint16).view(np.uint8),  # a bfloat16 NaN
}


def _layout(*segments: tuple[int, int, int]) -> bytes:
    return b"".join(struct.pack("<3Q", *s) for s in segments)


def test_the_pclmul_path_is_used_on_this_machine() -> None:
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    assert native.implementation() == ("pclmul" if " pclmulqdq" in flags else "table")


@pytest.mark.parametrize(
    "length", [0, 1, 7, 15, 16, 63, 64, 79, 80, 81, 127, 128, 129, 1000, 65_553, 1 << 20]
)
def test_crc32_equals_zlib_at_every_length_and_alignment(length: int) -> None:
    data = os.urandom(length + 16)
    for skew in range(16):
        view = memoryview(data)[skew : skew + length]
        for value in (0, 1, 0xFFFFFFFF, 0x12345678):
            assert native.crc32(view, value) == zlib.crc32(view, value)


def test_crc32_continues_across_pieces() -> None:
    data = os.urandom(300_000)
    crc = 0
    for i in range(0, len(data), 7777):
        crc = native.crc32(data[i : i + 7777], crc)
    assert crc == zlib.crc32(data)


@pytest.mark.parametrize("dtype", sorted(KINDS))
def test_check_finds_the_first_non_finite_tensor_in_any_range(dtype: str) -> None:
    itemsize = 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
    n = 100_003 * itemsize
    head = 26  # an untested tensor first: the float32/float64 elements then straddle 64 KiB pieces
    payload = np.zeros(head + 2 * n, np.uint8)
    layout = _layout((0, head, 0), (head, n, KINDS[dtype]), (head + n, n, KINDS[dtype]))
    assert native.check(payload, 0, payload.size, 0, layout) == (zlib.crc32(payload.tobytes()), -1)
    # a bad element in the third tensor: the one holding the first byte of a 64 KiB piece
    third = head + n
    boundary = (third // 65536 + 1) * 65536
    at = boundary - (boundary - third) % itemsize
    payload[at : at + itemsize] = BAD[dtype]
    crc, bad = native.check(payload, 0, payload.size, 0, layout)
    assert (crc, bad) == (zlib.crc32(payload.tobytes()), 2)
    # checked in ranges that cut elements in two, as a receiver does while bytes arrive
    crc, found = 0, -1
    cuts = [0, 5, 65_537, at + 1, at + itemsize + 3, payload.size]
    for lo, hi in itertools.pairwise(cuts):
        crc, bad = native.check(payload, lo, hi, crc, layout)
        found = bad if found < 0 else found
    assert crc == zlib.crc32(payload.tobytes()) and found == 2
    # the same bytes in the untested tensor are not reported
    clean = np.zeros(head + n, np.uint8)
    clean[:itemsize] = BAD[dtype]
    assert native.check(clean, 0, clean.size, 0, _layout((0, head, 0), (head, n, KINDS[dtype])))[1] == -1


def test_finite_extremes_pass() -> None:
    values = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 0.0, -0.0, 1e-45], np.float32)
    layout = _layout((0, values.nbytes, KINDS["float32"]))
    assert native.check(values.view(np.uint8), 0, values.nbytes, 0, layout)[1] == -1


def test_check_refuses_bad_ranges_and_layouts() -> None:
    data = bytes(100)
    with pytest.raises(ValueError, match="range"):
        native.check(data, 0, 101, 0, b"")
    with pytest.raises(ValueError, match="layout"):
        native.check(data, 0, 10, 0, b"\0" * 5)
    with pytest.raises(TypeError, match="contiguous"):
        native.check(12, 0, 1, 0, b"")  # type: ignore[arg-type]  # the refusal under test


def test_copy_crc_copies_and_checksums() -> None:
    src = os.urandom(200_001)
    dst = bytearray(200_010)
    assert native.copy_crc(dst, src, 7) == zlib.crc32(src, 7)
    assert bytes(dst[: len(src)]) == src
    with pytest.raises(ValueError, match="do not fit"):
        native.copy_crc(bytearray(3), b"abcd")
    with pytest.raises(TypeError, match="writable"):
        native.copy_crc(b"xxxx", b"ab")  # type: ignore[arg-type]  # the refusal under test


@pytest.mark.parametrize("length", [0, 1, 63, 64, 79, 16_384, 16_385, 200_001])
def test_copy_crc_at_every_destination_alignment(length: int) -> None:
    """The non-temporal copy handles any destination offset, head and tail."""
    src = os.urandom(length)
    for skew in range(17):
        dst = bytearray(length + 32)
        view = memoryview(dst)[skew:]
        assert native.copy_crc(view, src) == zlib.crc32(src)
        assert bytes(view[:length]) == src and not any(dst[:skew]) and not any(dst[skew + length :])
