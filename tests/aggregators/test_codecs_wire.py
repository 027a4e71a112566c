"""Codecs on the wire, pure parts: specs, layouts, checks, and sums of encoded members.

``aggregators/codecs/payload.py`` (a push's tensors as codec words in a payload) and
``aggregators/codecs/payloadsum.py`` (an aggregator's sum of encoded members).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mlfabric.aggregators.codecs import CodecError, decode, relative_l2
from mlfabric.aggregators.codecs.payload import (
    check_encoding,
    codec_spec,
    decode_layout,
    encode_update,
    encoded_of,
    parse_codec,
)
from mlfabric.aggregators.codecs.payloadsum import EncodedSum
from mlfabric.tensors import Encoding, Layout, encode_into, layouts_from_pb, layouts_to_pb, plan_layout


def _member(update: dict[str, Any], spec: str) -> tuple[list[Layout], memoryview]:
    codec = parse_codec(spec)
    rng = np.random.default_rng(3)
    words, encoded = (update, None) if codec is None else encode_update(update, codec, rng)
    layouts, total = plan_layout(words, encoded)
    buf = bytearray(total)
    encode_into(memoryview(buf), words, layouts)
    return layouts, memoryview(buf)


def _decoded(layouts: list[Layout], buf: memoryview) -> dict[str, np.ndarray]:
    out = {}
    for x in layouts:
        if x.encoding is None:
            out[x.name] = np.frombuffer(buf, x.dtype, int(np.prod(x.shape)), x.offset).reshape(x.shape)
        else:
            out[x.name] = decode(encoded_of(x, buf))
    return out


def _updates(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"w": rng.normal(size=(50, 40)).astype(np.float32), "h": rng.normal(size=300).astype(np.float64)}
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    "spec",
    [
        "fp16",
        "bf16",
        "int8",
        "int8:bound=6",
        "int8:block=64,stochastic=0",
        "int8:bound=0.5,stochastic=1",
        "topk",
        "topk:ratio=0.01",
        "randk:ratio=0.25",
        "randk:ratio=0.25,rescale=0",
    ],
)
def test_specs_round_trip(spec: str) -> None:
    codec = parse_codec(spec)
    assert parse_codec(codec_spec(codec)) == codec
    assert parse_codec(codec) is codec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gzip", "unknown codec 'gzip' (known: none, bf16, fp16, int8, randk, topk)"),
        ("topk:ratio=0", "codec 'topk:ratio=0': ratio must be in (0, 1], got 0.0"),
        ("topk:ratio=1.5", "ratio must be in (0, 1], got 1.5"),
        ("topk:ratio=x", "could not convert string to float"),
        ("topk:bound=2", "unknown parameter 'bound=2' (accepted: ratio)"),
        ("randk:ratio=0.1,rescale=maybe", "expected 0/1/true/false"),
        ("randk:seed=3", "unknown parameter 'seed=3' (accepted: ratio, rescale, shared)"),
        ("int8:bound=0", "bound must be finite and > 0, got 0.0"),
        ("int8:bound=x", "could not convert string to float"),
        ("int8:rounds=3", "unknown parameter 'rounds=3' (accepted: bound, block, stochastic)"),
        ("fp16:bound=3", "unknown parameter 'bound=3' (accepted: none)"),
        ("int8:stochastic=maybe", "expected 0/1/true/false"),
    ],
)
def test_bad_specs_name_the_codec_and_the_known_ones(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_codec(spec)
    assert message in str(err.value) and "known: none, bf16, fp16, int8, randk, topk" in str(err.value)


def test_not_a_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="codec must be a name or a codec object, got int"):
        parse_codec(3)


def test_encoded_layouts_round_trip_through_the_proto_and_decode() -> None:
    update = {"w": np.linspace(-3, 3, 1000).astype(np.float32), "raw": np.zeros(3, np.uint16)}
    layouts, buf = _member(update, "int8:bound=4,stochastic=0")
    assert layouts_from_pb(layouts_to_pb(layouts)) == layouts
    w, raw = layouts
    assert w.encoding is not None and w.encoding.words == "int8" and w.nbytes == 1000
    assert raw.encoding is None  # bfloat16 words travel as they are
    got = decode_layout(w, buf)
    assert got.dtype == np.float32 and np.abs(got - update["w"]).max() <= 4 / 127 / 2 + 1e-7


def test_float16_tensors_are_encoded_only_by_int8() -> None:
    update = {"h": np.ones(8, np.float16)}
    assert _member(update, "fp16")[0][0].encoding is None
    assert _member(update, "int8")[0][0].encoding is not None


@pytest.mark.parametrize(
    ("encoding", "field", "words"),
    [
        (
            Encoding("int8", "int8", (0.1, 0.2), 0),
            "scales",
            "expected 1 (one for the tensor, 8 elements), got 2",
        ),
        (Encoding("int8", "int8", (float("inf"),), 0), "scales", "scale 0 is inf"),
        (Encoding("int8", "int8", (-1.0,), 0), "scales", "scale 0 is -1.0"),
        (Encoding("int8", "int8", (0.5,), 0, 1.0), "scales", "expected the shared scale"),
        (Encoding("int8", "int8", (1.0,), 0, float("nan")), "bound", "expected a finite bound"),
        (Encoding("int8", "float16", (1.0,)), "words", "expected int8 or int16 or int32, got 'float16'"),
        (Encoding("fp16", "float16", (1.0,)), "scales", "fp16 has no scales"),
        (Encoding("lz4", "float32"), "codec", "unknown codec 'lz4'"),
        (Encoding("topk", "float32", count=3, ratio=0.25), "count", "expected 2 values (ratio 0.25 of 8"),
        (Encoding("randk", "float32", count=1, ratio=0.0), "ratio", "expected a ratio in (0, 1], got 0.0"),
        (Encoding("topk", "float16", count=2, ratio=0.25), "words", "expected float32, got 'float16'"),
        (Encoding("topk", "float32", members=2, count=5, ratio=0.25), "count", "expected 2 to 4 values"),
        (Encoding("randk", "float32", (0.5,), count=2, ratio=0.25), "scales", "randk has no scales"),
        (Encoding("fp16", "float16", members=0), "members", "expected >= 1, got 0"),
    ],
)
def test_the_encoding_checks_name_the_field(encoding: Encoding, field: str, words: str) -> None:
    with pytest.raises(CodecError) as err:
        check_encoding(Layout("t", "float32", (8,), 0, 8, encoding))
    assert err.value.field == field and words in str(err.value) and "tensor 't'" in str(err.value)


def test_a_bfloat16_tensor_is_never_encoded() -> None:
    with pytest.raises(CodecError, match="a codec encodes"):
        check_encoding(Layout("t", "bfloat16", (8,), 0, 16, Encoding("fp16", "float16")))


def test_words_that_do_not_fit_the_payload_are_refused() -> None:
    layouts, buf = _member({"w": np.ones(10, np.float32)}, "fp16")
    with pytest.raises(CodecError, match="expected 10 float16 words"):
        encoded_of(layouts[0], buf[:-2])


@pytest.mark.parametrize(("spec", "form"), [("fp16", "fp16"), ("bf16", "bf16"), ("int8:bound=8", "int8")])
def test_a_summable_codec_is_summed_on_its_words_and_forwarded_in_it(spec: str, form: str) -> None:
    updates = _updates(4)
    members = [_member(u, spec) for u in updates]
    total = EncodedSum(members[0][0])
    for layouts, buf in members:
        total.add(layouts, buf)
    words, encoded, forms = total.finish()
    assert forms == {"w": form, "h": form} and total.count == 4
    assert all(e.members == 4 for _, _, e in encoded.values())
    out, n = plan_layout(words, encoded)
    sum_buf = bytearray(n)
    encode_into(memoryview(sum_buf), words, out)
    got = _decoded(out, memoryview(sum_buf))
    decodes = [_decoded(*m) for m in members]
    for k in ("w", "h"):
        dense = np.sum([np.asarray(d[k], np.float64) for d in decodes], axis=0)
        tolerance = {"fp16": 2**-10, "bf16": 2**-7, "int8": 0.0}[form]  # int8: the int32 sum is exact
        assert relative_l2(got[k], dense) <= tolerance + 1e-6


def test_int8_with_a_shared_bound_sums_exactly_and_widens_its_words() -> None:
    update = {"w": np.full(4, 7.9, np.float32)}
    members = [_member(update, "int8:bound=8,stochastic=0") for _ in range(3)]
    total = EncodedSum(members[0][0])
    for layouts, buf in members:
        total.add(layouts, buf)
    words, encoded, _ = total.finish()
    assert words["w"].dtype == np.int16 and words["w"].tolist() == [3 * 125] * 4  # type: ignore[attr-defined]
    assert encoded["w"][2].words == "int16" and encoded["w"][2].members == 3


@pytest.mark.parametrize(
    "specs",
    [["fp16", "int8:bound=8", "none"], ["int8", "int8"], ["int8:bound=8", "int8:bound=4"], ["none", "fp16"]],
)
def test_mixed_or_non_summable_members_are_decoded_and_forwarded_dense(specs: list[str]) -> None:
    updates = _updates(len(specs), seed=1)
    members = [_member(u, s) for u, s in zip(updates, specs, strict=True)]
    total = EncodedSum(members[0][0])
    for layouts, buf in members:
        total.add(layouts, buf)
    words, encoded, forms = total.finish()
    assert not encoded and forms == {"w": "raw", "h": "raw"}
    decodes = [_decoded(*m) for m in members]
    for k, dtype in (("w", np.float32), ("h", np.float64)):
        got = words[k]
        assert isinstance(got, np.ndarray) and got.dtype == dtype
        dense = sum(np.asarray(d[k], np.float64) for d in decodes)
        np.testing.assert_allclose(got, dense, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


def test_an_fp16_sum_beyond_its_range_is_forwarded_dense() -> None:
    big = {"w": np.full(3, 60000.0, np.float32)}
    total = EncodedSum(_member(big, "fp16")[0])
    for _ in range(2):
        total.add(*_member(big, "fp16"))
    words, _, forms = total.finish()
    assert forms == {"w": "raw"} and words["w"].tolist() == [120000.0] * 3  # type: ignore[attr-defined]


def test_a_bad_member_is_refused_and_leaves_the_sum_as_it_was() -> None:
    good = _member({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, "int8:bound=8,stochastic=0")
    total = EncodedSum(good[0])
    total.add(*good)
    layouts, buf = _member(
        {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, "int8:bound=8,stochastic=0"
    )
    bad = bytearray(buf)
    bad[layouts[1].offset] = 0x80  # int8 -128: beyond ±127 for one member
    with pytest.raises(
        CodecError, match=r"tensor 'b' \(int8\): values in \[-128, 16\], expected within ±127"
    ):
        total.add(layouts, memoryview(bad))
    assert total.count == 1
    words, _, _ = total.finish()
    np.testing.assert_array_equal(words["a"], words["b"])  # "a" was not summed twice, nor "b" once


def test_a_member_with_other_tensors_is_refused() -> None:
    total = EncodedSum(_member({"w": np.ones(4, np.float32)}, "fp16")[0])
    with pytest.raises(ValueError, match="differ from the aggregate's"):
        total.add(*_member({"w": np.ones(5, np.float32)}, "fp16"))
