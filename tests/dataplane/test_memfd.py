"""Recycled memfd buffers (mlfabric/wire/memfd.py), alone and as the listener's allocator."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from mlfabric.daemon.channels.frames import Frame, FrameHeader, FrameLimits
from mlfabric.daemon.channels.listener import DataPlaneListener, Response
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire.memfd import MemfdPool, size_class


@pytest.mark.parametrize(
    ("nbytes", "capacity"),
    [(0, 65536), (1, 65536), (65536, 65536), (65537, 131072), ((1 << 28) - 1, 1 << 28), (1 << 28, 1 << 28)],
)
def test_size_class(nbytes: int, capacity: int) -> None:
    assert size_class(nbytes) == capacity


def test_reuse_same_class_only_and_fd_shares_bytes() -> None:
    pool = MemfdPool(max_idle_bytes=1 << 24)
    a = pool.allocate(100_000)
    a[:3] = b"abc"
    assert os.pread(a.fd, 3, 0) == b"abc" and os.fstat(a.fd).st_size == 131072
    a.release()
    a.release()  # idempotent: not in the pool twice
    assert pool.idle_bytes == 131072
    b = pool.allocate(1 << 20)  # another class: new memfd
    c = pool.allocate(70_000)  # same class as a: a again
    d = pool.allocate(70_000)  # a is taken: new memfd
    assert c is a and b is not a and d is not a
    assert (pool.reused, pool.created) == (1, 3)
    for buf in (b, c, d):
        buf.release()
    pool.close()
    assert pool.idle_bytes == 0 and a.fd == -1 and a.closed


def test_full_pool_frees_instead_of_keeping() -> None:
    pool = MemfdPool(max_idle_bytes=65536)
    a, b = pool.allocate(10), pool.allocate(10)
    a.release()
    b.release()  # no room: freed
    assert pool.idle_bytes == 65536 and b.fd == -1 and a.fd >= 0
    pool.close()
    assert a.fd == -1  # closing the pool frees what it kept


def test_threads_never_share_a_buffer() -> None:
    pool = MemfdPool(max_idle_bytes=1 << 24)
    clashes: list[int] = []
    in_use: set[int] = set()
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            buf = pool.allocate(1000)
            with lock:
                if id(buf) in in_use:
                    clashes.append(id(buf))
                in_use.add(id(buf))
            with lock:
                in_use.discard(id(buf))
            buf.release()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clashes == [] and pool.created <= 4 and pool.reused + pool.created == 800
    pool.close()


def test_listener_receives_into_pooled_memfds() -> None:
    pool = MemfdPool(max_idle_bytes=1 << 26)
    seen: list[tuple[int, bytes]] = []

    def handler(frame: Frame) -> Response:
        assert frame.buffer is not None
        n = frame.header.payload_bytes
        seen.append((frame.buffer.fd, os.pread(frame.buffer.fd, n, 0)))  # what a server process reads
        frame.buffer.release()
        return Response(FrameHeader(kind=dataplane_pb2.FRAME_KIND_ACK, update_id=frame.header.update_id))

    listener = DataPlaneListener("127.0.0.1:0", handler, FrameLimits(), alloc=pool.allocate)
    address = listener.start()
    peers = PeerPool(FrameLimits())
    payloads = [np.full(300_000, i, np.float32).tobytes() for i in range(3)]
    try:
        for i, data in enumerate(payloads):
            header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id=f"u{i}")
            header.tensors.add(name="w", dtype="float32", shape=[300_000], offset=0, nbytes=len(data))
            peers.request(address, header, data)
    finally:
        peers.close()
        listener.stop()
        pool.close()
    assert [data for _, data in seen] == payloads
    assert len({fd for fd, _ in seen}) == 1 and pool.reused == 2  # one memfd served all three
