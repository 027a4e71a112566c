"""How an aggregator hop sums its members and finishes the sum it forwards (docs/compression.md).

Members travelling as they are go into an :class:`~mlfabric.aggregators.kernels.Accumulator`,
in place in a pooled buffer (DESIGN §9). When the first member came with encoded tensors
(``push(..., codec=...)``), the aggregate is an
:class:`~mlfabric.aggregators.codecs.payloadsum.EncodedSum`: members of one summable codec are
summed on their words and the sum forwarded in that codec; top-k (or random-k) members are
scattered into a float32 sum forwarded on the union of their positions (dense when that is no
fewer bytes); mixed or non-summable members are decoded, summed densely and forwarded as they
are. An encoded member of an aggregate whose
first member was raw is decoded and summed as the raw ones are.

``agg`` is the role's :class:`~.state.Aggregate` (its lock held by the caller): ``acc``, ``buffer``,
``tensors`` (the ``TensorLayout`` messages the forward's header carries), ``payload_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlfabric.aggregators.codecs import CodecError
from mlfabric.aggregators.codecs.payload import decode_to_raw, raw_layouts
from mlfabric.aggregators.codecs.payloadsum import EncodedSum
from mlfabric.aggregators.kernels import Accumulator
from mlfabric.wire.tensors import encode_into, layouts_from_pb, layouts_to_pb, plan_layout

__all__ = ["add_member", "finish"]


def add_member(agg: Any, h: Any, frame: Any, alloc: Callable[[int], Any]) -> str:
    """Sum a member into ``agg`` (its lock held); why it cannot be ("": summed, nothing changed else).

    Members travelling as they are go into an :class:`Accumulator` in place; when the first
    member came encoded, into an :class:`EncodedSum` (summable codecs on their words). An
    encoded member of a raw aggregate is decoded first (docs/compression.md).
    """
    layouts = layouts_from_pb(h.tensors)
    encoded = any(x.encoding is not None for x in layouts)
    members = max(1, h.num_updates)
    created = agg.acc is None
    try:
        if agg.acc is None:
            if encoded:
                agg.acc = EncodedSum(layouts)
                agg.tensors, agg.payload_bytes = list(h.tensors), h.payload_bytes
            else:
                buffer = alloc(h.payload_bytes)
                agg.acc = Accumulator(layouts, buffer)
                agg.buffer, agg.tensors, agg.payload_bytes = buffer, list(h.tensors), h.payload_bytes
        if isinstance(agg.acc, EncodedSum):
            agg.acc.add(layouts, frame.payload, members)
            agg.payload_bytes = (
                agg.acc.payload_bytes
            )  # announced as it would be forwarded (sparse: the union)
            return ""
        if not encoded and list(h.tensors) == agg.tensors:
            agg.acc.add(frame.payload)
            return ""
        raw, size = raw_layouts(layouts)
        if not encoded or raw != layouts_from_pb(agg.tensors):
            return f"its tensor layout differs from the other members of aggregate {h.aggregate_id}"
        decoded = bytearray(size)  # decoded, then summed as the raw members are
        decode_to_raw(layouts, frame.payload, memoryview(decoded))
        agg.acc.add(decoded)
    except (CodecError, ValueError) as exc:
        if created:  # the first member was refused: the next one starts the sum
            buffer, agg.acc, agg.buffer, agg.tensors, agg.payload_bytes = agg.buffer, None, None, [], 0
            if buffer is not None and hasattr(buffer, "release"):
                buffer.release()
        return str(exc)
    return ""


def finish(agg: Any, alloc: Callable[[int], Any]) -> str:
    """Finish the sum into the buffer the forward sends (its lock held); why not ("": done).

    An :class:`EncodedSum` is laid out afresh: summable codecs re-encoded, the rest dense
    (:mod:`mlfabric.aggregators.codecs.payloadsum`), in a pooled buffer of its size.
    """
    if isinstance(agg.acc, Accumulator):
        if not agg.acc.finished:
            agg.acc.finish()
        return ""
    if not isinstance(agg.acc, EncodedSum) or agg.acc.finished:
        return ""
    words, encoded, _ = agg.acc.finish()
    layouts, total = plan_layout(words, encoded)
    try:
        buffer = alloc(total)
    except (MemoryError, OSError) as exc:
        return f"cannot allocate {total} bytes for the sum: {exc!r}"
    encode_into(memoryview(buffer), words, layouts)
    agg.buffer, agg.tensors, agg.payload_bytes = buffer, layouts_to_pb(layouts), total
    return ""
