"""Codec rates (encode, decode, sum at an aggregator hop), compression and error (issue 26).

For each codec of :mod:`mlfabric.aggregators.codecs`, on one float32 tensor (default 64 MiB,
standard normal values, seeded), interleaved per round, one call per case:

- ``encode``: ``codec.encode(x, rng=...)``;
- ``decode``: ``codec.decode(encoded)``;
- ``sum``: ``codec.sum_into(acc, encoded)`` of a later member (the accumulator already holds
  the first: an add, not the first member's copy);
- ``finish``: ``codec.finish(acc)`` of the sum of ``--members`` members (different seeds):
  the sum encoded again to forward (top-k of the dense sum, int8 re-quantised, fp16/bf16
  narrowed, shared-scale int8 narrowed to int16).

against numpy baselines on the same tensor: float32 (``np.copy`` to "encode" and "decode",
``np.add(acc, x, out=acc)`` to sum), ``astype(float16)``/``astype(float32)`` and a float32
accumulator ``np.add(acc, h, out=acc)``, and bfloat16 by truncation (``(x.view(uint32) >> 16)
.astype(uint16)``, the shortest numpy spelling; the codec rounds to nearest-even).

The first round is a warm-up; rates are medians of the rounds, GB/s of **float32 input** (the
tensor's 4 bytes per element, whatever the codec sends; 1e9 bytes per second of wall clock,
one thread). Per codec also: the compression ratio (float32 bytes / encoded bytes), the
relative L2 error of a round trip, and, for ``--members`` members (different seeds), the
relative L2 error of the forwarded sum (``decode(finish(acc))``) and of the dense one
(``finish_dense(acc)``) against the exact float64 sum of the originals.

Run::

    python experiments/bench_codecs.py --out experiments/results/bench_codecs.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mlfabric.aggregators.codecs import (
    Bf16Codec,
    Codec,
    CodecSum,
    Encoded,
    ErrorFeedback,
    Fp16Codec,
    Int8Codec,
    RandomKCodec,
    TopKCodec,
    relative_l2,
)

OPS = ("encode", "decode", "sum", "finish")
#: the error-feedback measurement: steps of updates of this many elements (256 KiB of float32)
FEEDBACK_STEPS = 200
FEEDBACK_ELEMENTS = 1 << 16


def codecs(bound: float, ratio: float) -> dict[str, Codec]:
    """The codecs measured, by label."""
    return {
        "fp16": Fp16Codec(),
        "bf16": Bf16Codec(),
        "int8, block 256": Int8Codec(block=256),
        "int8, block 256, nearest": Int8Codec(block=256, stochastic=False),
        "int8, per tensor": Int8Codec(block=0),
        f"int8, shared bound {bound:g}": Int8Codec(bound=bound),
        f"top-k {ratio:g}": TopKCodec(ratio=ratio),
        f"random-k {ratio:g}": RandomKCodec(ratio=ratio),
        f"random-k {ratio:g}, not rescaled": RandomKCodec(ratio=ratio, rescale=False),
    }


def feedback_errors(codec: Codec, steps: int, n: int, seed: int = 7) -> tuple[float, float]:
    """Relative L2 of the sum of ``steps`` decoded updates (N(0, 1), ``n`` elements, a new
    seed per step) against the sum of the originals: without and with error feedback."""
    rng = np.random.default_rng(seed)
    total = np.zeros(n)
    plain = np.zeros(n)
    with_ef = np.zeros(n)
    ef = ErrorFeedback(codec) if not (isinstance(codec, RandomKCodec) and codec.rescale) else None
    for step in range(steps):
        g = np.random.default_rng(seed + 1 + step).standard_normal(n, dtype=np.float32)
        total += g
        plain += codec.decode(codec.encode(g, rng=rng))
        if ef is not None:
            with_ef += codec.decode(ef.encode("g", g, rng=rng))
    return relative_l2(plain, total), relative_l2(with_ef, total) if ef is not None else float("nan")


def _codec_cases(
    codec: Codec, x: np.ndarray, rng: np.random.Generator, members: list[Encoded], summed: CodecSum
) -> dict[str, Callable[[], object]]:
    acc = CodecSum()
    codec.sum_into(acc, members[0])
    later = members[1 % len(members)]
    return {
        "encode": lambda: codec.encode(x, rng=rng),
        "decode": lambda: codec.decode(members[0]),
        "sum": lambda: codec.sum_into(acc, later),
        "finish": lambda: codec.finish(summed, rng=rng),
    }


def _baseline_cases(x: np.ndarray) -> dict[str, dict[str, Callable[[], object]]]:
    acc = x.copy()
    acc16 = np.zeros_like(x)
    acc_bf = np.zeros_like(x)
    h = x.astype(np.float16)
    words = (x.view(np.uint32) >> 16).astype(np.uint16)

    def add() -> None:
        np.add(acc, x, out=acc)

    def add16() -> None:
        np.add(acc16, h, out=acc16)

    def add_bf() -> None:
        np.add(acc_bf, (words.astype(np.uint32) << 16).view(np.float32), out=acc_bf)

    return {
        "numpy float32 (copy, copy, np.add)": {"encode": x.copy, "decode": x.copy, "sum": add},
        "numpy astype float16 (np.add into float32)": {
            "encode": lambda: x.astype(np.float16),
            "decode": lambda: h.astype(np.float32),
            "sum": add16,
        },
        "numpy bfloat16 by truncation (shift, np.add)": {
            "encode": lambda: (x.view(np.uint32) >> 16).astype(np.uint16),
            "decode": lambda: (words.astype(np.uint32) << 16).view(np.float32),
            "sum": add_bf,
        },
    }


def _errors(
    label: str, codec: Codec, members: list[np.ndarray], exact: np.ndarray, seed: int
) -> tuple[dict[str, float | str | bool], list[Encoded], CodecSum]:
    rng = np.random.default_rng(seed)
    encoded = [codec.encode(m, rng=rng) for m in members]
    acc = CodecSum()
    for e in encoded:
        codec.sum_into(acc, e)
    forwarded = codec.finish(acc, rng=rng)
    row: dict[str, float | str | bool] = {
        "codec": label,
        "summable": codec.summable,
        "ratio": encoded[0].ratio,
        "error": relative_l2(codec.decode(encoded[0]), members[0]),
        "sum_error": relative_l2(codec.decode(forwarded), exact),
        "dense_error": relative_l2(codec.finish_dense(acc), exact),
        "clipped": sum(e.clipped for e in encoded),
        "forwarded_ratio": members[0].nbytes / forwarded.nbytes,
    }
    row["plain_steps"], row["ef_steps"] = feedback_errors(codec, FEEDBACK_STEPS, FEEDBACK_ELEMENTS)
    return row, encoded, acc


def run(
    nbytes: int, rounds: int, members: int, bound: float, ratio: float, only: set[str] | None = None
) -> tuple[list[dict[str, float | str | bool]], dict[tuple[str, str], float]]:
    """Errors per codec, then every case timed, interleaved per round; medians (seconds)."""
    n = nbytes // 4
    xs = [np.random.default_rng(s).standard_normal(n, dtype=np.float32) for s in range(members)]
    exact = np.sum([m.astype(np.float64) for m in xs], axis=0)
    chosen = {
        k: c for k, c in codecs(bound, ratio).items() if only is None or k.split(",")[0].split(" ")[0] in only
    }
    measured = {label: _errors(label, codec, xs, exact, seed=1) for label, codec in chosen.items()}
    rows = [row for row, _, _ in measured.values()]
    del exact
    x = xs[0]
    del xs[1:]
    rng = np.random.default_rng(2)
    cases: dict[tuple[str, str], Callable[[], object]] = {}
    for label, codec in chosen.items():
        _, encoded, summed = measured[label]
        cases.update({(label, op): fn for op, fn in _codec_cases(codec, x, rng, encoded, summed).items()})
    for label, ops in _baseline_cases(x).items():
        cases.update({(label, op): fn for op, fn in ops.items()})
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for r in range(rounds + 1):
        for key, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
            if r:
                samples[key].append(seconds)
    return rows, {key: statistics.median(s) for key, s in samples.items()}


def table(
    rows: list[dict[str, float | str | bool]],
    times: dict[tuple[str, str], float],
    nbytes: int,
    rounds: int,
    members: int,
) -> str:
    """The results as markdown tables."""

    def rate(label: str, op: str) -> str:
        t = times.get((label, op))
        return f"{nbytes / t / 1e9:.2f}" if t else "—"

    lines = [
        f"tensor {nbytes / 2**20:.0f} MiB float32 (standard normal), {rounds} interleaved rounds "
        "(+1 warm-up), one thread; GB/s of float32 input (median)",
        "",
        "| codec | summable | encode | decode | sum | finish | ratio | round-trip rel. L2 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        label = str(row["codec"])
        summable = "yes" if row["summable"] else "no"
        rates = " | ".join(rate(label, op) for op in OPS)
        lines.append(f"| {label} | {summable} | {rates} | {row['ratio']:.2f} | {row['error']:.2e} |")
    baselines = sorted({label for label, _ in times} - {str(r["codec"]) for r in rows})
    for label in baselines:
        rates = " | ".join(rate(label, op) for op in OPS)
        lines.append(f"| {label} | — | {rates} | — | — |")
    lines += [
        "",
        f"Sum of {members} members (seeds 0..{members - 1}) against the exact float64 sum: relative L2 "
        "of the forwarded sum (`decode(finish(acc))`, the bytes the next hop gets) and of the dense "
        "float32 sum (`finish_dense(acc)`); values clipped at encode (shared bound) over all members.",
        "",
        "| codec | forwarded sum rel. L2 | dense sum rel. L2 | forwarded ratio | clipped |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['codec']} | {row['sum_error']:.2e} | {row['dense_error']:.2e} "
            f"| {row['forwarded_ratio']:.2f} | {row['clipped']} |"
        )
    lines += [
        "",
        f"Error feedback: {FEEDBACK_STEPS} steps of updates of {FEEDBACK_ELEMENTS} elements (N(0, 1), a new "
        "seed per step); relative L2 of the sum of the decoded updates against the sum of the originals "
        "(the residual still held at the sender is the difference; — : a rescaled random-k is refused).",
        "",
        "| codec | without feedback | with feedback |",
        "| --- | ---: | ---: |",
    ]
    for row in rows:
        ef = float(row["ef_steps"])
        lines.append(f"| {row['codec']} | {row['plain_steps']:.2e} | {'—' if ef != ef else f'{ef:.2e}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="tensor size in MiB (float32)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--members", type=int, default=4, help="members of the measured sum errors")
    parser.add_argument("--bound", type=float, default=6.0, help="shared int8 bound (values are N(0, 1))")
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k / random-k fraction kept")
    parser.add_argument("--only", help="comma-separated codec names (fp16,bf16,int8,top-k,random-k)")
    parser.add_argument("--out", type=Path, help="also write the tables (markdown) here")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    only = {o.strip() for o in args.only.split(",")} if args.only else None
    t0 = time.perf_counter()
    rows, times = run(nbytes, args.rounds, args.members, args.bound, args.ratio, only)
    text = table(rows, times, nbytes, args.rounds, args.members)
    print(text, end="")
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.out is not None:
        header = "# Codecs: encode, decode and sum rates, compression and error\n\n"
        cmd = (
            f"`python experiments/bench_codecs.py --mib {args.mib} --rounds {args.rounds} "
            f"--members {args.members} --bound {args.bound:g} --ratio {args.ratio:g}`\n\n"
        )
        args.out.write_text(header + cmd + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
