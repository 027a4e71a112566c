"""top-k and random-k: a fraction of the values, with their positions (Stich et al. 2018).

The payload is the kept values (float32) and their flat positions (``uint32``, strictly
increasing: sorted, no duplicates), 8 bytes per kept value: ``ratio = 0.01`` sends 2% of a
float32 tensor's bytes.

- **top-k** keeps the ``k = ceil(ratio * n)`` values of largest magnitude (exactly: a sampled
  threshold narrows the candidates, ``argpartition`` picks among them; ties at the k-th
  magnitude are broken arbitrarily; a NaN cannot be ranked: :class:`CodecError`). Error:
  ``||x' - x||**2 <= (1 - k/n) ||x||**2`` (what is dropped is the smallest part), kept values
  exact. Biased: use it under
  :class:`~mlfabric.aggregators.codecs.feedback.ErrorFeedback`.
- **random-k** keeps ``k`` positions drawn uniformly without replacement; with ``rescale``
  (default) the values are multiplied by ``n/k`` so ``E[x'] = x`` (variance
  ``(n/k - 1) ||x||**2``); without, it is the contractive ``(k/n)``-compressor that error
  feedback needs.

Members do not share positions, so an aggregator cannot add the payloads as they are
(``summable`` is False): :meth:`sum_into` scatters each member into a dense float32 sum and
:meth:`finish` re-encodes the sum with the same codec (its own top-k, or k fresh random
positions), keeping one member's bytes on the next hop at the cost of the mass outside the
kept positions (measured in ``experiments/bench_codecs.py``); :meth:`finish_dense` gives the
exact sum instead.
"""

from __future__ import annotations

import math
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
    decoded,
    dense_result,
    frozen,
)

__all__ = ["RandomKCodec", "TopKCodec", "top_k_indices", "version_rng"]

#: elements sampled to guess the k-th magnitude before the exact selection
_SAMPLE = 1 << 16


def top_k_indices(values: np.ndarray, k: int) -> np.ndarray:
    """The sorted positions of the ``k`` largest magnitudes of a 1-D array (``uint32``).

    A strided sample of the magnitudes gives a threshold a little below the k-th largest; only
    the elements at or above it go through ``argpartition`` (exact whenever at least ``k``
    do, else the whole array does).

    Examples
    --------
    >>> top_k_indices(np.array([0.1, -5.0, 2.0, 0.0, -3.0], np.float32), 2).tolist()
    [1, 4]
    """
    n = values.size
    if k >= n:
        return np.arange(n, dtype=np.uint32)
    if k <= 0:
        return np.empty(0, np.uint32)
    mags = np.abs(values)
    picked: np.ndarray | None = None
    if n > 4 * _SAMPLE:
        sample = mags[:: n // _SAMPLE]
        m = sample.size
        top = min(m, math.ceil(1.5 * k * m / n) + 16)
        threshold = np.partition(sample, m - top)[m - top]
        # mostly zeros (a sum of sparse members, a sparse gradient): the nonzeros, padded with zeros
        candidates = np.flatnonzero(mags > 0 if threshold == 0 else mags >= threshold)
        if threshold == 0 and candidates.size < k:
            zeros = np.flatnonzero(mags == 0)[: k - candidates.size]
            picked = np.concatenate([candidates, zeros])
        elif candidates.size >= k:
            part = np.argpartition(mags[candidates], candidates.size - k)[candidates.size - k :]
            picked = candidates[part]
    if picked is None:
        picked = np.argpartition(mags, n - k)[n - k :]
    picked.sort()
    return picked.astype(np.uint32)


def _check_sparse(encoded: Encoded, name: str) -> Encoded:
    if not isinstance(encoded, Encoded):
        raise CodecError("encoded", f"expected an Encoded, got {type(encoded).__name__}")
    indices = encoded.indices
    if not isinstance(indices, np.ndarray):
        raise CodecError("indices", f"expected a uint32 array, got {type(indices).__name__}")
    if indices.dtype != np.uint32 or indices.ndim != 1:
        raise CodecError("indices", f"expected a 1-D uint32 array, got {indices.ndim}-D {indices.dtype}")
    enc = check_encoded(encoded, name, _SparseCodec.payload_dtypes, count=indices.size)
    size = enc.size
    if indices.size > size:
        raise CodecError("indices", f"expected at most {size} (the tensor's size), got {indices.size}")
    if indices.size:
        top = int(indices.max())
        if top >= size:
            raise CodecError("indices", f"index {top} out of range for a tensor of {size} elements")
        bad = np.flatnonzero(indices[1:] <= indices[:-1])
        if bad.size:
            i = int(bad[0])
            raise CodecError(
                "indices",
                f"expected strictly increasing, got {indices[i]} then {indices[i + 1]} at position "
                f"{i + 1} ({'duplicated' if indices[i] == indices[i + 1] else 'unsorted'})",
            )
    return enc


class _SparseCodec:
    """Decode, dense sums and re-encoding, shared by top-k and random-k."""

    name: ClassVar[str]
    summable: ClassVar[bool] = False
    #: the kept values' dtype (their positions are uint32)
    payload_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    ratio: float

    def _check_ratio(self) -> None:
        if not (0 < self.ratio <= 1):
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio!r}")

    def _check(self, encoded: Encoded) -> Encoded:
        """The checks :meth:`decode` and :meth:`sum_into` make (CodecError naming the field)."""
        return _check_sparse(encoded, self.name)

    def k_for(self, size: int) -> int:
        """Values kept of a tensor of ``size`` elements: ``ceil(ratio * size)``, at least 1."""
        return 0 if size == 0 else min(size, max(1, math.ceil(self.ratio * size)))

    def _select(self, flat: np.ndarray, k: int, rng: np.random.Generator | None) -> tuple[np.ndarray, float]:
        raise NotImplementedError

    def _encode_flat(
        self,
        flat: np.ndarray,
        dtype: str,
        shape: tuple[int, ...],
        members: int,
        rng: np.random.Generator | None,
    ) -> Encoded:
        if flat.size >= 2**32:
            raise CodecError("array", f"at most 2**32 - 1 elements (uint32 positions), got {flat.size}")
        indices, factor = self._select(flat, self.k_for(flat.size), rng)
        values = flat[indices].astype(np.float32)
        if factor != 1.0:
            values *= np.float32(factor)
        return Encoded(self.name, dtype, shape, frozen(values), None, frozen(indices), members=members)

    def encode(self, array: np.ndarray, *, rng: np.random.Generator | None = None) -> Encoded:
        """Keep ``k`` values of ``array`` (float16/32/64; not modified) and their positions.

        Raises
        ------
        CodecError
            Not a floating numpy array, more than 2**32 - 1 elements, or (top-k) a NaN.
        """
        flat = as_float_array(array)
        return self._encode_flat(flat, array.dtype.name, tuple(array.shape), 1, rng)

    def decode(self, encoded: Encoded) -> np.ndarray:
        """The dense tensor (zeros where nothing was kept), original dtype and shape.

        Raises
        ------
        CodecError
            Another codec's payload; indices not ``uint32``, out of range, duplicated or
            unsorted; values not float32, or not as many as the indices; a bad shape.
        """
        enc = _check_sparse(encoded, self.name)
        assert enc.indices is not None
        out = np.zeros(enc.size, np.float32)
        out[enc.indices] = enc.payload
        return decoded(out, enc)

    def sum_into(self, acc: CodecSum, encoded: Encoded) -> None:
        """Scatter-add one member into the dense float32 sum (its positions are unique).

        Raises
        ------
        CodecError
            As :meth:`decode`, or the shape/dtype differ from the first member's.
        """
        enc = _check_sparse(encoded, self.name)
        check_member(acc, enc, self.name)
        assert enc.indices is not None
        if acc.values is None:
            acc.codec, acc.first, acc.values = self.name, enc, np.zeros(enc.size, np.float32)
        acc.values[enc.indices] += enc.payload
        acc.members += enc.members

    def finish(self, acc: CodecSum, *, rng: np.random.Generator | None = None) -> Encoded:
        """The sum re-encoded with this codec (k values of the dense sum; random-k needs ``rng``).

        Raises
        ------
        CodecError
            Nothing was summed.
        """
        values = dense_result(acc).reshape(-1)
        assert acc.first is not None
        return self._encode_flat(values, acc.first.dtype, acc.first.shape, acc.members, rng)

    def finish_dense(self, acc: CodecSum) -> np.ndarray:
        """The exact float32 sum of the members' decodes."""
        return dense_result(acc)


@dataclass(frozen=True)
class TopKCodec(_SparseCodec):
    """Keep the ``ceil(ratio * n)`` largest magnitudes.

    Examples
    --------
    >>> codec = TopKCodec(ratio=0.4)
    >>> enc = codec.encode(np.array([0.1, -5.0, 2.0, 0.0, -3.0], np.float32))
    >>> enc.indices.tolist(), enc.payload.tolist(), codec.decode(enc).tolist()
    ([1, 4], [-5.0, -3.0], [0.0, -5.0, 0.0, 0.0, -3.0])
    >>> acc = CodecSum(); codec.sum_into(acc, enc)
    >>> codec.sum_into(acc, codec.encode(np.array([4.0, 1.0, 0.0, 0.0, 0.5], np.float32)))
    >>> codec.finish_dense(acc).tolist(), codec.decode(codec.finish(acc)).tolist()
    ([4.0, -4.0, 0.0, 0.0, -3.0], [4.0, -4.0, 0.0, 0.0, 0.0])
    """

    ratio: float = 0.01
    name: ClassVar[str] = "topk"
    randomised: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self._check_ratio()

    def _select(self, flat: np.ndarray, k: int, rng: np.random.Generator | None) -> tuple[np.ndarray, float]:
        if flat.size and np.isnan(flat.max()):
            i = int(np.flatnonzero(np.isnan(flat))[0])
            raise CodecError("array", f"element {i} is nan: top-k cannot rank it")
        return top_k_indices(flat, k), 1.0


def version_rng(base_version: int) -> np.random.Generator:
    """The generator a shared random-k push draws its positions from: seeded by its base version.

    Every worker pushing against one model version draws the same positions, tensor by tensor
    (the tensors are encoded in the model's order), so an aggregate of their pushes (a
    synchronous round's members) keeps ``k`` values: summable on the values, as fp16 is.

    Examples
    --------
    >>> a, b = version_rng(7).choice(100, 3, replace=False), version_rng(7).choice(100, 3, replace=False)
    >>> bool((a == b).all()), bool((a == version_rng(8).choice(100, 3, replace=False)).all())
    (True, False)
    """
    return np.random.default_rng([0x6D6C66, int(base_version) & 0xFFFFFFFFFFFFFFFF])


@dataclass(frozen=True)
class RandomKCodec(_SparseCodec):
    """Keep ``ceil(ratio * n)`` positions drawn uniformly; ``rescale`` by ``n/k`` to be unbiased.

    ``shared``: a push draws them from :func:`version_rng` of its base version instead of the
    worker's own generator (``Worker.push`` does the choosing), so that pushes against one
    model version share their positions.

    Examples
    --------
    >>> codec = RandomKCodec(ratio=0.5)
    >>> enc = codec.encode(np.arange(4, dtype=np.float32), rng=np.random.default_rng(1))
    >>> enc.indices.tolist(), enc.payload.tolist()
    ([1, 2], [2.0, 4.0])
    """

    ratio: float = 0.01
    rescale: bool = True
    shared: bool = False
    name: ClassVar[str] = "randk"
    randomised: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._check_ratio()

    def _select(self, flat: np.ndarray, k: int, rng: np.random.Generator | None) -> tuple[np.ndarray, float]:
        if rng is None:
            raise ValueError("RandomKCodec needs rng= (a numpy Generator)")
        picked = rng.choice(flat.size, k, replace=False) if k else np.empty(0, np.int64)
        picked.sort()
        factor = flat.size / k if self.rescale and k else 1.0
        return picked.astype(np.uint32), factor
