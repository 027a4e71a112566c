"""The NaN/inf test fused into the receiver's CRC pass (recv_frame, recv_payload, _native.check).

Issue #16, defect 8: a non-finite update is refused where its payload is already being read,
not in an extra pass. These tests check that :func:`recv_frame` finds the first tensor holding
a NaN or an infinity for every float dtype, wherever the bad element sits (first, across a
receive piece boundary, last), in a payload of one piece or of several, and that the payload
and its CRC check are unchanged by it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypedDict, Unpack

import numpy as np
import pytest

from mlfabric import tensors as tcodec
from mlfabric.daemon.channels.frames import (
    Frame,
    FrameError,
    FrameHeader,
    FrameLimits,
    recv_frame,
    send_frame,
)
from mlfabric.daemon.channels.payloadio import RECV_PIECE_BYTES
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire import _native

LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=64 << 20)
BF16_BITS = {np.nan: 0x7FC0, np.inf: 0x7F80, -np.inf: 0xFF80}


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(20)
    b.settimeout(20)
    yield a, b
    a.close()
    b.close()


def _frame(tensors: dict[str, tuple[str, np.ndarray]]) -> tuple[FrameHeader, bytes]:
    """An UPDATE header for ``name -> (dtype name, array)`` back to back, and the payload."""
    header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id="h/1/7", job="j", server="s")
    parts, offset = [], 0
    for name, (dtype, arr) in tensors.items():
        raw = arr.tobytes()
        header.tensors.add(name=name, dtype=dtype, shape=arr.shape, offset=offset, nbytes=len(raw))
        parts.append(raw)
        offset += len(raw)
    return header, b"".join(parts)


class _Receive(TypedDict, total=False):
    """The options of :func:`recv_frame` these tests change."""

    chunk_bytes: int
    check_finite: Callable[[Any], bool] | None


def _exchange(
    pair: tuple[socket.socket, socket.socket], header: FrameHeader, payload: bytes, **recv: Unpack[_Receive]
) -> tuple[Frame, bytes]:
    a, b = pair
    t = threading.Thread(target=send_frame, args=(a, header, payload))
    t.start()
    try:
        frame = recv_frame(b, LIMITS, **recv)
    finally:
        t.join(20)
    assert frame is not None
    return frame, bytes(frame.payload)


def _bad_tensor(dtype: str, count: int, where: int, bad: float) -> np.ndarray:
    if dtype == "bfloat16":
        arr = np.full(count, 0x3F80, np.uint16)  # 1.0
        arr[where] = BF16_BITS[bad]
        return arr
    arr = np.ones(count, {"float16": np.float16, "float32": np.float32, "float64": np.float64}[dtype])
    arr[where] = bad
    return arr


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("big", [False, True], ids=["one-piece", "pieces"])
def test_non_finite_found_in_the_crc_pass(
    pair: tuple[socket.socket, socket.socket], dtype: str, bad: float, big: bool
) -> None:
    itemsize = 2 if dtype in ("float16", "bfloat16") else int(dtype[-2:]) // 8
    nbytes = 3 * RECV_PIECE_BYTES + 1000 if big else RECV_PIECE_BYTES // 8
    count = nbytes // itemsize
    second_piece = (RECV_PIECE_BYTES - 4000) // itemsize  # 4000 bytes of "first" before "t"
    for where in (0, second_piece if big else count // 2, count - 1):
        ok = np.arange(1000, dtype=np.float32)
        t = _bad_tensor(dtype, count, where, bad)
        header, payload = _frame({"first": ("float32", ok), "t": (dtype, t)})
        frame, got = _exchange(pair, header, payload)
        assert frame.finite_checked and frame.non_finite == "t", (dtype, bad, where)
        assert got == payload  # received intact, CRC verified


def test_finite_payload_and_a_sum_that_overflows_pass(pair: tuple[socket.socket, socket.socket]) -> None:
    huge = np.full(1 << 16, np.finfo(np.float32).max, np.float32)  # the block sum overflows to inf
    header, payload = _frame({"a": ("float64", np.ones(5000)), "huge": ("float32", huge)})
    frame, _ = _exchange(pair, header, payload)
    assert frame.finite_checked and frame.non_finite is None


def test_elements_split_across_receive_chunks(pair: tuple[socket.socket, socket.socket]) -> None:
    """Chunks of 7 bytes split every float64: each element is tested once it is whole."""
    t = np.ones(301)
    t[300] = np.nan
    header, payload = _frame({"x": ("float16", np.ones(3, np.float16)), "t": ("float64", t)})
    frame, _ = _exchange(pair, header, payload, chunk_bytes=7)
    assert frame.non_finite == "t"


def test_integer_tensors_are_not_tested(pair: tuple[socket.socket, socket.socket]) -> None:
    """uint16 words with a bfloat16 infinity's bits are integers, not floats: skipped."""
    words = np.full(4096, 0x7F80, np.uint16)
    header, payload = _frame({"ids": ("uint16", words), "c": ("int32", np.full(9, -1, np.int32))})
    frame, _ = _exchange(pair, header, payload)
    assert frame.finite_checked and frame.non_finite is None
    header, payload = _frame({"ids": ("uint16", words), "w": ("bfloat16", words)})
    frame, _ = _exchange(pair, header, payload)
    assert frame.non_finite == "w"


def test_check_off_and_other_frame_kinds(pair: tuple[socket.socket, socket.socket]) -> None:
    header, payload = _frame({"t": ("float32", np.array([np.nan], np.float32))})
    frame, _ = _exchange(pair, header, payload, check_finite=None)
    assert not frame.finite_checked and frame.non_finite is None
    header.kind = dataplane_pb2.FRAME_KIND_MODEL  # a model reply: not an update, not tested
    frame, _ = _exchange(pair, header, payload)
    assert not frame.finite_checked
    header.kind = dataplane_pb2.FRAME_KIND_UPDATE
    header.replica_version = 3  # a replicated entry: checked where it was first applied
    frame, _ = _exchange(pair, header, payload)
    assert not frame.finite_checked


def test_crc_mismatch_still_wins(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    header, payload = _frame({"t": ("float32", np.array([np.nan, 1.0], np.float32))})
    t = threading.Thread(target=send_frame, args=(a, header, payload), kwargs={"crc32": 1234})
    t.start()
    with pytest.raises(FrameError, match="CRC-32 mismatch"):
        recv_frame(b, LIMITS)
    t.join(10)


@pytest.mark.parametrize("seed", range(6))
def test_check_in_random_pieces_agrees_with_first_non_finite(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for i in range(int(rng.integers(1, 6))):
        kind = rng.choice(["float32", "float64", "float16", "raw"])
        n = int(rng.integers(0, 200_000))
        arr = (
            rng.integers(0, 0x7F00, n).astype(np.uint16)
            if kind == "raw"
            else rng.standard_normal(n).astype(kind)
        )
        if n and rng.random() < 0.4:
            arr[int(rng.integers(0, n))] = 0x7F80 if kind == "raw" else rng.choice([np.nan, np.inf, -np.inf])
        tensors[f"t{i}"] = arr
    layouts, total = tcodec.plan_layout(tensors)
    buf = bytearray(total)
    tcodec.encode_into(memoryview(buf), tensors, layouts)
    layout = tcodec.pack_layout(layouts)
    crc, found, pos = 0, -1, 0
    while pos < total:
        end = min(total, pos + int(rng.integers(1, 300_000)))
        crc, bad = _native.check(buf, pos, end, crc, layout)
        found = bad if found < 0 else found
        pos = end
    assert (layouts[found].name if found >= 0 else None) == tcodec.first_non_finite(tensors)
