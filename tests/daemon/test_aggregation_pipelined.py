"""Pipelined (cut-through) aggregates executed by a real daemon (``AggregateDirective.pipelined``).

In-process daemons ``ps`` (server ps0, float32 model) and ``agg``; the members are sent to the
aggregator by the test itself over raw data-plane sockets, so it decides how far each member's
payload has landed: the aggregate must be announced once every member has *begun*, its
forward must carry the exact sum once they are whole, and a member that breaks off must fail
the aggregate with nothing applied (the forward cut off before its CRC trailer).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.daemon.channels.frames import (
    FrameHeader,
    FrameLimits,
    encode_header,
    payload_crc32,
    recv_frame,
)
from mlfabric.daemon.channels.sockets import parse_address
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from tests.daemon.test_aggregation import AggScheduler, held_scheduler, wait_until

N = 64 * 1024  # float32 elements a member: 256 KiB
APPLIED = control_pb2.OUTCOME_APPLIED


@pytest.fixture
def scheduler() -> Iterator[AggScheduler]:
    yield from held_scheduler()


@pytest.fixture
def cluster(make_daemon: Any, scheduler: AggScheduler) -> Iterator[dict[str, Any]]:
    daemons = {h: make_daemon(h) for h in ("ps", "agg")}
    model = {"w": np.zeros(N, dtype=np.float32)}
    server = mlfabric.register_as_server(
        "job", "ps0", model, mlfabric.Params(tau_max=4), daemon=daemons["ps"].config.socket_path
    )
    metas: list[Any] = []

    @server.on_update
    def apply(update: dict[str, Any], meta: Any) -> None:
        metas.append(meta)
        server.model["w"] -= update["w"]

    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield {"daemons": daemons, "server": server, "metas": metas}
    server.stop()
    thread.join(5)
    server.close()


def _member(i: int, dtype: str = "float32") -> tuple[Any, bytes]:
    """Member ``i``'s header (from host ``x<i>``) and payload: ``w`` all ``i + 1``."""
    values = np.full(N, i + 1, dtype=dtype)
    header = FrameHeader(
        kind=dataplane_pb2.FRAME_KIND_UPDATE,
        update_id=f"x{i}/u/1",
        job="job",
        server="ps0",
        worker=f"x{i}",
        norm=float(i + 1),
        src_host=f"x{i}",
    )
    header.tensors.add(name="w", dtype=dtype, shape=[N], offset=0, nbytes=values.nbytes)
    return header, values.tobytes()


def _directive(sched: AggScheduler, agg_id: str, headers: list[Any], pipelined: bool = True) -> None:
    members = [
        control_pb2.AggregateMember(
            update_id=h.update_id,
            worker=h.worker,
            norm=h.norm,
            src_host=h.src_host,
            bytes=h.tensors[0].nbytes,
        )
        for h in headers
    ]
    directive = control_pb2.AggregateDirective(
        aggregate_id=agg_id,
        job="job",
        server="ps0",
        members=members,
        dst_host="ps",
        dst_address=sched.address_of("ps"),
        timeout_seconds=30,
        pipelined=pipelined,
    )
    sched.send("agg", control_pb2.Directive(aggregate=directive))


def _directed(c: dict[str, Any], sched: AggScheduler, agg_id: str, headers: list[Any], **kw: Any) -> None:
    """:func:`_directive`, waiting until the aggregator has it (frames may overtake it otherwise)."""
    _directive(sched, agg_id, headers, **kw)
    wait_until(lambda: c["daemons"]["agg"].aggregator.owns(agg_id))


def _begin(sched: AggScheduler, header: Any, payload: bytes, agg_id: str, upto: int) -> socket.socket:
    """Connect to the aggregator and send ``header`` and the first ``upto`` payload bytes."""
    header.aggregate_id = agg_id
    sock = socket.create_connection(parse_address(sched.address_of("agg")), timeout=10)
    sock.sendall(encode_header(header, len(payload), 0, True) + payload[:upto])
    return sock


def _finish(sock: socket.socket, payload: bytes, upto: int) -> Any:
    """Send the rest of the payload and its CRC-32 trailer; the aggregator's reply header."""
    sock.sendall(payload[upto:] + payload_crc32(payload).to_bytes(4, "big"))
    reply = recv_frame(sock, FrameLimits())
    sock.close()
    assert reply is not None
    return reply.header


def _forward(sched: AggScheduler, agg_id: str) -> None:
    send = control_pb2.SendDirective(
        update_id=agg_id, next_hop_host="ps", next_hop_address=sched.address_of("ps"), dst_host="ps"
    )
    sched.send("agg", control_pb2.Directive(send=send))


def test_pipelined_aggregate_is_announced_as_members_begin_and_applied_once_with_their_sum(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    members = [_member(i) for i in range(3)]
    agg_id = "agg:job:p0"
    _directed(cluster, scheduler, agg_id, [h for h, _ in members])
    half = (N * 4) // 2
    socks = [_begin(scheduler, h, p, agg_id, half) for h, p in members]
    ready = wait_until(lambda: scheduler.ready_for(agg_id))  # every member has begun, none is whole
    assert ready.bytes == N * 4 and ready.norm == 6.0 and ready.worker == ""
    _forward(scheduler, agg_id)  # the sum's first half can go now
    acks = [_finish(s, p, half) for s, (_, p) in zip(socks, members, strict=True)]
    assert all(a.kind == dataplane_pb2.FRAME_KIND_ACK and a.outcome == 0 for a in acks)
    report = wait_until(lambda: scheduler.report_for(agg_id))[0]
    assert report.ok and report.outcome == APPLIED and report.server_version == 1
    assert sorted(v.update_id for v in report.member_verdicts) == sorted(h.update_id for h, _ in members)
    meta = cluster["metas"][-1]
    assert meta.num_updates == 3 and len(cluster["metas"]) == 1
    np.testing.assert_array_equal(cluster["server"].model["w"], np.full(N, -6.0, dtype=np.float32))


def test_member_breaking_off_fails_the_aggregate_and_nothing_is_applied(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    members = [_member(i) for i in range(2)]
    agg_id = "agg:job:p1"
    _directed(cluster, scheduler, agg_id, [h for h, _ in members])
    half = (N * 4) // 2
    socks = [_begin(scheduler, h, p, agg_id, half) for h, p in members]
    wait_until(lambda: scheduler.ready_for(agg_id))
    _forward(scheduler, agg_id)  # streams the first half of the sum to the server's daemon
    _finish(socks[0], members[0][1], half)
    role = cluster["daemons"]["agg"].aggregator
    wait_until(lambda: role._aggregates[agg_id].state == "forwarding")  # the forward is under way
    socks[1].close()  # member 1 breaks off halfway
    failed = wait_until(lambda: [f for f in scheduler.failed if f.aggregate_id == agg_id])
    assert "broke off" in failed[0].reason
    report = wait_until(lambda: scheduler.report_for(agg_id))[0]
    assert not report.ok and report.outcome == control_pb2.OUTCOME_UNSPECIFIED
    assert "cut off" in report.error
    assert cluster["server"].version == 0 and not cluster["metas"]
    np.testing.assert_array_equal(cluster["server"].model["w"], np.zeros(N, dtype=np.float32))


def test_members_that_are_not_float32_are_summed_store_and_forward(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    """A float64 member is not summed on the fly: the aggregate is announced once both are whole."""
    members = [_member(i, "float64") for i in range(2)]
    agg_id = "agg:job:p2"
    _directed(cluster, scheduler, agg_id, [h for h, _ in members])
    half = (N * 8) // 2
    socks = [_begin(scheduler, h, p, agg_id, half) for h, p in members]
    _finish(socks[0], members[0][1], half)
    assert scheduler.ready_for(agg_id) is None  # member 1 is not whole yet
    _finish(socks[1], members[1][1], half)
    wait_until(lambda: scheduler.ready_for(agg_id))


def test_a_member_joins_a_pipelined_aggregate_before_its_sum_begins(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    """A round re-issues its aggregate with one more member while the first two land."""
    members = [_member(i) for i in range(3)]
    agg_id = "agg:job:p3"
    _directed(cluster, scheduler, agg_id, [h for h, _ in members[:2]])
    half = (N * 4) // 2
    socks = [_begin(scheduler, h, p, agg_id, half) for h, p in members[:2]]
    wait_until(lambda: scheduler.ready_for(agg_id))  # both listed members have begun
    _directive(scheduler, agg_id, [h for h, _ in members])  # the third joins: open again
    socks.append(_begin(scheduler, members[2][0], members[2][1], agg_id, half))
    wait_until(lambda: len([r for r in scheduler.ready if r.update_id == agg_id]) == 2)
    assert scheduler.ready[-1].norm == 6.0
    _forward(scheduler, agg_id)
    for s, (_, p) in zip(socks, members, strict=True):
        _finish(s, p, half)
    report = wait_until(lambda: scheduler.report_for(agg_id))[0]
    assert report.ok and report.outcome == APPLIED and len(report.member_verdicts) == 3
    np.testing.assert_array_equal(cluster["server"].model["w"], np.full(N, -6.0, dtype=np.float32))


def test_a_forward_directed_before_its_members_begin_waits_for_them(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    """The scheduler releases a pipelined aggregate with its members' sends: it goes once they began."""
    members = [_member(i) for i in range(2)]
    agg_id = "agg:job:p4"
    _directed(cluster, scheduler, agg_id, [h for h, _ in members])
    _forward(scheduler, agg_id)
    role = cluster["daemons"]["agg"].aggregator
    wait_until(lambda: role._aggregates[agg_id].pending_send is not None)  # held, not refused
    half = (N * 4) // 2
    socks = [_begin(scheduler, h, p, agg_id, half) for h, p in members]
    for s, (_, p) in zip(socks, members, strict=True):
        _finish(s, p, half)
    report = wait_until(lambda: scheduler.report_for(agg_id))[0]
    assert report.ok and report.outcome == APPLIED and len(report.member_verdicts) == 2
    np.testing.assert_array_equal(cluster["server"].model["w"], np.full(N, -3.0, dtype=np.float32))
