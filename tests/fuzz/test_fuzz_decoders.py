"""Fuzzing the pure decoders (DESIGN §7): whatever the bytes, only the documented errors.

:func:`~mlfabric.daemon.channels.frames.recv_frame` (over a socket pair),
:func:`~mlfabric.daemon.channels.frames.check_header`,
:class:`~mlfabric.wire.framing.MessageReader` and the tensor layout of the daemon's payload
code each get 1,000 generated inputs, random and mutated from well-formed ones; each either
decodes or raises its one error class (``FrameError``, ``ProtocolError``, ``ValueError``)
with a message. These are fast: they run in every CI run, and the coverage-guided targets
under ``fuzz/`` run the same checks for longer (``docs/fuzzing.md``).
"""

from __future__ import annotations

import socket
import struct
import zlib
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mlfabric.daemon.channels.frames import (
    MAGIC,
    FrameError,
    FrameLimits,
    check_header,
    recv_frame,
    send_frame,
)
from mlfabric.proto.v1 import dataplane_pb2, local_pb2
from mlfabric.wire.framing import MessageReader, ProtocolError

_LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=1 << 16)


def _wire(header: Any, payload: bytes) -> bytes:
    """``header`` and ``payload`` as a frame's bytes (the CRC right or as the header says)."""
    header.payload_bytes = len(payload)
    raw = header.SerializeToString()
    trailer = struct.pack(">I", zlib.crc32(payload)) if header.crc_trailer else b""
    return MAGIC + struct.pack(">I", len(raw)) + raw + payload + trailer


def _well_formed(header: Any, payload: bytes) -> bytes:
    """A frame ``recv_frame`` accepts: an UPDATE of one float32 tensor covering ``payload``, its CRC.

    The random header's other fields stay as drawn. Hypothesis biases its draws with the
    constants of the modules loaded (hypothesis 6.15x), so random headers alone decode only
    by luck, more or less often depending on what else ran in the process.
    """
    header.kind = dataplane_pb2.FRAME_KIND_UPDATE
    header.model_bytes = header.range_offset = 0
    del header.tensors[:]
    payload = payload[: len(payload) // 4 * 4]
    if payload:
        header.tensors.add(
            name="w", dtype="float32", shape=[len(payload) // 4], offset=0, nbytes=len(payload)
        )
    header.crc_trailer = False
    header.payload_crc32 = zlib.crc32(payload)
    return _wire(header, payload)


def decode_frame(data: bytes) -> str:
    """Feed ``data`` to ``recv_frame`` until the end; what happened (raises anything else)."""
    a, b = socket.socketpair()
    try:
        a.sendall(data)  # small inputs: fit the socket buffer
        a.shutdown(socket.SHUT_WR)
        b.settimeout(5)
        frames = 0
        while True:
            try:
                frame = recv_frame(b, _LIMITS)
            except FrameError as exc:
                assert exc.reason.strip()
                return "error"
            if frame is None:
                return f"{frames} frames"
            assert frame.payload.nbytes == frame.header.payload_bytes
            frames += 1
    finally:
        a.close()
        b.close()


def decode_local(data: bytes) -> str:
    """Feed ``data`` to a ``MessageReader`` and parse each message as ``LocalRequest``."""
    a, b = socket.socketpair()
    reader = MessageReader(b, max_message=1 << 16)
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        messages = 0
        while True:
            try:
                body = reader.read(idle_timeout=5)
            except ProtocolError as exc:
                assert str(exc).strip()
                return "error"
            if body is None:
                return f"{messages} messages"
            try:
                local_pb2.LocalRequest.FromString(body)
            except Exception as exc:  # noqa: BLE001 - only DecodeError is allowed; named below
                assert type(exc).__name__ == "DecodeError", repr(exc)
            messages += 1
    finally:
        reader.close()
        a.close()
        b.close()


def test_recv_frame_decodes_or_names_the_problem(fz: Any) -> None:
    outcomes: dict[str, int] = {}
    drawn = st.tuples(fz.proto(dataplane_pb2.FrameHeader), st.binary(max_size=100))
    frames = st.one_of(drawn.map(lambda t: _wire(*t)), drawn.map(lambda t: _well_formed(*t)))

    @fz.settings
    @given(data=st.one_of(st.binary(max_size=200), frames, frames.flatmap(fz.mutated)))
    def run(data: bytes) -> None:
        outcome = decode_frame(data)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    run()
    print(f"recv_frame: {sum(outcomes.values())} inputs, outcomes {outcomes}")
    assert sum(outcomes.values()) >= fz.examples
    assert outcomes.get("1 frames", 0) > 0 and outcomes.get("error", 0) > 0


def test_check_header_accepts_or_names_the_problem(fz: Any) -> None:
    count = 0

    @fz.settings
    @given(header=fz.proto(dataplane_pb2.FrameHeader))
    def run(header: Any) -> None:
        nonlocal count
        count += 1
        try:
            check_header(header, _LIMITS)
        except FrameError as exc:
            assert exc.reason.strip()
            return
        a, b = socket.socketpair()  # a header it accepts can be sent and received
        try:
            with a, b:
                a.settimeout(5)
                b.settimeout(5)
                send_frame(a, header, b"\x00" * header.payload_bytes)
                frame = recv_frame(b, _LIMITS)
                assert frame is not None and list(frame.header.tensors) == list(header.tensors)
        except FrameError as exc:  # sizes a sender may use but this receiver's limits refuse
            assert "limit" in exc.reason, exc.reason

    run()
    assert count >= fz.examples


def test_local_framing_decodes_or_names_the_problem(fz: Any) -> None:
    outcomes: dict[str, int] = {}

    def framed(request: Any) -> bytes:
        body = request.SerializeToString()
        return struct.pack(">I", len(body)) + body

    messages = st.lists(fz.proto(local_pb2.LocalRequest).map(framed), min_size=1, max_size=3).map(b"".join)

    @fz.settings
    @given(data=st.one_of(st.binary(max_size=200), messages, messages.flatmap(fz.mutated)))
    def run(data: bytes) -> None:
        outcome = decode_local(data)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    run()
    print(f"local framing: {sum(outcomes.values())} inputs, outcomes {outcomes}")
    assert sum(outcomes.values()) >= fz.examples
