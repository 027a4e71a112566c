"""Summing kernels: worker updates into one aggregate, in place, as they arrive (paper §5).

An aggregator hop sums the payloads of the updates it aggregates (MLfabric §5, Fig. 6) so
that one update's worth of bytes, not one per worker, crosses the server's ingress. The
payloads are the flat tensor payloads of :mod:`mlfabric.tensors` (tensors back to back, no
padding); every member of an aggregate has the same layout (the server's model).

:class:`Accumulator` keeps a running sum:

- ``float32`` and ``float64`` runs are summed natively and **in place** in the output
  buffer (the first member is copied in, each later one added with
  ``np.add(acc, x, out=acc)``), so the aggregate is ready to forward without another copy;
- ``float16`` and ``bfloat16`` runs are accumulated in a ``float32`` accumulator (a summed
  half-precision value loses bits with every add) and narrowed into the output buffer once,
  by :meth:`Accumulator.finish`. bfloat16 travels as raw ``uint16`` words: a word shifted
  into the high half of a ``uint32`` is the float32 with the same value, and narrowing
  rounds to nearest-even.

There is no per-tensor Python loop on the hot path: adjacent tensors of one dtype form one
*run* and each run is one vectorised call over ``np.frombuffer`` views of the raw buffers
(memfd mappings, receive buffers); a model of one dtype is one call per member. Widening
runs go through a bounded scratch in chunks, so a member costs no allocation of its size.

Nothing here does I/O: the daemon passes the buffers in (DESIGN §9).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlfabric.wire.tensors import DTYPES, Layout

__all__ = ["WIDE_DTYPES", "Accumulator", "Run", "bf16_to_f32", "f16_to_f32", "f32_to_bf16", "plan_runs"]

#: dtypes accumulated in a float32 accumulator rather than in place.
WIDE_DTYPES = frozenset({"float16", "bfloat16"})

#: float32 bits shifted from a float16's magnitude are 2**-112 of its value.
_F16_RESCALE = np.float32(2.0**112)
#: Bits of float32 2**16: above every finite float16 (65504), reached by inf/NaN rescaled.
_F32_BITS_2_16 = 0x47800000

#: Elements per widening chunk (fits a core's L2 with the scratch).
_CHUNK = 1 << 16

Buffer = bytes | bytearray | memoryview | mmap.mmap | Any


@dataclass(frozen=True)
class Run:
    """Adjacent tensors of one dtype: one vectorised call per member.

    ``offset``/``nbytes`` are the run's bytes in the payload; ``count`` its elements;
    ``acc_offset`` where its float32 accumulator starts in the scratch (widening runs only,
    in elements).
    """

    dtype: str
    offset: int
    nbytes: int
    count: int
    acc_offset: int = 0


def plan_runs(layouts: Sequence[Layout]) -> list[Run]:
    """Group a payload's tensors into runs of adjacent tensors of one dtype.

    Parameters
    ----------
    layouts : sequence of Layout
        The payload's tensors (any order; sorted by offset here).

    Returns
    -------
    list of Run
        In payload order; widening runs (float16, bfloat16) get consecutive places in the
        float32 accumulator.

    Raises
    ------
    ValueError
        A dtype the kernels do not sum, or tensors that overlap.

    Examples
    --------
    >>> ls = [Layout("a", "float32", (2,), 0, 8), Layout("b", "float32", (1,), 8, 4),
    ...       Layout("c", "bfloat16", (3,), 12, 6)]
    >>> [(r.dtype, r.offset, r.nbytes, r.count, r.acc_offset) for r in plan_runs(ls)]
    [('float32', 0, 12, 3, 0), ('bfloat16', 12, 6, 3, 0)]
    """
    runs: list[Run] = []
    wide = 0
    end = 0
    for layout in sorted(layouts, key=lambda x: x.offset):
        if layout.dtype not in DTYPES:
            raise ValueError(
                f"tensor {layout.name!r}: cannot sum dtype {layout.dtype!r} (known: {sorted(DTYPES)})"
            )
        if layout.offset < end:
            raise ValueError(
                f"tensor {layout.name!r} at offset {layout.offset} overlaps the tensor before it"
            )
        if layout.nbytes == 0:
            continue
        size = DTYPES[layout.dtype].itemsize
        if layout.nbytes % size:
            raise ValueError(
                f"tensor {layout.name!r}: {layout.nbytes} bytes is not a whole number of {layout.dtype}"
            )
        last = runs[-1] if runs else None
        if last is not None and last.dtype == layout.dtype and last.offset + last.nbytes == layout.offset:
            runs[-1] = Run(
                last.dtype,
                last.offset,
                last.nbytes + layout.nbytes,
                last.count + layout.nbytes // size,
                last.acc_offset,
            )
        else:
            runs.append(Run(layout.dtype, layout.offset, layout.nbytes, layout.nbytes // size, wide))
        if layout.dtype in WIDE_DTYPES:
            wide += layout.nbytes // size
        end = layout.offset + layout.nbytes
    return runs


def bf16_to_f32(words: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 words to float32 (exact): each word becomes the high half of a uint32.

    Parameters
    ----------
    words : numpy.ndarray of uint16
        Raw bfloat16 words.
    out : numpy.ndarray of float32
        Same length; receives the values.

    Returns
    -------
    numpy.ndarray
        ``out``.

    Examples
    --------
    >>> w = np.array([0x3F80, 0xC000, 0x3EAB], np.uint16)     # 1.0, -2.0, ~0.334
    >>> bf16_to_f32(w, np.empty(3, np.float32)).tolist()
    [1.0, -2.0, 0.333984375]
    """
    np.left_shift(words, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def f16_to_f32(words: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """Widen raw float16 words to float32 (exact), faster than numpy's per-element cast.

    The magnitude bits shifted into place are a float32 2**112 too small (subnormal halves
    included), so one multiply rescales them; inf and NaN (the only results >= 2**16) get the
    float32 all-ones exponent, and the sign bit is or-ed back in. Six vectorised passes over
    the chunk, each in cache.

    Parameters
    ----------
    words : numpy.ndarray of uint16
        Raw float16 words (a float16 array's ``view(np.uint16)``).
    out : numpy.ndarray of float32
        Same length; receives the values.
    scratch : numpy.ndarray of uint32
        Same length; overwritten.

    Returns
    -------
    numpy.ndarray
        ``out``.

    Examples
    --------
    >>> h = np.array([1.5, -2.0, 6e-8, 65504, np.inf, -np.inf], np.float16)
    >>> f16_to_f32(h.view(np.uint16), np.empty(6, np.float32), np.empty(6, np.uint32)).tolist()
    [1.5, -2.0, 5.960464477539063e-08, 65504.0, inf, -inf]
    """
    bits = out.view(np.uint32)
    np.bitwise_and(words, 0x7FFF, out=bits, dtype=np.uint32)
    np.left_shift(bits, 13, out=bits)
    np.multiply(out, _F16_RESCALE, out=out)
    special = np.greater_equal(bits, _F32_BITS_2_16, out=scratch.view(np.bool_)[: bits.size])
    if special.any():  # inf/NaN: 2**16 * (1.m) becomes the all-ones exponent with the same m
        np.bitwise_or(bits, 0x7F800000, out=bits, where=special)
    np.bitwise_and(words, 0x8000, out=scratch, dtype=np.uint32)
    np.left_shift(scratch, 16, out=scratch)
    np.bitwise_or(bits, scratch, out=bits)
    return out


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Narrow float32 to raw bfloat16 words, rounding to nearest-even (NaN stays NaN).

    Parameters
    ----------
    values : numpy.ndarray of float32
        The values (not modified).
    out : numpy.ndarray of uint16
        Same length; receives the words.

    Returns
    -------
    numpy.ndarray
        ``out``.

    Examples
    --------
    >>> v = np.array([1.0, 1.00390625, 1.01171875, -3.5, np.nan], np.float32)
    >>> [hex(x) for x in f32_to_bf16(v, np.empty(5, np.uint16))]
    ['0x3f80', '0x3f80', '0x3f82', '0xc060', '0x7fc0']
    """
    bits = values.view(np.uint32)
    tmp = (bits >> 16) & 1
    tmp += 0x7FFF
    tmp += bits
    tmp >>= 16
    np.copyto(out, tmp, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0 | (out[nan] & 0x8000)
    return out


class Accumulator:
    """The running sum of an aggregate's member payloads (paper §5), written into ``out``.

    Parameters
    ----------
    layouts : sequence of Layout
        The members' tensor layout (all members share it: the server's model).
    out : writable buffer
        Receives the aggregate, laid out like a member (e.g. a pooled memfd mapping of at
        least the payload's size). float32/float64 runs are summed in it in place.
    scratch : numpy.ndarray of float32, optional
        The float32 accumulator of the float16/bfloat16 runs (at least
        :attr:`wide_elements` long); allocated when not given.

    Attributes
    ----------
    count : int
        Members summed so far.
    payload_bytes : int
        Size of one member (and of the aggregate).

    Examples
    --------
    >>> from mlfabric.tensors import plan_layout, encode_into, decode
    >>> def payload(x):
    ...     t = {"w": np.full(3, x, np.float32), "h": np.full(2, x, np.float16)}
    ...     layouts, n = plan_layout(t)
    ...     b = bytearray(n); encode_into(memoryview(b), t, layouts)
    ...     return layouts, b
    >>> layouts, first = payload(1.5)
    >>> out = bytearray(len(first))
    >>> acc = Accumulator(layouts, out)
    >>> acc.add(first); acc.add(payload(2.0)[1]); acc.add(payload(-0.5)[1])
    >>> acc.finish()
    >>> sum_ = decode(out, layouts); sum_["w"].tolist(), sum_["h"].tolist(), acc.count
    ([3.0, 3.0, 3.0], [3.0, 3.0], 3)
    >>> out = bytearray(len(first)); mean = Accumulator(layouts, out)
    >>> mean.add(first); mean.add(payload(2.5)[1]); mean.finish(mean=True)
    >>> decode(out, layouts)["h"].tolist()
    [2.0, 2.0]
    """

    def __init__(self, layouts: Sequence[Layout], out: Buffer, scratch: np.ndarray | None = None) -> None:
        self.runs = plan_runs(layouts)
        self.payload_bytes = max((x.offset + x.nbytes for x in layouts), default=0)
        self._out = memoryview(out).cast("B")
        if len(self._out) < self.payload_bytes:
            raise ValueError(
                f"output buffer holds {len(self._out)} bytes, the payload needs {self.payload_bytes}"
            )
        if self._out.readonly:
            raise ValueError("output buffer is read-only")
        self.wide_elements = sum(r.count for r in self.runs if r.dtype in WIDE_DTYPES)
        if scratch is None:
            scratch = np.empty(self.wide_elements, np.float32)
        elif scratch.dtype != np.float32 or scratch.size < self.wide_elements:
            raise ValueError(f"scratch must be float32 with >= {self.wide_elements} elements")
        self._acc = scratch
        chunk = min(_CHUNK, self.wide_elements)
        self._chunk = np.empty(chunk, np.float32) if chunk else None
        self._sign = np.empty(chunk, np.uint32) if chunk else None
        self._views = [np.frombuffer(self._out, DTYPES[r.dtype], r.count, r.offset) for r in self.runs]
        self.count = 0
        self.finished = False

    def add(self, payload: Buffer) -> None:
        """Sum one member's payload in (its bytes laid out like ``layouts``).

        Parameters
        ----------
        payload : buffer
            At least :attr:`payload_bytes` bytes (e.g. a receive buffer's mapping); only read.

        Raises
        ------
        ValueError
            ``payload`` is shorter than a member, or the aggregate was finished.
        """
        if self.finished:
            raise ValueError("the aggregate was already finished")
        src = memoryview(payload).cast("B")
        if len(src) < self.payload_bytes:
            raise ValueError(f"member payload holds {len(src)} bytes, expected {self.payload_bytes}")
        first = self.count == 0
        with np.errstate(all="ignore"):  # overflow to inf is the sum's value, as with np.add
            for run, dst in zip(self.runs, self._views, strict=True):
                x = np.frombuffer(src, DTYPES[run.dtype], run.count, run.offset)
                if run.dtype not in WIDE_DTYPES:
                    if first:
                        np.copyto(dst, x)
                    else:
                        np.add(dst, x, out=dst)
                else:
                    self._add_wide(run, x, first)
        self.count += 1

    def _add_wide(self, run: Run, x: np.ndarray, first: bool) -> None:
        acc = self._acc[run.acc_offset : run.acc_offset + run.count]
        assert self._chunk is not None and self._sign is not None
        words = x if run.dtype == "bfloat16" else x.view(np.uint16)
        for start in range(0, run.count, _CHUNK):  # widen a chunk (in cache), then add it
            stop = min(start + _CHUNK, run.count)
            target = acc[start:stop] if first else self._chunk[: stop - start]
            if run.dtype == "bfloat16":
                bf16_to_f32(words[start:stop], target)
            else:
                f16_to_f32(words[start:stop], target, self._sign[: stop - start])
            if not first:
                np.add(acc[start:stop], target, out=acc[start:stop])

    def finish(self, *, mean: bool = False) -> None:
        """Write the aggregate into ``out``: narrow the float32 accumulators (and divide for a mean).

        Called once, after the last member; no member may be added after it.

        Parameters
        ----------
        mean : bool
            Divide the sum by :attr:`count` (the members' mean) instead of leaving the sum.

        Raises
        ------
        ValueError
            No member was added, or the aggregate was already finished.
        """
        if self.count == 0:
            raise ValueError("no member was added to the aggregate")
        if self.finished:
            raise ValueError("the aggregate was already finished")
        self.finished = True
        with np.errstate(all="ignore"):
            for run, dst in zip(self.runs, self._views, strict=True):
                if run.dtype not in WIDE_DTYPES:
                    if mean:
                        np.divide(dst, self.count, out=dst)
                    continue
                acc = self._acc[run.acc_offset : run.acc_offset + run.count]
                if mean:
                    np.divide(acc, np.float32(self.count), out=acc)
                if run.dtype == "float16":
                    np.copyto(dst, acc, casting="same_kind")
                else:
                    f32_to_bf16(acc, dst)
