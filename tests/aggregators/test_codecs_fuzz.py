"""Fuzzing the codecs' readers: whatever an Encoded holds, decode and sum_into either work
(and give the tensor's shape) or raise CodecError naming a field; nothing else escapes, and a
refused member leaves the running sum as it was."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlfabric.aggregators.codecs import (
    Bf16Codec,
    Codec,
    CodecError,
    CodecSum,
    Encoded,
    Fp16Codec,
    Int8Codec,
    RandomKCodec,
    TopKCodec,
    decode,
)

CODECS: list[Codec] = [
    Fp16Codec(),
    Bf16Codec(),
    Int8Codec(block=4, stochastic=False),
    Int8Codec(block=0, stochastic=False),
    Int8Codec(bound=2.0, stochastic=False),
    TopKCodec(ratio=0.3),
    RandomKCodec(ratio=0.3),
]
FIELDS = {
    "encoded",
    "codec",
    "dtype",
    "shape",
    "members",
    "payload",
    "scales",
    "indices",
    "block",
    "accumulator",
}

_DTYPES = ["float16", "float32", "float64", "uint16", "int8", "int16", "int32", "int64", "uint32", "uint8"]


@st.composite
def arrays(draw: st.DrawFn, max_size: int = 12) -> Any:
    """A small array of any of the dtypes, with special values, sometimes not an array."""
    kind = draw(st.sampled_from(["array", "array", "array", "none", "bytes", "2d"]))
    if kind == "none":
        return None
    if kind == "bytes":
        return b"\x00\x01"
    dtype: np.dtype[Any] = np.dtype(draw(st.sampled_from(_DTYPES)))
    n = draw(st.integers(0, max_size))
    elements: st.SearchStrategy[Any]
    if dtype.kind == "f":
        width = {2: 16, 4: 32}.get(dtype.itemsize, 64)
        elements = st.floats(allow_nan=True, allow_infinity=True, width=width)  # type: ignore[arg-type]
    else:
        info = np.iinfo(dtype.name)
        elements = st.integers(int(info.min), int(info.max))
    values = np.array(draw(st.lists(elements, min_size=n, max_size=n)), dtype=dtype)
    if kind == "2d" and n % 2 == 0 and n:
        values = values.reshape(2, -1)
    return values


@st.composite
def encodeds(draw: st.DrawFn) -> tuple[Codec, Encoded]:
    """A well-formed encoding of a small tensor, then some of its fields replaced at random."""
    codec = draw(st.sampled_from(CODECS))
    shape = draw(st.sampled_from([(0,), (1,), (6,), (2, 5), (3, 1, 4)]))
    x = np.linspace(-1.5, 1.5, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    good = codec.encode(x, rng=np.random.default_rng(0))
    changes: dict[str, Any] = {}
    for name in draw(st.sets(st.sampled_from(["payload", "scales", "indices", "shape", "misc"]), max_size=3)):
        if name == "shape":
            changes["shape"] = draw(
                st.sampled_from([(6,), (2, 3), (-1,), (2**40, 2**40), (10,), "6", (1.5,), (0,)])
            )
        elif name == "misc":
            changes[draw(st.sampled_from(["codec", "dtype", "members", "block"]))] = draw(
                st.sampled_from(["fp16", "int8", "topk", "float64", "bfloat16", 0, 1, 3, -2, 4, None])
            )
        else:
            changes[name] = draw(arrays())
    return codec, dataclasses.replace(good, **changes)


def _attempt(fn: Any) -> Any:
    try:
        return fn()
    except CodecError as exc:
        assert exc.field in FIELDS, str(exc)
        assert str(exc).startswith(exc.field + ": ") and len(str(exc)) > len(exc.field) + 8
        return exc


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(encodeds())
def test_only_codec_errors_escape(case: tuple[Codec, Encoded]) -> None:
    codec, enc = case
    out = _attempt(lambda: codec.decode(enc))
    if isinstance(out, np.ndarray):
        assert out.shape == enc.shape and out.dtype.name == enc.dtype
    by_name = _attempt(lambda: decode(enc))
    assert isinstance(by_name, CodecError) or isinstance(out, CodecError) or by_name.shape == out.shape

    first = CodecSum()
    summed = _attempt(lambda: codec.sum_into(first, enc))
    if isinstance(summed, CodecError):
        assert first.members == 0 and first.values is None
    # a refused later member leaves the sum as it was
    x = np.linspace(-1.5, 1.5, 6, dtype=np.float32)
    acc = CodecSum()
    codec.sum_into(acc, codec.encode(x, rng=np.random.default_rng(1)))
    before = None if acc.values is None else acc.values.copy()
    later = _attempt(lambda: codec.sum_into(acc, enc))
    if isinstance(later, CodecError):
        assert acc.members == 1 and before is not None and acc.values is not None
        assert np.array_equal(acc.values, before, equal_nan=True)
    if isinstance(out, CodecError) and out.field not in ("accumulator",):
        assert isinstance(summed, CodecError)  # decode and sum refuse the same payloads
