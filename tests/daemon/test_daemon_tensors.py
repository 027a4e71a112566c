"""The tensor codec: round trips of every dtype through a payload and a memfd, numpy and torch."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mlfabric import tensorio
from mlfabric import tensors as tc

NUMPY_DTYPES = [np.float32, np.float16, np.float64]


def _sample(dtype: type, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 1, 4)])
def test_numpy_round_trip_through_a_memfd(dtype: type, shape: tuple[int, ...]) -> None:
    original = {"a": _sample(dtype, shape, 1), "b": _sample(np.float64, (3,), 2)}
    fd, layouts, total = tensorio.to_memfd(original)
    try:
        assert total == sum(v.nbytes for v in original.values())
        back = tensorio.read_memfd(fd, layouts)
    finally:
        os.close(fd)
    assert list(back) == ["a", "b"]
    for name, value in original.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)


def test_bfloat16_as_raw_uint16_words_in_numpy() -> None:
    words = np.array([0x3F80, 0xC000, 0x0000, 0x7F80], dtype=np.uint16)  # 1.0, -2.0, 0.0, +inf
    layouts, total = tc.plan_layout({"h": words})
    assert layouts[0].dtype == "bfloat16" and total == 8
    buf = bytearray(total)
    tc.encode_into(memoryview(buf), {"h": words}, layouts)
    back = tc.decode(buf, layouts)["h"]
    assert back.dtype == np.uint16
    np.testing.assert_array_equal(back, words)
    assert tc.l2_norm({"h": words[:2]}) == pytest.approx(np.sqrt(5.0))


def test_non_contiguous_and_big_endian_arrays_are_packed() -> None:
    base = np.arange(12, dtype=">f8").reshape(3, 4)
    view = base[:, ::2]
    fd, layouts, _ = tensorio.to_memfd({"v": view})
    try:
        back = tensorio.read_memfd(fd, layouts)["v"]
    finally:
        os.close(fd)
    np.testing.assert_array_equal(back, view)


@pytest.mark.parametrize("bad", [np.zeros(2, np.int32), np.zeros(2, np.complex64), [1.0, 2.0]])
def test_unsupported_values_are_refused(bad: object) -> None:
    with pytest.raises(tc.TensorError):
        tc.plan_layout({"x": bad})


def test_layout_that_does_not_fit_is_refused() -> None:
    layouts = [tc.Layout("x", "float32", (4,), 0, 16)]
    with pytest.raises(tc.TensorError, match="'x'"):
        tc.decode(bytes(8), layouts)


def test_protobuf_layouts_round_trip() -> None:
    layouts, _ = tc.plan_layout({"a": np.zeros((2, 2)), "b": np.zeros(3, np.float16)})
    assert tc.layouts_from_pb(tc.layouts_to_pb(layouts)) == layouts


def test_l2_norm_over_all_tensors() -> None:
    update = {"a": np.array([3.0], np.float16), "b": np.array([[4.0]], np.float32)}
    assert tc.l2_norm(update) == 5.0


def test_l2_norm_accumulates_in_float64_without_overflow() -> None:
    # float16 squares overflow float16 (300**2 > 65504) and float32 sums lose the small terms:
    # the norm is exact in float64 whatever the tensor's dtype, non-contiguous views included
    big = np.full(4, 300.0, np.float16)
    assert tc.l2_norm({"h": big}) == 600.0
    many = np.concatenate([np.full(1, 2.0**24, np.float32), np.ones(3, np.float32)])
    assert tc.l2_norm({"f": many}) ** 2 == 2.0**48 + 3
    strided = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]
    assert tc.l2_norm({"s": strided}) == pytest.approx(float(np.sqrt((strided**2).sum())))


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_torch_round_trip(dtype: str) -> None:
    original = {
        "w": torch.randn(3, 4).to(getattr(torch, dtype)),
        "s": torch.tensor(2.5, dtype=getattr(torch, dtype)),
    }
    fd, layouts, _ = tensorio.to_memfd(original)
    try:
        back = tensorio.read_memfd(fd, layouts, as_torch=True)
        raw = tensorio.read_memfd(fd, layouts)
    finally:
        os.close(fd)
    for name, value in original.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert torch.equal(back[name], value)
    assert layouts[0].dtype == dtype
    if dtype == "bfloat16":  # numpy sees the raw words: the top half of the float32 bits
        expected = (original["w"].float().numpy().view(np.uint32) >> 16).astype(np.uint16)
        np.testing.assert_array_equal(raw["w"], expected)


def test_torch_and_numpy_norms_agree() -> None:
    t = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.bfloat16)
    assert tc.l2_norm({"t": t}) == pytest.approx(5.0)
    assert tc.dtype_name(t) == "bfloat16"
    with pytest.raises(tc.TensorError, match="int64"):
        tc.dtype_name(torch.zeros(2, dtype=torch.int64))


def test_non_contiguous_torch_tensor() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    fd, layouts, _ = tensorio.to_memfd({"t": t})
    try:
        back = tensorio.read_memfd(fd, layouts, as_torch=True)["t"]
    finally:
        os.close(fd)
    assert torch.equal(back, t)
