"""A server's model on the wire, compressed (``Params(model_compression=)``; docs/compression.md).

With ``model_compression`` a server publishes its float32/float64 tensors as fp16 or bf16
words (each tensor's ``TensorLayout`` keeps its own dtype and shape and adds the
``TensorEncoding``, as an update's do): every ``get`` of a worker, every relay and every piece
of the model moves half the bytes, and the worker's ``get`` decodes them back to the tensor's
own dtype (:func:`mlfabric.wire.tensors.decode`). Only the casts carry a model: they round each
element once (fp16: ``2**-11 |x|``, bf16: ``2**-8 |x|``) with no state to keep, where int8's
error would need the error feedback a model has no sender to keep. The server's own model stays
exact; only the copy on the wire is rounded, afresh from the exact model at each publish (the
rounding does not accumulate).

Pure: tensors in, words and encodings out.

Examples
--------
>>> import numpy as np
>>> from mlfabric.wire.tensors import decode, encode_into, plan_layout
>>> model = {"w": np.array([1.0, 1 / 3], np.float32), "h": np.array([0.1], np.float16)}
>>> words, encoded = encode_model(model, parse_model_codec("fp16"))
>>> layouts, total = plan_layout(words, encoded)
>>> total, [x.encoding.codec if x.encoding else None for x in layouts]
(6, ['fp16', None])
>>> buf = bytearray(total); encode_into(memoryview(buf), words, layouts)
>>> got = decode(buf, layouts)
>>> got["w"].dtype, got["w"].tolist(), got["h"].dtype
(dtype('float32'), [1.0, 0.333251953125], dtype('float16'))
"""

from __future__ import annotations

from collections.abc import Mapping

from mlfabric.aggregators.codecs.base import CodecError
from mlfabric.aggregators.codecs.casts import Bf16Codec, Fp16Codec
from mlfabric.aggregators.codecs.payload import encode_update, parse_codec
from mlfabric.wire.tensors import Encoding

__all__ = ["MODEL_CODECS", "encode_model", "parse_model_codec"]

#: What ``Params(model_compression=)`` accepts (``none``: the model travels as it is).
MODEL_CODECS = ("none", "bf16", "fp16")
_KNOWN = ", ".join(MODEL_CODECS)

ModelCodec = Fp16Codec | Bf16Codec


def parse_model_codec(spec: object) -> ModelCodec | None:
    """The codec a job's model travels with, from its spec (None: as it is).

    Parameters
    ----------
    spec : str, codec or None
        ``None``, ``""``, ``"none"``, ``"fp16"``, ``"bf16"``, or an ``Fp16Codec``/``Bf16Codec``.

    Returns
    -------
    Fp16Codec, Bf16Codec or None

    Raises
    ------
    ValueError
        An unknown codec, or one that does not carry a model (int8, topk, randk), naming it and the known
        ones.

    Examples
    --------
    >>> parse_model_codec("bf16"), parse_model_codec(None)
    (Bf16Codec(), None)
    >>> parse_model_codec("zstd")
    Traceback (most recent call last):
    ...
    ValueError: unknown codec 'zstd' (known for a model: none, bf16, fp16)
    >>> parse_model_codec("int8:bound=4")
    Traceback (most recent call last):
    ...
    ValueError: codec 'int8:bound=4' does not carry a model (known for a model: none, bf16, fp16)
    """
    try:
        codec = parse_codec(spec)
    except ValueError as exc:
        message = str(exc).rsplit(" (known: ", 1)[0]
        raise ValueError(f"{message} (known for a model: {_KNOWN})") from None
    if codec is None or isinstance(codec, Fp16Codec | Bf16Codec):
        return codec
    raise ValueError(f"codec {spec!r} does not carry a model (known for a model: {_KNOWN})")


def encode_model(
    tensors: Mapping[str, object], codec: ModelCodec
) -> tuple[dict[str, object], dict[str, tuple[str, tuple[int, ...], Encoding]]]:
    """A model's tensors as ``codec``'s words, for :func:`~mlfabric.wire.tensors.plan_layout`.

    float32/float64 tensors are encoded; float16 and bfloat16 ones travel as they are. A
    tensor fp16 cannot carry (a finite value beyond 65504) travels as it is too: a model is
    always published, exactly where it cannot be rounded.

    Parameters
    ----------
    tensors : Mapping[str, numpy.ndarray or torch.Tensor]
        The model (not changed).
    codec : Fp16Codec or Bf16Codec
        The model's codec (:func:`parse_model_codec`).

    Returns
    -------
    words : dict
        name -> the codec's words, or the tensor itself.
    encoded : dict
        name -> (dtype, shape, Encoding) of each encoded tensor.

    Examples
    --------
    >>> import numpy as np
    >>> words, encoded = encode_model({"big": np.array([1e6], np.float32)}, Fp16Codec())
    >>> words["big"].dtype, encoded
    (dtype('float32'), {})
    """
    words: dict[str, object] = {}
    encoded: dict[str, tuple[str, tuple[int, ...], Encoding]] = {}
    for name, value in tensors.items():
        try:
            one, how = encode_update({name: value}, codec)
        except CodecError:  # beyond fp16's range: exact, as it is
            words[name] = value
            continue
        words[name] = one[name]
        encoded.update(how)
    return words, encoded
