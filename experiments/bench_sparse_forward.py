"""Bytes an aggregator hop forwards for top-k members, and the time it takes to sum them (issue 26).

An aggregate of top-k (or random-k) members is summed into float32 and forwarded on the union
of the members' positions (``aggregators/codecs/payloadsum.py``; dense when that is no fewer
bytes). This measures, for ``m`` members of one float32 tensor (default 1 179 648 elements,
the 4.5 MB of the testbed's digits MLP) encoded with ``topk:ratio=R``, over seeds:

- the bytes forwarded (``plan_layout`` of :meth:`EncodedSum.finish`) against the dense sum's
  (``4 n``) and against the ``m`` members forwarded unsummed (``m x 8 k``);
- the wall time of the hop's work: ``EncodedSum.add`` of every member (checks, scatter, the
  union) and ``finish`` (the union's values), one thread, medians over ``--rounds``;

for two kinds of members: independent standard normal updates (their top-k positions barely
overlap: the union is near ``m x k``, the worst case) and correlated ones (a shared standard
normal part plus half as much of each member's own: real workers' gradients of one model
overlap like this, or more).

Run::

    python experiments/bench_sparse_forward.py --out experiments/results/bench_sparse_forward.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from mlfabric.aggregators.codecs import TopKCodec
from mlfabric.aggregators.codecs.payload import encode_update, parse_codec
from mlfabric.aggregators.codecs.payloadsum import EncodedSum
from mlfabric.tensors import Layout, encode_into, plan_layout


def members(n: int, m: int, spec: str, seed: int, shared: float) -> list[tuple[list[Layout], bytearray]]:
    """``m`` members of one float32 tensor of ``n`` elements encoded with ``spec``."""
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(n).astype(np.float32)
    codec = parse_codec(spec)
    assert codec is not None
    out = []
    for _ in range(m):
        own = rng.standard_normal(n).astype(np.float32)
        update = {"w": shared * common + (0.5 if shared else 1.0) * own}
        words, encoded = encode_update(update, codec, rng)
        layouts, total = plan_layout(words, encoded)
        buf = bytearray(total)
        encode_into(memoryview(buf), words, layouts)
        out.append((layouts, buf))
    return out


def forward(parts: list[tuple[list[Layout], bytearray]]) -> tuple[int, float]:
    """The bytes the hop forwards and the seconds its sum took."""
    start = time.perf_counter()
    total = EncodedSum(parts[0][0])
    for layouts, buf in parts:
        total.add(layouts, buf)
    words, encoded, _ = total.finish()
    seconds = time.perf_counter() - start
    return plan_layout(words, encoded)[1], seconds


def spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--elements", type=int, default=1_179_648)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--members", default="2,4,8,16")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    spec = f"topk:ratio={args.ratio}"
    n = args.elements
    k = TopKCodec(ratio=args.ratio).k_for(n)
    lines = [
        f"`python experiments/bench_sparse_forward.py --elements {n} --ratio {args.ratio} "
        f"--members {args.members} --seeds {args.seeds} --rounds {args.rounds}`",
        "",
        f"One float32 tensor of {n} elements ({4 * n} bytes dense), `{spec}` (k = {k}: {8 * k} bytes per "
        "member). Medians [min-max] over the seeds; the sum's time is the median of the rounds per seed.",
        "",
        "| members | updates | forwarded / dense | forwarded / members unsummed | sum + finish (ms) |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for m in (int(x) for x in args.members.split(",")):
        for kind, shared in (("independent", 0.0), ("correlated", 1.0)):
            dense, unsummed, millis = [], [], []
            for seed in (int(s) for s in args.seeds.split(",")):
                parts = members(n, m, spec, seed, shared)
                runs = [forward(parts) for _ in range(args.rounds)]
                size = runs[0][0]
                dense.append(size / (4 * n))
                unsummed.append(size / sum(len(b) for _, b in parts))
                millis.append(1e3 * statistics.median(s for _, s in runs))
            lines.append(
                f"| {m} | {kind} | {spread(dense, '{:.3f}')} | {spread(unsummed, '{:.3f}')} | "
                f"{spread(millis, '{:.1f}')} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
