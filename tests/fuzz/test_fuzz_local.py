"""Fuzzing the local API (DESIGN §3): malformed messages and descriptors at real daemons' sockets.

Each example connects to a daemon's Unix socket (``ps``, which holds server ``ps0``, or
``w0``), writes its input, closes its write side and reads every ``LocalEvent`` until the
daemon closes. Inputs: random bytes, a length prefix over the 16 MiB limit, and sequences of
length-prefixed ``LocalRequest`` messages of any content (:func:`proto`; unknown jobs, wrong
shapes, negative sizes, NaN norms, ``has_payload`` without a descriptor), each message with
no descriptor, or a memfd of random bytes, a pipe, ``/dev/null``, a directory or a socket
passed with it. Pushes to the real server never carry exactly its model's layout (float64
``w`` of 8), so none is a legitimate update. Every event must parse and every error name its
problem; afterwards the daemons are alive, a normal push is APPLIED and the model holds
exactly the normal pushes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import types
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlfabric.proto.v1 import dataplane_pb2, local_pb2

pytestmark = pytest.mark.slow

_FD_KINDS = ["none", "memfd", "pipe", "devnull", "directory", "socket"]


def _real_layout(request: Any) -> bool:
    kind = request.WhichOneof("kind")
    if kind != "push":
        return False
    layout = [(t.name, t.dtype, list(t.shape), t.offset, t.nbytes) for t in request.push.tensors]
    return layout == [("w", "float64", [8], 0, 64)]


def _open_fd(kind: str, content: bytes) -> tuple[int | None, list[int]]:
    """A descriptor of ``kind`` to pass, and every descriptor to close afterwards."""
    if kind == "memfd":
        fd = os.memfd_create("fuzz")
        os.write(fd, content)
        return fd, [fd]
    if kind == "pipe":
        r, w = os.pipe()
        return r, [r, w]
    if kind == "devnull":
        fd = os.open(os.devnull, os.O_RDWR)
        return fd, [fd]
    if kind == "directory":
        fd = os.open("/", os.O_RDONLY)
        return fd, [fd]
    if kind == "socket":
        a, b = socket.socketpair()
        fd = a.detach()
        return fd, [fd, b.detach()]
    return None, []


def exchange(path: str, pieces: list[tuple[bytes, str, bytes]], timeout: float) -> list[Any] | None:
    """Send ``(bytes, fd kind, memfd content)`` pieces, close the write side, read every event.

    None when the daemon neither answered nor closed within ``timeout`` seconds.
    """
    events = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        to_close: list[int] = []
        try:
            for data, fd_kind, content in pieces:
                if fd_kind == "await":  # a registration: wait for its answer before going on
                    sock.sendall(data)
                    head = sock.recv(4, socket.MSG_WAITALL)
                    (n,) = struct.unpack(">I", head)
                    body = sock.recv(n, socket.MSG_WAITALL)
                    event = local_pb2.LocalEvent.FromString(body)
                    assert event.WhichOneof("kind") == "registered", event
                    continue
                fd, owned = _open_fd(fd_kind, content)
                to_close += owned
                if fd is None:
                    sock.sendall(data)
                else:
                    sent = socket.send_fds(sock, [data], [fd])
                    sock.sendall(data[sent:])
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the daemon closed after a framing error; its error may still be readable
        finally:
            for fd in to_close:
                with contextlib.suppress(OSError):
                    os.close(fd)
        buf = b""
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 16)
            except TimeoutError:
                return None
            except ConnectionResetError:
                break
            for fd in fds:
                os.close(fd)
            if not data:
                break
            buf += data
        while len(buf) >= 4:
            (n,) = struct.unpack(">I", buf[:4])
            assert len(buf) >= 4 + n, f"the daemon sent a truncated event ({len(buf) - 4} of {n} bytes)"
            events.append(local_pb2.LocalEvent.FromString(buf[4 : 4 + n]))
            buf = buf[4 + n :]
        assert not buf, f"trailing bytes after the daemon's events: {buf!r}"
    return events


def test_malformed_local_messages_at_real_daemons(fuzz_cluster: types.SimpleNamespace, fz: Any) -> None:
    inputs = {"random": 0, "oversized": 0, "messages": 0, "aimed": 0}
    fd_kinds = dict.fromkeys([*_FD_KINDS, "await"], 0)
    errors: list[str] = []
    hung: list[Any] = []

    def framed(request: Any) -> bytes:
        if _real_layout(request):
            request.push.tensors[0].dtype = "float32"  # never a legitimate update of ps0
        body = request.SerializeToString()
        return struct.pack(">I", len(body)) + body

    message = st.tuples(
        fz.proto(local_pb2.LocalRequest).map(framed),
        st.sampled_from(_FD_KINDS),
        st.binary(max_size=128),
    )
    register = local_pb2.LocalRequest(
        request_id=1,
        register_worker=local_pb2.RegisterWorkerRequest(job=fz.job, name="fuzzer", wait_seconds=5),
    )
    push = st.builds(
        lambda tensors, payload_bytes, has_payload, base, norm: local_pb2.LocalRequest(
            request_id=2,
            push=local_pb2.PushRequest(
                server=fz.server,
                tensors=tensors,
                payload_bytes=payload_bytes,
                has_payload=has_payload,
                base_version=base,
                norm=norm,
            ),
        ),
        st.lists(fz.proto(dataplane_pb2.TensorLayout), max_size=3),
        st.sampled_from([0, 8, 63, 64, 65, 2**40, 2**64 - 1]),
        st.booleans(),
        st.sampled_from([0, -1, 10**9, -(2**63)]),
        st.sampled_from([0.0, float("nan"), -1.0]),
    )
    aimed = st.lists(
        st.tuples(push.map(framed), st.sampled_from(_FD_KINDS), st.binary(max_size=128)),
        min_size=1,
        max_size=3,
    ).map(lambda ps: [(framed(register), "await", b""), *ps])
    cases = st.one_of(
        st.tuples(st.just("aimed"), aimed),
        st.tuples(
            st.just("random"), st.lists(st.tuples(st.binary(max_size=200), st.just("none"), st.just(b"")))
        ),
        st.tuples(
            st.just("oversized"),
            st.sampled_from([(16 << 20) + 1, 2**31, 2**32 - 1]).map(
                lambda n: [(struct.pack(">I", n) + b"x", "none", b"")]
            ),
        ),
        st.tuples(st.just("messages"), st.lists(message, min_size=1, max_size=4)),
        st.tuples(
            st.just("messages"),
            st.lists(message, min_size=1, max_size=3).flatmap(
                lambda ms: fz.mutated(b"".join(m[0] for m in ms)).map(lambda b: [(b, ms[0][1], ms[0][2])])
            ),
        ),
    )
    pids = {host: fuzz_cluster.processes.daemons[host]["pid"] for host in ("ps", "w0")}
    fds_before = {host: len(os.listdir(f"/proc/{pid}/fd")) for host, pid in pids.items()}
    pool = ThreadPoolExecutor(max_workers=8)
    sent: list[tuple[Any, Future[list[Any] | None]]] = []

    @fz.settings
    @given(case=cases, target=st.sampled_from(["ps", "w0"]))
    def run(case: tuple[str, list[tuple[bytes, str, bytes]]], target: str) -> None:
        kind, pieces = case
        inputs[kind] += 1
        for _, fd_kind, _ in pieces:
            fd_kinds[fd_kind] += 1
        path = fuzz_cluster.ps_socket if target == "ps" else fuzz_cluster.w0_socket
        sent.append((pieces, pool.submit(exchange, path, pieces, 15.0)))

    try:
        run()
        for pieces, future in sent:
            events = future.result()
            if events is None:
                hung.append(pieces)
                continue
            for event in events:
                if event.WhichOneof("kind") == "error":
                    assert event.error.code and event.error.message.strip(), event
                    errors.append(f"{event.error.code}: {event.error.message}")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    total = sum(inputs.values())
    kinds = sorted({e[:40] for e in errors})
    print(f"local API: {total} inputs {inputs}, descriptors {fd_kinds}")
    print(f"{len(errors)} errors of {len(kinds)} kinds:")
    print("\n".join(kinds))
    assert total >= fz.examples
    assert not hung, f"{len(hung)} inputs got neither an answer nor a close, e.g. {hung[0]!r}"[:2000]
    fz.healthy(fuzz_cluster)
    # every descriptor passed in (memfds, pipes, sockets, directories) was closed again
    deadline = fz.time.monotonic() + 10
    while True:
        fds_after = {host: len(os.listdir(f"/proc/{pid}/fd")) for host, pid in pids.items()}
        if all(fds_after[h] <= fds_before[h] + 8 for h in pids) or fz.time.monotonic() > deadline:
            break
        fz.time.sleep(0.2)
    print(f"daemon descriptors before {fds_before}, after {fds_after}")
    assert all(fds_after[h] <= fds_before[h] + 8 for h in pids), (fds_before, fds_after)
