"""Fuzzing the data plane (DESIGN §7): malformed frames at a real daemon's listener.

Each example opens a TCP connection to the ``ps`` daemon's data plane (the daemon that holds
server ``ps0``), writes one input, closes its write side and reads what comes back until the
daemon closes. Inputs: random bytes, a well-formed frame of any header (:func:`proto`) with a
payload of any length, the same frame mutated (truncated, extended, bytes flipped, a length
field replaced), and frames whose length prefix claims more than the limit. An UPDATE for
``job``/``ps0`` always carries a wrong CRC-32 (a correct one would be a legitimate update,
which the data plane does not authenticate). Whatever came back must be well-formed frames, and
an ERROR must name the problem; afterwards the daemon is alive, a normal push is APPLIED and
the model holds exactly the normal pushes.
"""

from __future__ import annotations

import os
import socket
import struct
import types
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlfabric.daemon.channels.frames import MAGIC, FrameError, FrameLimits, recv_frame
from mlfabric.daemon.channels.sockets import parse_address
from mlfabric.proto.v1 import dataplane_pb2

pytestmark = pytest.mark.slow

_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE


#: The real server's model as a data-plane layout: ("w", float64, [8]) at offset 0.
_REAL_LAYOUT = [("w", "float64", [8], 0, 64)]


def frame_bytes(header: Any, payload: bytes, job: str, server: str, good_crc: bool = False) -> bytes:
    """The wire bytes of ``header`` + ``payload`` (``good_crc``: the right CRC-32).

    An UPDATE for the real server whose layout is the real model's always gets a wrong CRC-32.
    """
    header.payload_bytes = len(payload)
    if good_crc:
        header.payload_crc32 = zlib.crc32(payload)
    trailer = struct.pack(">I", zlib.crc32(payload)) if header.crc_trailer else b""
    layout = [(t.name, t.dtype, list(t.shape), t.offset, t.nbytes) for t in header.tensors]
    real = header.kind == _UPDATE and header.job == job and header.server == server and layout == _REAL_LAYOUT
    if real:  # never a legitimate update: the CRC is wrong wherever it is carried
        bad = (zlib.crc32(payload) ^ 0x5A5A5A5A) & 0xFFFFFFFF
        header.payload_crc32 = bad
        trailer = struct.pack(">I", bad) if header.crc_trailer else b""
    raw = header.SerializeToString()
    return MAGIC + struct.pack(">I", len(raw)) + raw + payload + trailer


@st.composite
def aimed(draw: Any, job: str, server: str) -> bytes:
    """An UPDATE or GET for the real job's server with a layout near its model's, right CRC."""
    header = dataplane_pb2.FrameHeader(
        kind=draw(st.sampled_from([_UPDATE, dataplane_pb2.FRAME_KIND_GET])),
        job=job,
        server=server,
        update_id=draw(st.sampled_from(["w0/1", "x/1", "", "agg:0:1"])),
        worker=draw(st.sampled_from(["w0", "", "zz"])),
        base_version=draw(st.sampled_from([0, -1, 1, 10**9, -(2**63), 2**63 - 1])),
        norm=draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf")])),
        num_updates=draw(st.sampled_from([0, 1, 2, 2**32 - 1])),
        aggregate_id=draw(st.sampled_from(["", "agg:0:1", "w0/1"])),
        crc_trailer=draw(st.booleans()),
    )
    offset = 0
    for _ in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(["float64", "float32", "float16", "bfloat16", "uint8", "int64"]))
        shape = draw(st.lists(st.sampled_from([0, 1, 2, 4, 7, 8, 9, 64]), max_size=3))
        count = 1
        for d in shape:
            count *= d
        nbytes = count * {"float64": 8, "int64": 8, "float32": 4, "uint8": 1}.get(dtype, 2)
        header.tensors.add(
            name=draw(st.sampled_from(["w", "b", ""])), dtype=dtype, shape=shape, offset=offset, nbytes=nbytes
        )
        offset += nbytes
    for _ in range(draw(st.integers(0, 2))):
        header.members.add(update_id=draw(st.sampled_from(["w0/1", "w0/2", ""])), worker="w0")
    values = draw(st.sampled_from([1.0, float("nan"), float("inf"), 1e308]))
    payload = struct.pack("<d", values) * (offset // 8) + b"\x01" * (offset % 8)
    return frame_bytes(header, payload, job, server, good_crc=True)


def exchange(address: str, data: bytes, timeout: float = 5.0) -> list[Any] | None:
    """Write ``data``, close the write side, read every reply frame until the daemon closes.

    None when the daemon neither answered nor closed within ``timeout`` seconds.
    """
    host, port = parse_address(address)
    replies = []
    with socket.create_connection((host, port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the daemon rejected the start of it and closed; its ERROR may still be readable
        while True:
            try:
                frame = recv_frame(sock, FrameLimits(max_payload_bytes=1 << 20))
            except ConnectionResetError:
                break
            except TimeoutError:
                return None
            except FrameError as exc:
                assert "peer closed" in exc.reason, f"the daemon sent a malformed reply: {exc.reason}"
                break
            if frame is None:
                break
            replies.append(frame.header)
    return replies


def _sockets(pid: int) -> int:
    """Open sockets of process ``pid``."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            continue
    return sum(link.startswith("socket:") for link in links)


def describe(data: bytes) -> str:
    """The header of a frame's bytes, when it has one (for failure messages)."""
    try:
        (hlen,) = struct.unpack(">I", data[4:8])
        return f"{dataplane_pb2.FrameHeader.FromString(data[8 : 8 + hlen])} + {len(data) - 8 - hlen} bytes"
    except Exception:  # noqa: BLE001 - only a description of raw bytes
        return repr(data[:200])


def check_replies(replies: list[Any]) -> None:
    for h in replies:
        assert h.kind in (
            dataplane_pb2.FRAME_KIND_ERROR,
            dataplane_pb2.FRAME_KIND_ACK,
            dataplane_pb2.FRAME_KIND_MODEL,
        ), h
        if h.kind == dataplane_pb2.FRAME_KIND_ERROR:
            assert h.reason.strip(), f"an ERROR without a reason: {h}"


def test_malformed_frames_at_a_real_daemon(fuzz_cluster: types.SimpleNamespace, fz: Any) -> None:
    inputs = {"random": 0, "frame": 0, "aimed": 0, "mutated": 0, "oversized": 0}
    errors: list[str] = []
    hung: list[bytes] = []

    frames = st.tuples(fz.proto(dataplane_pb2.FrameHeader), st.binary(max_size=200), st.booleans()).map(
        lambda hp: frame_bytes(hp[0], hp[1], fz.job, fz.server, hp[2])
    )
    oversized = st.tuples(st.sampled_from([(1 << 20) + 1, 2**31, 2**32 - 1]), st.binary(max_size=16)).map(
        lambda t: MAGIC + struct.pack(">I", t[0]) + t[1]
    )
    cases = st.one_of(
        st.tuples(st.just("random"), st.binary(max_size=300)),
        st.tuples(st.just("random"), st.binary(max_size=40).map(lambda b: MAGIC + b)),
        st.tuples(st.just("frame"), frames),
        st.tuples(st.just("aimed"), aimed(fz.job, fz.server)),
        st.tuples(st.just("mutated"), frames.flatmap(fz.mutated)),
        st.tuples(st.just("oversized"), oversized),
    )

    # a member of an aggregate the daemon does not know waits up to 5 s for the scheduler's word
    # (it may come after the member): exchanges run 16 at a time, so those few cost no minutes
    pid = fuzz_cluster.processes.daemons["ps"]["pid"]
    sockets_before = _sockets(pid)
    pool = ThreadPoolExecutor(max_workers=16)
    sent: list[tuple[bytes, Future[list[Any] | None]]] = []

    @fz.settings
    @given(case=cases)
    def run(case: tuple[str, bytes]) -> None:
        kind, data = case
        inputs[kind] += 1
        sent.append((data, pool.submit(exchange, fuzz_cluster.ps_data, data, 15.0)))

    try:
        run()
        for data, future in sent:
            replies = future.result()
            if replies is None:
                hung.append(data)
                continue
            check_replies(replies)
            errors.extend(h.reason for h in replies if h.kind == dataplane_pb2.FRAME_KIND_ERROR)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    total = sum(inputs.values())
    kinds = sorted({reason[:30] for reason in errors})
    print(f"data plane: {total} inputs {inputs}; {len(errors)} ERROR replies of {len(kinds)} kinds: {kinds}")
    assert total >= fz.examples
    assert not hung, f"{len(hung)} inputs got neither an answer nor a close, e.g. {describe(hung[0])}"
    crashes = [reason for reason in errors if reason.startswith("internal error")]
    assert not crashes, f"the daemon's handler raised on: {crashes[:5]}"
    fz.healthy(fuzz_cluster)
    sockets_after = _sockets(pid)  # (memfds are pooled receive buffers, reused: not counted)
    print(f"ps daemon's sockets: {sockets_before} before, {sockets_after} after")
    assert sockets_after <= sockets_before + 4, "the daemon kept connections of finished exchanges"
