"""The sum of members whose tensors travel encoded, at an aggregator hop (docs/compression.md).

:class:`~mlfabric.aggregators.kernels.Accumulator` sums payloads of tensors travelling as they
are. When a member's tensors are encoded (:mod:`mlfabric.aggregators.codecs.payload`), an
aggregator sums them with :class:`EncodedSum`, tensor by tensor:

- **a summable codec, every member alike** (fp16, bf16; int8 with the same shared bound): the
  words are summed without decoding (fp16/bf16 widened into a float32 accumulator, int8 words
  added into an int32 accumulator with the shared scale: exact) and the sum is **forwarded in
  the same codec**: the next hop (the server, or a parent aggregate of a tree) gets the same
  compression and can sum it again; fp16/bf16 are narrowed once, int8 words are narrowed to the
  narrowest of int8/int16/int32 that holds the sum (no second rounding). An fp16 sum beyond
  float16's range is forwarded as it is instead (the tensor's own dtype).
- **members of one sparse codec** (top-k; random-k): each member's values are scattered at its
  positions into a float32 sum (exact: a member's positions are unique) and the sum is
  **forwarded on the union of the members' positions** (the same codec's layout, ``members``
  the updates it sums, ``count`` the union's size, ``ratio`` the members' largest): nothing is
  dropped (a second top-k of the sum would drop the mass outside its positions: 0.985 against
  0.957 for 4 members at 1 %) and the bytes grow with the members only until the union is no
  fewer bytes than the dense sum, which is then forwarded as it is.
- **members of different codecs, a non-summable codec (int8 with own scales), or raw
  members**: each member is decoded (a sparse one scattered at its positions) and summed
  densely (float32; float64 for a float64 tensor) and the sum is **forwarded as it is**, in
  the tensor's own dtype: a second quantisation would add its error to the sum
  (``docs/compression.md``: 1.39e-2 against 9.84e-3 for int8 with own scales), and one raw
  sum is at most one update's bytes.

Every tensor of a member is checked (the codec's checks: words, scales, range) before any is
summed: a member refused leaves the sum as it was.

Examples
--------
>>> from mlfabric.aggregators.codecs.payload import encode_update, parse_codec
>>> from mlfabric.tensors import encode_into, plan_layout
>>> def member(x, spec):
...     words, enc = encode_update({"w": np.full(3, x, np.float32)}, parse_codec(spec))
...     layouts, n = plan_layout(words, enc)
...     buf = bytearray(n); encode_into(memoryview(buf), words, layouts)
...     return layouts, memoryview(buf)
>>> total = EncodedSum(member(0.0, "int8:bound=1,stochastic=0")[0])
>>> total.add(*member(0.5, "int8:bound=1,stochastic=0")); total.add(*member(1.0, "int8:bound=1,stochastic=0"))
>>> words, encoded, forms = total.finish()
>>> words["w"].tolist(), encoded["w"][2].members, forms
([191, 191, 191], 2, {'w': 'int8'})
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlfabric.aggregators.codecs.base import CodecError, CodecSum, Encoded
from mlfabric.aggregators.codecs.payload import (
    WireCodec,
    check_words,
    codec_for,
    encoded_of,
    encoding_of,
    read_dense,
    sparse_words,
)
from mlfabric.aggregators.kernels import f32_to_bf16
from mlfabric.wire.tensors import DTYPES, Encoding, Layout

__all__ = ["EncodedSum"]

_NO_WORDS = np.empty(0, np.int8)


@dataclass
class _TensorSum:
    """One tensor's running sum: on a summable codec's words (``acc``), on a sparse codec's
    positions (``acc``, ``union``), or dense (``dense``)."""

    dtype: str
    shape: tuple[int, ...]
    first_bytes: int  # the first member's bytes of this tensor
    key: tuple[Any, ...] = ()  # the summable encoding every member so far shares
    codec: WireCodec | None = None
    acc: CodecSum | None = None
    dense: np.ndarray | None = None
    union: np.ndarray | None = None  # sparse members: where any member had a value (bool)
    ratio: float = 0.0  # sparse members: the largest ratio among them

    @property
    def dense_dtype(self) -> np.dtype[Any]:
        return np.dtype(np.float64 if self.dtype == "float64" else np.float32)

    @property
    def raw_bytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def union_count(self) -> int | None:
        """Positions of the union when it is forwarded sparse (fewer bytes than dense), else None."""
        if self.union is None:
            return None
        count = int(np.count_nonzero(self.union))
        return count if 8 * count < self.raw_bytes else None

    def forward_bytes(self) -> int:
        """The bytes this tensor would be forwarded in now (a summable codec's: the first member's)."""
        count = self.union_count()
        if count is not None:
            return 8 * count
        return self.raw_bytes if self.union is not None or self.dense is not None else self.first_bytes

    def dense_or_other(self, enc: Encoded) -> bool:
        """Whether the sum went dense, or sums another codec than the sparse member ``enc``'s."""
        return self.dense is not None or (self.acc is not None and self.key != ("sparse", enc.codec))

    def to_dense(self) -> None:
        """Leave the codec's words: the sum so far as a dense array."""
        if self.acc is not None and self.codec is not None:
            self.dense = self.codec.finish_dense(self.acc).reshape(-1).astype(self.dense_dtype)
        self.acc, self.codec, self.key, self.union = None, None, (), None


def _key(encoding: Encoding | None, codec: WireCodec | None) -> tuple[Any, ...]:
    """What members must share to be summed on their words (empty: not summable)."""
    if encoding is None or codec is None or not codec.summable:
        return ()
    return (encoding.codec, encoding.bound)


class EncodedSum:
    """The running sum of an aggregate's members, some of whose tensors are encoded.

    Parameters
    ----------
    layouts : sequence of Layout
        The first member's layouts: the tensors (names, dtypes, shapes) every member carries.

    Attributes
    ----------
    count : int
        Worker updates summed so far (a member that is itself a sum counts its members).
    """

    @property
    def payload_bytes(self) -> int:
        """What the aggregate is announced with: the bytes it would be forwarded in now (a
        summable codec's tensors: the first member's; sparse ones: the union of the positions
        so far, or dense when that is no fewer bytes; tensors summed densely: their own)."""
        return sum(t.forward_bytes() for t in self._tensors.values())

    def __init__(self, layouts: Sequence[Layout]) -> None:
        ordered = sorted(layouts, key=lambda x: x.offset)
        self._tensors = {x.name: _TensorSum(x.dtype, tuple(x.shape), x.nbytes) for x in ordered}
        self.count = 0
        self.finished = False

    def add(self, layouts: Sequence[Layout], payload: Any, members: int = 1) -> None:
        """Sum one member in (its tensors laid out by ``layouts`` in ``payload``; only read).

        Raises
        ------
        ValueError
            The member's tensors differ (names, dtypes, shapes) from the first member's, or
            the sum was finished; :class:`~mlfabric.aggregators.codecs.CodecError` (a
            ValueError) naming the tensor when one does not decode. Nothing is summed then.
        """
        if self.finished:
            raise ValueError("the aggregate was already finished")
        got = {x.name: (x.dtype, tuple(x.shape)) for x in layouts}
        want = {name: (t.dtype, t.shape) for name, t in self._tensors.items()}
        if got != want or len(layouts) != len(got):
            raise ValueError(
                f"its tensors {sorted(got.items())} differ from the aggregate's {sorted(want.items())}"
            )
        view = memoryview(payload).cast("B")
        checked: list[tuple[Layout, Encoded | None, WireCodec | None]] = []
        for x in layouts:  # every tensor checked before any is summed
            if x.encoding is None:
                if x.offset + x.nbytes > len(view):
                    raise ValueError(f"tensor {x.name!r}: beyond the {len(view)}-byte payload")
                checked.append((x, None, None))
                continue
            member, codec = encoded_of(x, view), codec_for(x.encoding)
            try:
                check_words(codec, member)
            except CodecError as exc:
                why = str(exc).split(": ", 1)[-1]
                raise CodecError(exc.field, f"tensor {x.name!r} ({member.codec}): {why}") from None
            checked.append((x, member, codec))
        for x, enc, wire_codec in checked:
            self._add(self._tensors[x.name], x, view, enc, wire_codec)
        self.count += members

    def _add(
        self, t: _TensorSum, x: Layout, view: memoryview, enc: Encoded | None, codec: WireCodec | None
    ) -> None:
        if enc is not None and enc.indices is not None and codec is not None and not t.dense_or_other(enc):
            if t.acc is None:  # the first: the sum kept with the union of the positions
                t.acc, t.codec, t.key, t.union = (
                    CodecSum(),
                    codec,
                    ("sparse", enc.codec),
                    np.zeros(enc.size, bool),
                )
            codec.sum_into(t.acc, enc)
            assert t.union is not None and t.acc.first is not None
            t.union[enc.indices] = True
            t.ratio = max(t.ratio, float(getattr(codec, "ratio", 0.0)))
            t.acc.first = dataclasses.replace(t.acc.first, payload=_NO_WORDS, indices=None)  # no views kept
            return
        key = _key(x.encoding, codec)
        if (
            key
            and enc is not None
            and codec is not None
            and (t.key == key or (t.acc is None and t.dense is None))
        ):
            if t.acc is None:
                t.acc, t.codec, t.key = CodecSum(), codec, key
            t.codec.sum_into(t.acc, enc)  # type: ignore[union-attr]
            assert t.acc.first is not None
            if t.acc.first.payload.size:  # keep no view of the member's buffer
                t.acc.first = dataclasses.replace(t.acc.first, payload=_NO_WORDS)
            return
        t.to_dense()  # different codecs, a non-summable one, or raw: decode and sum densely
        values = read_dense(x, view, t.dense_dtype)
        if t.dense is None:
            t.dense = values if values.base is None and values.flags.writeable else values.copy()
        else:
            np.add(t.dense, values, out=t.dense)

    @property
    def codec(self) -> str:
        """The codec the sum would be forwarded in now: a codec's name, ``mixed``, or "" (none).

        As :func:`~mlfabric.aggregators.codecs.payload.wire_summary` names a payload (tensors
        forwarded as they are do not count). An fp16 sum beyond float16's range is still
        forwarded as it is by :meth:`finish`.
        """
        codecs = {
            t.codec.name
            for t in self._tensors.values()
            if t.acc is not None and t.codec is not None and (t.union is None or t.union_count() is not None)
        }
        return "" if not codecs else codecs.pop() if len(codecs) == 1 else "mixed"

    def finish(
        self,
    ) -> tuple[dict[str, object], dict[str, tuple[str, tuple[int, ...], Encoding]], dict[str, str]]:
        """The sum to forward, for :func:`~mlfabric.wire.tensors.plan_layout`; called once.

        Returns
        -------
        words : dict
            name -> the codec's words (a summable codec's sum, re-encoded) or the tensor (dense).
        encoded : dict
            name -> (dtype, shape, Encoding) of the tensors forwarded encoded.
        forms : dict
            name -> the codec each tensor is forwarded in, or ``"raw"``.
        """
        if self.finished:
            raise ValueError("the aggregate was already finished")
        self.finished = True
        words: dict[str, object] = {}
        encoded: dict[str, tuple[str, tuple[int, ...], Encoding]] = {}
        forms: dict[str, str] = {}
        for name, t in self._tensors.items():
            count = t.union_count()
            if count is not None and t.acc is not None and t.acc.values is not None and t.codec is not None:
                kept = np.flatnonzero(t.union).astype(np.uint32)  # type: ignore[arg-type]
                values = t.acc.values[kept]
                enc = Encoded(t.codec.name, t.dtype, t.shape, values, None, kept, members=t.acc.members)
                words[name], forms[name] = sparse_words(enc), enc.codec
                wire = codec_for(Encoding(enc.codec, "float32", ratio=t.ratio))  # the members' largest
                encoded[name] = (t.dtype, t.shape, encoding_of(enc, wire))
                continue
            if t.union is not None:  # the union is no fewer bytes than the dense sum
                t.to_dense()
            if t.acc is not None and t.codec is not None:
                try:
                    enc = t.codec.finish(t.acc)
                except CodecError:  # an fp16 sum beyond float16's range: forwarded as it is
                    t.to_dense()
                else:
                    words[name], forms[name] = enc.payload, enc.codec
                    encoded[name] = (t.dtype, t.shape, encoding_of(enc, t.codec))
                    continue
            words[name], forms[name] = _raw(t), "raw"
        return words, encoded, forms


def _raw(t: _TensorSum) -> np.ndarray:
    """A dense sum in the tensor's own dtype (bfloat16: raw words, rounded to nearest-even)."""
    dense = t.dense if t.dense is not None else np.zeros(math.prod(t.shape), t.dense_dtype)
    if t.dtype == "bfloat16":
        return f32_to_bf16(dense, np.empty(dense.size, np.uint16)).reshape(t.shape)
    with np.errstate(over="ignore"):  # a float16 sum beyond its range is inf, as the kernels give
        return dense.astype(t.dtype).reshape(t.shape)
