"""The data plane's frame header check: kinds, sizes and tensor layouts (DESIGN §7, §9).

Every daemon checks each frame's header here before it reads a payload byte (the receiver:
:func:`~mlfabric.daemon.channels.frames.recv_frame`; a sender checks its own, without size
limits), and the roles check the headers handed to them (the worker intake, the server's
serving). Every rule a header can break raises :class:`FrameError` naming the problem;
:mod:`.frames` moves the bytes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from mlfabric.aggregators.codecs import CodecError
from mlfabric.aggregators.codecs.payload import check_encoding
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire.tensors import SPARSE_CODECS, words_dtype

__all__ = ["DTYPE_ITEMSIZE", "FrameError", "FrameLimits", "check_header"]

FrameHeader = dataplane_pb2.FrameHeader

#: Bytes per element of the dtypes a tensor layout may name (DESIGN §7).
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint16": 2}
DTYPE_ITEMSIZE.update({"uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8})

_KINDS = frozenset(k for k in dataplane_pb2.FrameKind.values() if k)
_MODEL_KIND = dataplane_pb2.FRAME_KIND_MODEL
_UPDATE_KIND = dataplane_pb2.FRAME_KIND_UPDATE


@dataclass(frozen=True)
class FrameLimits:
    """What a receiver accepts.

    Parameters
    ----------
    max_header_bytes : int
        Largest serialized :class:`FrameHeader` (the 4-byte length field is checked against it
        before any header byte is read).
    max_payload_bytes : int
        Largest ``payload_bytes`` (checked before the payload buffer is allocated).

    Examples
    --------
    >>> FrameLimits(max_header_bytes=4096, max_payload_bytes=1 << 20).max_payload_bytes
    1048576
    """

    max_header_bytes: int = 1 << 20
    max_payload_bytes: int = 4 << 30


class FrameError(Exception):
    """A frame broke a rule of the data plane; the message names the problem.

    Parameters
    ----------
    reason : str
        What was wrong (``"bad magic b'GET '"``, ``"CRC-32 mismatch ..."``, ...).
    reply_possible : bool
        True when the peer speaks the protocol and the stream is still in step, so an ERROR
        frame can be sent back before closing; False (bad magic, peer gone) otherwise.

    Examples
    --------
    >>> str(FrameError("payload of 10 bytes exceeds the limit of 4"))
    'payload of 10 bytes exceeds the limit of 4'
    """

    def __init__(self, reason: str, *, reply_possible: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.reply_possible = reply_possible


def check_header(header: Any, limits: FrameLimits, payload_bytes: int | None = None) -> None:
    """Check a header's kind, payload size and tensor layout; raise :class:`FrameError` if broken.

    The layout rules: every tensor has a known dtype, non-negative dims and
    ``nbytes == prod(shape) * itemsize``; tensors lie inside the payload, do not overlap, and
    together cover exactly ``payload_bytes`` (a non-empty payload must be described). A tensor
    travelling encoded (an UPDATE's, or a MODEL's of a job with ``model_compression``) counts
    its words' itemsize, and its encoding passes
    :func:`~mlfabric.aggregators.codecs.payload.check_encoding` (a known codec, scales of the
    right count, finite, >= 0, the shared scale its bound gives) and sums at most the frame's
    ``num_updates``; a sparse one (top-k, random-k: an UPDATE's only) holds its ``count``
    values and positions (8 bytes each).

    Parameters
    ----------
    header : FrameHeader
        The header to check.
    limits : FrameLimits
        The receiver's limits.
    payload_bytes : int, optional
        The payload's size, when it is not (yet) the header's ``payload_bytes`` (a sender's).

    Examples
    --------
    >>> h = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, payload_bytes=8)
    >>> _ = h.tensors.add(name="w", dtype="float32", shape=[2], offset=0, nbytes=8)
    >>> check_header(h, FrameLimits())
    >>> h.payload_bytes = 12
    >>> try:
    ...     check_header(h, FrameLimits())
    ... except FrameError as exc:
    ...     print(exc)
    tensor layout covers 8 bytes but payload_bytes is 12
    """
    if header.kind not in _KINDS:
        raise FrameError(f"unknown frame kind {header.kind}")
    size = header.payload_bytes if payload_bytes is None else payload_bytes
    if size > limits.max_payload_bytes:
        raise FrameError(f"payload of {size} bytes exceeds the limit of {limits.max_payload_bytes}")
    if header.kind == _MODEL_KIND and header.model_bytes:
        # a piece of a model (docs/model-relays.md): the layout, on the first piece only,
        # describes the whole model; the piece lies inside it
        if header.range_offset + size > header.model_bytes:
            raise FrameError(
                f"piece [{header.range_offset}, {header.range_offset + size}) out of range of a "
                f"{header.model_bytes}-byte model"
            )
        if not header.tensors:
            return
        size = header.model_bytes
    spans: list[tuple[int, int, str]] = []
    for t in header.tensors:
        count = 1
        for dim in t.shape:
            if dim < 0:
                raise FrameError(f"tensor {t.name!r}: negative dimension in shape {list(t.shape)}")
            count *= dim
        if t.HasField("encoding"):  # compressed: its bytes are the codec's words (docs/compression.md)
            if header.kind not in (_UPDATE_KIND, _MODEL_KIND):
                raise FrameError(f"tensor {t.name!r}: only an UPDATE's or a MODEL's tensors travel encoded")
            if t.encoding.codec in SPARSE_CODECS and header.kind != _UPDATE_KIND:
                raise FrameError(f"tensor {t.name!r}: only an UPDATE's tensors travel {t.encoding.codec}")
            try:
                check_encoding(t)
            except CodecError as exc:
                raise FrameError(f"bad encoding: {exc}") from None
            if t.encoding.members > max(1, header.num_updates):
                raise FrameError(
                    f"tensor {t.name!r}: its words sum {t.encoding.members} updates, the frame carries "
                    f"{max(1, header.num_updates)}"
                )
        words = words_dtype(t)
        itemsize = DTYPE_ITEMSIZE.get(words)
        if itemsize is None:
            raise FrameError(f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
        if t.HasField("encoding") and t.encoding.codec in SPARSE_CODECS:
            if t.encoding.count * (itemsize + 4) != t.nbytes:
                raise FrameError(
                    f"tensor {t.name!r}: nbytes {t.nbytes} != {t.encoding.count} values x ({itemsize} + 4 "
                    f"bytes of position) ({t.encoding.codec}, shape {list(t.shape)})"
                )
        elif count * itemsize != t.nbytes:
            raise FrameError(
                f"tensor {t.name!r}: nbytes {t.nbytes} != {count} elements x {itemsize} bytes "
                f"({words}, shape {list(t.shape)})"
            )
        if t.offset + t.nbytes > size:
            raise FrameError(
                f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.nbytes}) out of range "
                f"of a {size}-byte payload"
            )
        spans.append((t.offset, t.nbytes, t.name))
    spans.sort()
    for (off_a, len_a, name_a), (off_b, _len_b, name_b) in itertools.pairwise(spans):
        if off_a + len_a > off_b:
            raise FrameError(f"tensors {name_a!r} and {name_b!r} overlap")
    covered = sum(n for _, n, _ in spans)
    if covered != size:
        raise FrameError(f"tensor layout covers {covered} bytes but payload_bytes is {size}")
