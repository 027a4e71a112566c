"""The tensor codec: named tensors <-> a flat payload in a memfd (DESIGN §7).

An update or a model is a dict of name -> tensor (numpy array or torch tensor) with
dtype ``float32``, ``float16``, ``bfloat16`` or ``float64``. On its way between a
training process, its daemon and peer daemons it travels as one flat payload: the
tensors' bytes concatenated back to back (the data plane's frame check wants the
layout to cover the payload exactly, so there is no padding) plus a layout
(name, dtype, shape, offset, nbytes per tensor, the ``TensorLayout`` message of
``dataplane.proto``).

Numpy has no bfloat16: a bfloat16 tensor is a numpy ``uint16`` array of the raw
2-byte words (the top half of the float32 bit pattern); with torch it round-trips
to ``torch.bfloat16``. Torch is optional: nothing here imports it unless the
caller passes torch tensors or asks for them.

This module is the codec itself (layouts, dtype checks, encode and decode of a buffer); moving
a payload in and out of a memfd (the one copy into a pooled or new memfd, the read or the
mapping out of a passed one) is :mod:`mlfabric.tensorio`. :func:`check_update` compares an
update's layout with a server's model spec (the client checks before copying, the daemon on
arrival: one wording of every mismatch).

Client and daemon both import this module (:mod:`mlfabric.wire`); training code sees it as
:mod:`mlfabric.tensors`.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlfabric.wire.errors import MlfabricError

__all__ = [
    "DTYPES",
    "FiniteScan",
    "Layout",
    "Spec",
    "TensorError",
    "check_update",
    "decode",
    "dtype_name",
    "encode_into",
    "first_non_finite",
    "l2_norm",
    "layouts_from_pb",
    "layouts_to_pb",
    "plan_layout",
]

#: dtype name -> numpy dtype the bytes are viewed as (bfloat16: raw uint16 words).
DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float64": np.dtype("<f8"),
}

_NUMPY_NAMES = {"float32": "float32", "float16": "float16", "uint16": "bfloat16", "float64": "float64"}


class TensorError(MlfabricError, ValueError):
    """A tensor the codec cannot carry (unsupported dtype, not an array, bad layout).

    An :class:`~mlfabric.wire.errors.MlfabricError` (code ``bad_tensor``), and a ``ValueError``
    as before.

    Examples
    --------
    >>> err = TensorError("tensor 'w': dtype int8 is not supported")
    >>> isinstance(err, MlfabricError), isinstance(err, ValueError), err.code
    (True, True, 'bad_tensor')
    """

    def __init__(self, message: str, code: str = "bad_tensor") -> None:
        super().__init__(message, code)


@dataclass(frozen=True)
class Layout:
    """Where one tensor sits in a payload (mirrors ``TensorLayout`` in ``dataplane.proto``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _is_torch(value: object) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def dtype_name(value: object) -> str:
    """The mlfabric dtype name of a numpy array or torch tensor.

    Parameters
    ----------
    value : numpy.ndarray or torch.Tensor
        The tensor. A numpy ``uint16`` array is taken as raw bfloat16 words.

    Returns
    -------
    str
        One of ``float32``, ``float16``, ``bfloat16``, ``float64``.

    Raises
    ------
    TensorError
        For any other dtype or a value that is not a tensor.

    Examples
    --------
    >>> dtype_name(np.zeros(2, dtype=np.float16))
    'float16'
    """
    if _is_torch(value):
        name = str(value.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
        if name in DTYPES:
            return name
        raise TensorError(f"unsupported torch dtype {value.dtype}; use one of {sorted(DTYPES)}")  # type: ignore[attr-defined]
    if isinstance(value, np.ndarray):
        found = _NUMPY_NAMES.get(value.dtype.name)
        if found is None:
            raise TensorError(
                f"unsupported numpy dtype {value.dtype}; use float32, float16, float64 "
                "or uint16 (raw bfloat16 words)"
            )
        return found
    raise TensorError(f"expected a numpy array or torch tensor, got {type(value).__name__}")


def _as_numpy(value: object) -> np.ndarray:
    """A C-contiguous little-endian numpy view (or copy) of a tensor's bytes."""
    if _is_torch(value):
        import torch

        tensor = value.detach().cpu().contiguous()  # type: ignore[attr-defined]
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)
            return np.ascontiguousarray(tensor.numpy().view(np.uint16))
        return np.ascontiguousarray(tensor.numpy())
    arr = np.asarray(value)
    return np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))


def plan_layout(tensors: Mapping[str, object]) -> tuple[list[Layout], int]:
    """Lay the tensors out in one payload, back to back in the dict's order.

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The update or model.

    Returns
    -------
    layouts : list of Layout
        One per tensor.
    total : int
        Payload size in bytes.

    Examples
    --------
    >>> layouts, total = plan_layout({"a": np.zeros(3, np.float32), "b": np.zeros(1)})
    >>> [(x.name, x.offset, x.nbytes) for x in layouts], total
    ([('a', 0, 12), ('b', 12, 8)], 20)
    """
    layouts: list[Layout] = []
    offset = 0
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise TensorError(f"tensor names must be non-empty strings, got {name!r}")
        dtype = dtype_name(value)
        shape = tuple(int(d) for d in value.shape)  # type: ignore[attr-defined]
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        layouts.append(Layout(name, dtype, shape, offset, nbytes))
        offset += nbytes
    return layouts, offset


def encode_into(
    buf: memoryview | mmap.mmap, tensors: Mapping[str, object], layouts: Sequence[Layout]
) -> None:
    """Copy the tensors' bytes into ``buf`` at the offsets of ``layouts``.

    Parameters
    ----------
    buf : writable buffer
        At least as large as the payload.
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The tensors, as given to :func:`plan_layout`.
    layouts : sequence of Layout
        From :func:`plan_layout`.

    Examples
    --------
    >>> t = {"a": np.arange(2, dtype=np.float32)}
    >>> layouts, n = plan_layout(t)
    >>> b = bytearray(n); encode_into(memoryview(b), t, layouts)
    >>> decode(b, layouts)["a"].tolist()
    [0.0, 1.0]
    """
    view = memoryview(buf).cast("B")
    for layout in layouts:
        arr = _as_numpy(tensors[layout.name])
        view[layout.offset : layout.offset + layout.nbytes] = arr.reshape(-1).view(np.uint8).data


def decode(
    buf: bytes | bytearray | memoryview | mmap.mmap,
    layouts: Sequence[Layout],
    *,
    as_torch: bool = False,
    copy: bool = True,
) -> dict[str, Any]:
    """Named tensors from a payload.

    Parameters
    ----------
    buf : buffer
        The payload.
    layouts : sequence of Layout
        Where each tensor sits.
    as_torch : bool
        Return torch tensors (bfloat16 as ``torch.bfloat16``) instead of numpy arrays.
    copy : bool
        Copy out of ``buf`` (default) so the result outlives the buffer.

    Returns
    -------
    dict
        name -> numpy array (bfloat16 as ``uint16`` words) or torch tensor.

    Raises
    ------
    TensorError
        When a layout does not fit the buffer or names an unknown dtype.

    Examples
    --------
    >>> layouts, n = plan_layout({"x": np.ones((2, 2))})
    >>> decode(bytes(n), layouts)["x"].shape
    (2, 2)
    """
    view = memoryview(buf).cast("B")
    out: dict[str, Any] = {}
    for layout in layouts:
        dtype = DTYPES.get(layout.dtype)
        if dtype is None:
            raise TensorError(f"tensor {layout.name!r}: unknown dtype {layout.dtype!r}")
        count = int(np.prod(layout.shape, dtype=np.int64))
        if count * dtype.itemsize != layout.nbytes or layout.offset + layout.nbytes > len(view):
            raise TensorError(
                f"tensor {layout.name!r}: layout {layout.shape} {layout.dtype} at offset {layout.offset} "
                f"({layout.nbytes} bytes) does not fit a {len(view)}-byte payload"
            )
        arr = np.frombuffer(view, dtype=dtype, count=count, offset=layout.offset).reshape(layout.shape)
        if copy:
            arr = arr.copy()
        out[layout.name] = _to_torch(arr, layout.dtype) if as_torch else arr
    return out


def _to_torch(arr: np.ndarray, dtype: str) -> Any:
    """A torch tensor sharing ``arr``'s memory (bfloat16 words become ``torch.bfloat16``)."""
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def l2_norm(tensors: Mapping[str, object]) -> float:
    """The L2 norm of an update over all its tensors (the default ``norm`` of a push).

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The update.

    Returns
    -------
    float
        sqrt(sum of squares of every element), computed in float64.

    Examples
    --------
    >>> l2_norm({"a": np.array([3.0]), "b": np.array([4.0], dtype=np.float32)})
    5.0
    """
    total = 0.0
    for value in tensors.values():
        dtype = dtype_name(value)
        arr = _as_numpy(value)
        if dtype == "bfloat16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        flat = arr.reshape(-1)
        # einsum's own loop, accumulating in float64 through a small cast buffer: no float64 copy
        # of the tensor, and no BLAS call (np.dot from many threads at once contends inside
        # OpenBLAS: 64 threads pushing took 165x longer than with einsum)
        total += float(np.einsum("i,i->", flat, flat, dtype=np.float64))
    return float(np.sqrt(total))


#: Bytes per block of the NaN/inf test (a block and its scratch stay in cache).
_FINITE_BLOCK_BYTES = 256 * 1024

#: Exponent bits of the 2-byte float dtypes (raw words): all ones means inf or NaN.
_EXPONENT_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80}
#: Wider float dtypes tested by a block sum (:func:`_block_non_finite`).
_SUMMED: dict[str, np.dtype[Any]] = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}
_RAW_WORDS: np.dtype[Any] = np.dtype("<u2")


def _block_non_finite(block: np.ndarray, exponent_bits: int = 0, scratch: np.ndarray | None = None) -> bool:
    """Whether ``block`` holds a NaN or an infinity.

    float32/float64: a block whose sum is finite holds only finite values (a NaN or an infinity
    makes the sum non-finite), so the exact per-element test runs only on a block whose sum is
    not (a non-finite value, or a sum that overflowed). 2-byte floats (``exponent_bits`` given,
    ``block`` their raw ``uint16`` words): non-finite when the exponent bits are all ones, i.e.
    when the largest ``word & exponent_bits`` equals them (``scratch``: a ``uint16`` array at
    least as long as the block for the masked words, so nothing is allocated per block).
    """
    if exponent_bits:
        masked = np.empty_like(block) if scratch is None else scratch[: block.size]
        np.bitwise_and(block, exponent_bits, out=masked)
        return bool(masked.size) and int(masked.max()) == exponent_bits
    # (callers silence numpy's overflow/invalid warnings once per call, not per block)
    return not math.isfinite(np.add.reduce(block)) and not bool(np.isfinite(block).all())


def first_non_finite(tensors: Mapping[str, object]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, or None when all are finite.

    One read of each tensor, block by block (:func:`_block_non_finite`: a block sum for
    float32/float64, the exponent bits for float16 and bfloat16). The daemons run the same test
    on a payload's bytes as they arrive (:class:`FiniteScan`); this is the server process's
    fallback for a payload no daemon checked (DESIGN §9).

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The update.

    Examples
    --------
    >>> first_non_finite({"a": np.ones(3), "b": np.array([1.0, np.nan], np.float32)})
    'b'
    >>> first_non_finite({"a": np.array([np.finfo(np.float16).max] * 2, np.float16)}) is None
    True
    >>> first_non_finite({"raw": np.array([0x3F80, 0x7F80], np.uint16)})  # bfloat16 1.0, +inf
    'raw'
    """
    for name, value in tensors.items():
        if _is_torch(value):
            import torch

            if not bool(torch.isfinite(value).all()):  # type: ignore[arg-type]
                return name
            continue
        flat = np.asarray(value).reshape(-1)
        bits = {np.dtype(np.uint16): 0x7F80, np.dtype(np.float16): 0x7C00}.get(flat.dtype, 0)
        if bits:
            flat = flat.view(np.uint16)
        step = _FINITE_BLOCK_BYTES // max(1, flat.itemsize)
        scratch = np.empty(min(step, flat.size), np.uint16) if bits else None
        with np.errstate(over="ignore", invalid="ignore"):
            for start in range(0, flat.size, step):
                if _block_non_finite(flat[start : start + step], bits, scratch):
                    return name
    return None


class FiniteScan:
    """The NaN/inf test of a payload's tensors, run piece by piece as its bytes become final.

    The receiving daemon calls :meth:`scan` right after the CRC-32 of each piece (see
    :class:`~mlfabric.daemon.channels.payloadio.Crc32Follower`), while the piece is still in cache, so
    the test costs no extra pass over the payload. Each tensor region of the layout is tested
    on its complete elements: float32/float64 by a block sum, float16/bfloat16 by their
    exponent bits (:func:`_block_non_finite`); other dtypes (``uint8``, ``int32``, ...) are
    skipped. Pieces must come in order; an element split across two pieces is tested with the
    second.

    Parameters
    ----------
    layouts : sequence of Layout
        Where each tensor sits in the payload.

    Attributes
    ----------
    bad : str or None
        The name of the first tensor found holding a NaN or an infinity (scanning stops there).
    done : bool
        Every tensor was scanned to its end (and ``bad`` is None, or it stopped at ``bad``).

    Examples
    --------
    >>> t = {"a": np.ones(3), "b": np.array([1.0, np.inf], np.float32)}
    >>> layouts, n = plan_layout(t)
    >>> buf = bytearray(n); encode_into(memoryview(buf), t, layouts)
    >>> scan = FiniteScan(layouts)
    >>> scan.scan(memoryview(buf), 27); scan.bad is None   # 'b' has one complete element so far
    True
    >>> scan.scan(memoryview(buf), n); scan.bad, scan.done
    ('b', True)
    """

    def __init__(self, layouts: Sequence[Layout]) -> None:
        self._regions: list[tuple[int, int, str, np.dtype[Any] | None, int]] = []
        for x in sorted(layouts, key=lambda x: x.offset):
            bits = _EXPONENT_BITS.get(x.dtype, 0)
            dtype: np.dtype[Any] | None = _RAW_WORDS if bits else _SUMMED.get(x.dtype)
            self._regions.append((x.offset, x.offset + x.nbytes, x.name, dtype, bits))
        wants = any(r[4] for r in self._regions)  # a 2-byte float: scratch for its masked words
        self._scratch = np.empty(_FINITE_BLOCK_BYTES // 2, np.uint16) if wants else None
        self._next = 0  # index of the region being scanned
        self._pos = 0  # bytes before this are scanned (or skipped)
        self.bad: str | None = None

    @property
    def done(self) -> bool:
        """Whether the scan is over (every region scanned, or a non-finite tensor found)."""
        return self.bad is not None or self._next >= len(self._regions)

    def scan(self, view: memoryview, end: int) -> None:
        """Bytes ``[0, end)`` of ``view`` (the payload) are final: test those not tested yet."""
        with np.errstate(over="ignore", invalid="ignore"):
            self._scan(view, end)

    def _scan(self, view: memoryview, end: int) -> None:
        while self.bad is None and self._next < len(self._regions):
            offset, stop, name, dtype, bits = self._regions[self._next]
            start = max(self._pos, offset)
            limit = min(end, stop)
            if dtype is None:  # not a float: nothing to test
                start = limit
            else:
                count = (limit - start) // dtype.itemsize
                step = _FINITE_BLOCK_BYTES // dtype.itemsize
                for first in range(0, count, step):
                    n = min(step, count - first)
                    block = np.frombuffer(view, dtype=dtype, count=n, offset=start + first * dtype.itemsize)
                    if _block_non_finite(block, bits, self._scratch):
                        self.bad = name
                        return
                start += count * dtype.itemsize
            self._pos = start
            if start < stop:
                return  # wait for the rest of this tensor
            self._next += 1


def layouts_to_pb(layouts: Sequence[Layout]) -> list[Any]:
    """``TensorLayout`` messages (``dataplane.proto``) for the layouts.

    Parameters
    ----------
    layouts : sequence of Layout
        Where each tensor sits.

    Returns
    -------
    list of mlfabric.proto.v1.dataplane_pb2.TensorLayout

    Examples
    --------
    >>> layouts_to_pb([Layout("w", "float32", (2,), 0, 8)])[0].nbytes
    8
    """
    from mlfabric.proto.v1 import dataplane_pb2

    return [
        dataplane_pb2.TensorLayout(
            name=x.name, dtype=x.dtype, shape=list(x.shape), offset=x.offset, nbytes=x.nbytes
        )
        for x in layouts
    ]


def layouts_from_pb(messages: Sequence[Any]) -> list[Layout]:
    """Layouts from ``TensorLayout`` messages.

    Parameters
    ----------
    messages : sequence of TensorLayout
        As carried by a push, a frame header or a model reply.

    Returns
    -------
    list of Layout

    Examples
    --------
    >>> layouts_from_pb(layouts_to_pb([Layout("w", "float64", (1,), 0, 8)]))[0].dtype
    'float64'
    """
    return [
        Layout(m.name, m.dtype, tuple(int(d) for d in m.shape), int(m.offset), int(m.nbytes))
        for m in messages
    ]


#: Model spec: tensor name -> (dtype, shape).
Spec = dict[str, tuple[str, tuple[int, ...]]]


def check_update(
    spec: Mapping[str, tuple[str, tuple[int, ...]]], layouts: Sequence[Layout], where: str
) -> str | None:
    """The first way an update's tensors differ from a model spec, or None when they match.

    Parameters
    ----------
    spec : Mapping[str, (dtype, shape)]
        The server's model.
    layouts : sequence of Layout
        The update's tensors.
    where : str
        Names the server in messages (e.g. ``"server 'ps0' of job 'j'"``).

    Returns
    -------
    str or None
        A message naming the tensor and both shapes/dtypes, or None.

    Examples
    --------
    >>> spec = {"w": ("float32", (2, 3))}
    >>> check_update(spec, [Layout("w", "float32", (3, 2), 0, 24)], "server 'ps0'")
    "tensor 'w': update has shape (3, 2) float32 but server 'ps0' expects shape (2, 3) float32"
    >>> check_update(spec, [Layout("w", "float32", (2, 3), 0, 24)], "server 'ps0'") is None
    True
    """
    names = [x.name for x in layouts]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        return f"tensor {duplicates[0]!r} appears more than once in the update"
    for layout in layouts:
        expected = spec.get(layout.name)
        if expected is None:
            return f"tensor {layout.name!r}: not in the model of {where} (it has {sorted(spec)})"
        dtype, shape = expected
        if layout.dtype != dtype or tuple(layout.shape) != tuple(shape):
            return (
                f"tensor {layout.name!r}: update has shape {tuple(layout.shape)} {layout.dtype} "
                f"but {where} expects shape {tuple(shape)} {dtype}"
            )
    missing = sorted(set(spec) - set(names))
    if missing:
        return f"tensor {missing[0]!r}: missing from the update ({where} expects {sorted(spec)})"
    return None
