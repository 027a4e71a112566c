"""Summing rate of the aggregation kernels against ``numpy.add`` on the same buffers (paper §5).

For each dtype, one member payload (default 64 MiB) sits in a memfd mapping from the daemon's
``MemfdPool`` (as a received member does), and the aggregate in another (as the aggregator's
pooled output buffer does). Per round, interleaved, each case adds the member once:

- ``kernel``: :meth:`mlfabric.aggregators.kernels.Accumulator.add` (a later member, i.e. an
  add, not the first member's copy);
- ``numpy``: the bare numpy reference on the same buffers: ``np.add(acc, x, out=acc)`` with
  ``acc`` the aggregate's view (float32/float64) or a float32 accumulator (float16);
  for bfloat16, numpy's shortest spelling of the widening add,
  ``np.add(acc, (x.astype(uint32) << 16).view(float32), out=acc)``.

The first round is a warm-up. The table gives medians of the rounds, GB/s of member input
(1e9 bytes per second of wall clock; one thread), and kernel/numpy (target >= 0.9x, and
>= 2 GB/s for float32).

Run::

    python experiments/bench_aggregators.py --out experiments/results/bench_aggregators.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mlfabric.aggregators.kernels import Accumulator
from mlfabric.tensors import DTYPES, Layout
from mlfabric.wire.memfd import MemfdPool

DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")


def _cases(dtype: str, nbytes: int, pool: MemfdPool) -> dict[str, Callable[[], None]]:
    size = DTYPES[dtype].itemsize
    count = nbytes // size
    layouts = [Layout("w", dtype, (count,), 0, count * size)]
    member = pool.allocate(count * size)
    out = pool.allocate(count * size)
    rng = np.random.default_rng(0)
    values = rng.standard_normal(count).astype(np.float32)
    x = np.frombuffer(member, DTYPES[dtype], count)
    if dtype == "bfloat16":
        x[:] = values.view(np.uint32) >> 16
    else:
        x[:] = values
    acc = Accumulator(layouts, out)
    acc.add(member)  # the first member: from now on each add is a later member's
    if dtype in ("float32", "float64"):
        ref = np.frombuffer(out, DTYPES[dtype], count)

        def numpy_add() -> None:
            np.add(ref, x, out=ref)

    else:
        acc32 = np.zeros(count, np.float32)
        if dtype == "float16":

            def numpy_add() -> None:
                np.add(acc32, x, out=acc32)

        else:

            def numpy_add() -> None:
                np.add(acc32, (x.astype(np.uint32) << 16).view(np.float32), out=acc32)

    return {"kernel": lambda: acc.add(member), "numpy": numpy_add}


def run(nbytes: int, rounds: int, dtypes: tuple[str, ...]) -> list[dict[str, float | str]]:
    """Time every case of every dtype, interleaved per round; medians per case."""
    pool = MemfdPool(max_idle_bytes=0, name="bench-aggregators")
    cases = {(d, name): fn for d in dtypes for name, fn in _cases(d, nbytes, pool).items()}
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for r in range(rounds + 1):
        for key, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
            if r:
                samples[key].append(seconds)
    rows: list[dict[str, float | str]] = []
    for d in dtypes:
        kernel = statistics.median(samples[(d, "kernel")])
        ref = statistics.median(samples[(d, "numpy")])
        bytes_in = nbytes // DTYPES[d].itemsize * DTYPES[d].itemsize
        rows.append(
            {
                "dtype": d,
                "kernel_gbs": bytes_in / kernel / 1e9,
                "numpy_gbs": bytes_in / ref / 1e9,
                "ratio": ref / kernel,
                "kernel_min_gbs": bytes_in / min(samples[(d, "kernel")]) / 1e9,
                "numpy_min_gbs": bytes_in / min(samples[(d, "numpy")]) / 1e9,
            }
        )
    return rows


def table(rows: list[dict[str, float | str]], nbytes: int, rounds: int) -> str:
    """The results as a markdown table."""
    lines = [
        f"member payload {nbytes / 2**20:.0f} MiB, {rounds} interleaved rounds (+1 warm-up), one thread; "
        "GB/s of member input (median; best round in brackets)",
        "",
        "| dtype | kernel GB/s | numpy.add GB/s | kernel/numpy |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['kernel_gbs']:.2f} ({r['kernel_min_gbs']:.2f}) "
            f"| {r['numpy_gbs']:.2f} ({r['numpy_min_gbs']:.2f}) | {r['ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="member payload size in MiB")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dtypes", default=",".join(DTYPE_NAMES))
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    text = table(run(nbytes, args.rounds, dtypes), nbytes, args.rounds)
    print(text, end="")
    if args.out is not None:
        header = "# Aggregation kernels: summing rate vs numpy.add\n\n"
        cmd = f"`python experiments/bench_aggregators.py --mib {args.mib} --rounds {args.rounds}`\n\n"
        args.out.write_text(header + cmd + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
