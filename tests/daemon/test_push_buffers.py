"""Reused memfds on the push path: a buffer is recycled only when nobody reads it."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

import mlfabric
import mlfabric.server
from mlfabric.api import Worker
from mlfabric.proto.v1 import control_pb2, local_pb2
from mlfabric.tensorio import from_fd, map_memfd, read_memfd, write_fd
from mlfabric.tensors import Layout, plan_layout
from mlfabric.wire.memfd import MemfdPool


class RecordingClient:
    """A stand-in for ``LocalClient``: keeps every pushed memfd (a dup) and its event handler."""

    def __init__(self) -> None:
        self.pushes: list[tuple[Any, Any, int]] = []

    def submit(self, request: Any, handler: Any, fd: int | None = None) -> int:
        assert fd is not None
        self.pushes.append((request, handler, os.dup(fd)))
        return len(self.pushes)

    def forget(self, request_id: int) -> None:
        del request_id

    def close(self) -> None:
        for _, _, fd in self.pushes:
            os.close(fd)


def _inode(fd: int) -> int:
    return os.fstat(fd).st_ino


def _resolve(handler: Any, outcome: control_pb2.Outcome = control_pb2.OUTCOME_APPLIED) -> None:
    handler(local_pb2.LocalEvent(push_result=local_pb2.PushResult(outcome=outcome, version=1)), None)


def _content(request: Any, fd: int) -> np.ndarray:
    layouts = [Layout(t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in request.push.tensors]
    return read_memfd(fd, layouts)["w"]


def test_update_memfd_is_not_reused_before_its_push_resolved() -> None:
    client = RecordingClient()
    worker = Worker(client, "job", "w0", local_pb2.RegisterReply())  # type: ignore[arg-type]
    try:
        first = worker.push("ps0", {"w": np.full(1000, 1.0)}, norm=1.0)
        worker.push("ps0", {"w": np.full(1000, 2.0)}, norm=1.0)
        (req1, handler1, fd1), (req2, _, fd2) = client.pushes
        assert _inode(fd1) != _inode(fd2)  # the first push is unresolved: its memfd is not handed out
        np.testing.assert_array_equal(_content(req1, fd1), 1.0)  # and not overwritten

        _resolve(handler1)
        assert first.wait(0).status == mlfabric.APPLIED
        worker.push("ps0", {"w": np.full(1000, 3.0)}, norm=1.0)
        req3, _, fd3 = client.pushes[2]
        assert _inode(fd3) == _inode(fd1)  # resolved: recycled
        np.testing.assert_array_equal(_content(req3, fd3), 3.0)
        np.testing.assert_array_equal(_content(req2, fd2), 2.0)  # the one in flight is untouched
    finally:
        worker.close()


def test_dropped_push_recycles_but_a_lost_connection_discards() -> None:
    client = RecordingClient()
    worker = Worker(client, "job", "w0", local_pb2.RegisterReply())  # type: ignore[arg-type]
    try:
        worker.push("ps0", {"w": np.ones(10)}, norm=1.0)
        _resolve(client.pushes[0][1], control_pb2.OUTCOME_DROPPED)
        worker.push("ps0", {"w": np.ones(10)}, norm=1.0)
        assert _inode(client.pushes[1][2]) == _inode(client.pushes[0][2])
        # the daemon connection broke: the daemon may still send from it, so it is never reused
        lost = local_pb2.LocalEvent(error=local_pb2.LocalError(code="disconnected", message="gone"))
        client.pushes[1][1](lost, None)
        worker.push("ps0", {"w": np.ones(10)}, norm=1.0)
        assert _inode(client.pushes[2][2]) != _inode(client.pushes[1][2])
    finally:
        worker.close()


def test_connection_lost_after_the_verdict_keeps_the_verdict_and_the_pooled_memfd() -> None:
    # a daemon shutting down answers a push DROPPED and closes the connection at once: the
    # reader thread may fail every handler before the push's handler was forgotten, so the
    # handle hears a final event twice (seen in tests/faults: a later push got EBADF)
    client = RecordingClient()
    worker = Worker(client, "job", "w0", local_pb2.RegisterReply())  # type: ignore[arg-type]
    try:
        first = worker.push("ps0", {"w": np.ones(10)}, norm=1.0)
        _resolve(client.pushes[0][1], control_pb2.OUTCOME_DROPPED)
        lost = local_pb2.LocalEvent(error=local_pb2.LocalError(code="disconnected", message="gone"))
        client.pushes[0][1](lost, None)
        assert first.wait(0).status == mlfabric.DROPPED  # the verdict, not the late error
        worker.push("ps0", {"w": np.full(10, 2.0)}, norm=1.0)  # the recycled memfd is still open
        req2, _, fd2 = client.pushes[1]
        assert _inode(fd2) == _inode(client.pushes[0][2])
        np.testing.assert_array_equal(_content(req2, fd2), 2.0)
    finally:
        worker.close()


def test_map_memfd_views_the_payload_without_a_copy() -> None:
    pool = MemfdPool(max_idle_bytes=1 << 20)
    update = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2)}
    layouts, total = plan_layout(update)
    buf = pool.allocate(total)
    write_fd(buf.fd, update, layouts)
    tensors, mapping = map_memfd(buf.fd, layouts)
    np.testing.assert_array_equal(tensors["w"], update["w"])
    buf[0:4] = np.float32(42).tobytes()  # the same pages: a view, not a copy
    assert tensors["w"][0, 0] == 42
    del tensors
    mapping.close()
    buf.release()
    pool.close()


def test_daemon_recycles_receive_buffers(make_daemon: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    privatized: list[Any] = []  # the default on_update keeps no view: the mapping just closes
    monkeypatch.setattr(mlfabric.server, "privatize", privatized.append)
    ps, w0 = make_daemon("ps"), make_daemon("w0")
    model = {"w": np.zeros(50_000)}
    server = mlfabric.register_as_server("job", "ps0", model, daemon=ps.config.socket_path)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    try:
        for i in range(3):
            assert worker.push("ps0", {"w": np.full(50_000, float(i))}).wait(10).applied
        _, got = worker.get("ps0")
        np.testing.assert_array_equal(got["w"], -3.0)  # 0 - (0 + 1 + 2), exact
        pool = ps.receive_buffers
        assert pool.created == 1 and pool.reused == 2
        assert privatized == []
    finally:
        worker.close()
        server.stop()
        thread.join(5)
        server.close()


def test_receive_buffer_without_verdict_is_not_recycled(make_daemon: Any) -> None:
    """A verdict timeout answers UNKNOWN while the process may still read the update: no reuse."""
    ps, w0 = make_daemon("ps", verdict_timeout=0.3), make_daemon("w0")
    server = mlfabric.register_as_server("job", "ps0", {"w": np.zeros(1000)}, daemon=ps.config.socket_path)
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    try:  # the server never serves: its deliveries wait in its inbox, unread
        for value in (1.0, 2.0):
            result = worker.push("ps0", {"w": np.full(1000, value)}).wait(10)
            assert result.status == mlfabric.UNKNOWN and "gave no verdict" in result.reason
        event, fd = server._inbox.get(timeout=5)
        np.testing.assert_array_equal(from_fd(event.deliver.tensors, fd)["w"], 1.0)  # not overwritten
        assert ps.receive_buffers.reused == 0
    finally:
        worker.close()
        server.close()


def test_update_kept_by_on_update_survives_buffer_reuse(make_daemon: Any) -> None:
    """The server maps the update (no copy); a view kept past on_update is privatized, not overwritten."""
    ps, w0 = make_daemon("ps"), make_daemon("w0")
    server = mlfabric.register_as_server("job", "ps0", {"w": np.zeros(1000)}, daemon=ps.config.socket_path)
    kept: list[np.ndarray] = []
    server.on_update(lambda update, meta: kept.append(update["w"]))
    thread = threading.Thread(target=server.serve, kwargs={"max_updates": 2, "timeout": 20})
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    try:
        for value in (1.0, 2.0):
            assert worker.push("ps0", {"w": np.full(1000, value)}).wait(10).applied
        thread.join(10)
        assert ps.receive_buffers.reused == 1  # the second update landed in the first one's buffer
        np.testing.assert_array_equal(kept[0], 1.0)
        np.testing.assert_array_equal(kept[1], 2.0)
    finally:
        worker.close()
        server.close()
