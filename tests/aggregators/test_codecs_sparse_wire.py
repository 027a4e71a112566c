"""Top-k and random-k on the wire, pure parts (docs/compression.md, "Sparse codecs on the wire").

A sparse tensor's bytes are its ``count`` float32 values then their ``count`` uint32 positions;
``count`` and ``ratio`` are in the header (``TensorEncoding``), so the frame check knows the
bytes before reading them; the positions are checked where they are read; an aggregator sums
sparse members densely and forwards the sum dense.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from mlfabric.aggregators.codecs import CodecError, ErrorFeedback, RandomKCodec, TopKCodec, decode
from mlfabric.aggregators.codecs.payload import (
    codec_spec,
    decode_layout,
    encode_update,
    encoded_of,
    parse_codec,
    wire_summary,
)
from mlfabric.aggregators.codecs.payloadsum import EncodedSum
from mlfabric.daemon.channels.frames import FrameError, FrameHeader, FrameLimits, check_header
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.tensors import Layout, encode_into, layouts_from_pb, layouts_to_pb, pack_layout, plan_layout
from mlfabric.wire import _native


def _member(
    update: dict[str, Any], spec: str, rng: np.random.Generator | None = None
) -> tuple[list[Layout], bytearray]:
    codec = parse_codec(spec)
    assert codec is not None
    words, encoded = encode_update(update, codec, rng or np.random.default_rng(3))
    layouts, total = plan_layout(words, encoded)
    buf = bytearray(total)
    encode_into(memoryview(buf), words, layouts)
    return layouts, buf


def _update(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(50, 40)).astype(np.float32), "h": rng.normal(size=300)}


def test_a_topk_tensor_is_its_values_then_its_positions_and_decodes_to_k_positions() -> None:
    update = _update(0)
    layouts, buf = _member(update, "topk:ratio=0.01")
    w, h = layouts
    assert w.encoding is not None and h.encoding is not None
    assert (w.encoding.codec, w.encoding.words, w.encoding.count, w.encoding.ratio) == (
        "topk",
        "float32",
        20,
        0.01,
    )
    assert (w.nbytes, h.encoding.count, h.nbytes, len(buf)) == (160, 3, 24, 184)
    assert layouts_from_pb(layouts_to_pb(layouts)) == layouts  # count and ratio travel in the header
    values = np.frombuffer(buf, np.float32, 20, 0)
    positions = np.frombuffer(buf, np.uint32, 20, 80)
    flat = update["w"].reshape(-1)
    np.testing.assert_array_equal(values, flat[positions])
    assert set(positions.tolist()) == set(np.argsort(-np.abs(flat))[:20].tolist())
    got = decode_layout(w, memoryview(buf))
    assert got.shape == (50, 40) and np.count_nonzero(got) == 20
    np.testing.assert_array_equal(got.reshape(-1)[positions], values)
    assert decode_layout(h, memoryview(buf)).dtype == np.float64
    # the stats: the codec's name, the tensors' bytes uncompressed
    assert wire_summary(layouts) == ("topk", 2000 * 4 + 300 * 8)


def test_randk_draws_its_positions_from_the_generator_and_rescales() -> None:
    update = _update(1)
    first = _member(update, "randk:ratio=0.05", np.random.default_rng(11))
    again = _member(update, "randk:ratio=0.05", np.random.default_rng(11))
    other = _member(update, "randk:ratio=0.05", np.random.default_rng(12))
    assert first[1] == again[1] and first[1] != other[1]  # the seed decides the positions
    w = first[0][0]
    assert w.encoding is not None and w.encoding.count == 100
    positions = np.frombuffer(first[1], np.uint32, 100, 400)
    values = np.frombuffer(first[1], np.float32, 100, 0)
    np.testing.assert_allclose(values, update["w"].reshape(-1)[positions] * 20, rtol=1e-6)  # n/k = 20
    plain = _member(update, "randk:ratio=0.05,rescale=0", np.random.default_rng(11))
    np.testing.assert_array_equal(
        np.frombuffer(plain[1], np.float32, 100, 0), update["w"].reshape(-1)[positions]
    )


def test_a_sparse_codec_encodes_a_tensor_only_when_its_bytes_are_fewer() -> None:
    update = {"f32": np.ones(8, np.float32), "f16": np.ones(64, np.float16), "tiny16": np.ones(4, np.float16)}
    layouts, _ = _member(update, "topk:ratio=0.5")
    by_name = {x.name: x for x in layouts}
    assert by_name["f32"].encoding is None  # 4 values x 8 bytes = the tensor's 32 bytes
    layouts, _ = _member(update, "topk:ratio=0.1")
    by_name = {x.name: x for x in layouts}
    assert by_name["f32"].encoding is not None and by_name["f16"].encoding is not None  # 7 x 8 < 128
    assert by_name["tiny16"].encoding is None  # 1 value x 8 bytes = the tensor's 8 bytes


@pytest.mark.parametrize(
    ("spec", "form"),
    [
        ("topk:ratio=0.01", "topk:ratio=0.01"),
        ("randk", "randk:ratio=0.01"),
        ("randk:rescale=0", "randk:ratio=0.01,rescale=0"),
    ],
)
def test_sparse_specs_read_back(spec: str, form: str) -> None:
    codec = parse_codec(spec)
    assert codec_spec(codec) == form and parse_codec(form) == codec


def _corrupt(
    layouts: list[Layout], buf: bytearray, positions: list[int] | None = None, **encoding: Any
) -> Layout:
    w = layouts[0]
    assert w.encoding is not None
    if positions is not None:
        count = w.encoding.count
        np.frombuffer(buf, np.uint32, count, w.offset + 4 * count)[: len(positions)] = positions
    return replace(w, encoding=replace(w.encoding, **encoding)) if encoding else w


@pytest.mark.parametrize(
    ("positions", "named"),
    [
        ([0, 5, 2000], "indices: tensor 'w' (topk): index 2000 out of range for a tensor of 2000 elements"),
        (
            [3, 3],
            "indices: tensor 'w' (topk): expected strictly increasing, got 3 then 3 at position 1 "
            "(duplicated)",
        ),
        (
            [9, 4],
            "indices: tensor 'w' (topk): expected strictly increasing, got 9 then 4 at position 1 (unsorted)",
        ),
    ],
)
def test_bad_positions_are_refused_where_they_are_read_naming_the_problem(
    positions: list[int], named: str
) -> None:
    layouts, buf = _member(_update(2), "topk:ratio=0.01")
    w = _corrupt(layouts, buf, positions)
    with pytest.raises(CodecError) as err:
        decode_layout(w, memoryview(buf))
    assert str(err.value) == named
    total = EncodedSum(layouts)  # an aggregator refuses the member before summing any tensor
    good = _member(_update(3), "topk:ratio=0.01")
    total.add(*good)
    with pytest.raises(CodecError, match="indices: tensor 'w' \\(topk\\)"):
        total.add(layouts, buf)
    assert total.count == 1


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"count": 21}, "count: tensor 'w' (topk): expected 20 values (ratio 0.01 of 2000 elements), got 21"),
        (
            {"ratio": 0.02},
            "count: tensor 'w' (topk): expected 40 values (ratio 0.02 of 2000 elements), got 20",
        ),
        ({"ratio": 1.5}, "ratio: tensor 'w' (topk): expected a ratio in (0, 1], got 1.5"),
        ({"words": "int8"}, "words: tensor 'w' (topk): expected float32, got 'int8'"),
        ({"block": 4}, "scales: tensor 'w' (topk): topk has no scales, block or bound, got 0/4/0.0"),
    ],
)
def test_the_frame_check_refuses_a_sparse_header_before_reading_a_byte(
    change: dict[str, Any], named: str
) -> None:
    layouts, buf = _member(_update(4), "topk:ratio=0.01")
    header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, payload_bytes=len(buf), num_updates=2)
    header.tensors.extend(layouts_to_pb([_corrupt(layouts, buf, **change), *layouts[1:]]))
    with pytest.raises(FrameError) as err:
        check_header(header, FrameLimits())
    assert str(err.value) == f"bad encoding: {named}"


def test_the_frame_check_counts_a_sparse_tensors_bytes_from_its_header() -> None:
    layouts, buf = _member(_update(5), "topk:ratio=0.01")
    header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, payload_bytes=len(buf), num_updates=1)
    header.tensors.extend(layouts_to_pb(layouts))
    check_header(header, FrameLimits())
    header.tensors[0].nbytes = 2000 * 4  # as if dense
    with pytest.raises(
        FrameError, match=r"tensor 'w': nbytes 8000 != 20 values x \(4 \+ 4 bytes of position\)"
    ):
        check_header(header, FrameLimits())
    header.tensors[0].nbytes = 160
    header.kind = dataplane_pb2.FRAME_KIND_MODEL  # a model is never sparse
    with pytest.raises(FrameError, match="tensor 'w': only an UPDATE's tensors travel topk"):
        check_header(header, FrameLimits())


def test_the_nan_pass_tests_the_values_not_the_positions() -> None:
    layouts, buf = _member(_update(6), "topk:ratio=0.01")
    segments = np.frombuffer(pack_layout(layouts), np.uint64).reshape(-1, 3)
    assert segments.tolist() == [[0, 80, 1], [160, 12, 1]]  # (offset, bytes, float32) of the values
    assert _native.check(buf, 0, len(buf), 0, pack_layout(layouts))[1] == -1
    np.frombuffer(buf, np.float32, 3, 160)[1] = np.inf  # a value of "h"
    assert _native.check(buf, 0, len(buf), 0, pack_layout(layouts))[1] == 1
    clean = _member(_update(6), "topk:ratio=0.01")[1]
    np.frombuffer(clean, np.uint32, 1, 80)[0] = 0x7FC00000  # a position with a NaN's bits: not a value
    assert _native.check(clean, 0, len(clean), 0, pack_layout(layouts))[1] == -1


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "randk:ratio=0.02"])
def test_sparse_members_are_summed_and_forwarded_on_the_union_of_their_positions(spec: str) -> None:
    members = [_member(u, spec, np.random.default_rng(i)) for i, u in enumerate(_update(s) for s in range(4))]
    total = EncodedSum(members[0][0])
    for layouts, buf in members:
        total.add(layouts, buf)
    words, encoded, forms = total.finish()
    codec = spec.split(":")[0]
    assert forms == {"w": codec, "h": codec} and total.codec == codec
    out, size = plan_layout(words, encoded)
    sum_buf = bytearray(size)
    encode_into(memoryview(sum_buf), words, out)
    assert size == total.payload_bytes  # announced as forwarded
    member_bytes = len(members[0][1])
    assert size <= 4 * member_bytes < 2000 * 4 + 300 * 8  # at most the members' bytes, fewer than dense
    for x in out:
        union = set()
        for lay, b in members:
            m = next(y for y in lay if y.name == x.name)
            assert m.encoding is not None
            union |= set(
                np.frombuffer(b, np.uint32, m.encoding.count, m.offset + 4 * m.encoding.count).tolist()
            )
        assert x.encoding is not None and x.encoding.members == 4 and x.encoding.count == len(union)
        exact = sum(
            np.asarray(
                decode(encoded_of(next(y for y in lay if y.name == x.name), memoryview(b))), np.float64
            )
            for lay, b in members
        )
        got = decode_layout(x, memoryview(sum_buf))  # the frame check and the decode accept it
        assert got.dtype == np.dtype(x.dtype)  # the tensor's own dtype
        np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-6)  # nothing dropped
    header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, payload_bytes=size, num_updates=4)
    header.tensors.extend(layouts_to_pb(out))
    check_header(header, FrameLimits())
    again = EncodedSum(out)  # a parent aggregate (a tree) sums the union again
    again.add(out, sum_buf, 4)
    again.add(*members[0])
    _, encoded2, _ = again.finish()
    assert encoded2["w"][2].members == 5


def test_a_union_no_smaller_than_the_dense_sum_is_forwarded_dense() -> None:
    members = [
        _member(
            {"w": np.arange(8, dtype=np.float32) * (-1) ** i}, "randk:ratio=0.25", np.random.default_rng(i)
        )
        for i in range(4)
    ]
    total = EncodedSum(members[0][0])
    for layouts, buf in members:
        total.add(layouts, buf)
    words, encoded, forms = total.finish()
    # 4 members of 2 positions: a union of >= 4 positions is 32 bytes, the dense float32 sum 32
    assert forms == {"w": "raw"} and not encoded and total.codec == ""
    exact = sum(np.asarray(decode(encoded_of(lay[0], memoryview(b))), np.float64) for lay, b in members)
    got = words["w"]
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, exact, rtol=1e-6)


def test_sparse_and_other_members_are_summed_densely() -> None:
    update = _update(9)
    members = [_member(update, "topk:ratio=0.01"), _member(update, "fp16")]
    total = EncodedSum(members[0][0])
    for layouts, buf in members:
        total.add(layouts, buf)
    assert total.payload_bytes == 2000 * 4 + 300 * 8  # dense: announced so
    _, encoded, forms = total.finish()
    assert not encoded and forms == {"w": "raw", "h": "raw"}


@pytest.mark.parametrize(
    ("members", "count", "named"),
    [
        (3, 19, "count: tensor 'w' (topk): expected 20 to 60 values (the union of 3 members' positions"),
        (3, 61, "expected 20 to 60 values"),
    ],
)
def test_the_union_of_a_sums_positions_is_bounded_by_its_members(
    members: int, count: int, named: str
) -> None:
    layouts, buf = _member(_update(4), "topk:ratio=0.01")
    header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, payload_bytes=len(buf), num_updates=members)
    header.tensors.extend(layouts_to_pb([_corrupt(layouts, buf, members=members, count=count), *layouts[1:]]))
    with pytest.raises(FrameError, match=re.escape(named)):
        check_header(header, FrameLimits())


def test_error_feedback_with_topk_keeps_what_was_not_sent() -> None:
    codec = TopKCodec(ratio=0.05)
    feedback = ErrorFeedback(codec)
    g = {"w": np.random.default_rng(7).normal(size=200).astype(np.float32)}
    sent = np.zeros(200)
    for _ in range(10):
        words, encoded = encode_update(g, codec, feedback=feedback)
        layouts, _ = plan_layout(words, encoded)
        got = decode_layout(layouts[0], memoryview(words["w"]))  # type: ignore[arg-type]
        assert np.count_nonzero(got) == 10
        sent += got
    residual = feedback.residual("w")
    assert residual is not None
    np.testing.assert_allclose(sent + residual, 10 * g["w"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contractive"):
        ErrorFeedback(RandomKCodec(ratio=0.1))


def test_a_sparse_update_reads_back_from_a_memfd_decoded() -> None:
    import os

    from mlfabric.tensorio import map_memfd, read_memfd, to_memfd

    update = _update(10)
    codec = parse_codec("topk:ratio=0.01")
    assert codec is not None
    words, encoded = encode_update(update, codec)
    fd, layouts, _ = to_memfd(words, encoded=encoded)
    try:
        read = read_memfd(fd, layouts)
        mapped, mapping = map_memfd(fd, layouts)
        for name in update:
            assert read[name].dtype == update[name].dtype and np.count_nonzero(read[name]) == (
                20 if name == "w" else 3
            )
            np.testing.assert_array_equal(read[name], mapped[name])
        del mapped
        if mapping is not None:
            mapping.close()
    finally:
        os.close(fd)


def test_shared_randk_members_of_one_version_keep_k_positions_in_their_sum() -> None:
    from mlfabric.aggregators.codecs.sparse import version_rng

    spec = "randk:ratio=0.02,rescale=0,shared=1"
    codec = parse_codec(spec)
    assert isinstance(codec, RandomKCodec) and codec.shared and codec_spec(codec) == spec
    # four workers pushing against version 7 draw their positions from version_rng(7): the same
    members = [_member(_update(s), spec, version_rng(7)) for s in range(4)]
    total = EncodedSum(members[0][0])
    for layouts, buf in members:
        total.add(layouts, buf)
    words, encoded, _ = total.finish()
    out, size = plan_layout(words, encoded)
    assert size == len(members[0][1])  # the sum is as small as one member: k values and positions
    for x in out:
        assert x.encoding is not None and x.encoding.members == 4
        assert x.encoding.count == math.ceil(0.02 * int(np.prod(x.shape)))
    # against another version: other positions
    other = _member(_update(0), spec, version_rng(8))
    assert bytes(other[1]) != bytes(_member(_update(0), spec, version_rng(7))[1])
