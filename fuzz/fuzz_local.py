"""Coverage-guided fuzz target: local-API framing and ``LocalRequest`` parsing (DESIGN §3).

Run: ``python fuzz/fuzz_local.py -max_total_time=180 [corpus_dir]``. Each input is the byte
stream a training process writes to its daemon's socket (sent through a real socket pair, as
``recv_fds`` needs one); :class:`~mlfabric.wire.framing.MessageReader` splits it into messages
and each is parsed as a ``LocalRequest`` and dispatched on its kind as the daemon does. Only
``ProtocolError`` and protobuf's ``DecodeError`` may come out.
"""

from __future__ import annotations

import socket
import sys

import atheris

with atheris.instrument_imports(include=["mlfabric"]):
    from google.protobuf.message import DecodeError

    from mlfabric.proto.v1 import local_pb2
    from mlfabric.wire.framing import MessageReader, ProtocolError


def test_one_input(data: bytes) -> None:
    if len(data) > 100_000:  # must fit the socket buffer: one writer, one reader, one thread
        return
    a, b = socket.socketpair()
    reader = MessageReader(b, max_message=1 << 16)
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        while True:
            try:
                body = reader.read(idle_timeout=1.0)
            except ProtocolError as exc:
                if not str(exc).strip():
                    raise AssertionError("a ProtocolError without a message") from exc
                return
            if body is None:
                return
            try:
                request = local_pb2.LocalRequest.FromString(body)
            except DecodeError:
                continue
            kind = request.WhichOneof("kind")
            if kind in ("push", "publish"):
                getattr(request, kind).has_payload  # noqa: B018 - what the daemon reads next
    finally:
        reader.close()
        a.close()
        b.close()


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
