"""Frame encoding and decoding (daemon/channels/frames.py) over socket pairs."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import zlib
from collections.abc import Iterator
from typing import cast

import numpy as np
import pytest

from mlfabric.daemon.channels.frames import (
    MAGIC,
    FileSpan,
    FrameError,
    FrameHeader,
    FrameLimits,
    check_header,
    payload_crc32,
    recv_frame,
    send_frame,
)
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire import crc

LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=64 << 20)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


def update_header(tensors: dict[str, np.ndarray], update_id: str = "u1") -> tuple[FrameHeader, bytes]:
    """An UPDATE header laying out ``tensors`` back to back, and the concatenated payload."""
    header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id=update_id, job="j", server="s")
    parts, offset = [], 0
    for name, arr in tensors.items():
        raw = arr.tobytes()
        header.tensors.add(name=name, dtype=str(arr.dtype), shape=arr.shape, offset=offset, nbytes=len(raw))
        parts.append(raw)
        offset += len(raw)
    return header, b"".join(parts)


def send_in_thread(target: object, *args: object, **kwargs: object) -> threading.Thread:
    t = threading.Thread(target=target, args=args, kwargs=kwargs)  # type: ignore[arg-type]
    t.start()
    return t


def test_empty_payload_round_trip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    calls: list[int] = []

    def alloc(n: int) -> bytearray:
        calls.append(n)
        return bytearray(n)

    stats = send_frame(a, FrameHeader(kind=dataplane_pb2.FRAME_KIND_GET, job="j", server="s0", worker="w"))
    frame = recv_frame(b, LIMITS, alloc=alloc)
    assert frame is not None
    assert (frame.header.kind, frame.header.server, frame.header.worker) == (
        dataplane_pb2.FRAME_KIND_GET,
        "s0",
        "w",
    )
    assert frame.payload.nbytes == 0 and frame.buffer is None and calls == []
    assert stats.bytes == 0 and frame.stats.bytes == 0


def test_multi_tensor_round_trip_into_caller_buffer(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    rng = np.random.default_rng(1)
    tensors: dict[str, np.ndarray] = {
        "w1": rng.standard_normal((64, 32)).astype(np.float32),
        "b1": rng.standard_normal(32).astype(np.float64),
        "h": rng.standard_normal((3, 5, 7)).astype(np.float16),
        "empty": np.zeros((0, 4), np.float32),
    }
    header, payload = update_header(tensors)
    header.norm = 2.5
    header.base_version = 7
    allocated: list[bytearray] = []

    def alloc(n: int) -> bytearray:
        allocated.append(bytearray(n + 100))  # larger than asked is allowed
        return allocated[-1]

    t = send_in_thread(send_frame, a, header, payload)
    frame = recv_frame(b, LIMITS, alloc)
    t.join()
    assert frame is not None and frame.buffer is allocated[0]
    assert bytes(frame.payload) == payload
    assert frame.header.payload_bytes == len(payload)
    assert frame.header.payload_crc32 == zlib.crc32(payload)
    assert (frame.header.norm, frame.header.base_version) == (2.5, 7)
    for t_layout in frame.header.tensors:
        got = np.frombuffer(
            frame.payload[t_layout.offset : t_layout.offset + t_layout.nbytes], dtype=t_layout.dtype
        ).reshape(tuple(t_layout.shape))
        np.testing.assert_array_equal(got, tensors[t_layout.name])
    assert frame.stats.bytes == len(payload) and frame.stats.end >= frame.stats.start


@pytest.mark.parametrize("size", [10, 100_000, 3 << 20, (12 << 20) + 3])
@pytest.mark.parametrize("crc_given", [False, True])
@pytest.mark.parametrize("as_span", ["buffer", "span", "span_sendfile"])
def test_crc_in_header_or_trailer(
    pair: tuple[socket.socket, socket.socket], size: int, crc_given: bool, as_span: str
) -> None:
    """Without a CRC the sender appends it as a trailer; either way the receiver reports it verified."""
    a, b = pair
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    header, _ = update_header({"w": np.frombuffer(payload, np.uint8)})
    fd = os.memfd_create("test-crc")
    try:
        os.write(fd, payload)
        body: bytes | FileSpan = FileSpan(fd, 0, size) if as_span != "buffer" else payload
        crc = zlib.crc32(payload) if crc_given else None
        t = send_in_thread(send_frame, a, header, body, crc32=crc, zero_copy=as_span == "span_sendfile")
        head = b.recv(8, socket.MSG_PEEK | socket.MSG_WAITALL)
        (hlen,) = struct.unpack(">I", head[4:])
        wire = FrameHeader.FromString(b.recv(8 + hlen, socket.MSG_PEEK | socket.MSG_WAITALL)[8:])
        frame = recv_frame(b, LIMITS)
        t.join()
    finally:
        os.close(fd)
    assert wire.crc_trailer is not crc_given
    assert wire.payload_crc32 == (zlib.crc32(payload) if crc_given else 0)
    assert frame is not None and bytes(frame.payload) == payload
    assert frame.header.payload_crc32 == zlib.crc32(payload) and not frame.header.crc_trailer


@pytest.mark.parametrize("size", [1000, 20 << 20])
def test_corrupted_payload_detected(pair: tuple[socket.socket, socket.socket], size: int) -> None:
    """One flipped byte anywhere (in the first or a later receive piece) is a CRC mismatch."""
    a, b = pair
    payload = bytearray(np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes())
    header = good_header(size)
    header.payload_crc32 = zlib.crc32(payload)
    payload[size * 2 // 3] ^= 0x40
    t = send_in_thread(a.sendall, raw_frame(header, bytes(payload)))
    with pytest.raises(FrameError, match="CRC-32 mismatch"):
        recv_frame(b, FrameLimits(max_payload_bytes=64 << 20))
    t.join()


def test_trailer_mismatch_and_missing_trailer(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    header = good_header(4)
    header.crc_trailer = True
    a.sendall(raw_frame(header, b"abcd" + struct.pack(">I", zlib.crc32(b"abce"))))
    with pytest.raises(FrameError, match="CRC-32 mismatch"):
        recv_frame(b, LIMITS)
    a.sendall(raw_frame(header, b"abcd" + b"\0\0"))
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(FrameError, match=r"peer closed mid-frame \(CRC-32 trailer: 2 of 4"):
        recv_frame(b, LIMITS)


def test_header_not_modified_and_crc_passed_in(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    header, payload = update_header({"w": np.arange(10, dtype=np.float32)})
    send_frame(a, header, payload, crc32=zlib.crc32(payload))
    assert header.payload_bytes == 0 and header.payload_crc32 == 0  # the caller's copy is untouched
    frame = recv_frame(b, LIMITS)
    assert frame is not None and bytes(frame.payload) == payload


def test_wrong_crc_passed_in_is_caught_by_receiver(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    header, payload = update_header({"w": np.arange(10, dtype=np.float32)}, update_id="u-bad")
    send_frame(a, header, payload, crc32=zlib.crc32(payload) ^ 1)
    with pytest.raises(FrameError, match=r"CRC-32 mismatch on update 'u-bad'") as info:
        recv_frame(b, LIMITS)
    assert info.value.reply_possible


def test_memfd_span_sent_with_sendfile(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = np.arange(3 << 18, dtype=np.float32)  # 3 MiB, sent in 1 MiB chunks
    fd = os.memfd_create("test-span")
    try:
        os.write(fd, b"x" * 8192 + data.tobytes() + b"tail")
        span = FileSpan(fd, 8192, data.nbytes)
        header, _ = update_header({"w": data})
        assert payload_crc32(span) == zlib.crc32(data.tobytes())
        t = send_in_thread(send_frame, a, header, span, chunk_bytes=1 << 20, zero_copy=True)
        frame = recv_frame(b, LIMITS, alloc=lambda n: mmap.mmap(-1, n))
        t.join()
    finally:
        os.close(fd)
    assert frame is not None
    np.testing.assert_array_equal(np.frombuffer(frame.payload, np.float32), data)


def test_clean_close_between_frames_returns_none(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    assert recv_frame(b, LIMITS) is None


def raw_frame(header: FrameHeader, payload: bytes = b"", magic: bytes = MAGIC) -> bytes:
    raw = header.SerializeToString()
    return magic + struct.pack(">I", len(raw)) + raw + payload


def good_header(nbytes: int) -> FrameHeader:
    h = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, payload_bytes=nbytes)
    h.tensors.add(name="w", dtype="uint8", shape=[nbytes], offset=0, nbytes=nbytes)
    return h


@pytest.mark.parametrize(
    ("wire", "match", "reply_possible"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "bad magic", False),
        (MAGIC + struct.pack(">I", 5000), "header of 5000 bytes exceeds the limit of 4096", True),
        (MAGIC + struct.pack(">I", 1) + b"\x08", "header does not parse", True),
        (raw_frame(good_header(100 << 20)), "payload of 104857600 bytes exceeds the limit", True),
        (MAGIC + b"\x00", "peer closed mid-frame", False),
        (MAGIC + struct.pack(">I", 50) + b"\x08\x01", "peer closed mid-frame", False),
        (raw_frame(good_header(10), b"short"), r"peer closed mid-frame \(payload: 5 of 10", False),
    ],
)
def test_malformed_wire(
    pair: tuple[socket.socket, socket.socket], wire: bytes, match: str, reply_possible: bool
) -> None:
    a, b = pair
    a.sendall(wire)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(FrameError, match=match) as info:
        recv_frame(b, LIMITS)
    assert info.value.reply_possible is reply_possible


def layout(
    *tensors: tuple[str, str, list[int], int, int],
    size: int,
    kind: dataplane_pb2.FrameKind = dataplane_pb2.FRAME_KIND_UPDATE,
) -> FrameHeader:
    h = FrameHeader(kind=kind, payload_bytes=size)
    for name, dtype, shape, offset, nbytes in tensors:
        h.tensors.add(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes)
    return h


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (layout(("a", "float32", [2], 0, 8), size=12), "covers 8 bytes but payload_bytes is 12"),
        (layout(size=4), "covers 0 bytes but payload_bytes is 4"),
        (
            layout(("a", "float32", [2], 0, 8), ("b", "float32", [2], 4, 8), size=16),
            "'a' and 'b' overlap",
        ),
        (layout(("a", "float32", [4], 8, 16), size=16), r"'a': bytes \[8, 24\) out of range"),
        (layout(("a", "float32", [3], 0, 8), size=8), "nbytes 8 != 3 elements x 4 bytes"),
        (layout(("a", "complex64", [1], 0, 8), size=8), "unknown dtype 'complex64'"),
        (layout(("a", "float32", [-1, -2], 0, 8), size=8), "negative dimension"),
        (layout(size=0, kind=dataplane_pb2.FRAME_KIND_UNSPECIFIED), "unknown frame kind 0"),
        # a kind no enum value names, as the wire may carry it
        (layout(size=0, kind=cast(dataplane_pb2.FrameKind, 99)), "unknown frame kind 99"),
    ],
)
def test_bad_layout_rejected_by_receiver(
    pair: tuple[socket.socket, socket.socket], header: FrameHeader, match: str
) -> None:
    with pytest.raises(FrameError, match=match):
        check_header(header, LIMITS)
    a, b = pair
    a.sendall(raw_frame(header, b"\0" * header.payload_bytes))
    with pytest.raises(FrameError, match=match) as info:
        recv_frame(b, LIMITS)
    assert info.value.reply_possible


def test_sender_refuses_layout_that_does_not_match_payload(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    header, _ = update_header({"w": np.zeros(4, np.float32)})
    with pytest.raises(FrameError, match=r"bytes \[0, 16\) out of range of a 15-byte payload"):
        send_frame(a, header, b"\0" * 15)


def test_alloc_too_small_is_a_caller_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    header, payload = update_header({"w": np.zeros(4, np.float32)})
    send_frame(a, header, payload)
    with pytest.raises(ValueError, match=r"alloc\(16\) returned 8 bytes"):
        recv_frame(b, LIMITS, alloc=lambda n: bytearray(n // 2))


def test_crc32_matches_zlib_in_pieces() -> None:
    data = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    running = 0
    for start in range(0, len(data), 77_777):
        running = crc.crc32(memoryview(data)[start : start + 77_777], running)
    assert running == zlib.crc32(data) == payload_crc32(data)
