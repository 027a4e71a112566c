"""Codecs on the wire: a push's tensors as codec words in a payload, and back (docs/compression.md).

An update travels through the data plane as one flat payload (:mod:`mlfabric.wire.tensors`).
A tensor that travels **encoded** keeps its own dtype and shape in its ``TensorLayout`` (the
model spec names them) and adds a ``TensorEncoding``: the codec's name, the dtype of the
words its bytes hold, and what it needs to read them (int8: the scales, the block, the
shared bound). Its bytes are the codec's words, one per element, so every check of a layout
(the bytes cover ``prod(shape) x`` the words' itemsize) and the CRC + NaN/inf pass still
apply: fp16 words are tested as float16, bf16 words as bfloat16, int8 words are integers.
The scales travel in the header: a wrong count, a NaN, an infinity or a negative scale is
refused by the frame check before a payload byte is read (:func:`check_encoding`). A sparse
codec's bytes (``topk``, ``randk``) are its ``count`` kept values (float32, NaN-tested like
any float32 words) followed by their ``count`` flat positions (uint32, strictly increasing):
``count`` and ``ratio`` are in the header, so the bytes are checkable before they are read
(``count == ceil(ratio x prod(shape))``); the positions are checked where they are read.

Which codecs travel (:data:`WIRE_CODECS`): ``fp16``, ``bf16``, ``int8`` (own scales per
block, or a shared scale ``bound / 127``: ``int8:bound=B``), ``topk:ratio=R`` and
``randk:ratio=R`` (``rescale=0`` for the contractive form error feedback needs). Only
float16/float32/float64 tensors are encoded, and only when the words are smaller than the
tensor (bfloat16 tensors, float16 ones under fp16/bf16, and a sparse codec keeping 8 bytes
per value of as many bytes of tensor travel as they are).

Pure: plain data and buffers in, arrays out.

Examples
--------
>>> from mlfabric.tensors import encode_into, plan_layout
>>> codec = parse_codec("int8:bound=2,stochastic=0")
>>> words, encoded = encode_update({"w": np.array([0.5, -1.0, 4.0], np.float32)}, codec)
>>> words["w"].tolist(), encoded["w"][2].scales, encoded["w"][2].bound
([32, -64, 127], (0.015748031437397003,), 2.0)
>>> layouts, total = plan_layout(words, encoded)
>>> buf = bytearray(total); encode_into(memoryview(buf), words, layouts)
>>> [round(v, 3) for v in decode_layout(layouts[0], memoryview(buf)).tolist()]
[0.504, -1.008, 2.0]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mlfabric.aggregators.codecs.base import FLOAT_DTYPES, CodecError, Encoded
from mlfabric.aggregators.codecs.casts import Bf16Codec, Fp16Codec
from mlfabric.aggregators.codecs.feedback import ErrorFeedback
from mlfabric.aggregators.codecs.int8 import Int8Codec, check_scales
from mlfabric.aggregators.codecs.sparse import RandomKCodec, TopKCodec
from mlfabric.aggregators.kernels import bf16_to_f32
from mlfabric.wire.tensors import (
    DTYPES,
    SPARSE_CODECS,
    WORD_DTYPES,
    Encoding,
    Layout,
    _as_numpy,
    dtype_name,
    is_encoded,
)

__all__ = [
    "KNOWN_CODECS",
    "WIRE_CODECS",
    "WireCodec",
    "check_encoding",
    "check_words",
    "codec_for",
    "codec_spec",
    "decode_layout",
    "decode_to_raw",
    "encode_update",
    "encoded_of",
    "encoding_of",
    "parse_codec",
    "raw_layouts",
    "read_dense",
    "sparse_words",
    "wire_summary",
]

#: The codecs a push may travel with, by name.
WIRE_CODECS: dict[str, type[Any]] = {
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8": Int8Codec,
    "topk": TopKCodec,
    "randk": RandomKCodec,
}
#: What ``codec=`` / ``Params(compression=)`` accept (``none``: no codec).
KNOWN_CODECS = ("none", *sorted(WIRE_CODECS))
_KNOWN = ", ".join(KNOWN_CODECS)

WireCodec = Fp16Codec | Bf16Codec | Int8Codec | TopKCodec | RandomKCodec

#: the parameters a spec string may give each codec, and how each reads
_PARAMS: dict[type[Any], dict[str, Any]] = {
    Int8Codec: {"bound": float, "block": int, "stochastic": lambda v: _boolean(v)},
    TopKCodec: {"ratio": float},
    RandomKCodec: {"ratio": float, "rescale": lambda v: _boolean(v), "shared": lambda v: _boolean(v)},
}


def _boolean(value: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"expected 0/1/true/false, got {value!r}")


def parse_codec(spec: object) -> WireCodec | None:
    """The codec of a push or a job from its spec (None: no compression).

    Parameters
    ----------
    spec : str, codec or None
        ``None``, ``""`` or ``"none"``: none. ``"fp16"``, ``"bf16"``, ``"int8"`` (own scales,
        blocks of 256), ``"int8:bound=B"`` (one shared scale ``B / 127``: aggregators sum the
        words without decoding), with ``block=N`` and ``stochastic=0|1`` as further
        ``key=value`` pairs after the colon (comma-separated); ``"topk:ratio=R"`` (the
        ``ceil(R x n)`` largest magnitudes; R 0.01 by default), ``"randk:ratio=R"`` (as many
        positions drawn from the worker's ``rng``, values rescaled by ``n/k``;
        ``rescale=0``: not rescaled, for error feedback; ``shared=1``: drawn from the push's
        base version, the same for every worker pushing against it); or a codec object of
        those classes.

    Returns
    -------
    Fp16Codec, Bf16Codec, Int8Codec, TopKCodec, RandomKCodec or None

    Raises
    ------
    ValueError
        An unknown codec or a bad parameter: the message names the codec and the known ones.

    Examples
    --------
    >>> parse_codec("int8:bound=6")
    Int8Codec(block=0, bound=6.0, stochastic=True)
    >>> parse_codec("none") is None, parse_codec("fp16")
    (True, Fp16Codec())
    >>> parse_codec("gzip")
    Traceback (most recent call last):
    ...
    ValueError: unknown codec 'gzip' (known: none, bf16, fp16, int8, randk, topk)
    >>> parse_codec("int8:bound=-1")
    Traceback (most recent call last):
    ...
    ValueError: codec 'int8:bound=-1': bound must be finite and > 0, got -1.0 (known: ...)
    >>> parse_codec("topk:ratio=0.01"), parse_codec("randk:ratio=0.1,rescale=0")
    (TopKCodec(ratio=0.01), RandomKCodec(ratio=0.1, rescale=False, shared=False))
    """
    if spec is None:
        return None
    if isinstance(spec, tuple(WIRE_CODECS.values())):
        return spec  # type: ignore[return-value]
    if not isinstance(spec, str):
        raise ValueError(
            f"codec must be a name or a codec object, got {type(spec).__name__} (known: {_KNOWN})"
        )
    name, _, rest = spec.strip().partition(":")
    if name in ("", "none") and not rest:
        return None
    cls = WIRE_CODECS.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r} (known: {_KNOWN})")
    params: dict[str, Any] = {}
    accepted = _PARAMS.get(cls, {})
    try:
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in accepted:
                raise ValueError(f"unknown parameter {item!r} (accepted: {', '.join(accepted) or 'none'})")
            params[key.strip()] = accepted[key.strip()](value.strip())
        codec: WireCodec = cls(**params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"codec {spec!r}: {exc} (known: {_KNOWN})") from None
    return codec


def codec_spec(codec: WireCodec | None) -> str:
    """The spec string of a codec (:func:`parse_codec` reads it back); ``""`` for none.

    Examples
    --------
    >>> codec_spec(parse_codec("int8:bound=6,stochastic=0"))
    'int8:bound=6.0,stochastic=0'
    >>> codec_spec(Int8Codec()), codec_spec(None), codec_spec(RandomKCodec(0.5, rescale=False))
    ('int8:block=256', '', 'randk:ratio=0.5,rescale=0')
    >>> codec_spec(parse_codec("randk:ratio=0.1,rescale=0,shared=1"))
    'randk:ratio=0.1,rescale=0,shared=1'
    """
    if codec is None:
        return ""
    if isinstance(codec, TopKCodec | RandomKCodec):
        rescale = isinstance(codec, RandomKCodec) and not codec.rescale
        shared = isinstance(codec, RandomKCodec) and codec.shared
        return (
            f"{codec.name}:ratio={codec.ratio!r}"
            + (",rescale=0" if rescale else "")
            + (",shared=1" if shared else "")
        )
    if not isinstance(codec, Int8Codec):
        return str(codec.name)
    where = f"bound={codec.bound!r}" if codec.bound is not None else f"block={codec.block}"
    return f"int8:{where}" + ("" if codec.stochastic else ",stochastic=0")


def encoding_of(enc: Encoded, codec: WireCodec) -> Encoding:
    """The wire's :class:`~mlfabric.wire.tensors.Encoding` of an encoded tensor."""
    if isinstance(codec, TopKCodec | RandomKCodec):
        count = 0 if enc.indices is None else int(enc.indices.size)
        return Encoding(enc.codec, "float32", members=int(enc.members), count=count, ratio=float(codec.ratio))
    scales = () if enc.scales is None else tuple(float(s) for s in enc.scales)
    bound = float(codec.bound) if isinstance(codec, Int8Codec) and codec.bound is not None else 0.0
    return Encoding(enc.codec, enc.payload.dtype.name, scales, int(enc.block), bound, int(enc.members))


def encode_update(
    tensors: Mapping[str, object],
    codec: WireCodec,
    rng: np.random.Generator | None = None,
    feedback: ErrorFeedback | None = None,
) -> tuple[dict[str, object], dict[str, tuple[str, tuple[int, ...], Encoding]]]:
    """Encode a push's tensors with ``codec`` for :func:`~mlfabric.wire.tensors.plan_layout`.

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The update.
    codec : Fp16Codec, Bf16Codec, Int8Codec, TopKCodec or RandomKCodec
        The codec (a stochastic int8 and random-k need ``rng``).
    rng : numpy.random.Generator, optional
        For stochastic rounding and random-k's positions.
    feedback : ErrorFeedback, optional
        Error feedback (its codec is ``codec``): each tensor is sent with its residual added,
        and the new residuals are kept once every tensor was encoded.

    Returns
    -------
    words : dict
        name -> the codec's words (encoded tensors; a sparse codec's: its values' bytes then its
        positions', as one ``uint8`` array) or the tensor itself (travelling as it is).
    encoded : dict
        name -> (dtype, shape, Encoding) of each encoded tensor.

    Raises
    ------
    CodecError
        A value the codec cannot carry (int8: a NaN or an infinity; fp16: beyond its range;
        top-k: a NaN), naming the tensor and the element.

    Examples
    --------
    >>> words, encoded = encode_update({"w": np.array([0.5, -3.0, 0.0, 1.0], np.float32)}, TopKCodec(0.25))
    >>> words["w"].nbytes, encoded["w"][2].count, encoded["w"][2].ratio
    (8, 1, 0.25)
    >>> decode_layout(Layout("w", "float32", (4,), 0, 8, encoded["w"][2]), memoryview(words["w"])).tolist()
    [0.0, -3.0, 0.0, 0.0]
    """
    words: dict[str, object] = {}
    encoded: dict[str, tuple[str, tuple[int, ...], Encoding]] = {}
    residuals: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        dtype = dtype_name(value)
        array = _as_numpy(value) if dtype in FLOAT_DTYPES else None
        if array is None or not _gains(codec, array):
            words[name] = value  # nothing to gain: travels as it is
            continue
        try:
            if feedback is None:
                enc = codec.encode(array, rng=rng)
            else:
                enc, residuals[name] = feedback.step(name, array, rng=rng)
        except CodecError as exc:
            raise CodecError(exc.field, f"tensor {name!r} ({codec_spec(codec)}): {_message(exc)}") from None
        words[name] = enc.payload if enc.indices is None else sparse_words(enc)
        encoded[name] = (dtype, tuple(int(d) for d in array.shape), encoding_of(enc, codec))
    for name, residual in residuals.items():
        assert feedback is not None
        feedback.keep(name, residual)
    return words, encoded


def _gains(codec: WireCodec, array: np.ndarray) -> bool:
    """Whether ``codec``'s words are fewer bytes than ``array`` (float16/32/64)."""
    if isinstance(codec, TopKCodec | RandomKCodec):
        return 8 * codec.k_for(array.size) < array.nbytes
    return array.dtype != np.float16 or isinstance(codec, Int8Codec)


def sparse_words(enc: Encoded) -> np.ndarray:
    """A sparse tensor's bytes on the wire: its float32 values, then its uint32 positions.

    Examples
    --------
    >>> enc = TopKCodec(0.5).encode(np.array([0.0, 2.0, -1.0, 0.5], np.float32))
    >>> sparse_words(enc).view(np.uint32)[2:].tolist()
    [1, 2]
    """
    assert enc.indices is not None
    values = np.asarray(enc.payload, "<f4").view(np.uint8)
    return np.concatenate([values, np.asarray(enc.indices, "<u4").view(np.uint8)])


def _message(exc: CodecError) -> str:
    return str(exc).split(": ", 1)[-1]


def codec_for(encoding: Encoding) -> WireCodec:
    """The codec that checks, sums and finishes tensors of ``encoding`` (it is checked already).

    int8 with a bound: the shared-scale codec (summable); own scales: nearest rounding.

    Examples
    --------
    >>> codec_for(Encoding("int8", "int8", (0.1,), 0, 12.7)).summable
    True
    >>> codec_for(Encoding("int8", "int8", (0.1,), 256)).summable
    False
    >>> codec_for(Encoding("topk", "float32", count=6, ratio=0.01))
    TopKCodec(ratio=0.01)
    """
    if encoding.codec == "topk":
        return TopKCodec(ratio=encoding.ratio)
    if encoding.codec == "randk":  # the values are rescaled already: decoding needs no factor
        return RandomKCodec(ratio=encoding.ratio, rescale=False)
    if encoding.codec != "int8":
        codec: WireCodec = WIRE_CODECS[encoding.codec]()
        return codec
    if encoding.bound > 0:
        return Int8Codec(bound=encoding.bound, stochastic=False)
    return Int8Codec(block=encoding.block, stochastic=False)


def check_encoding(layout: Layout | Any) -> None:
    """The checks of an encoded tensor's layout that need no payload byte (the frame check's).

    Parameters
    ----------
    layout : Layout or TensorLayout
        A tensor whose layout has an encoding.

    Raises
    ------
    CodecError
        Naming the tensor and the field: an unknown codec; a dtype a codec does not encode;
        words of the wrong dtype for the codec; ``members < 1``; int8: scales of the wrong
        count, NaN, infinite or negative, a bound that is not finite and >= 0, or a shared
        scale that is not ``bound / 127``; fp16/bf16: scales, a block or a bound given;
        topk/randk: a ratio not in (0, 1], a ``count`` that is not ``k = ceil(ratio x n)``
        (a sum of ``m`` members, the union of their positions: not in ``[k, min(n, m x k)]``),
        scales, a block or a bound given.

    Examples
    --------
    >>> bad = Layout("w", "float32", (600,), 0, 600, Encoding("int8", "int8", (0.1, 0.2), 256))
    >>> try:
    ...     check_encoding(bad)
    ... except CodecError as exc:
    ...     print(exc)
    scales: tensor 'w' (int8): expected 3 (one per block of 256, 600 elements), got 2
    """
    e = layout.encoding
    if e is None:
        return
    name, codec = layout.name, str(e.codec)
    try:
        _check_encoding(layout, e, codec)
    except CodecError as exc:
        raise CodecError(exc.field, f"tensor {name!r} ({codec or 'no codec'}): {_message(exc)}") from None


def _check_encoding(layout: Any, e: Any, codec: str) -> None:
    cls = WIRE_CODECS.get(codec)
    if cls is None:
        raise CodecError("codec", f"unknown codec {codec!r} (known: {', '.join(sorted(WIRE_CODECS))})")
    if layout.dtype not in FLOAT_DTYPES:
        raise CodecError("dtype", f"a codec encodes {sorted(FLOAT_DTYPES)}, not {layout.dtype!r}")
    if e.words not in cls.payload_dtypes:
        raise CodecError("words", f"expected {' or '.join(cls.payload_dtypes)}, got {e.words!r}")
    if e.members < 1:
        raise CodecError("members", f"expected >= 1, got {e.members}")
    size = math.prod(int(d) for d in layout.shape)
    if codec in SPARSE_CODECS:
        _check_sparse_encoding(e, codec, size)
        return
    if codec != "int8":
        if len(e.scales) or e.block or e.bound:
            raise CodecError(
                "scales", f"{codec} has no scales, block or bound, got {len(e.scales)}/{e.block}/{e.bound}"
            )
        return
    scales = check_scales(np.array(e.scales, np.float32), int(e.block), size)
    if not (math.isfinite(e.bound) and e.bound >= 0):
        raise CodecError("bound", f"expected a finite bound >= 0 (0: own scales), got {e.bound}")
    if e.bound > 0:
        shared = Int8Codec(bound=float(e.bound)).shared_scale
        if e.block != 0 or scales[0] != shared:
            raise CodecError(
                "scales",
                f"expected the shared scale {shared} (bound {e.bound} / 127, block 0), "
                f"got {scales.tolist()[:4]} (block {e.block})",
            )


def _check_sparse_encoding(e: Any, codec: str, size: int) -> None:
    if len(e.scales) or e.block or e.bound:
        raise CodecError(
            "scales", f"{codec} has no scales, block or bound, got {len(e.scales)}/{e.block}/{e.bound}"
        )
    if not (0 < e.ratio <= 1):
        raise CodecError("ratio", f"expected a ratio in (0, 1], got {e.ratio}")
    k = TopKCodec(ratio=float(e.ratio)).k_for(size)
    if e.members == 1 and e.count != k:
        raise CodecError("count", f"expected {k} values (ratio {e.ratio} of {size} elements), got {e.count}")
    most = min(size, e.members * k)  # a sum of members: the union of their positions
    if not k <= e.count <= most:
        raise CodecError(
            "count",
            f"expected {k} to {most} values (the union of {e.members} members' positions, ratio {e.ratio} "
            f"of {size} elements), got {e.count}",
        )


def encoded_of(layout: Layout, payload: memoryview) -> Encoded:
    """The :class:`Encoded` an encoded tensor's layout and payload bytes describe (a view, checked).

    Raises
    ------
    CodecError
        :func:`check_encoding`'s, or the words do not fit the payload (field ``payload``).
    """
    check_encoding(layout)
    e = layout.encoding
    assert e is not None
    size = math.prod(layout.shape)
    sparse = e.codec in SPARSE_CODECS
    count = e.count if sparse else size
    words = WORD_DTYPES[e.words]
    expected = count * (words.itemsize + (4 if sparse else 0))
    if expected != layout.nbytes or layout.offset + layout.nbytes > len(payload):
        what = f"{count} float32 values and {count} uint32 positions" if sparse else f"{size} {e.words} words"
        raise CodecError(
            "payload",
            f"tensor {layout.name!r} ({e.codec}): {layout.nbytes} bytes at offset {layout.offset} of a "
            f"{len(payload)}-byte payload, expected {what}",
        )
    array = np.frombuffer(payload, words, count, layout.offset)
    if sparse:
        positions = np.frombuffer(payload, "<u4", count, layout.offset + 4 * count)
        return Encoded(e.codec, layout.dtype, layout.shape, array, None, positions, members=e.members)
    scales = np.array(e.scales, np.float32) if e.codec == "int8" else None
    return Encoded(e.codec, layout.dtype, layout.shape, array, scales, None, e.block, e.members)


def decode_layout(layout: Layout, payload: memoryview) -> np.ndarray:
    """An encoded tensor decoded (a new array of its dtype and shape).

    Raises
    ------
    CodecError
        Naming the tensor and what is wrong (:func:`encoded_of`, the codec's own checks: int8
        words beyond ``±127 x members``).
    """
    enc = encoded_of(layout, payload)
    assert layout.encoding is not None
    codec = codec_for(layout.encoding)
    try:
        return codec.decode(enc)
    except CodecError as exc:
        raise CodecError(exc.field, f"tensor {layout.name!r} ({enc.codec}): {_message(exc)}") from None


def read_dense(layout: Layout, payload: memoryview, dtype: np.dtype[Any]) -> np.ndarray:
    """A tensor of a payload as a flat array of ``dtype`` (float32 or float64), decoded if encoded.

    Examples
    --------
    >>> from mlfabric.tensors import encode_into, plan_layout
    >>> t = {"h": np.array([1.5, 2.0], np.float16)}
    >>> layouts, n = plan_layout(t)
    >>> b = bytearray(n); encode_into(memoryview(b), t, layouts)
    >>> read_dense(layouts[0], memoryview(b), np.dtype(np.float32)).tolist()
    [1.5, 2.0]
    """
    if layout.encoding is not None:
        return decode_layout(layout, payload).reshape(-1).astype(dtype, copy=False)
    count = math.prod(layout.shape)
    raw = np.frombuffer(payload, DTYPES[layout.dtype], count, layout.offset)
    if layout.dtype == "bfloat16":
        return bf16_to_f32(raw, np.empty(count, np.float32)).astype(dtype, copy=False)
    return raw.astype(dtype)


def raw_layouts(layouts: Sequence[Layout]) -> tuple[list[Layout], int]:
    """The layouts of the same tensors travelling as they are (no encoding), back to back.

    Examples
    --------
    >>> enc = Layout("w", "float32", (4,), 0, 8, Encoding("fp16", "float16"))
    >>> raw_layouts([enc])
    ([Layout(name='w', dtype='float32', shape=(4,), offset=0, nbytes=16, encoding=None)], 16)
    """
    out: list[Layout] = []
    offset = 0
    for x in sorted(layouts, key=lambda x: x.offset):
        nbytes = math.prod(x.shape) * DTYPES[x.dtype].itemsize
        out.append(Layout(x.name, x.dtype, tuple(x.shape), offset, nbytes))
        offset += nbytes
    return out, offset


def wire_summary(layouts: Sequence[Any]) -> tuple[str, int]:
    """The codec a payload travels with and its tensors' bytes uncompressed (for the stats).

    Parameters
    ----------
    layouts : sequence of Layout or TensorLayout
        The payload's tensors.

    Returns
    -------
    codec : str
        ``none`` (no tensor encoded), the codec's name, or ``mixed``.
    raw_bytes : int
        The bytes the tensors would take travelling as they are.

    Examples
    --------
    >>> enc = Layout("w", "float32", (4,), 0, 4, Encoding("int8", "int8", (0.1,)))
    >>> wire_summary([enc, Layout("b", "float64", (2,), 4, 16)])
    ('int8', 32)
    >>> wire_summary([])
    ('none', 0)
    """
    codecs = {str(x.encoding.codec) for x in layouts if is_encoded(x)}
    raw = sum(
        math.prod(int(d) for d in x.shape) * DTYPES[x.dtype].itemsize for x in layouts if x.dtype in DTYPES
    )
    codec = "none" if not codecs else codecs.pop() if len(codecs) == 1 else "mixed"
    return codec, raw


def check_words(codec: WireCodec, enc: Encoded) -> None:
    """The checks ``codec.decode``/``sum_into`` make of a member, without summing it.

    Raises
    ------
    CodecError
        As :meth:`decode` would.
    """
    codec._check(enc)


def decode_to_raw(layouts: Sequence[Layout], payload: memoryview, out: memoryview) -> list[Layout]:
    """Write a payload's tensors into ``out`` as they would travel unencoded (encoded ones decoded).

    For a receiver that sums raw payloads (:class:`~mlfabric.aggregators.kernels.Accumulator`)
    and gets a member whose tensors are encoded. ``out`` holds at least the raw size
    (:func:`raw_layouts`). Every encoded tensor is checked before anything is written.

    Returns
    -------
    list of Layout
        The raw layouts (:func:`raw_layouts`).

    Raises
    ------
    CodecError
        A tensor that does not decode (named).

    Examples
    --------
    >>> from mlfabric.tensors import encode_into, plan_layout
    >>> words, encoded = encode_update({"w": np.array([1.0, 2.0], np.float32)}, Fp16Codec())
    >>> layouts, n = plan_layout(words, encoded)
    >>> b = bytearray(n); encode_into(memoryview(b), words, layouts)
    >>> raw, size = raw_layouts(layouts); out = bytearray(size)
    >>> _ = decode_to_raw(layouts, memoryview(b), memoryview(out)); np.frombuffer(out, np.float32).tolist()
    [1.0, 2.0]
    """
    raw, _ = raw_layouts(layouts)
    decoded = {x.name: decode_layout(x, payload) for x in layouts if x.encoding is not None}
    by_name = {x.name: x for x in layouts}
    for r in raw:
        src = by_name[r.name]
        if r.name in decoded:
            out[r.offset : r.offset + r.nbytes] = decoded[r.name].reshape(-1).view(np.uint8).data
        else:
            out[r.offset : r.offset + r.nbytes] = payload[src.offset : src.offset + src.nbytes]
    return raw
