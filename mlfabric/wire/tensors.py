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

import mmap
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mlfabric.wire import _native
from mlfabric.wire.errors import MlfabricError

__all__ = [
    "DTYPES",
    "LAYOUT_KINDS",
    "SPARSE_CODECS",
    "WORD_DTYPES",
    "Encoding",
    "Layout",
    "Spec",
    "TensorError",
    "check_update",
    "decode",
    "dtype_name",
    "encode_into",
    "first_non_finite",
    "is_encoded",
    "l2_norm",
    "layouts_from_pb",
    "layouts_to_pb",
    "pack_layout",
    "plan_layout",
    "words_dtype",
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


#: numpy dtypes of an encoded tensor's words (``TensorEncoding.words``; docs/compression.md)
WORD_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "uint16": np.dtype("<u2"),
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "float32": np.dtype("<f4"),
}


@dataclass(frozen=True)
class Encoding:
    """How an encoded tensor's words read (mirrors ``TensorEncoding`` in ``dataplane.proto``).

    Plain data: the codecs (:mod:`mlfabric.aggregators.codecs.payload`) check and read it.
    ``scales`` are float32 values as Python floats (int8), ``bound`` 0 for own scales;
    ``count`` and ``ratio``: the values kept by a sparse codec (:data:`SPARSE_CODECS`).
    """

    codec: str
    words: str
    scales: tuple[float, ...] = ()
    block: int = 0
    bound: float = 0.0
    members: int = 1
    count: int = 0
    ratio: float = 0.0


#: codecs whose bytes are ``count`` float32 values, then their ``count`` uint32 positions
SPARSE_CODECS = frozenset({"topk", "randk"})


@dataclass(frozen=True)
class Layout:
    """Where one tensor sits in a payload (mirrors ``TensorLayout`` in ``dataplane.proto``).

    ``dtype`` is the tensor's own dtype; with an ``encoding`` the ``nbytes`` at ``offset`` are
    the codec's words (:func:`words_dtype`), one per element (a sparse codec's: ``count``
    float32 values, then ``count`` uint32 positions).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    encoding: Encoding | None = None


def words_dtype(layout: Any) -> str:
    """The dtype of the bytes a layout (:class:`Layout` or ``TensorLayout``) describes.

    The tensor's dtype, or its encoding's words when it travels encoded.

    Examples
    --------
    >>> words_dtype(Layout("w", "float32", (2,), 0, 2, Encoding("int8", "int8", (0.1,))))
    'int8'
    >>> words_dtype(Layout("w", "float32", (2,), 0, 8))
    'float32'
    """
    return str(layout.encoding.words) if is_encoded(layout) else str(layout.dtype)


def is_encoded(layout: Any) -> bool:
    """Whether a :class:`Layout` or ``TensorLayout`` message travels encoded.

    Examples
    --------
    >>> plain = Layout("w", "float32", (2,), 0, 8)
    >>> is_encoded(plain), is_encoded(layouts_to_pb([plain])[0])
    (False, False)
    """
    if isinstance(layout, Layout):
        return layout.encoding is not None
    return bool(layout.HasField("encoding"))


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


def plan_layout(
    tensors: Mapping[str, object], encoded: Mapping[str, tuple[str, tuple[int, ...], Encoding]] | None = None
) -> tuple[list[Layout], int]:
    """Lay the tensors out in one payload, back to back in the dict's order.

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The update or model.
    encoded : Mapping[str, (dtype, shape, Encoding)], optional
        The tensors that travel encoded: their value in ``tensors`` is the codec's words (a
        1-D numpy array of the encoding's ``words`` dtype), laid out with the tensor's own
        dtype and shape (:mod:`mlfabric.aggregators.codecs.payload`).

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
        if encoded is not None and name in encoded:
            dtype, shape, encoding = encoded[name]
            nbytes = int(np.asarray(value).nbytes)
            layouts.append(Layout(name, dtype, tuple(shape), offset, nbytes, encoding))
            offset += nbytes
            continue
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
    # compressed tensors first, each decoded from a copy of its words (a new array): a payload
    # that does not decode raises before any view of ``buf`` exists (its mapping can be closed)
    decoded = {x.name: _decode_encoded(buf, x) for x in layouts if x.encoding is not None}
    view = memoryview(buf).cast("B")
    out: dict[str, Any] = {}
    for layout in layouts:
        if layout.name in decoded:
            arr = decoded[layout.name]
            out[layout.name] = _to_torch(arr, layout.dtype) if as_torch else arr
            continue
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


def _decode_encoded(buf: bytes | bytearray | memoryview | mmap.mmap, layout: Layout) -> np.ndarray:
    """An encoded tensor of ``buf`` decoded by its codec (:mod:`mlfabric.aggregators.codecs.payload`)."""
    from mlfabric.aggregators.codecs.payload import decode_layout

    with memoryview(buf) as whole, whole.cast("B") as flat:
        end = layout.offset + layout.nbytes
        if end > len(flat):
            raise TensorError(
                f"tensor {layout.name!r}: bytes [{layout.offset}, {end}) do not fit a "
                f"{len(flat)}-byte payload"
            )
        words = bytes(flat[layout.offset : end])
    return decode_layout(replace(layout, offset=0), memoryview(words))


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


#: ``kind`` of a dtype in :func:`pack_layout` (the C extension's NaN/inf test; 0: not tested).
LAYOUT_KINDS: dict[str, int] = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4}
#: encoded words -> the :data:`LAYOUT_KINDS` key they are tested as
_ENCODED_KINDS = {"float16": "float16", "uint16": "bfloat16", "float32": "float32"}
_SEGMENT = struct.Struct("<3Q")  # offset, nbytes, kind


def pack_layout(layouts: Sequence[Any]) -> bytes:
    """The layout as :func:`mlfabric.wire._native.check` takes it: ``(offset, nbytes, kind)`` each.

    Three little-endian uint64 per tensor, in the order given (``check`` reports the index of
    the first tensor holding a NaN or an infinity); ``kind`` is :data:`LAYOUT_KINDS`' (1
    float32, 2 float64, 3 float16, 4 bfloat16), 0 for a dtype that is not tested (integers).
    ``layouts`` are :class:`Layout` or ``TensorLayout`` messages (a frame header's ``tensors``).

    Examples
    --------
    >>> from mlfabric.wire import _native
    >>> t = {"a": np.ones(3), "b": np.array([1.0, np.inf], np.float32)}
    >>> layouts, n = plan_layout(t)
    >>> buf = bytearray(n); encode_into(memoryview(buf), t, layouts)
    >>> len(pack_layout(layouts)), _native.check(buf, 0, n, 0, pack_layout(layouts))[1]
    (48, 1)
    """
    return b"".join(_SEGMENT.pack(x.offset, _tested_bytes(x), _kind(x)) for x in layouts)


def _tested_bytes(layout: Any) -> int:
    """The bytes of a layout the NaN/inf pass tests: a sparse tensor's values, not its positions."""
    if is_encoded(layout) and layout.encoding.codec in SPARSE_CODECS:
        return min(int(layout.nbytes), 4 * int(layout.encoding.count))
    return int(layout.nbytes)


def _kind(layout: Any) -> int:
    """The :data:`LAYOUT_KINDS` value a layout's bytes are tested as (0: not tested)."""
    if is_encoded(layout):  # fp16/bf16 words as float16/bfloat16, sparse values as float32; int8: no
        return LAYOUT_KINDS.get(_ENCODED_KINDS.get(str(layout.encoding.words), ""), 0)
    return LAYOUT_KINDS.get(layout.dtype, 0)


def first_non_finite(tensors: Mapping[str, object]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, or None when all are finite.

    One read of each tensor by the C extension (a value is non-finite when its exponent bits
    are all ones; :func:`mlfabric.wire._native.check`). The daemons run the same test on a
    payload's bytes as they arrive (``recv_frame``); this is the server process's fallback for
    a payload no daemon checked (DESIGN §9).

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The update (numpy ``uint16``: raw bfloat16 words).

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
        flat = _as_numpy(value).reshape(-1)
        kind = LAYOUT_KINDS.get(_NUMPY_NAMES.get(flat.dtype.name, ""), 0)
        if kind and _native.check(flat, 0, flat.nbytes, 0, _SEGMENT.pack(0, flat.nbytes, kind))[1] >= 0:
            return name
    return None


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

    out = []
    for x in layouts:
        message = dataplane_pb2.TensorLayout(
            name=x.name, dtype=x.dtype, shape=list(x.shape), offset=x.offset, nbytes=x.nbytes
        )
        e = x.encoding
        if e is not None:
            message.encoding.CopyFrom(
                dataplane_pb2.TensorEncoding(
                    codec=e.codec,
                    words=e.words,
                    scales=e.scales,
                    block=e.block,
                    bound=e.bound,
                    members=e.members,
                    count=e.count,
                    ratio=e.ratio,
                )
            )
        out.append(message)
    return out


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
        Layout(m.name, m.dtype, tuple(int(d) for d in m.shape), int(m.offset), int(m.nbytes), _encoding(m))
        for m in messages
    ]


def _encoding(message: Any) -> Encoding | None:
    """The :class:`Encoding` of a ``TensorLayout`` message, None when it travels as it is."""
    if not message.HasField("encoding"):
        return None
    e = message.encoding
    return Encoding(
        e.codec, e.words, tuple(e.scales), int(e.block), float(e.bound), int(e.members), int(e.count), e.ratio
    )


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
