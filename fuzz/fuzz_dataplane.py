"""Coverage-guided fuzz target: data-plane frames through ``recv_frame`` (DESIGN §7).

Run: ``python fuzz/fuzz_dataplane.py -max_total_time=180 [corpus_dir]`` (atheris/libFuzzer
flags). Each input is the byte stream a peer daemon sends; ``recv_frame`` reads frames from it
until the end. Only :class:`~mlfabric.daemon.channels.frames.FrameError` (naming the problem) may
come out; any other exception is a crash, saved by libFuzzer as ``crash-<sha1>``.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["mlfabric"]):
    from mlfabric.daemon.channels.frames import FrameError, FrameLimits, recv_frame
    from mlfabric.proto.v1 import dataplane_pb2  # noqa: F401 - instrumented with the decoder

_LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=1 << 16)


class BytesSocket:
    """The receiving end of a stream that carries ``data`` and then closes (no system calls)."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        n = min(len(view), len(self._data) - self._pos)
        view[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def test_one_input(data: bytes) -> None:
    sock = BytesSocket(data)
    for _ in range(64):
        try:
            frame = recv_frame(sock, _LIMITS)
        except FrameError as exc:
            if not exc.reason.strip():
                raise AssertionError("a FrameError without a reason") from exc
            return
        if frame is None:
            return
        if frame.payload.nbytes != frame.header.payload_bytes:
            raise AssertionError(
                f"payload of {frame.payload.nbytes} bytes, header says {frame.header.payload_bytes}"
            )


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
