"""Chunks of an all-reduce payload: byte ranges cut on element boundaries (docs/allreduce.md).

An all-reduce's payload (tensors back to back, :mod:`mlfabric.tensors`) is pipelined along
its tree in chunks. A chunk is a byte range ``[lo, hi)`` that never splits an element; its
tensors are the pieces of the payload's tensors inside it, as flat 1-D layouts relative to
``lo`` (so a chunk is summed with :class:`~mlfabric.aggregators.kernels.Accumulator` like a
whole payload, and its frame header's layout adds up to its bytes). Pure.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from mlfabric.wire.tensors import DTYPES, Layout

__all__ = ["Chunk", "split_chunks", "split_segments"]


@dataclass(frozen=True)
class Chunk:
    """One chunk: payload bytes ``[lo, hi)`` and its tensor pieces (offsets relative to ``lo``)."""

    index: int
    lo: int
    hi: int
    layouts: tuple[Layout, ...]


def _cut(layouts: Sequence[Layout], target: int) -> int:
    """``target`` moved down to the element boundary of the tensor it falls in."""
    for t in layouts:
        if t.offset <= target < t.offset + t.nbytes:
            size = DTYPES[t.dtype].itemsize
            return t.offset + (target - t.offset) // size * size
    return target


def split_chunks(layouts: Sequence[Layout], payload_bytes: int, chunk_bytes: int) -> list[Chunk]:
    """Cut a payload into chunks of about ``chunk_bytes`` (at least one element each).

    Parameters
    ----------
    layouts : sequence of Layout
        The payload's tensors (back to back).
    payload_bytes : int
        The payload's size.
    chunk_bytes : int
        The target chunk size (>= 1).

    Returns
    -------
    list of Chunk
        Covering ``[0, payload_bytes)`` in order (one empty chunk for an empty payload).

    Examples
    --------
    >>> ls = [Layout("a", "float64", (3,), 0, 24), Layout("b", "float32", (2,), 24, 8)]
    >>> [(c.lo, c.hi, [(x.name, x.shape, x.offset) for x in c.layouts]) for c in split_chunks(ls, 32, 12)]
    [(0, 8, [('a[0:1]', (1,), 0)]), (8, 24, [('a[1:3]', (2,), 0)]), (24, 32, [('b[0:2]', (2,), 0)])]
    """
    ordered = sorted((t for t in layouts if t.nbytes), key=lambda t: t.offset)
    chunks = _chunks(ordered, _cuts(ordered, 0, payload_bytes, chunk_bytes), 0)
    return chunks or [Chunk(0, 0, 0, ())]


def _cuts(ordered: Sequence[Layout], lo: int, hi: int, chunk_bytes: int) -> list[int]:
    """Element-boundary cuts of ``[lo, hi)`` about ``chunk_bytes`` apart (``lo`` and ``hi`` included)."""
    cuts = [lo]
    target = lo + max(1, chunk_bytes)
    while target < hi:
        cut = _cut(ordered, target)
        if cut > cuts[-1]:
            cuts.append(cut)
        target = max(target + max(1, chunk_bytes), cut + 1)
    cuts.append(hi)
    return cuts


def split_segments(
    layouts: Sequence[Layout], payload_bytes: int, parts: int, chunk_bytes: int
) -> tuple[list[Chunk], list[int]]:
    """Cut a payload into ``parts`` segments (a ring's), and each segment into chunks.

    Segment ``k`` covers about ``[k B / parts, (k+1) B / parts)``, its ends moved down to
    element boundaries; a segment with no whole element (a payload of fewer elements than
    ``parts``) has no chunks.

    Parameters
    ----------
    layouts : sequence of Layout
        The payload's tensors (back to back).
    payload_bytes : int
        The payload's size.
    parts : int
        Segments (the ring's participants, >= 1).
    chunk_bytes : int
        The target chunk size within a segment (>= 1).

    Returns
    -------
    chunks : list of Chunk
        Covering ``[0, payload_bytes)`` in order, indexed from 0.
    segment_of : list of int
        Each chunk's segment.

    Examples
    --------
    >>> ls = [Layout("a", "float32", (5,), 0, 20)]
    >>> chunks, seg = split_segments(ls, 20, 3, 4)
    >>> [(c.lo, c.hi) for c in chunks], seg
    ([(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)], [0, 1, 1, 2, 2])
    >>> [(c.lo, c.hi) for c in split_segments(ls, 20, 8, 64)[0]]    # 5 elements, 8 segments
    [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
    """
    ordered = sorted((t for t in layouts if t.nbytes), key=lambda t: t.offset)
    bounds = [0]
    for k in range(1, parts):
        bounds.append(max(bounds[-1], _cut(ordered, k * payload_bytes // parts)))
    bounds.append(payload_bytes)
    chunks: list[Chunk] = []
    segment_of: list[int] = []
    for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if hi <= lo:
            continue
        more = _chunks(ordered, _cuts(ordered, lo, hi, chunk_bytes), len(chunks))
        chunks += more
        segment_of += [k] * len(more)
    return chunks, segment_of


def _chunks(ordered: Sequence[Layout], cuts: Sequence[int], first: int) -> list[Chunk]:
    """The chunks between consecutive ``cuts``, numbered from ``first``."""
    chunks = []
    for i, (lo, hi) in enumerate(itertools.pairwise(cuts), start=first):
        pieces = []
        for t in ordered:
            a, b = max(lo, t.offset), min(hi, t.offset + t.nbytes)
            if a >= b:
                continue
            size = DTYPES[t.dtype].itemsize
            first, last = (a - t.offset) // size, (b - t.offset) // size
            pieces.append(Layout(f"{t.name}[{first}:{last}]", t.dtype, (last - first,), a - lo, b - a))
        chunks.append(Chunk(i, lo, hi, tuple(pieces)))
    return chunks
