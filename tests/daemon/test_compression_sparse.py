"""Top-k and random-k pushes through two in-process daemons to a server (docs/compression.md).

As ``test_compression.py`` for the casts and int8: the push travels as ``count`` values and
their positions per tensor; the server applies the decoded update (zeros outside the
positions); error feedback keeps what was not sent; bad sparse payloads are refused by the
frame check (the header) or DROPPED by the server (positions, NaN values) naming the problem,
the model intact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.aggregators.codecs import decode
from mlfabric.aggregators.codecs.payload import encode_update, encoded_of, parse_codec
from mlfabric.daemon.channels.peers import FrameLimits, PeerPool
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from mlfabric.tensors import Layout, encode_into, plan_layout
from tests.daemon import test_compression
from tests.daemon.test_compression import MODEL, _frame, _send_raw, _update
from tests.daemon.test_daemon_push import wait_until

served = test_compression.served  # daemons "ps" (server ps0) and "w0" (a worker); the job's params

RAW = 600 * 8 + 8 * 4  # MODEL's bytes: "w" (20, 30) float64, "b" (8,) float32


def _encoded(
    update: dict[str, np.ndarray], spec: str, seed: int = 0, rng: np.random.Generator | None = None
) -> tuple[list[Layout], bytearray]:
    codec = parse_codec(spec)
    assert codec is not None
    words, encoded = encode_update(update, codec, rng or np.random.default_rng(seed))
    layouts, total = plan_layout(words, encoded)
    buf = bytearray(total)
    encode_into(memoryview(buf), words, layouts)
    return layouts, buf


def _decoded(layouts: list[Layout], buf: bytearray) -> dict[str, np.ndarray]:
    return {x.name: decode(encoded_of(x, memoryview(buf))) for x in layouts}


def test_a_topk_push_changes_exactly_its_k_positions(served: dict[str, Any], scheduler: Any) -> None:
    worker, server = served["worker"], served["server"]
    update = _update(1)
    result = worker.push("ps0", update, codec="topk:ratio=0.01").wait(10)
    assert result.status == mlfabric.APPLIED, result.reason
    for name, k in (("w", 6), ("b", 1)):  # ceil(0.01 x 600), ceil(0.01 x 8)
        changed = np.flatnonzero(server.model[name] != MODEL[name])
        largest = np.argsort(-np.abs(update[name].reshape(-1)))[:k]
        assert sorted(changed.tolist()) == sorted(largest.tolist())
        np.testing.assert_array_equal(  # the kept values exactly (float32 on the wire)
            (MODEL[name] - server.model[name]).reshape(-1)[changed],
            update[name].reshape(-1)[changed].astype(np.float32),
        )
    wait_until(lambda: any(r.update_id == result.update_id for r in scheduler.reports))
    report = next(r for r in scheduler.reports if r.update_id == result.update_id)
    assert report.bytes == (6 + 1) * 8  # 7 float32 values and 7 uint32 positions
    pushed, received = served["w0"].stats(), served["ps"].stats()
    assert (pushed.pushes, pushed.push_bytes, pushed.push_raw_bytes) == (
        {"topk": 1},
        {"topk": 56},
        {"topk": RAW},
    )
    assert (received.update_bytes_received, received.update_raw_bytes_received) == (
        {"topk": 56},
        {"topk": RAW},
    )


def test_randk_positions_come_from_the_workers_rng(served: dict[str, Any]) -> None:
    worker, server = served["worker"], served["server"]
    update = _update(2)
    worker.rng = np.random.default_rng(21)
    assert worker.push("ps0", update, codec="randk:ratio=0.05").wait(10).applied
    expected = _decoded(*_encoded(update, "randk:ratio=0.05", seed=21))  # the same seed: the same positions
    for name in MODEL:
        np.testing.assert_array_equal(server.model[name], MODEL[name] - expected[name])
    assert np.count_nonzero(server.model["w"] != MODEL["w"]) == 30


def test_shared_randk_positions_come_from_the_pushs_base_version(served: dict[str, Any]) -> None:
    from mlfabric.aggregators.codecs.sparse import version_rng

    worker, server = served["worker"], served["server"]
    update, spec = _update(3), "randk:ratio=0.05,shared=1"
    worker.rng = np.random.default_rng(21)  # not used: the positions are the version's (0)
    assert worker.push("ps0", update, codec=spec, base_version=0).wait(10).applied
    expected = _decoded(*_encoded(update, spec, rng=version_rng(0)))
    for name in MODEL:
        np.testing.assert_array_equal(server.model[name], MODEL[name] - expected[name])


def test_error_feedback_with_topk_sends_what_was_left_out_later(served: dict[str, Any]) -> None:
    worker, server = served["worker"], served["server"]
    g = _update(3)
    pushes = 20
    for _ in range(pushes):
        assert worker.push("ps0", g, codec="topk:ratio=0.05", error_feedback=True).wait(10).applied
    feedback = worker.feedback("ps0")
    assert feedback is not None and feedback.codec == parse_codec("topk:ratio=0.05")
    for name in MODEL:  # sent = pushes x g - the last residual (the residual: what was not sent)
        residual = feedback.residual(name)
        assert residual is not None
        np.testing.assert_allclose(server.model[name], MODEL[name] - pushes * g[name] + residual, atol=1e-4)
    exact = pushes * g["w"]
    with_feedback = np.linalg.norm(MODEL["w"] - server.model["w"] - exact) / np.linalg.norm(exact)
    assert np.count_nonzero(server.model["w"] != MODEL["w"]) > 5 * 30  # more than the 30 largest
    before = server.model["w"].copy()
    for _ in range(pushes):  # without: the same 30 largest positions every time, the rest never
        assert worker.push("ps0", g, codec="topk:ratio=0.05").wait(10).applied
    assert np.count_nonzero(server.model["w"] != before) == 30
    without = np.linalg.norm(before - server.model["w"] - exact) / np.linalg.norm(exact)
    assert with_feedback < 0.5 * without  # relative L2 of what the server applied (0.36 and 0.84)


def _forged(ps: Any, update_id: str, layouts: list[Layout], buf: bytearray) -> Any:
    conn = PeerPool(FrameLimits()).connect(ps.data_address)
    try:
        return conn.request(_frame(update_id, layouts), bytes(buf)).header
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("positions", "named"),
    [
        ([0, 1, 600], "indices: tensor 'w' (topk): index 600 out of range for a tensor of 600 elements"),
        ([4, 4], "expected strictly increasing, got 4 then 4 at position 1 (duplicated)"),
        ([7, 2], "expected strictly increasing, got 7 then 2 at position 1 (unsorted)"),
    ],
)
def test_bad_positions_are_dropped_by_the_server_naming_the_problem(
    served: dict[str, Any], positions: list[int], named: str
) -> None:
    ps, server = served["ps"], served["server"]
    layouts, buf = _encoded(_update(4), "topk:ratio=0.01")
    w = next(x for x in layouts if x.name == "w")
    np.frombuffer(buf, np.uint32, len(positions), w.offset + 4 * 6)[:] = positions
    reply = _forged(ps, "forged/sparse", layouts, buf)
    assert reply.outcome == control_pb2.OUTCOME_DROPPED
    assert "does not decode" in reply.reason and named in reply.reason
    assert server.version == 0 and server.applied == 0
    np.testing.assert_array_equal(server.model["w"], MODEL["w"])


def test_nan_values_are_dropped_by_the_servers_daemon(served: dict[str, Any]) -> None:
    worker, server = served["worker"], served["server"]
    update = _update(5)
    update["w"][:] = np.nan  # random-k does not rank: whichever positions it draws hold a NaN
    handle = worker.push("ps0", update, codec="randk:ratio=0.01")
    result = handle.wait(10)
    assert result.status == mlfabric.DROPPED
    assert f"tensor 'w' of {handle.update_id} holds non-finite values" in result.reason
    assert server.version == 0
    np.testing.assert_array_equal(server.model["w"], MODEL["w"])


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            lambda t: setattr(t.encoding, "count", 7),
            "count: tensor 'w' (topk): expected 6 values (ratio 0.01 of 600",
        ),
        (
            lambda t: setattr(t.encoding, "ratio", 0.02),
            "expected 12 values (ratio 0.02 of 600 elements), got 6",
        ),
        (
            lambda t: setattr(t, "nbytes", 4800),
            "tensor 'w': nbytes 4800 != 6 values x (4 + 4 bytes of position)",
        ),
        (
            lambda t: setattr(t.encoding, "members", 2),
            "tensor 'w': its words sum 2 updates, the frame carries 1",
        ),
    ],
)
def test_a_bad_sparse_header_is_refused_by_the_frame_check(
    served: dict[str, Any], change: Any, named: str
) -> None:
    ps, server = served["ps"], served["server"]
    layouts, buf = _encoded(_update(6), "topk:ratio=0.01")
    header = _frame("forged/header", layouts)
    change(next(t for t in header.tensors if t.name == "w"))
    reply = _send_raw(ps.data_address, header, bytes(buf))
    assert reply.kind == dataplane_pb2.FRAME_KIND_ERROR
    assert named in reply.reason
    assert server.version == 0 and server.applied == 0
    np.testing.assert_array_equal(server.model["w"], MODEL["w"])


@pytest.mark.parametrize("served", [mlfabric.Params(sync_workers=2)], indirect=True)
def test_a_synchronous_round_sums_topk_members_decoded(served: dict[str, Any]) -> None:
    worker, server = served["worker"], served["server"]
    first, second = _update(8), _update(9)
    handles = [worker.push("ps0", first, codec="topk:ratio=0.1"), worker.push("ps0", second, codec="fp16")]
    assert [h.wait(10).version for h in handles] == [1, 1]
    sent = [_decoded(*_encoded(first, "topk:ratio=0.1")), _decoded(*_encoded(second, "fp16"))]
    for name in MODEL:
        np.testing.assert_allclose(
            server.model[name], MODEL[name] - (sent[0][name] + sent[1][name]), atol=1e-6
        )
