"""int8: 8-bit quantisation with a scale per block, stochastic rounding (QSGD, Alistarh et al. 2017).

A value ``x`` in a block with scale ``s`` travels as the int8 ``q = round(x / s)`` in
``[-127, 127]`` and decodes as ``q * s``. With stochastic rounding ``q`` is ``floor(x/s)`` or
``floor(x/s) + 1`` with the probabilities that make ``E[q * s] = x`` (unbiased); with
nearest rounding it is the nearest. ``q = floor(x/s + u)``, ``u`` uniform in [0, 1) with 23
random bits: the rounding probabilities are exact to float32's rounding of ``x/s + u``.
Scales below the smallest normal float32 are raised to it (their inverse stays finite).

**Where the scale comes from** is what decides whether an aggregator can add the int8 words:

- **own scales** (``Int8Codec(block=256)``, the default): each block of ``block`` elements has
  ``s = max|x| / 127``, carried in the payload (one float32 per block: +1.6% at 256). Every
  member has different scales, so an aggregator dequantises each member and sums in float32
  (``summable`` is False), then re-quantises the sum at :meth:`Int8Codec.finish`.
- **a shared scale** (``Int8Codec(bound=B)``): the job (or the scheduler) gives a bound ``B``
  on the values and every member uses ``s = B / 127`` for the whole tensor. Members then sum
  **exactly** as int32 (``summable`` is True, no decode); the sum is forwarded in the
  narrowest of int8/int16/int32 that holds it with the same scale, so the next hop (a tree)
  keeps summing words. Values beyond ``B`` are clipped (``Encoded.clipped`` counts them): run
  it under :class:`~mlfabric.aggregators.codecs.feedback.ErrorFeedback` so the clipped part is
  sent later, and pick ``B`` from the gradients' observed range. A member whose scale is not
  the agreed one is refused (:class:`CodecError`, field ``scales``).

Error bounds, per element with scale ``s``: nearest ``|x' - x| <= s/2``; stochastic
``|x' - x| < s``, unbiased, variance ``<= s**2 / 4``; a shared-scale value beyond the bound
also loses ``|x| - B``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from mlfabric.aggregators.codecs.base import (
    CHUNK,
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

__all__ = ["Int8Codec", "block_count", "check_scales"]

_QMAX = 127
#: the smallest normal float32: a scale below it would have an infinite inverse
_TINY = np.float32(2.0**-126)
#: the most members an int32 accumulator of int8 words can sum without overflow
_MAX_MEMBERS = (2**31 - 1) // _QMAX


def block_count(size: int, block: int) -> int:
    """How many scales a tensor of ``size`` elements has with blocks of ``block`` (0: one).

    Examples
    --------
    >>> block_count(1000, 256), block_count(1000, 0), block_count(0, 256)
    (4, 1, 0)
    """
    return 1 if block == 0 else -(-size // block)


def _scales_of(maxima: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales ``max|x| / 127`` (at least the smallest normal float32 unless 0, so that the
    inverse is finite) and their inverses (0 for an all-zero block)."""
    scales = maxima / np.float32(_QMAX)
    np.maximum(scales, _TINY, out=scales, where=scales > 0)
    return scales, np.divide(1, scales, out=np.zeros_like(scales), where=scales > 0)


def _dither(rng: np.random.Generator, y: np.ndarray) -> None:
    """``y += 1 + u`` with ``u`` uniform in [0, 1) (23 random bits: a float32 in [1, 2))."""
    bits = rng.bit_generator.random_raw((y.size + 1) // 2).view(np.uint32)[: y.size]
    bits >>= 9
    bits |= 0x3F800000
    y += bits.view(np.float32)


def _mul_blocks(y: np.ndarray, factors: np.ndarray, block: int) -> None:
    """``y *= factor of each element's block`` (``y`` starts at a block boundary)."""
    if block == 0 or factors.size == 1:
        y *= factors[0]
        return
    full = y.size // block * block
    if full:
        y[:full].reshape(-1, block).__imul__(factors[: full // block, None])
    if full < y.size:
        y[full:] *= factors[-1]


def _block_max(x: np.ndarray, block: int) -> np.ndarray:
    """max |x| of each block of ``x`` (float32; ``x`` starts at a block boundary)."""
    full = x.size // block * block
    rows = x[:full].reshape(-1, block)
    out = np.maximum(rows.max(axis=1), -rows.min(axis=1)).astype(np.float32)
    if full < x.size:
        tail = x[full:]
        out = np.append(out, np.float32(max(tail.max(), -tail.min())))
    return out


def _non_finite(values: np.ndarray, offset: int, what: str) -> CodecError:
    """The error naming the first NaN or infinity of ``values`` (element ``offset`` + i)."""
    i = int(np.flatnonzero(~np.isfinite(values))[0])
    return CodecError(what, f"element {offset + i} is {values[i]}, expected a finite value")


def _check_scales(encoded: Encoded) -> np.ndarray:
    return check_scales(encoded.scales, encoded.block, encoded.size)


def check_scales(scales: object, block: object, size: int) -> np.ndarray:
    """Check an int8 tensor's scales: one float32 per ``block`` elements of ``size``, finite, >= 0.

    Returns
    -------
    numpy.ndarray
        ``scales``, checked.

    Raises
    ------
    CodecError
        Naming ``block`` or ``scales``: a count that does not match, a NaN, an infinity, a
        negative scale, not a 1-D float32 array.

    Examples
    --------
    >>> check_scales(np.array([0.5, np.nan], np.float32), 4, 8)
    Traceback (most recent call last):
    ...
    mlfabric.aggregators.codecs.base.CodecError: scales: scale 1 is nan, expected a finite value >= 0
    """
    if not isinstance(block, int | np.integer) or block < 0:
        raise CodecError("block", f"expected an int >= 0, got {block!r}")
    if not isinstance(scales, np.ndarray):
        raise CodecError("scales", f"expected a float32 array, got {type(scales).__name__}")
    if scales.dtype != np.float32 or scales.ndim != 1:
        raise CodecError("scales", f"expected a 1-D float32 array, got {scales.ndim}-D {scales.dtype}")
    expected = block_count(size, int(block))
    if scales.size != expected:
        per = "one per block of " + str(block) if block else "one for the tensor"
        raise CodecError("scales", f"expected {expected} ({per}, {size} elements), got {scales.size}")
    bad = ~(np.isfinite(scales) & (scales >= 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CodecError("scales", f"scale {i} is {scales[i]}, expected a finite value >= 0")
    return scales


def _check_range(encoded: Encoded) -> None:
    limit = _QMAX * int(encoded.members)
    payload = encoded.payload
    if payload.size and (int(payload.max()) > limit or int(payload.min()) < -limit):
        raise CodecError(
            "payload",
            f"values in [{payload.min()}, {payload.max()}], expected within ±{limit} "
            f"(127 per member, {encoded.members} members)",
        )


def _dequantise(enc: Encoded, out: np.ndarray, *, add: bool) -> None:
    """``out = q * s`` (or ``out += q * s``), chunk by chunk (float32)."""
    assert enc.scales is not None
    scratch = np.empty(min(enc.size, CHUNK + enc.block), np.float32)
    for start, stop in chunks(enc.size, enc.block):
        y = scratch[: stop - start] if add else out[start:stop]
        np.copyto(y, enc.payload[start:stop], casting="unsafe")
        first = start // enc.block if enc.block else 0
        _mul_blocks(y, enc.scales[first : first + block_count(stop - start, enc.block)], enc.block)
        if add:
            np.add(out[start:stop], y, out=out[start:stop])


@dataclass(frozen=True)
class Int8Codec:
    """int8 quantisation (QSGD-style): own per-block scales, or one shared scale from a bound.

    Parameters
    ----------
    block : int
        Elements per scale with own scales (0: one scale for the whole tensor); set to 0 when
        ``bound`` is given.
    bound : float, optional
        Give it for a shared scale ``bound / 127`` (then ``block`` must be 0): members sum as
        int32 without decoding. Every member and the aggregator must use the same bound.
        Values beyond it are clipped (counted in :attr:`Encoded.clipped`).
    stochastic : bool
        Stochastic rounding (unbiased; ``encode`` and ``finish`` need ``rng``) or nearest.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> codec = Int8Codec(block=4)
    >>> x = np.array([1.0, -0.5, 0.25, 0.0, 10.0, 2.0], np.float32)
    >>> enc = codec.encode(x, rng=rng)
    >>> enc.payload.tolist(), enc.scales.tolist()
    ([127, -63, 32, 0, 127, 25], [0.007874015718698502, 0.07874015718698502])
    >>> bool(np.abs(codec.decode(enc) - x).max() < enc.scales.max())
    True

    A shared scale: members sum as int32, exactly.

    >>> shared = Int8Codec(bound=1.0, stochastic=False)
    >>> a = shared.encode(np.array([0.5, -1.0], np.float32))
    >>> b = shared.encode(np.array([0.25, 2.0], np.float32))
    >>> b.clipped
    1
    >>> acc = CodecSum(); shared.sum_into(acc, a); shared.sum_into(acc, b)
    >>> total = shared.finish(acc)
    >>> total.payload.tolist(), total.members, [round(v, 3) for v in shared.decode(total).tolist()]
    ([96, 0], 2, [0.756, 0.0])
    """

    block: int = 256
    bound: float | None = None
    stochastic: bool = True
    name: ClassVar[str] = "int8"
    #: the payload's dtypes: int8 words; a shared-scale sum narrowed to int16 or int32
    payload_dtypes: ClassVar[tuple[str, ...]] = ("int8", "int16", "int32")

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or self.block < 0:
            raise ValueError(f"block must be an int >= 0, got {self.block!r}")
        if self.bound is not None:
            if not (math.isfinite(self.bound) and self.bound > 0):
                raise ValueError(f"bound must be finite and > 0, got {self.bound!r}")
            object.__setattr__(self, "block", 0)  # one shared scale for the whole tensor

    @property
    def summable(self) -> bool:
        """True with a shared scale (int32 sums of the words), False with own scales."""
        return self.bound is not None

    @property
    def randomised(self) -> bool:
        """True with stochastic rounding."""
        return self.stochastic

    @property
    def shared_scale(self) -> np.float32 | None:
        """``bound / 127`` as float32 (the agreed scale), or None with own scales."""
        return None if self.bound is None else np.float32(self.bound / _QMAX)

    def _quantise(
        self, flat: np.ndarray, rng: np.random.Generator | None, what: str
    ) -> tuple[np.ndarray, np.ndarray, int]:
        if self.stochastic and rng is None:
            raise ValueError("Int8Codec(stochastic=True) needs rng= (a numpy Generator)")
        n, block = flat.size, self.block
        shared = self.shared_scale
        scales: np.ndarray
        factors: np.ndarray
        if shared is not None:
            scales = np.array([shared], np.float32)
            factors = np.float32(1) / scales
        elif block == 0:
            top = _block_max(flat, max(n, 1)) if n else np.zeros(1, np.float32)
            if not np.isfinite(top[0]):
                raise _non_finite(flat, 0, what)
            scales, factors = _scales_of(top)
        else:
            scales = np.empty(block_count(n, block), np.float32)
        q = np.empty(n, np.int8)
        clipped = 0
        with np.errstate(all="ignore"):
            for start, stop in chunks(n, block):
                y = flat[start:stop].astype(np.float32)
                if not (np.isfinite(y.max(initial=0.0)) and np.isfinite(y.min(initial=0.0))):
                    raise _non_finite(y, start, what)
                if shared is None and block:
                    first = start // block
                    found, factors = _scales_of(_block_max(y, block))
                    scales[first : first + found.size] = found
                _mul_blocks(y, factors, block)
                if shared is not None and (y.max(initial=0.0) > _QMAX or y.min(initial=0.0) < -_QMAX):
                    clipped += int(np.count_nonzero(np.abs(y) > _QMAX))
                if self.stochastic:
                    assert rng is not None
                    _dither(rng, y)
                    np.floor(y, out=y)
                    y -= 1
                else:
                    np.rint(y, out=y)
                np.clip(y, -_QMAX, _QMAX, out=y)
                np.copyto(q[start:stop], y, casting="unsafe")
        return q, scales, clipped

    def encode(self, array: np.ndarray, *, rng: np.random.Generator | None = None) -> Encoded:
        """Quantise ``array`` (float16/32/64; not modified).

        Raises
        ------
        CodecError
            Not a floating array, or a NaN/infinity in it (field ``array``).
        ValueError
            Stochastic rounding without ``rng``.
        """
        flat = as_float_array(array)
        q, scales, clipped = self._quantise(flat, rng, "array")
        block = 0 if self.bound is not None else self.block
        return Encoded(
            "int8", array.dtype.name, tuple(array.shape), frozen(q), frozen(scales), None, block, 1, clipped
        )

    def _check(self, encoded: Encoded) -> Encoded:
        enc = check_encoded(encoded, "int8", self.payload_dtypes)
        _check_scales(enc)
        _check_range(enc)
        return enc

    def decode(self, encoded: Encoded) -> np.ndarray:
        """``q * s`` per block, in the original dtype and shape.

        Raises
        ------
        CodecError
            Another codec's payload; payload dtype or length wrong, or values beyond
            ``±127 * members``; scales of the wrong count or dtype, negative, NaN or infinite.
        """
        enc = self._check(encoded)
        out = np.empty(enc.size, np.float32)
        _dequantise(enc, out, add=False)
        return decoded(out, enc)

    def sum_into(self, acc: CodecSum, encoded: Encoded) -> None:
        """Add a member: its int8 words into an int32 sum (shared scale), else its decode in float32.

        Raises
        ------
        CodecError
            The member is inconsistent (see :meth:`decode`); its shape or dtype differ from the
            first member's; with a shared scale, its scale is not the agreed ``bound / 127``
            (field ``scales``) or the sum would exceed int32 (field ``members``).
        """
        enc = self._check(encoded)
        check_member(acc, enc, self.name)
        shared = self.shared_scale
        if shared is None:
            if acc.values is None:
                acc.codec, acc.first, acc.values = self.name, enc, np.empty(enc.size, np.float32)
                _dequantise(enc, acc.values, add=False)
            else:
                _dequantise(enc, acc.values, add=True)
            acc.members += enc.members
            return
        assert enc.scales is not None
        if enc.block != 0 or enc.scales[0] != shared:
            raise CodecError(
                "scales",
                f"expected the shared scale {shared} (bound {self.bound} / 127, block 0), "
                f"got {enc.scales.tolist()[:4]} (block {enc.block})",
            )
        if acc.members + enc.members > _MAX_MEMBERS:
            raise CodecError("members", f"an int32 sum holds at most {_MAX_MEMBERS} members")
        if acc.values is None:
            acc.codec, acc.first, acc.values = self.name, enc, enc.payload.astype(np.int32)
        else:
            np.add(acc.values, enc.payload, out=acc.values)
        acc.members += enc.members

    def finish(self, acc: CodecSum, *, rng: np.random.Generator | None = None) -> Encoded:
        """The sum to forward: shared scale, the int32 sum narrowed to the narrowest integer
        type that holds it (exact); own scales, the float32 sum quantised again (``rng`` as
        for :meth:`encode`).

        Raises
        ------
        CodecError
            Nothing was summed.
        """
        values = dense_result(acc).reshape(-1)
        first = acc.first
        assert first is not None
        if self.shared_scale is None:
            q, scales, _ = self._quantise(values, rng, "sum")
            return Encoded(
                "int8", first.dtype, first.shape, frozen(q), frozen(scales), None, self.block, acc.members
            )
        top = max(int(values.max(initial=0)), -int(values.min(initial=0)))
        narrow = np.int8 if top <= _QMAX else np.int16 if top <= 32767 else np.int32
        scales = np.array([self.shared_scale], np.float32)
        payload = frozen(values.astype(narrow))
        return Encoded("int8", first.dtype, first.shape, payload, frozen(scales), None, 0, acc.members)

    def finish_dense(self, acc: CodecSum) -> np.ndarray:
        """The sum as float32 (shared scale: the int32 sum times the scale)."""
        values = dense_result(acc)
        if self.shared_scale is None:
            return values
        return values.astype(np.float32) * self.shared_scale
