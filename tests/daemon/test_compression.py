"""Compressed pushes through two in-process daemons to a server (docs/compression.md).

A push with ``codec=`` (or the job's ``Params(compression=)``) travels as codec words in the
data plane's frames; the server applies the decoded update, equal to
``aggregators.codecs.decode`` of what was sent. Corrupt or inconsistent encodings are refused
by the frame check or the server, naming the problem, and the model stays intact.
"""

from __future__ import annotations

import socket
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.aggregators.codecs import decode
from mlfabric.aggregators.codecs.payload import encode_update, encoded_of, parse_codec
from mlfabric.daemon.channels.frames import FrameHeader, encode_header, recv_frame
from mlfabric.daemon.channels.peers import FrameLimits, PeerPool
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from mlfabric.tensors import encode_into, layouts_to_pb, plan_layout
from tests.daemon.test_daemon_push import wait_until

MODEL: dict[str, np.ndarray] = {"w": np.linspace(-1, 1, 600).reshape(20, 30), "b": np.zeros(8, np.float32)}


def _serve(daemon: Any, params: mlfabric.Params) -> tuple[Any, threading.Thread]:
    server = mlfabric.register_as_server(
        "job", "ps0", {k: v.copy() for k, v in MODEL.items()}, params, daemon=daemon.config.socket_path
    )
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def served(make_daemon: Any, request: Any) -> Iterator[dict[str, Any]]:
    """Daemons "ps" (server ps0) and "w0" (a worker); the job's params: the indirect parameter."""
    params = getattr(request, "param", mlfabric.Params())
    ps, w0 = make_daemon("ps"), make_daemon("w0")
    server, thread = _serve(ps, params)
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    worker.rng = np.random.default_rng(7)
    yield {"ps": ps, "w0": w0, "server": server, "worker": worker}
    worker.close()
    server.stop()
    thread.join(5)
    server.close()


def _update(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(20, 30)), "b": rng.normal(size=8).astype(np.float32)}


def _sent(update: dict[str, np.ndarray], spec: str) -> dict[str, np.ndarray]:
    """What the server decodes of ``update`` sent with a deterministic codec ``spec``."""
    codec = parse_codec(spec)
    if codec is None:
        return update
    words, encoded = encode_update(update, codec)
    layouts, total = plan_layout(words, encoded)
    buf = bytearray(total)
    encode_into(memoryview(buf), words, layouts)
    return {x.name: decode(encoded_of(x, memoryview(buf))) for x in layouts}


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8:bound=4,stochastic=0", "int8:block=64,stochastic=0"])
def test_a_compressed_push_applies_the_decoded_update(
    served: dict[str, Any], scheduler: Any, spec: str
) -> None:
    worker, server = served["worker"], served["server"]
    update = _update(1)
    result = worker.push("ps0", update, codec=spec).wait(10)
    assert result.status == mlfabric.APPLIED, result.reason
    expected = _sent(update, spec)
    for name in MODEL:  # the server applied exactly the decode of what was sent
        np.testing.assert_array_equal(server.model[name], MODEL[name] - expected[name])
        assert server.model[name].dtype == MODEL[name].dtype
    raw = 600 * 8 + 8 * 4
    words = {"fp16": 2, "bf16": 2}.get(spec, 1)
    wait_until(lambda: any(r.update_id == result.update_id for r in scheduler.reports))
    report = next(r for r in scheduler.reports if r.update_id == result.update_id)
    assert report.bytes == (600 + 8) * words < raw  # the bytes on the wire are the words
    codec = spec.split(":")[0]  # the stats: bytes on the wire against the tensors' own
    pushed, received = served["w0"].stats(), served["ps"].stats()
    assert (pushed.pushes, pushed.push_bytes, pushed.push_raw_bytes) == (
        {codec: 1},
        {codec: report.bytes},
        {codec: raw},
    )
    assert (received.update_bytes_received, received.update_raw_bytes_received) == (
        {codec: report.bytes},
        {codec: raw},
    )


def test_stochastic_int8_stays_within_its_scale(served: dict[str, Any]) -> None:
    worker, server = served["worker"], served["server"]
    update = _update(2)
    assert worker.push("ps0", update, codec="int8:bound=4").wait(10).applied
    for name in MODEL:  # within one step of the shared scale 4 / 127 per element
        assert np.abs(server.model[name] - (MODEL[name] - update[name])).max() < 4 / 127


def test_error_feedback_sends_what_the_codec_lost_on_the_next_push(served: dict[str, Any]) -> None:
    worker, server = served["worker"], served["server"]
    spec, pushes = "int8:bound=1,stochastic=0", 12
    g: dict[str, np.ndarray] = {
        "w": np.random.default_rng(5).uniform(-0.9, 0.9, (20, 30)),
        "b": np.full(8, 38.45 / 127, np.float32),  # 0.45 of a scale lost per push
    }
    for _ in range(pushes):
        assert worker.push("ps0", g, codec=spec, error_feedback=True).wait(10).applied
    feedback = worker.feedback("ps0")
    assert feedback is not None and feedback.codec == parse_codec(spec)
    for name in MODEL:  # sent = pushes * g - the last residual: off by at most half a scale
        residual = feedback.residual(name)
        assert residual is not None and np.abs(residual).max() <= 0.5 / 127 + 1e-6
        np.testing.assert_allclose(server.model[name], MODEL[name] - pushes * g[name] + residual, atol=1e-5)
    # without it the same rounding error adds up push after push
    for _ in range(pushes):
        assert worker.push("ps0", g, codec=spec).wait(10).applied
    drift = np.abs(server.model["b"] - (MODEL["b"] - 2 * pushes * g["b"])).max()
    assert drift > 5 * 0.5 / 127


def test_a_push_refused_while_encoding_keeps_the_residuals(served: dict[str, Any]) -> None:
    worker = served["worker"]
    g = _update(1)
    assert worker.push("ps0", g, codec="int8:bound=4,stochastic=0", error_feedback=True).wait(10).applied
    feedback = worker.feedback("ps0")
    assert feedback is not None
    before = {name: np.array(feedback.residual(name)) for name in MODEL}
    bad = {"w": g["w"], "b": np.full(8, np.inf, np.float32)}  # "w" encodes, "b" cannot
    with pytest.raises(ValueError, match="tensor 'b'"):
        worker.push("ps0", bad, codec="int8:bound=4,stochastic=0", error_feedback=True)
    for name in MODEL:
        np.testing.assert_array_equal(feedback.residual(name), before[name])


@pytest.mark.parametrize("served", [mlfabric.Params(compression="fp16")], indirect=True)
def test_the_jobs_compression_is_the_default_and_a_push_may_choose_none(served: dict[str, Any]) -> None:
    worker, server = served["worker"], served["server"]
    assert worker.params.compression == "fp16"
    update = _update(3)
    assert worker.push("ps0", update).wait(10).applied
    np.testing.assert_array_equal(server.model["w"], MODEL["w"] - _sent(update, "fp16")["w"])
    exact = _update(4)
    assert worker.push("ps0", exact, codec="none").wait(10).applied
    np.testing.assert_array_equal(server.model["w"], MODEL["w"] - _sent(update, "fp16")["w"] - exact["w"])


@pytest.mark.parametrize("served", [mlfabric.Params(sync_workers=2)], indirect=True)
def test_a_synchronous_round_sums_compressed_updates_decoded(served: dict[str, Any]) -> None:
    worker, server = served["worker"], served["server"]
    first, second = _update(8), _update(9)
    handles = [
        worker.push("ps0", first, codec="int8:bound=4,stochastic=0"),
        worker.push("ps0", second, codec="fp16"),
    ]
    assert [h.wait(10).version for h in handles] == [1, 1]
    sent = [_sent(first, "int8:bound=4,stochastic=0"), _sent(second, "fp16")]
    for name in MODEL:  # summed in the tensors' own dtype from the decodes
        expected = MODEL[name] - (sent[0][name] + sent[1][name])
        np.testing.assert_allclose(server.model[name], expected, rtol=1e-6, atol=1e-6)


def test_an_unknown_codec_or_bad_parameter_is_refused_before_anything_is_sent(
    served: dict[str, Any], scheduler: Any
) -> None:
    worker, server = served["worker"], served["server"]
    with pytest.raises(
        ValueError, match=r"unknown codec 'zstd' \(known: none, bf16, fp16, int8, randk, topk\)"
    ):
        worker.push("ps0", _update(1), codec="zstd")
    with pytest.raises(ValueError, match=r"codec 'int8:bound=nan'.*bound must be finite"):
        worker.push("ps0", _update(1), codec="int8:bound=nan")
    with pytest.raises(ValueError, match=r"codec 'topk:ratio=2'.*ratio must be in \(0, 1\], got 2.0"):
        worker.push("ps0", _update(1), codec="topk:ratio=2")
    with pytest.raises(ValueError, match=r"error feedback needs a contractive codec"):
        worker.push("ps0", _update(1), codec="randk:ratio=0.1", error_feedback=True)
    nan = _update(1)
    nan["w"][3, 4] = np.nan
    with pytest.raises(ValueError, match=r"tensor 'w' \(int8:bound=4.0\): element 94 is nan"):
        worker.push("ps0", nan, codec="int8:bound=4")
    assert not scheduler.ready and server.version == 0


def _frame(update_id: str, layouts: list[Any], **fields: Any) -> Any:
    return FrameHeader(
        kind=dataplane_pb2.FRAME_KIND_UPDATE,
        update_id=update_id,
        job="job",
        server="ps0",
        worker="w9",
        base_version=0,
        num_updates=1,
        tensors=layouts_to_pb(layouts),
        **fields,
    )


def _send_raw(address: str, header: Any, payload: bytes) -> Any:
    """Send one frame as bytes (no sender-side check) and return the reply's header."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(encode_header(header, len(payload), zlib.crc32(payload), False) + payload)
        reply = recv_frame(sock, FrameLimits())
    assert reply is not None
    return reply.header


def _encoded_frame(spec: str) -> tuple[Any, bytearray]:
    codec = parse_codec(spec)
    assert codec is not None
    words, encoded = encode_update(_update(5), codec)
    layouts, total = plan_layout(words, encoded)
    buf = bytearray(total)
    encode_into(memoryview(buf), words, layouts)
    return _frame("forged/1", layouts), buf


@pytest.mark.parametrize(
    ("corrupt", "named"),
    [
        (
            lambda t: t.encoding.scales.append(0.5),
            "scales: tensor 'w' (int8): expected 1 (one for the tensor",
        ),
        (
            lambda t: t.encoding.scales.__setitem__(0, float("nan")),
            "scales: tensor 'w' (int8): scale 0 is nan",
        ),
        (lambda t: setattr(t.encoding, "codec", "lz4"), "codec: tensor 'w' (lz4): unknown codec 'lz4'"),
        (lambda t: setattr(t.encoding, "bound", 5.0), "expected the shared scale"),
        (lambda t: setattr(t.encoding, "words", "int16"), "nbytes 600 != 600 elements x 2 bytes (int16"),
        (lambda t: setattr(t.encoding, "members", 3), "its words sum 3 updates, the frame carries 1"),
    ],
)
def test_a_corrupt_encoding_is_refused_by_the_frame_check(
    served: dict[str, Any], corrupt: Any, named: str
) -> None:
    ps, server = served["ps"], served["server"]
    header, payload = _encoded_frame("int8:bound=4,stochastic=0")
    corrupt(next(t for t in header.tensors if t.name == "w"))
    reply = _send_raw(ps.data_address, header, bytes(payload))  # a sender's own check would refuse it
    assert reply.kind == dataplane_pb2.FRAME_KIND_ERROR
    assert named in reply.reason
    assert server.version == 0 and server.applied == 0
    np.testing.assert_array_equal(server.model["w"], MODEL["w"])


def test_int8_words_beyond_their_members_are_dropped_by_the_server(served: dict[str, Any]) -> None:
    ps, server = served["ps"], served["server"]
    codec = parse_codec("int8:bound=4,stochastic=0")
    assert codec is not None
    words, encoded = encode_update(_update(6), codec)
    wide = np.array(words["w"], np.int16)
    wide[7] = 300  # a member's words lie within +-127
    words["w"] = wide
    dtype, shape, enc = encoded["w"]
    from dataclasses import replace

    encoded["w"] = (dtype, shape, replace(enc, words="int16"))
    layouts, total = plan_layout(words, encoded)
    buf = bytearray(total)
    encode_into(memoryview(buf), words, layouts)
    conn = PeerPool(FrameLimits()).connect(ps.data_address)
    try:
        reply = conn.request(_frame("forged/2", layouts), bytes(buf))
    finally:
        conn.close()
    assert reply.header.outcome == control_pb2.OUTCOME_DROPPED
    assert "does not decode" in reply.header.reason and "tensor 'w' (int8)" in reply.header.reason
    assert "expected within ±127" in reply.header.reason
    assert server.version == 0
    np.testing.assert_array_equal(server.model["w"], MODEL["w"])
