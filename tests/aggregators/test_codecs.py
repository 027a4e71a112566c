"""The codecs of issue 26: round trips within their bounds, sums, unbiasedness, error feedback,
and every corrupt or inconsistent payload refused with a CodecError naming the field."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mlfabric.aggregators.codecs import (
    Bf16Codec,
    Codec,
    CodecError,
    CodecSum,
    Encoded,
    ErrorFeedback,
    Fp16Codec,
    Int8Codec,
    RandomKCodec,
    TopKCodec,
    compensate,
    decode,
    make_codec,
    relative_l2,
    top_k_indices,
)

ALL_CODECS: list[Codec] = [
    Fp16Codec(),
    Bf16Codec(),
    Int8Codec(),
    Int8Codec(block=0),
    Int8Codec(block=7, stochastic=False),
    Int8Codec(bound=4.0),
    TopKCodec(ratio=0.1),
    RandomKCodec(ratio=0.1),
]


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _x(
    n: int = 1000, seed: int = 0, dtype: Any = np.float32, shape: tuple[int, ...] | None = None
) -> np.ndarray:
    x = _rng(seed).standard_normal(n).astype(dtype)
    return x.reshape(shape) if shape else x


def _block_scales(enc: Encoded) -> np.ndarray:
    """The scale of every element of an int8 payload."""
    assert enc.scales is not None
    if enc.block == 0:
        return np.full(enc.size, enc.scales[0], np.float32)
    return np.repeat(enc.scales, enc.block)[: enc.size]


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_round_trip_keeps_dtype_and_shape(codec: Codec, dtype: Any) -> None:
    x = _x(60, dtype=dtype, shape=(3, 4, 5))
    enc = codec.encode(x, rng=_rng())
    assert enc.codec == codec.name and enc.dtype == np.dtype(dtype).name and enc.shape == (3, 4, 5)
    assert not enc.payload.flags.writeable  # plain frozen data
    out = codec.decode(enc)
    assert out.dtype == dtype and out.shape == x.shape
    assert np.array_equal(decode(enc), out)  # the name dispatch decodes the same


def test_fp16_within_its_bound() -> None:
    x = np.concatenate([_x(5000) * 100, _x(100) * 1e-6, [65504.0, -65519.0, 0.0]]).astype(np.float32)
    out = Fp16Codec().decode(Fp16Codec().encode(x))
    assert np.all(np.abs(out - x) <= 2.0**-11 * np.abs(x) + 2.0**-25)


def test_fp16_passes_non_finite_values_through() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    out = Fp16Codec().decode(Fp16Codec().encode(x))
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf and out[3] == 1.0


def test_bf16_within_its_bound() -> None:
    x = np.concatenate([_x(5000) * 1e20, _x(5000) * 1e-20]).astype(np.float32)
    out = Bf16Codec().decode(Bf16Codec().encode(x))
    assert np.all(np.abs(out - x) <= 2.0**-8 * np.abs(x))


@pytest.mark.parametrize("block", [0, 1, 64, 256, 999])
@pytest.mark.parametrize("stochastic", [True, False])
def test_int8_within_a_scale(block: int, stochastic: bool) -> None:
    x = _x(1000) * np.linspace(0.01, 100, 1000, dtype=np.float32)  # blocks of different ranges
    codec = Int8Codec(block=block, stochastic=stochastic)
    enc = codec.encode(x, rng=_rng())
    scale = _block_scales(enc)
    err = np.abs(codec.decode(enc) - x)
    assert enc.payload.dtype == np.int8 and enc.payload.min() >= -127
    assert np.all(err <= (scale if stochastic else scale / 2) * (1 + 1e-5))
    assert enc.scales is not None and enc.scales.size == (1 if block == 0 else -(-1000 // block))


def test_int8_all_zero_and_tiny_blocks() -> None:
    x = np.zeros(512, np.float32)
    x[256:] = 1e-40  # subnormal: the scale is raised to the smallest normal, the inverse stays finite
    codec = Int8Codec(block=256)
    enc = codec.encode(x, rng=_rng())
    assert enc.scales is not None and enc.scales[0] == 0 and np.isfinite(enc.scales[1])
    assert np.abs(codec.decode(enc) - x).max() < 2.0**-126


def test_int8_shared_scale_clips_beyond_the_bound() -> None:
    codec = Int8Codec(bound=1.0, stochastic=False)
    x = np.array([0.5, -3.0, 1.0, 2.0, -0.999], np.float32)
    enc = codec.encode(x)
    assert enc.clipped == 2 and enc.block == 0 and enc.scales is not None
    assert enc.scales.tolist() == [np.float32(1.0 / 127)]
    np.testing.assert_allclose(codec.decode(enc), np.clip(x, -1, 1), atol=0.5 / 127)


def test_topk_round_trip_keeps_exact_values_and_bounds_the_error() -> None:
    x = _x(1000)
    codec = TopKCodec(ratio=0.05)
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert enc.indices is not None and enc.indices.size == 50 and enc.ratio == pytest.approx(10.0)
    assert np.array_equal(out[enc.indices], x[enc.indices])
    assert np.linalg.norm(out - x) ** 2 <= (1 - 50 / 1000) * np.linalg.norm(x) ** 2


def test_randomk_rescales_its_values() -> None:
    x = _x(1000)
    enc = RandomKCodec(ratio=0.1).encode(x, rng=_rng())
    assert enc.indices is not None and enc.indices.size == 100
    np.testing.assert_allclose(enc.payload, x[enc.indices] * 10, rtol=1e-6)
    plain = RandomKCodec(ratio=0.1, rescale=False).encode(x, rng=_rng())
    assert np.array_equal(plain.payload, x[plain.indices])


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
def test_empty_and_scalar_tensors(codec: Codec) -> None:
    for x in (np.zeros(0, np.float32), np.array(2.5, np.float32)):
        enc = codec.encode(x, rng=_rng())
        out = codec.decode(enc)
        assert out.shape == x.shape
        if x.size and not isinstance(codec, RandomKCodec):
            assert out == pytest.approx(float(x), rel=0.02)


# ---------------------------------------------------------------------------- sums


def _sum(codec: Codec, members: list[Encoded]) -> CodecSum:
    acc = CodecSum()
    for m in members:
        codec.sum_into(acc, m)
    return acc


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
def test_sum_equals_the_sum_of_decodes(codec: Codec) -> None:
    members = [codec.encode(_x(700, seed=s) * (s + 1), rng=_rng(s)) for s in range(5)]
    acc = _sum(codec, members)
    assert acc.members == 5
    expected = np.sum([codec.decode(m).astype(np.float64) for m in members], axis=0)
    dense = codec.finish_dense(acc)
    assert dense.dtype == np.float32 and dense.shape == (700,)
    np.testing.assert_allclose(dense, expected, rtol=1e-5, atol=1e-4)
    total = codec.finish(acc, rng=_rng(9))
    assert total.members == 5 and total.codec == codec.name
    # the forwarded sum is the dense sum encoded once more, within the codec's own bound
    again = codec.decode(total)
    if isinstance(codec, Fp16Codec | Bf16Codec):
        rel = 2.0**-11 if isinstance(codec, Fp16Codec) else 2.0**-8
        assert np.all(np.abs(again - dense) <= rel * np.abs(dense) + 1e-6)
    elif isinstance(codec, Int8Codec) and codec.summable:
        np.testing.assert_allclose(again, expected, rtol=1e-5, atol=1e-4)  # exact int32 sum
        assert total.payload.dtype == np.int16  # |sum| > 127, < 32767
    elif isinstance(codec, Int8Codec):
        assert np.all(np.abs(again - dense) <= _block_scales(total) * (1 + 1e-5))
    elif isinstance(codec, TopKCodec):
        assert total.indices is not None
        assert np.array_equal(total.indices, top_k_indices(dense.reshape(-1), codec.k_for(700)))


def test_shared_int8_sums_of_sums_stay_exact() -> None:
    """A tree: two aggregates of int8 words summed again by the next hop, without decoding."""
    codec = Int8Codec(bound=3.0)
    members = [codec.encode(_x(500, seed=s), rng=_rng(s)) for s in range(6)]
    left, right = codec.finish(_sum(codec, members[:3])), codec.finish(_sum(codec, members[3:]))
    root = codec.finish(_sum(codec, [left, right]))
    flat = codec.finish(_sum(codec, members))
    assert root.members == 6 and np.array_equal(root.payload, flat.payload)
    assert sum(int(m.payload.astype(np.int64).sum()) for m in members) == int(
        root.payload.astype(np.int64).sum()
    )


def test_cast_sums_accumulate_in_float32() -> None:
    """1000 copies of 0.1 in fp16 summed in float32 (an fp16 running sum would stall at 64)."""
    codec = Fp16Codec()
    enc = codec.encode(np.full(4, 0.1, np.float32))
    acc = _sum(codec, [enc] * 1000)
    assert codec.finish_dense(acc) == pytest.approx(np.full(4, 1000 * float(np.float16(0.1))), rel=1e-5)


def test_fp16_finish_beyond_range_raises() -> None:
    codec = Fp16Codec()
    acc = _sum(codec, [codec.encode(np.full(2, 60000.0, np.float32))] * 2)
    with pytest.raises(CodecError, match="beyond float16's range") as err:
        codec.finish(acc)
    assert err.value.field == "sum"
    assert codec.finish_dense(acc).tolist() == [120000.0, 120000.0]


# ---------------------------------------------------------------------------- unbiasedness


def test_stochastic_rounding_is_unbiased() -> None:
    codec = Int8Codec(block=0)
    x = np.linspace(-1, 1, 41, dtype=np.float32) * np.float32(0.93)
    x[0] = -1.0  # the scale is 1/127; every other value falls between two steps
    rng = _rng(42)
    draws = 4000
    mean = np.zeros(x.size)
    for _ in range(draws):
        mean += codec.decode(codec.encode(x, rng=rng))
    mean /= draws
    scale = 1 / 127
    # each draw is off by < one scale (std <= scale/2): 5 standard errors of the mean
    assert np.abs(mean - x).max() < 5 * (scale / 2) / np.sqrt(draws)
    nearest = Int8Codec(block=0, stochastic=False)
    assert np.abs(nearest.decode(nearest.encode(x)) - x).max() > 10 * np.abs(mean - x).max()


def test_random_k_is_unbiased() -> None:
    codec = RandomKCodec(ratio=0.25)
    x = _x(40)
    rng = _rng(3)
    draws = 4000
    mean = np.mean([codec.decode(codec.encode(x, rng=rng)) for _ in range(draws)], axis=0)
    # each element is 4x or 0 with p = 1/4: std sqrt(3)|x|
    assert np.all(np.abs(mean - x) < 5 * np.sqrt(3) * np.abs(x) / np.sqrt(draws) + 1e-6)


def test_randomised_codecs_need_a_generator() -> None:
    with pytest.raises(ValueError, match="needs rng"):
        Int8Codec().encode(_x(10))
    with pytest.raises(ValueError, match="needs rng"):
        RandomKCodec().encode(_x(10))
    Int8Codec(stochastic=False).encode(_x(10))  # nearest rounding draws nothing


# ---------------------------------------------------------------------------- top-k selection


@pytest.mark.parametrize("n", [10, 1000, 300_000, 1_000_003])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3])
def test_topk_keeps_the_k_largest_magnitudes(n: int, ratio: float) -> None:
    x = _x(n, seed=n) * np.exp(_x(n, seed=n + 1))  # heavy-tailed
    codec = TopKCodec(ratio=ratio)
    k = codec.k_for(n)
    enc = codec.encode(x)
    assert enc.indices is not None and enc.indices.size == k
    kept = np.sort(np.abs(x[enc.indices]))
    assert np.array_equal(kept, np.sort(np.abs(x))[n - k :])
    assert np.all(np.diff(enc.indices.astype(np.int64)) > 0)


@pytest.mark.parametrize("nonzero", [0, 10, 999, 1000, 1001, 5000])
def test_topk_of_a_mostly_zero_tensor(nonzero: int) -> None:
    """A sum of sparse members: the sampled threshold is 0, the nonzeros come first."""
    n, k = 400_000, 1000
    x = np.zeros(n, np.float32)
    where = _rng(1).choice(n, nonzero, replace=False)
    x[where] = _x(nonzero) + 0.1 * np.sign(_x(nonzero, seed=2))
    idx = top_k_indices(x, k)
    assert idx.size == k and np.unique(idx).size == k
    assert np.array_equal(np.sort(np.abs(x[idx])), np.sort(np.abs(x))[n - k :])


def test_topk_when_the_sample_misleads() -> None:
    """A strided sample that sees only zeros, and ties: the exact path still picks k."""
    n = 600_000
    x = np.zeros(n, np.float32)
    x[1::2] = np.arange(n // 2, dtype=np.float32)  # the sample (stride n // 65536 = 9) sees both
    x[: n // 2 : 9] = 0.0
    idx = top_k_indices(x, 1000)
    assert idx.size == 1000 and np.array_equal(np.sort(x[idx]), np.sort(x)[-1000:])
    ties = top_k_indices(np.ones(n, np.float32), 77)
    assert ties.size == 77 and np.unique(ties).size == 77


# ---------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize(
    "codec",
    [
        TopKCodec(ratio=0.05),
        RandomKCodec(ratio=0.05, rescale=False),
        Int8Codec(bound=0.5),
        Int8Codec(),
        Fp16Codec(),
    ],
    ids=repr,
)
def test_error_feedback_loses_nothing(codec: Codec) -> None:
    ef = ErrorFeedback(codec)
    rng = _rng(5)
    steps, originals, sent = 200, np.zeros(400), np.zeros(400)
    norms = []
    for t in range(steps):
        g = _x(400, seed=t)
        originals += g
        sent += codec.decode(ef.encode("w", g, rng=rng))
        residual = ef.residual("w")
        assert residual is not None
        norms.append(float(np.linalg.norm(residual)))
        # nothing lost: what was sent plus what is held is what came, to float32 rounding
        np.testing.assert_allclose(sent + residual, originals, atol=1e-3 * (t + 1))
    # the residual stays bounded (it stops growing), so the decoded sum approaches the true one
    assert max(norms[100:]) <= 1.5 * max(norms[25:100])
    assert relative_l2(sent, originals) == pytest.approx(norms[-1] / np.linalg.norm(originals), rel=1e-3)
    assert relative_l2(sent, originals) < 0.5  # without feedback top-k / random-k lose > 0.5


def test_without_feedback_topk_loses_most_of_the_sum() -> None:
    codec = TopKCodec(ratio=0.05)
    gs = [_x(400, seed=t) for t in range(50)]
    plain = np.sum([codec.decode(codec.encode(g)) for g in gs], axis=0)
    assert relative_l2(plain, np.sum(gs, axis=0)) > 0.5


def test_error_feedback_state_per_name_and_reset() -> None:
    ef = ErrorFeedback(TopKCodec(ratio=0.5))
    ef.encode("a", np.array([1.0, 2.0], np.float32))
    ef.encode("b", np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    assert ef.residual("a") is not None and ef.residual("b") is not None
    assert ef.residual("a").tolist() == [1.0, 0.0]  # type: ignore[union-attr]
    with pytest.raises(CodecError, match=r"expected shape \(3,\)") as err:
        ef.encode("a", np.zeros(3, np.float32))
    assert err.value.field == "residual"
    ef.reset("a")
    ef.encode("a", np.zeros(3, np.float32))
    ef.reset()
    assert ef.residual("a") is None and ef.residual("b") is None


def test_error_feedback_refuses_a_non_contractive_codec() -> None:
    with pytest.raises(ValueError, match="contractive"):
        ErrorFeedback(RandomKCodec())
    enc, residual = compensate(RandomKCodec(rescale=False), _x(10), None, rng=_rng())
    assert residual.shape == (10,) and enc.members == 1


# ---------------------------------------------------------------------------- bad input


def _replace(**changes: Any) -> Callable[[Encoded], Encoded]:
    return lambda e: dataclasses.replace(e, **changes)


def _payload(fn: Callable[[np.ndarray], Any]) -> Callable[[Encoded], Encoded]:
    return lambda e: dataclasses.replace(e, payload=fn(e.payload.copy()))


def _indices(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[Encoded], Encoded]:
    def change(e: Encoded) -> Encoded:
        assert e.indices is not None
        return dataclasses.replace(e, indices=fn(e.indices.copy()))

    return change


def _scales(fn: Callable[[np.ndarray], Any]) -> Callable[[Encoded], Encoded]:
    def change(e: Encoded) -> Encoded:
        assert e.scales is not None
        return dataclasses.replace(e, scales=fn(e.scales.copy()))

    return change


def _set(i: int, value: Any) -> Callable[[np.ndarray], np.ndarray]:
    def fn(a: np.ndarray) -> np.ndarray:
        a[i] = value
        return a

    return fn


BAD: list[tuple[str, Codec, Callable[[Encoded], Encoded], str, str]] = [
    ("another codec", Fp16Codec(), _replace(codec="bf16"), "codec", "expected 'fp16', got 'bf16'"),
    ("unknown dtype", Fp16Codec(), _replace(dtype="int7"), "dtype", "got 'int7'"),
    ("negative shape", Fp16Codec(), _replace(shape=(-1, 4)), "shape", "non-negative"),
    ("members 0", Fp16Codec(), _replace(members=0), "members", "got 0"),
    ("payload dtype", Fp16Codec(), _payload(lambda a: a.astype(np.float32)), "payload", "got float32"),
    ("payload short", Bf16Codec(), _payload(lambda a: a[:-1]), "payload", "expected 20 elements"),
    ("payload bytes", Bf16Codec(), _payload(lambda a: a.tobytes()), "payload", "got bytes"),
    ("payload 2-D", Fp16Codec(), _payload(lambda a: a.reshape(4, 5)), "payload", "1-D"),
    (
        "scale count",
        Int8Codec(block=8),
        _scales(lambda s: s[:-1]),
        "scales",
        "expected 3 (one per block of 8",
    ),
    ("scale NaN", Int8Codec(block=8), _scales(_set(1, np.nan)), "scales", "scale 1 is nan"),
    ("scale inf", Int8Codec(block=0), _scales(_set(0, np.inf)), "scales", "scale 0 is inf"),
    ("scale negative", Int8Codec(block=8), _scales(_set(2, -1.0)), "scales", "scale 2 is -1.0"),
    ("scale dtype", Int8Codec(block=8), _scales(lambda s: s.astype(np.float64)), "scales", "got 1-D float64"),
    ("scales missing", Int8Codec(block=8), _replace(scales=None), "scales", "got NoneType"),
    ("block negative", Int8Codec(block=8), _replace(block=-8), "block", "got -8"),
    ("int8 -128", Int8Codec(block=8), _payload(_set(0, -128)), "payload", "expected within ±127"),
    (
        "int8 length",
        Int8Codec(block=8),
        _payload(lambda a: np.append(a, a[:1])),
        "payload",
        "expected 20 elements",
    ),
    ("int8 dtype", Int8Codec(block=8), _payload(lambda a: a.astype(np.uint8)), "payload", "got uint8"),
    ("index range", TopKCodec(0.25), _indices(_set(-1, 20)), "indices", "index 20 out of range"),
    ("index duplicate", TopKCodec(0.25), _indices(_set(1, 0)), "indices", "duplicated"),
    ("index unsorted", TopKCodec(0.25), _indices(lambda a: a[::-1].copy()), "indices", "unsorted"),
    ("index dtype", TopKCodec(0.25), _indices(lambda a: a.astype(np.int64)), "indices", "got 1-D int64"),
    ("index missing", RandomKCodec(0.25), _replace(indices=None), "indices", "got NoneType"),
    (
        "too many indices",
        TopKCodec(0.25),
        _indices(lambda a: np.arange(21, dtype=np.uint32)),
        "payload",
        "expected 21",
    ),
    ("values short", TopKCodec(0.25), _payload(lambda a: a[:-1]), "payload", "as many as its indices"),
    ("values dtype", RandomKCodec(0.25), _payload(lambda a: a.astype(np.float16)), "payload", "got float16"),
]


def _good(codec: Codec) -> Encoded:
    x = np.linspace(-2, 3, 20, dtype=np.float32)
    if isinstance(codec, Int8Codec):
        x[np.arange(0, 20, 8)] = 5.0  # no block all-zero: every scale > 0
    return codec.encode(x, rng=_rng())


@pytest.mark.parametrize(("case", "codec", "corrupt", "field", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_payloads_raise_naming_the_field(
    case: str, codec: Codec, corrupt: Callable[[Encoded], Encoded], field: str, words: str
) -> None:
    good = _good(codec)
    bad = corrupt(good)
    attempts: list[Callable[[], object]] = [
        lambda: codec.decode(bad),
        lambda: codec.sum_into(CodecSum(), bad),  # as a first member
        lambda: codec.sum_into(_sum(codec, [good]), bad),  # as a later one
    ]
    if field != "codec":
        attempts.append(lambda: decode(bad))
    for attempt in attempts:
        with pytest.raises(CodecError) as err:
            attempt()
        assert err.value.field == field, str(err.value)
        assert words in str(err.value), str(err.value)


def test_a_sum_refuses_members_that_do_not_match() -> None:
    codec = Fp16Codec()
    acc = _sum(codec, [codec.encode(np.zeros(4, np.float32))])
    with pytest.raises(CodecError, match=r"shape: expected \(4,\) \(the first member's\), got \(2, 2\)"):
        codec.sum_into(acc, codec.encode(np.zeros((2, 2), np.float32)))
    with pytest.raises(CodecError, match="dtype: expected 'float32'"):
        codec.sum_into(acc, codec.encode(np.zeros(4, np.float64)))
    bf = Bf16Codec()
    with pytest.raises(CodecError, match="accumulator: expected a sum of 'bf16' members, got one of 'fp16'"):
        bf.sum_into(acc, bf.encode(np.zeros(4, np.float32)))
    with pytest.raises(CodecError, match="accumulator: no member was summed"):
        codec.finish(CodecSum())
    assert acc.members == 1  # nothing refused was counted


def test_a_shared_scale_sum_refuses_another_scale() -> None:
    codec = Int8Codec(bound=1.0)
    acc = _sum(codec, [codec.encode(_x(16), rng=_rng())])
    with pytest.raises(CodecError, match="expected the shared scale") as err:
        codec.sum_into(acc, Int8Codec(bound=2.0).encode(_x(16), rng=_rng()))
    assert err.value.field == "scales"
    with pytest.raises(CodecError, match=r"block 8\)") as err:
        codec.sum_into(acc, Int8Codec(block=8).encode(_x(16), rng=_rng()))
    assert err.value.field == "scales"
    # an own-scale aggregator sums both (it dequantises every member)
    own = Int8Codec(block=8)
    acc2 = _sum(own, [Int8Codec(bound=2.0).encode(_x(16), rng=_rng()), own.encode(_x(16), rng=_rng())])
    assert acc2.members == 2


@pytest.mark.parametrize(
    ("codec", "array", "words"),
    [
        (Fp16Codec(), np.array([1.0, 7e4], np.float32), "value 70000.0 beyond float16's range"),
        (Fp16Codec(), np.array([np.nan, -1e5], np.float32), "value -100000.0 beyond"),
        (Int8Codec(), np.array([1.0, np.nan], np.float32), "element 1 is nan"),
        (Int8Codec(block=0), np.array([1.0, 2.0, -np.inf]), "element 2 is -inf"),
        (Int8Codec(bound=1.0), np.array([np.inf, 0.0], np.float32), "element 0 is inf"),
        (TopKCodec(), np.arange(4), "expected dtype float16, float32 or float64, got int64"),
        (TopKCodec(), np.array([1.0, np.inf, np.nan]), "element 2 is nan: top-k cannot rank it"),
        (Bf16Codec(), [1.0, 2.0], "expected a numpy array, got list"),
    ],
)
def test_bad_arrays_are_refused_at_encode(codec: Codec, array: Any, words: str) -> None:
    with pytest.raises(CodecError, match=words) as err:
        codec.encode(array, rng=_rng())
    assert err.value.field == "array"


def test_decode_by_name_refuses_an_unknown_codec() -> None:
    enc = dataclasses.replace(Fp16Codec().encode(np.zeros(2, np.float32)), codec="zstd")
    with pytest.raises(CodecError, match="codec: expected one of") as err:
        decode(enc)
    assert err.value.field == "codec"
    with pytest.raises(CodecError, match="expected an Encoded, got dict"):
        decode({"codec": "fp16"})  # type: ignore[arg-type]


def test_make_codec_and_parameters() -> None:
    assert make_codec("int8", bound=2.0) == Int8Codec(block=0, bound=2.0)
    assert Int8Codec(bound=2.0).summable and not Int8Codec().summable
    assert Fp16Codec().summable and not TopKCodec().summable
    for bad in (
        lambda: TopKCodec(ratio=0),
        lambda: Int8Codec(block=-1),
        lambda: Int8Codec(bound=float("nan")),
    ):
        with pytest.raises(ValueError):
            bad()
    assert all(isinstance(c, Codec) for c in ALL_CODECS)
