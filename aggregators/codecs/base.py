"""What every codec shares: the encoded form, the running sum, the error and the checks.

An :class:`Encoded` is plain frozen data: the payload words and the metadata needed to read
them (scales, indices, the original dtype and shape, how many updates it sums). Nothing in it
refers to a codec object, so an aggregator can check and decode what arrives from any member
with only the codec's name. A :class:`CodecSum` is the running sum of members at an
aggregator hop: a float32 (or, for int8 with a shared scale, int32) accumulator plus the
metadata of the first member, against which every later member is checked.

Every check raises :class:`CodecError` naming the field, what was expected and what came:
a corrupt or inconsistent payload is never decoded or summed into a wrong result.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mlfabric.wire.errors import MlfabricError

__all__ = [
    "CHUNK",
    "FLOAT_DTYPES",
    "Codec",
    "CodecError",
    "CodecSum",
    "Encoded",
    "as_float_array",
    "check_encoded",
    "chunks",
    "relative_l2",
]

#: the dtypes a codec encodes (and decode gives back): numpy floating types. bfloat16 tensors
#: (raw ``uint16`` words in :mod:`mlfabric.wire.tensors`) are widened to float32 by the caller.
FLOAT_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("float32"),
    "float64": np.dtype("float64"),
    "float16": np.dtype("float16"),
}

#: a bound on a tensor's elements (a shape beyond it is corrupt, not a tensor)
MAX_ELEMENTS = 1 << 48

#: Elements per chunk of a vectorised pass (a chunk and its temporaries fit a core's L2).
CHUNK = 1 << 16


class CodecError(MlfabricError, ValueError):
    """A payload or accumulator a codec cannot use: corrupt, inconsistent, or the wrong codec's.

    An :class:`~mlfabric.wire.errors.MlfabricError` (code ``bad_encoding``) and a
    ``ValueError``.

    Parameters
    ----------
    field : str
        The field at fault (``payload``, ``scales``, ``indices``, ``shape``, ``array``, ...).
    message : str
        What was expected and what came.

    Examples
    --------
    >>> err = CodecError("scales", "expected 4 values (one per block), got 3")
    >>> err.field, err.code, str(err)
    ('scales', 'bad_encoding', 'scales: expected 4 values (one per block), got 3')
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", code="bad_encoding")
        self.field = field


@dataclass(frozen=True)
class Encoded:
    """One tensor as a codec encoded it (or a sum of several, ``members > 1``).

    Attributes
    ----------
    codec : str
        The codec's name (``fp16``, ``bf16``, ``int8``, ``topk``, ``randk``).
    dtype : str
        The original dtype (a key of :data:`FLOAT_DTYPES`); decode gives it back.
    shape : tuple of int
        The original shape.
    payload : numpy.ndarray
        1-D: ``float16`` (fp16), ``uint16`` bfloat16 words (bf16), ``int8`` (int8; ``int16`` or
        ``int32`` for a shared-scale sum), ``float32`` kept values (topk, randk).
    scales : numpy.ndarray or None
        int8: ``float32``, one per block (one for the tensor when ``block == 0``).
    indices : numpy.ndarray or None
        topk, randk: ``uint32`` flat positions of the kept values, strictly increasing.
    block : int
        int8: elements per scale (0: one scale for the whole tensor).
    members : int
        How many updates this payload sums (1 for a worker's own update).
    clipped : int
        int8 with a shared scale: how many values lay beyond the bound and were clipped.

    Examples
    --------
    >>> e = Encoded("fp16", "float32", (2, 2), np.zeros(4, np.float16))
    >>> e.size, e.nbytes, e.ratio
    (4, 8, 2.0)
    """

    codec: str
    dtype: str
    shape: tuple[int, ...]
    payload: np.ndarray
    scales: np.ndarray | None = None
    indices: np.ndarray | None = None
    block: int = 0
    members: int = 1
    clipped: int = 0

    @property
    def size(self) -> int:
        """Elements of the original tensor."""
        return math.prod(int(d) for d in self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays that would travel (payload, scales, indices)."""
        extra = sum(a.nbytes for a in (self.scales, self.indices) if isinstance(a, np.ndarray))
        return int(self.payload.nbytes) + extra

    @property
    def ratio(self) -> float:
        """Compression ratio: the original tensor's bytes over :attr:`nbytes`."""
        original = self.size * FLOAT_DTYPES[self.dtype].itemsize
        return original / self.nbytes if self.nbytes else float("inf")


@dataclass
class CodecSum:
    """The running sum of encoded members at an aggregator hop (filled by ``Codec.sum_into``).

    Attributes
    ----------
    codec : str
        The codec that sums into it (set by the first member).
    values : numpy.ndarray or None
        The flat accumulator: ``float32``, or ``int32`` for int8 with a shared scale.
    first : Encoded or None
        The first member: later members must match its codec, dtype, shape (and scale).
    members : int
        Updates summed so far (a member that is itself a sum counts its members).

    Examples
    --------
    >>> CodecSum().members
    0
    """

    codec: str = ""
    values: np.ndarray | None = None
    first: Encoded | None = None
    members: int = 0


@runtime_checkable
class Codec(Protocol):
    """A codec (the interface every codec class here implements).

    ``summable`` says whether members are summed on their encoded words (fp16, bf16: widened
    into float32; int8 with a shared scale: int8 words added as int32) rather than decoded to
    float32 first (int8 with own scales, topk, randk: decode, sum densely, re-encode at
    :meth:`finish`). Every codec has ``sum_into``/``finish``; ``summable`` is about the cost
    and the exactness of the sum, not whether one exists.
    """

    @property
    def name(self) -> str:
        """The codec's name, as in :attr:`Encoded.codec`."""
        ...

    @property
    def summable(self) -> bool:
        """Whether an aggregator sums the encoded payloads without decoding them."""
        ...

    @property
    def randomised(self) -> bool:
        """Whether :meth:`encode` draws from ``rng`` (and so needs one)."""
        ...

    def encode(self, array: np.ndarray, *, rng: np.random.Generator | None = None) -> Encoded:
        """Encode one tensor (not modified)."""
        ...

    def decode(self, encoded: Encoded) -> np.ndarray:
        """The tensor back (original dtype and shape); :class:`CodecError` if inconsistent."""
        ...

    def sum_into(self, acc: CodecSum, encoded: Encoded) -> None:
        """Add one member into the running sum; :class:`CodecError` if it does not fit."""
        ...

    def finish(self, acc: CodecSum, *, rng: np.random.Generator | None = None) -> Encoded:
        """The sum, encoded to forward (``members`` = how many it sums)."""
        ...

    def finish_dense(self, acc: CodecSum) -> np.ndarray:
        """The sum as a float32 array of the original shape (no re-encoding)."""
        ...


def as_float_array(array: object) -> np.ndarray:
    """A flat C-contiguous view (or copy) of a floating array to encode.

    Parameters
    ----------
    array : numpy.ndarray
        float32, float64 or float16.

    Returns
    -------
    numpy.ndarray
        1-D, same dtype.

    Raises
    ------
    CodecError
        Not a numpy array, or not one of :data:`FLOAT_DTYPES` (field ``array``).

    Examples
    --------
    >>> as_float_array(np.ones((2, 3), np.float32)).shape
    (6,)
    >>> as_float_array(np.ones(2, np.int8))
    Traceback (most recent call last):
    ...
    mlfabric.aggregators.codecs.base.CodecError: array: expected dtype float16, float32 or float64, got int8
    """
    if not isinstance(array, np.ndarray):
        raise CodecError("array", f"expected a numpy array, got {type(array).__name__}")
    if array.dtype.name not in FLOAT_DTYPES:
        raise CodecError("array", f"expected dtype float16, float32 or float64, got {array.dtype}")
    return np.ascontiguousarray(array).reshape(-1)


def chunks(n: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of the chunks of a pass over ``n`` elements, starts multiples of ``align``.

    Examples
    --------
    >>> list(chunks(10, 4))[:2], list(chunks(0))
    ([(0, 10)], [])
    """
    step = max(align, CHUNK // max(align, 1) * max(align, 1))
    for start in range(0, n, step):
        yield start, min(start + step, n)


def _shape_size(shape: object) -> int:
    if not isinstance(shape, tuple) or not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
        raise CodecError("shape", f"expected a tuple of non-negative ints, got {shape!r}")
    size = math.prod(int(d) for d in shape)  # Python ints: no silent int64 wrap-around
    if size >= MAX_ELEMENTS:
        raise CodecError("shape", f"expected fewer than 2**48 elements, got {shape} ({size})")
    return size


def check_encoded(
    encoded: object, codec: str | tuple[str, ...], payload_dtypes: tuple[str, ...], count: int | None = None
) -> Encoded:
    """The checks every codec makes before it reads a payload.

    Parameters
    ----------
    encoded : Encoded
        What arrived.
    codec : str or tuple of str
        The codec name(s) it must carry.
    payload_dtypes : tuple of str
        The payload dtypes allowed.
    count : int, optional
        The payload's length; the tensor's size when not given.

    Returns
    -------
    Encoded
        ``encoded``, checked.

    Raises
    ------
    CodecError
        Naming the first field that is wrong: ``encoded``, ``codec``, ``dtype``, ``shape``,
        ``members``, ``payload``.

    Examples
    --------
    >>> e = Encoded("fp16", "float32", (3,), np.zeros(2, np.float16))
    >>> check_encoded(e, "fp16", ("float16",))
    Traceback (most recent call last):
    ...
    mlfabric.aggregators.codecs.base.CodecError: payload: expected 3 elements (shape (3,)), got 2
    """
    if not isinstance(encoded, Encoded):
        raise CodecError("encoded", f"expected an Encoded, got {type(encoded).__name__}")
    names = (codec,) if isinstance(codec, str) else codec
    if encoded.codec not in names:
        raise CodecError("codec", f"expected {' or '.join(map(repr, names))}, got {encoded.codec!r}")
    if encoded.dtype not in FLOAT_DTYPES:
        raise CodecError("dtype", f"expected one of {sorted(FLOAT_DTYPES)}, got {encoded.dtype!r}")
    size = _shape_size(encoded.shape)
    if not isinstance(encoded.members, int | np.integer) or encoded.members < 1:
        raise CodecError("members", f"expected an int >= 1, got {encoded.members!r}")
    payload = encoded.payload
    if not isinstance(payload, np.ndarray):
        raise CodecError("payload", f"expected a numpy array, got {type(payload).__name__}")
    if payload.dtype.name not in payload_dtypes:
        raise CodecError("payload", f"expected dtype {' or '.join(payload_dtypes)}, got {payload.dtype}")
    if payload.ndim != 1:
        raise CodecError("payload", f"expected a 1-D array, got {payload.ndim} dimensions")
    expected = size if count is None else count
    if payload.size != expected:
        what = f"shape {encoded.shape}" if count is None else "as many as its indices"
        raise CodecError("payload", f"expected {expected} elements ({what}), got {payload.size}")
    return encoded


def check_member(acc: CodecSum, encoded: Encoded, codec: str) -> None:
    """A later member must match the first one's codec, dtype and shape (CodecError otherwise)."""
    if acc.codec and acc.codec != codec:
        raise CodecError("accumulator", f"expected a sum of {codec!r} members, got one of {acc.codec!r}")
    first = acc.first
    if first is None:
        return
    if encoded.shape != first.shape:
        raise CodecError("shape", f"expected {first.shape} (the first member's), got {encoded.shape}")
    if encoded.dtype != first.dtype:
        raise CodecError("dtype", f"expected {first.dtype!r} (the first member's), got {encoded.dtype!r}")


def dense_result(acc: CodecSum) -> np.ndarray:
    """The accumulator as a float32 array of the members' shape (CodecError if empty)."""
    if acc.first is None or acc.values is None:
        raise CodecError("accumulator", "no member was summed")
    return acc.values.reshape(acc.first.shape)


def decoded(flat: np.ndarray, enc: Encoded) -> np.ndarray:
    """A decode's float32 values in the encoded tensor's shape and original dtype."""
    result = flat.reshape(enc.shape)
    return result if enc.dtype == "float32" else result.astype(enc.dtype)


def frozen(array: np.ndarray) -> np.ndarray:
    """``array`` made read-only (an :class:`Encoded` is plain frozen data)."""
    array.flags.writeable = False
    return array


def relative_l2(approx: np.ndarray, exact: np.ndarray) -> float:
    """``||approx - exact|| / ||exact||`` in float64 (0 when both are zero).

    Examples
    --------
    >>> relative_l2(np.array([1.0, 2.0]), np.array([1.0, 2.5]))
    0.1856...
    """
    a = np.asarray(approx, np.float64).reshape(-1)
    b = np.asarray(exact, np.float64).reshape(-1)
    norm = float(np.linalg.norm(b))
    diff = float(np.linalg.norm(a - b))
    return diff / norm if norm else diff
