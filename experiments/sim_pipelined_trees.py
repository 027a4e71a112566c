"""Pipelined (cut-through) aggregation trees against store-and-forward trees and fair, simulated.

Runs ``mlfabric simulate`` (the service's decision runner; this process, its CLI) on three
synchronous instances, each with compute jitter 0 and 0.1:

* the racks testbed (``experiments/testbed_racks.py``): 2 racks x 4 workers, 100 Mbit/s NICs,
  4:1 uplinks (100 Mbit/s), the server on the core at 100 Mbit/s, 4.5 MB updates
  (``experiments/instances/racks_2x4_100m.toml``);
* the same at 1 Gbit/s (``racks_2x4_1g.toml``);
* issue 23's instance: 2 racks x 6, 10 Gbit/s NICs, 1 Gbit/s uplinks, the server on the core
  at 10 Gbit/s, 20 MB updates (``racks_2x6_10g.toml``).

50 ms compute per iteration, 5 iterations (3 on issue 23's instance, as the issue ran it),
seeds 0 1 2 where the compute is jittered. Each policy row is one ``mlfabric simulate`` run
(``fair,stf+tree``, then ``stf+tree --pipelined-aggregates``); the table gives the mean round
(model out to the last update in: compute included, the model's way back not simulated) and
the transfer part (the mean round less the mean compute, 50 ms), median over the seeds::

    python experiments/sim_pipelined_trees.py [--out experiments/results/sim_pipelined_trees.md]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
INSTANCES = [
    # label, topology, workers, update MB, iterations
    ("racks testbed, 100 Mbit/s", "racks_2x4_100m.toml", 8, 4.5, 5),
    ("racks testbed, 1 Gbit/s", "racks_2x4_1g.toml", 8, 4.5, 5),
    ("issue 23: 2 x 6, 10G NICs, 1G uplinks", "racks_2x6_10g.toml", 12, 20.0, 3),
]
COMPUTE_MS = 50.0


def argv(topology: str, workers: int, mb: float, iterations: int, jitter: float, seed: int) -> list[str]:
    """The ``mlfabric simulate`` arguments of one instance (policies and the flag added by the caller)."""
    return [
        *("--topology", str(HERE / "instances" / topology), "--server", "ps", "--workers", str(workers)),
        *("--mode", "sync", "--update-mb", f"{mb:g}", "--compute-ms", f"{COMPUTE_MS:g}"),
        *("--iterations", str(iterations), "--jitter", f"{jitter:g}", "--seed", str(seed), "--quiet"),
    ]


def simulate(args: list[str]) -> list[dict[str, Any]]:
    """Run ``mlfabric simulate args`` in this process; its JSON rows."""
    from mlfabric.scheduler.sim import cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cli.run(parser.parse_args([*args, "--json", str(out)]))
        if rc:
            raise RuntimeError(f"mlfabric simulate {' '.join(args)} failed ({rc})")
        rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def measure() -> list[dict[str, Any]]:
    """One row per instance, jitter and policy: median over the seeds of the mean round."""
    rows = []
    for label, topo, workers, mb, iters in INSTANCES:
        for jitter in (0.0, 0.1):
            per: dict[str, list[float]] = {}
            lost = 0
            for seed in (0,) if jitter == 0 else (0, 1, 2):
                base = argv(topo, workers, mb, iters, jitter, seed)
                got = simulate([*base, "--policy", "fair,stf+tree"])
                got += simulate([*base, "--policy", "stf+tree", "--pipelined-aggregates"])
                for r in got:
                    per.setdefault(r["policy"], []).append(r["makespan_mean"])
                    lost += r["pushed"] - r["applied"]
            for policy, rounds in per.items():
                rows.append(
                    {
                        "instance": label,
                        "jitter": jitter,
                        "policy": policy,
                        "round": statistics.median(rounds),
                        "seeds": len(rounds),
                        "lost": lost,
                    }
                )
            print(f"# {label}, jitter {jitter:g}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: round, transfer part, ratios to fair and to store-and-forward."""
    out = [
        "| instance | jitter | policy | round (ms) | transfer (ms) | / fair | / stf+tree |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    key = {(r["instance"], r["jitter"], r["policy"]): r["round"] for r in rows}
    for r in rows:
        fair = key[(r["instance"], r["jitter"], "fair")]
        saf = key[(r["instance"], r["jitter"], "stf+tree")]
        transfer = (r["round"] - COMPUTE_MS / 1e3) * 1e3
        out.append(
            f"| {r['instance']} | {r['jitter']:g} | {r['policy']} | {r['round'] * 1e3:.0f} | "
            f"{transfer:.0f} | {r['round'] / fair:.2f}x | {r['round'] / saf:.2f}x |"
        )
    return "\n".join(out)


def main() -> int:
    """Measure, print the table, optionally write it with its command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the results (markdown)")
    args = parser.parse_args()
    rows = measure()
    assert all(r["lost"] == 0 for r in rows), "an update was not applied"
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.write_text(
            "# Pipelined aggregation trees in the simulator (`--pipelined-aggregates`)\n\n"
            "`python experiments/sim_pipelined_trees.py --out experiments/results/sim_pipelined_trees.md`"
            " (see its docstring; one row per policy, the median over seeds 0 1 2 with jitter 0.1, seed 0"
            " with jitter 0; round = mean synchronous round, model out to the last update in, 50 ms compute"
            " included; transfer = round - 50 ms). Every update of every run was applied.\n\n" + text + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
