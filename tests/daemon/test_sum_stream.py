"""The pieces of pipelined aggregation: the sum stream, a streamed payload, a watched receive."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from mlfabric.daemon.channels.frames import FrameError, FrameHeader, FrameLimits, recv_frame, send_frame
from mlfabric.daemon.channels.payloadio import PayloadAborted, StreamedPayload
from mlfabric.daemon.roles.aggregator.stream import SumStream
from mlfabric.proto.v1 import dataplane_pb2

F32 = np.dtype("<f4")


def _stream(n: int, members: int) -> tuple[SumStream, list[np.ndarray], memoryview]:
    values = [np.full(n, i + 1, dtype=F32) for i in range(members)]
    out = memoryview(bytearray(n * 4))
    stream = SumStream(out, [f"m{i}" for i in range(members)])
    for i, v in enumerate(values):
        stream.begin(f"m{i}", memoryview(v.tobytes()))
    return stream, values, out


def test_the_sum_goes_as_far_as_every_member_has_arrived() -> None:
    stream, _, out = _stream(8, 3)
    stream.progress("m0", 32)
    stream.progress("m1", 32)
    stream.progress("m2", 9)  # two words and a byte
    stream.wait(8, deadline=float("inf"))
    assert np.frombuffer(out, F32)[:2].tolist() == [6.0, 6.0]
    with pytest.raises(PayloadAborted, match="deadline"):
        stream.wait(12, deadline=0.0)  # the third word is not in and the deadline has passed


def test_the_last_piece_waits_until_every_member_is_accepted() -> None:
    stream, _, out = _stream(4, 2)
    for m in ("m0", "m1"):
        stream.progress(m, 16)
    stream.accepted("m0")
    done = threading.Event()

    def finish() -> None:
        stream.wait(16, deadline=float("inf"))
        done.set()

    thread = threading.Thread(target=finish)
    thread.start()
    assert not done.wait(0.2)  # all bytes are in, but m1's CRC has not been checked
    stream.accepted("m1")
    thread.join(5)
    assert done.is_set() and np.frombuffer(out, F32).tolist() == [3.0] * 4


def test_abort_wakes_the_forward_with_the_first_reason() -> None:
    stream, _, _ = _stream(4, 2)
    errors: list[BaseException] = []

    def forward() -> None:
        try:
            stream.wait(16, deadline=float("inf"))
        except PayloadAborted as exc:
            errors.append(exc)

    thread = threading.Thread(target=forward)
    thread.start()
    stream.abort("member m1 broke off")
    stream.abort("later reason")
    thread.join(5)
    assert [str(e) for e in errors] == ["member m1 broke off"]


def _header(nbytes: int) -> dataplane_pb2.FrameHeader:
    h = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id="u1")
    h.tensors.add(name="w", dtype="float32", shape=[nbytes // 4], offset=0, nbytes=nbytes)
    return h


class _Watch:
    def __init__(self) -> None:
        self.progress_seen: list[int] = []
        self.aborted: list[str] = []

    def progress(self, got: int) -> None:
        self.progress_seen.append(got)

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)


def test_a_streamed_payload_arrives_whole_and_the_receiver_watches_it_land() -> None:
    data = np.arange(200_000, dtype=F32).tobytes()  # several stream pieces
    released: list[int] = []

    def wait(upto: int) -> None:
        released.append(upto)

    a, b = socket.socketpair()
    watch = _Watch()
    sender = threading.Thread(
        target=send_frame, args=(a, _header(len(data)), StreamedPayload(memoryview(data), wait))
    )
    sender.start()
    frame = recv_frame(b, FrameLimits(), watch=lambda header, payload: watch)
    sender.join(5)
    assert frame is not None and bytes(frame.payload) == data
    assert released[-1] == len(data) and released == sorted(released) and len(released) > 1
    assert watch.progress_seen[-1] == len(data) and len(watch.progress_seen) > 1 and not watch.aborted


def test_an_aborted_stream_is_cut_off_and_the_receiver_discards_it() -> None:
    data = np.arange(200_000, dtype=F32).tobytes()

    def wait(upto: int) -> None:
        if upto > 300_000:
            raise PayloadAborted("member broke off")

    a, b = socket.socketpair()
    watch = _Watch()
    failures: list[BaseException] = []

    def send() -> None:
        try:
            send_frame(a, _header(len(data)), StreamedPayload(memoryview(data), wait))
        except PayloadAborted as exc:
            failures.append(exc)
            a.close()  # what the peer pool does with a connection whose request raised

    sender = threading.Thread(target=send)
    sender.start()
    with pytest.raises(FrameError, match="peer closed mid-frame"):
        recv_frame(b, FrameLimits(), watch=lambda header, payload: watch)
    sender.join(5)
    assert [str(e) for e in failures] == ["member broke off"]
    assert watch.aborted and "peer closed mid-frame" in watch.aborted[0]
