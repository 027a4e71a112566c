"""Pushes through two in-process daemons and an in-test scheduler: the life of a push (DESIGN §3)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.daemon.channels.frames import FrameHeader
from mlfabric.daemon.channels.peers import FrameLimits, PeerPool
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from mlfabric.tensors import layouts_to_pb, plan_layout


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    done = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        done.wait(0.02)
    raise AssertionError("condition not reached in time")


@pytest.fixture
def cluster(make_daemon: Any) -> Iterator[dict[str, Any]]:
    """Daemons "ps" (with server ps0 serving in a thread) and "w0"."""
    ps, w0 = make_daemon("ps"), make_daemon("w0")
    model: dict[str, np.ndarray] = {
        "w": np.arange(6, dtype=np.float64).reshape(2, 3),
        "b": np.zeros(4, dtype=np.float32),
    }
    server = mlfabric.register_as_server(
        "job",
        "ps0",
        {k: v.copy() for k, v in model.items()},
        mlfabric.Params(tau_max=2),
        daemon=ps.config.socket_path,
    )
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    yield {"ps": ps, "w0": w0, "server": server, "worker": worker, "model": model}
    worker.close()
    server.stop()
    thread.join(5)
    server.close()


def test_push_applies_with_exact_arithmetic(cluster: dict[str, Any], scheduler: Any) -> None:
    worker, model = cluster["worker"], cluster["model"]
    updates = [
        {"w": np.full((2, 3), float(i + 1)), "b": np.full(4, float(i), dtype=np.float32)} for i in range(3)
    ]
    results = []
    for update in updates:
        version, _ = worker.get("ps0")
        results.append(worker.push("ps0", update).wait(10))
        assert results[-1].delay == 0
    assert [r.status for r in results] == [mlfabric.APPLIED] * 3
    assert [r.version for r in results] == [1, 2, 3]
    version, got = worker.get("ps0")
    assert version == 3
    np.testing.assert_array_equal(got["w"], model["w"] - sum(u["w"] for u in updates))
    np.testing.assert_array_equal(got["b"], model["b"] - sum(u["b"] for u in updates))
    assert got["b"].dtype == np.float32
    # every transfer was reported with its bytes, outcome and measured times
    wait_until(lambda: len(scheduler.reports) == len(results))
    reports = {r.update_id: r for r in scheduler.reports}
    assert {r.update_id for r in results} == set(reports)
    for r in results:
        rep = reports[r.update_id]
        assert rep.ok and rep.outcome == control_pb2.OUTCOME_APPLIED and rep.server_version == r.version
        assert rep.bytes == 2 * 3 * 8 + 4 * 4 and rep.end >= rep.start > 0
        assert rep.src_host == "w0" and rep.dst_host == "ps"


def test_update_ids_and_ready_notifications(cluster: dict[str, Any], scheduler: Any) -> None:
    worker = cluster["worker"]
    handles = [
        worker.push("ps0", {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)}, norm=2.5) for _ in range(2)
    ]
    results = [h.wait(10) for h in handles]
    incarnation = cluster["w0"].worker.outgoing.incarnation
    assert len(incarnation) == 16
    assert [r.update_id for r in results] == [f"w0/{incarnation}/1", f"w0/{incarnation}/2"]
    ready = scheduler.ready
    assert [r.update_id for r in ready] == [r.update_id for r in results]
    assert all(r.norm == 2.5 and r.worker == "w0" and r.server == "ps0" and r.job == "job" for r in ready)


def test_default_norm_is_l2(cluster: dict[str, Any], scheduler: Any) -> None:
    cluster["worker"].push("ps0", {"w": np.full((2, 3), 2.0), "b": np.zeros(4, np.float32)}).wait(10)
    assert scheduler.ready[-1].norm == pytest.approx(np.sqrt(6 * 4.0))


def test_tau_max_drop_names_the_numbers(cluster: dict[str, Any]) -> None:
    worker = cluster["worker"]
    update = {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)}
    for _ in range(3):
        assert worker.push("ps0", update, base_version=0).wait(10).status == mlfabric.APPLIED
    # version is 3 now; base 0 gives delay 3 > tau_max 2
    result = worker.push("ps0", update, base_version=0).wait(10)
    assert result.status == mlfabric.DROPPED
    assert result.delay == 3 and result.version == 3
    assert "delay 3 exceeds tau_max 2" in result.reason
    assert cluster["server"].version == 3
    _, model = worker.get("ps0")
    np.testing.assert_array_equal(model["w"], cluster["model"]["w"] - 3)


def test_retried_update_is_not_applied_twice(cluster: dict[str, Any]) -> None:
    """The same UPDATE frame sent twice (a retry) gets the stored verdict; the model moves once."""
    ps, server = cluster["ps"], cluster["server"]
    update = {"w": np.full((2, 3), 5.0), "b": np.ones(4, np.float32)}
    layouts, total = plan_layout(update)
    payload = bytearray(total)
    from mlfabric.tensors import encode_into

    encode_into(memoryview(payload), update, layouts)
    header = FrameHeader(
        kind=dataplane_pb2.FRAME_KIND_UPDATE,
        update_id="other/7",
        job="job",
        server="ps0",
        worker="w9",
        base_version=0,
        num_updates=1,
        tensors=layouts_to_pb(layouts),
    )
    pool = PeerPool(FrameLimits())
    replies = []
    for _ in range(2):  # two connections, as a retry after a lost connection would
        conn = pool.connect(ps.data_address)
        replies.append(conn.request(header, bytes(payload)))
        conn.close()
    first, second = replies
    assert first.header.kind == dataplane_pb2.FRAME_KIND_ACK
    assert first.header.outcome == control_pb2.OUTCOME_APPLIED and first.header.version == 1
    assert (second.header.outcome, second.header.version) == (first.header.outcome, first.header.version)
    assert server.version == 1 and server.applied == 1
    np.testing.assert_array_equal(server.model["w"], cluster["model"]["w"] - 5.0)


def test_unreachable_peer_resolves_dropped_with_reason(cluster: dict[str, Any], scheduler: Any) -> None:
    worker = cluster["worker"]
    scheduler.hold = True
    handle = worker.push("ps0", {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)})
    wait_until(lambda: scheduler.ready)
    ready = scheduler.ready[-1]
    dead = "127.0.0.1:1"
    send = control_pb2.SendDirective(
        update_id=ready.update_id, next_hop_host="ps", next_hop_address=dead, dst_host="ps"
    )
    scheduler.send("w0", control_pb2.Directive(send=send))
    result = handle.wait(10)
    assert result.status == mlfabric.DROPPED
    assert dead in result.reason and "3 attempts" in result.reason
    wait_until(lambda: scheduler.reports)
    report = scheduler.reports[-1]
    assert not report.ok and dead in report.error and report.outcome == control_pb2.OUTCOME_DROPPED


def test_drop_directive_resolves_with_its_reason(cluster: dict[str, Any], scheduler: Any) -> None:
    worker = cluster["worker"]
    scheduler.hold = True
    handle = worker.push("ps0", {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)})
    wait_until(lambda: scheduler.ready)
    drop = control_pb2.DropDirective(
        update_id=scheduler.ready[-1].update_id, reason="expected delay 9 > tau_max 2"
    )
    scheduler.send("w0", control_pb2.Directive(drop=drop))
    result = handle.wait(10)
    assert (result.status, result.reason) == (mlfabric.DROPPED, "expected delay 9 > tau_max 2")
    assert cluster["server"].version == 0


def test_scheduler_loss_resolves_waiting_pushes(cluster: dict[str, Any], scheduler: Any) -> None:
    """Without a fallback (``fallback_after=None``) waiting pushes resolve DROPPED at once."""
    worker = cluster["worker"]
    cluster["w0"].worker.fallback.after = None
    scheduler.hold = True
    handle = worker.push("ps0", {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)})
    wait_until(lambda: scheduler.ready)
    scheduler.stop()
    result = handle.wait(10)
    assert result.status == mlfabric.DROPPED
    assert "scheduler connection lost" in result.reason


def test_daemons_reconnect_and_re_register_after_scheduler_restart(
    cluster: dict[str, Any], scheduler: Any
) -> None:
    worker, server = cluster["worker"], cluster["server"]
    update = {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)}
    assert worker.push("ps0", update).wait(10).applied
    port = int(scheduler.address.rsplit(":", 1)[1])
    scheduler.stop()
    fresh = type(scheduler)()
    fresh.start(port)
    try:
        # both daemons come back and re-register the server (at its current version) and the
        # worker; a daemon re-registers once welcomed, so w0's registration means it can send
        # (its session at the scheduler alone does not: the push raced the welcome, 1 run in 8);
        # an attempt refused "unknown job" (w0 back before ps) does not count: wait for the ack
        wait_until(lambda: {"ps", "w0"} <= set(fresh.sessions), timeout=15)
        wait_until(lambda: "ps0" in fresh.servers.get("job", {}), timeout=5)
        wait_until(lambda: any(host == "w0" for host, _, _ in fresh.accepted), timeout=10)
        assert fresh.servers["job"]["ps0"].version == 1
        result = worker.push("ps0", update).wait(10)
        assert result.applied and result.version == 2 and server.version == 2
    finally:
        fresh.stop()


def test_next_hop_without_the_server_resolves_dropped_naming_it(
    cluster: dict[str, Any], scheduler: Any
) -> None:
    worker, w0 = cluster["worker"], cluster["w0"]
    scheduler.hold = True
    handle = worker.push("ps0", {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)})
    wait_until(lambda: scheduler.ready)
    send = control_pb2.SendDirective(
        update_id=scheduler.ready[-1].update_id, next_hop_host="w0", next_hop_address=w0.data_address
    )
    scheduler.send("w0", control_pb2.Directive(send=send))
    result = handle.wait(10)
    assert result.status == mlfabric.DROPPED
    assert "no server 'ps0' of job 'job' on host 'w0'" in result.reason
    assert cluster["server"].version == 0


def test_garbage_on_the_data_plane_is_refused_and_the_daemon_keeps_running(cluster: dict[str, Any]) -> None:
    import socket

    host, port = cluster["ps"].data_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        try:
            reply = sock.recv(100)
        except ConnectionResetError:
            reply = b""
        assert reply == b""  # closed without a reply: not our protocol
    result = cluster["worker"].push("ps0", {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)}).wait(10)
    assert result.applied
