"""Codecs: fewer bytes on the bottleneck, in forms an aggregator hop can still sum (issue 26).

A codec turns one tensor into an :class:`Encoded` (plain frozen data: payload words, scales,
indices, the original dtype and shape) and back. Aggregators sum encoded members with
``sum_into`` into a :class:`CodecSum` and forward ``finish(...)``; ``summable`` says whether
that sum works on the encoded words (fp16, bf16, int8 with a shared scale) or decodes each
member first (int8 with own scales, top-k, random-k: decode, sum densely, re-encode).

=============================  =======  =========  ======================================
codec                          bytes    summable   error
=============================  =======  =========  ======================================
:class:`Fp16Codec`             1/2      yes (f32)  relative 2**-11 (range checked)
:class:`Bf16Codec`             1/2      yes (f32)  relative 2**-8
:class:`Int8Codec` (own)       ~1/4     no         < scale per element, unbiased
:class:`Int8Codec` (bound)     1/4      yes (i32)  < scale, clipped beyond the bound
:class:`TopKCodec`             2*ratio  no         the dropped tail
:class:`RandomKCodec`          2*ratio  no         unbiased (rescaled), variance n/k - 1
=============================  =======  =========  ======================================

:class:`ErrorFeedback` keeps what a codec lost at the sender and adds it to the next update.
Every check of a payload raises :class:`CodecError` naming the field. Pure: no I/O, no state
but the accumulators and residuals the caller holds. On the wire (all of them): the
encoded tensor layout and its checks in :mod:`.payload`, the aggregator's sum of encoded
members in :mod:`.payloadsum` (``docs/compression.md``).

Examples
--------
>>> codec = make_codec("int8", block=0, stochastic=False)
>>> enc = codec.encode(np.array([0.5, -1.0, 0.25], np.float32))
>>> [round(v, 3) for v in decode(enc).tolist()], enc.codec, round(enc.ratio, 2)
([0.504, -1.0, 0.252], 'int8', 1.71)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlfabric.aggregators.codecs.base import (
    FLOAT_DTYPES,
    Codec,
    CodecError,
    CodecSum,
    Encoded,
    relative_l2,
)
from mlfabric.aggregators.codecs.casts import Bf16Codec, Fp16Codec
from mlfabric.aggregators.codecs.feedback import ErrorFeedback, compensate
from mlfabric.aggregators.codecs.int8 import Int8Codec
from mlfabric.aggregators.codecs.sparse import RandomKCodec, TopKCodec, top_k_indices

__all__ = [
    "CODECS",
    "FLOAT_DTYPES",
    "Bf16Codec",
    "Codec",
    "CodecError",
    "CodecSum",
    "Encoded",
    "ErrorFeedback",
    "Fp16Codec",
    "Int8Codec",
    "RandomKCodec",
    "TopKCodec",
    "compensate",
    "decode",
    "make_codec",
    "relative_l2",
    "top_k_indices",
]

#: codec name (:attr:`Encoded.codec`) -> class
CODECS: dict[str, type[Any]] = {
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8": Int8Codec,
    "topk": TopKCodec,
    "randk": RandomKCodec,
}


def make_codec(name: str, **params: Any) -> Codec:
    """A codec by name, with its parameters (``block``, ``bound``, ``ratio``, ...).

    Raises
    ------
    ValueError
        An unknown name or a bad parameter.

    Examples
    --------
    >>> make_codec("topk", ratio=0.05)
    TopKCodec(ratio=0.05)
    >>> make_codec("gzip")
    Traceback (most recent call last):
    ...
    ValueError: unknown codec 'gzip' (known: bf16, fp16, int8, randk, topk)
    """
    cls = CODECS.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(sorted(CODECS))})")
    codec: Codec = cls(**params)
    return codec


def decode(encoded: Encoded) -> np.ndarray:
    """Decode any :class:`Encoded` by its codec name (decoding needs no codec parameters).

    Raises
    ------
    CodecError
        An unknown codec name (field ``codec``), or what the codec's ``decode`` raises.

    Examples
    --------
    >>> decode(Fp16Codec().encode(np.array([1.5], np.float32))).tolist()
    [1.5]
    """
    if not isinstance(encoded, Encoded):
        raise CodecError("encoded", f"expected an Encoded, got {type(encoded).__name__}")
    cls = CODECS.get(encoded.codec)
    if cls is None:
        raise CodecError("codec", f"expected one of {sorted(CODECS)}, got {encoded.codec!r}")
    result: np.ndarray = cls().decode(encoded)
    return result
