"""The summing kernels against a numpy reference, for every dtype (bfloat16 as raw words)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from mlfabric.aggregators.kernels import Accumulator, bf16_to_f32, f16_to_f32, f32_to_bf16, plan_runs
from mlfabric.tensors import Layout, decode, encode_into, plan_layout


def _bf16_words(values: np.ndarray) -> np.ndarray:
    """Reference bfloat16 rounding (nearest-even): torch's."""
    torch = pytest.importorskip("torch")
    return (
        torch.from_numpy(values.astype(np.float32))
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
    )


def _bf16_values(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def _payload(tensors: dict[str, np.ndarray]) -> tuple[list[Layout], bytearray]:
    layouts, n = plan_layout(tensors)
    buf = bytearray(n)
    encode_into(memoryview(buf), tensors, layouts)
    return layouts, buf


def _members(rng: np.random.Generator, n: int) -> list[dict[str, np.ndarray]]:
    members: list[dict[str, np.ndarray]] = []
    for _ in range(n):
        members.append(
            {
                "a32": rng.standard_normal((7, 5)).astype(np.float32),
                "b32": rng.standard_normal(3).astype(np.float32),
                "h16": rng.standard_normal(11).astype(np.float16),
                "bf": _bf16_words(rng.standard_normal(13).astype(np.float32)),
                "d64": rng.standard_normal(4),
                "h16b": rng.standard_normal(2).astype(np.float16),
            }
        )
    return members


@pytest.mark.parametrize("mean", [False, True])
def test_mixed_dtypes_match_the_reference(mean: bool) -> None:
    rng = np.random.default_rng(7)
    members = _members(rng, 5)
    layouts, first = _payload(members[0])
    out = bytearray(len(first))
    acc = Accumulator(layouts, out)
    for m in members:
        acc.add(_payload(m)[1])
    acc.finish(mean=mean)
    got = decode(out, layouts)
    div = len(members) if mean else 1
    for name in ("a32", "b32", "d64"):
        want = sum(m[name] for m in members)
        np.testing.assert_allclose(got[name], want / div, rtol=1e-6, atol=1e-6)
        assert got[name].dtype == members[0][name].dtype
    for name in ("h16", "h16b"):  # accumulated in float32, rounded once
        want32 = sum(m[name].astype(np.float32) for m in members) / np.float32(div)
        np.testing.assert_array_equal(got[name], want32.astype(np.float16))
    want_bf = np.sum([_bf16_values(m["bf"]) for m in members], axis=0, dtype=np.float32) / np.float32(div)
    np.testing.assert_array_equal(got["bf"], _bf16_words(np.asarray(want_bf)))


def test_one_dtype_is_one_run_and_float32_sums_in_place() -> None:
    t = {f"t{i}": np.arange(i + 1, dtype=np.float32) for i in range(50)}
    layouts, first = _payload(t)
    assert len(plan_runs(layouts)) == 1
    out = bytearray(len(first))
    acc = Accumulator(layouts, out)
    assert acc.wide_elements == 0  # no float32 scratch: the sum lives in ``out``
    acc.add(first)
    acc.add(_payload(t)[1])
    assert decode(out, layouts)["t49"].tolist() == (2 * np.arange(50, dtype=np.float32)).tolist()


def test_half_precision_sums_beyond_half_range_of_bits() -> None:
    """1000 members of 1.0 + 2**-10: a float16 running sum would stall; float32 does not."""
    t = {"h": np.full(4, 1 + 2**-10, np.float16), "b": _bf16_words(np.full(4, 1.0, np.float32))}
    layouts, buf = _payload(t)
    out = bytearray(len(buf))
    acc = Accumulator(layouts, out)
    for _ in range(1000):
        acc.add(buf)
    acc.finish()
    got = decode(out, layouts)
    assert got["h"].tolist() == [np.float16(1000 * (1 + 2**-10))] * 4
    assert _bf16_values(got["b"]).tolist() == [1000.0] * 4  # a bfloat16 running sum stalls at 256


def test_reads_from_memfd_mappings_without_copies() -> None:
    t = {"w": np.arange(1000, dtype=np.float64)}
    layouts, buf = _payload(t)
    fd = os.memfd_create("test-kernels")
    try:
        os.ftruncate(fd, 1 << 16)
        os.pwrite(fd, bytes(buf), 0)
        with mmap.mmap(fd, 1 << 16) as src:
            out = bytearray(1 << 16)
            acc = Accumulator(layouts, out)
            acc.add(src)
            acc.add(src)
            acc.finish()
            assert decode(out, layouts)["w"][999] == 1998.0
            del acc
    finally:
        os.close(fd)


def test_bf16_conversions_round_trip_and_round_to_nearest_even() -> None:
    words = np.arange(0, 1 << 16, dtype=np.uint16)
    values = bf16_to_f32(words, np.empty(words.size, np.float32))
    back = f32_to_bf16(values, np.empty(words.size, np.uint16))
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(back[finite], words[finite])
    assert np.isnan(bf16_to_f32(back[~finite], np.empty(int((~finite).sum()), np.float32))).all()
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(10_000) * 1e3).astype(np.float32)
    np.testing.assert_array_equal(f32_to_bf16(x, np.empty(x.size, np.uint16)), _bf16_words(x))


def test_f16_widening_matches_numpy_for_every_word() -> None:
    words = np.arange(0, 1 << 16, dtype=np.uint16)
    with np.errstate(all="ignore"):
        got = f16_to_f32(words, np.empty(words.size, np.float32), np.empty(words.size, np.uint32))
    want = words.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(got[np.isnan(want)]).all()


def test_bad_inputs_name_the_problem() -> None:
    layouts = [Layout("w", "float32", (4,), 0, 16)]
    with pytest.raises(ValueError, match="output buffer holds 8 bytes"):
        Accumulator(layouts, bytearray(8))
    with pytest.raises(ValueError, match="read-only"):
        Accumulator(layouts, bytes(16))
    with pytest.raises(ValueError, match="cannot sum dtype 'int8'"):
        plan_runs([Layout("w", "int8", (4,), 0, 4)])
    with pytest.raises(ValueError, match="overlaps"):
        plan_runs([Layout("a", "float32", (4,), 0, 16), Layout("b", "float32", (1,), 8, 4)])
    acc = Accumulator(layouts, bytearray(16))
    with pytest.raises(ValueError, match="member payload holds 4 bytes"):
        acc.add(bytearray(4))
    with pytest.raises(ValueError, match="no member"):
        acc.finish()
    acc.add(bytearray(16))
    acc.finish()
    with pytest.raises(ValueError, match="already finished"):
        acc.add(bytearray(16))
