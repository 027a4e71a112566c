"""fp16 and bf16: half-width casts, summed by an aggregator in a float32 accumulator.

Both halve the bytes of a float32 tensor. Members are summed on their encoded words: each
chunk is widened exactly (the bit-level conversions of :mod:`mlfabric.aggregators.kernels`)
and added into a float32 accumulator, and the sum is narrowed once when it is forwarded, as
the kernels do for float16/bfloat16 payloads (paper §5).

Error bounds (round to nearest-even):

- fp16: ``|x' - x| <= 2**-11 |x|`` for ``2**-14 <= |x| <= 65504``, ``<= 2**-25`` below (the
  subnormals). A finite value beyond float16's range would become an infinity: encoding it
  raises :class:`CodecError` (field ``array``; ``sum`` when finishing a sum) instead.
- bf16: ``|x' - x| <= 2**-8 |x|`` over float32's normal range (bfloat16 has its exponent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from mlfabric.aggregators.codecs.base import (
    CodecError,
    CodecSum,
    Encoded,
    as_float_array,
    check_encoded,
    check_member,
    chunks,
    decoded,
    dense_result,
    frozen,
)
from mlfabric.aggregators.kernels import bf16_to_f32, f16_to_f32, f32_to_bf16

__all__ = ["Bf16Codec", "Fp16Codec"]

#: float32 values at or beyond this round to infinity in float16 (65504 + half an ulp).
_F16_OVERFLOW = 65520.0


class _CastCodec:
    """The shared machinery of the two casts (a chunked narrow, a chunked widen)."""

    name: ClassVar[str]
    payload_dtype: ClassVar[np.dtype[np.generic]]
    payload_dtypes: ClassVar[tuple[str, ...]]
    summable: ClassVar[bool] = True
    randomised: ClassVar[bool] = False

    def _narrow(self, src: np.ndarray, out: np.ndarray, what: str) -> None:
        raise NotImplementedError

    def _widen(self, words: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
        raise NotImplementedError

    def _encode_flat(
        self, flat: np.ndarray, dtype: str, shape: tuple[int, ...], members: int, what: str
    ) -> Encoded:
        out = np.empty(flat.size, self.payload_dtype)
        for start, stop in chunks(flat.size):
            self._narrow(flat[start:stop], out[start:stop], what)
        return Encoded(self.name, dtype, shape, frozen(out), members=members)

    def encode(self, array: np.ndarray, *, rng: np.random.Generator | None = None) -> Encoded:
        """Encode ``array`` (float16, float32 or float64; not modified); ``rng`` is not used.

        Raises
        ------
        CodecError
            Not a floating numpy array; fp16: a finite value beyond float16's range.
        """
        flat = as_float_array(array)
        return self._encode_flat(flat, array.dtype.name, tuple(array.shape), 1, "array")

    def _check(self, encoded: Encoded) -> Encoded:
        return check_encoded(encoded, self.name, self.payload_dtypes)

    def decode(self, encoded: Encoded) -> np.ndarray:
        """The tensor back, in its original dtype and shape.

        Raises
        ------
        CodecError
            Another codec's payload, a payload of the wrong dtype or length, a bad shape.
        """
        enc = self._check(encoded)
        out = np.empty(enc.size, np.float32)
        scratch = np.empty(min(enc.size, 1 << 16), np.uint32)
        for start, stop in chunks(enc.size):
            self._widen(enc.payload[start:stop], out[start:stop], scratch[: stop - start])
        return decoded(out, enc)

    def sum_into(self, acc: CodecSum, encoded: Encoded) -> None:
        """Widen one member chunk by chunk and add it into the float32 accumulator.

        Raises
        ------
        CodecError
            The member is inconsistent, or its shape/dtype differ from the first member's.
        """
        enc = self._check(encoded)
        check_member(acc, enc, self.name)
        first = acc.values is None
        if first:
            acc.codec, acc.first, acc.values = self.name, enc, np.empty(enc.size, np.float32)
        assert acc.values is not None
        chunk = np.empty(min(enc.size, 1 << 16), np.float32)
        scratch = np.empty(chunk.size, np.uint32)
        with np.errstate(over="ignore", invalid="ignore"):
            for start, stop in chunks(enc.size):
                target = acc.values[start:stop]
                if first:
                    self._widen(enc.payload[start:stop], target, scratch[: stop - start])
                else:
                    self._widen(enc.payload[start:stop], chunk[: stop - start], scratch[: stop - start])
                    np.add(target, chunk[: stop - start], out=target)
        acc.members += enc.members

    def finish(self, acc: CodecSum, *, rng: np.random.Generator | None = None) -> Encoded:
        """The sum narrowed once to the half-width words, ready to forward.

        Raises
        ------
        CodecError
            Nothing was summed; fp16: the sum is beyond float16's range (field ``sum``):
            forward :meth:`finish_dense` instead.
        """
        values = dense_result(acc)
        assert acc.first is not None
        return self._encode_flat(values.reshape(-1), acc.first.dtype, acc.first.shape, acc.members, "sum")

    def finish_dense(self, acc: CodecSum) -> np.ndarray:
        """The float32 sum (no narrowing)."""
        return dense_result(acc)


@dataclass(frozen=True)
class Fp16Codec(_CastCodec):
    """Cast to IEEE float16 (2 bytes), summed in float32.

    Examples
    --------
    >>> codec = Fp16Codec()
    >>> enc = codec.encode(np.array([1.0, -2.5, 1e-3], np.float32))
    >>> enc.payload.dtype.name, enc.ratio, codec.decode(enc).tolist()
    ('float16', 2.0, [1.0, -2.5, 0.0010004043579101562])
    >>> acc = CodecSum()
    >>> codec.sum_into(acc, enc); codec.sum_into(acc, codec.encode(np.ones(3, np.float32)))
    >>> codec.decode(codec.finish(acc)).tolist(), acc.members
    ([2.0, -1.5, 1.0009765625], 2)
    >>> codec.encode(np.array([7e4], np.float32))
    Traceback (most recent call last):
    ...
    mlfabric.aggregators.codecs.base.CodecError: array: value 70000.0 beyond float16's range (65504)
    """

    name: ClassVar[str] = "fp16"
    payload_dtype: ClassVar[np.dtype[np.generic]] = np.dtype("float16")
    payload_dtypes: ClassVar[tuple[str, ...]] = ("float16",)

    def _narrow(self, src: np.ndarray, out: np.ndarray, what: str) -> None:
        with np.errstate(over="ignore", invalid="ignore"):
            hi, lo = src.max(initial=0.0), src.min(initial=0.0)
            if not (np.isfinite(hi) and np.isfinite(lo)) or hi >= _F16_OVERFLOW or lo <= -_F16_OVERFLOW:
                beyond = np.isfinite(src) & (np.abs(src) >= _F16_OVERFLOW)
                if beyond.any():
                    value = src[np.flatnonzero(beyond)[0]]
                    raise CodecError(what, f"value {value} beyond float16's range (65504)")
            np.copyto(out, src, casting="same_kind")

    def _widen(self, words: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
        f16_to_f32(words.view(np.uint16), out, scratch)


@dataclass(frozen=True)
class Bf16Codec(_CastCodec):
    """Cast to bfloat16 (the top half of a float32, rounded to nearest-even), summed in float32.

    The payload is the raw words as ``uint16``, as :mod:`mlfabric.wire.tensors` carries them.

    Examples
    --------
    >>> codec = Bf16Codec()
    >>> enc = codec.encode(np.array([1.0, 3.14159, -1e30], np.float32))
    >>> enc.payload.dtype.name, codec.decode(enc).tolist()
    ('uint16', [1.0, 3.140625, -1.0002555517425873e+30])
    """

    name: ClassVar[str] = "bf16"
    payload_dtype: ClassVar[np.dtype[np.generic]] = np.dtype("uint16")
    payload_dtypes: ClassVar[tuple[str, ...]] = ("uint16",)

    def _narrow(self, src: np.ndarray, out: np.ndarray, what: str) -> None:
        f32_to_bf16(src if src.dtype == np.float32 else src.astype(np.float32), out)

    def _widen(self, words: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
        bf16_to_f32(words, out)
