"""Compression on the namespace testbed: time to target per codec, seeds side by side (issue 26).

The setting of ``testbed_e2e.py`` (the paper's: 8 workers with uplinks of 200-25 Mbit/s, the
server's link ``--server-mbps`` changing every ``--period`` s, one straggler; the digits MLP
with 4.5 MB float32 updates; asynchronous SGD until a target test accuracy) once per system
and seed, the systems of one seed taking turns on one testbed under the same seeded schedule.
A system is ``POLICY``, ``POLICY@CODEC`` or ``POLICY@CODEC@MODEL_CODEC``: the workers push
with that codec (``push(codec=...)``; ``+ef`` adds error feedback at the sender) and the
server publishes its model with the model codec (``Params(model_compression=...)``). The codec
``auto`` registers the job with ``Params(compression="auto")``: the scheduler chooses each
worker host's codec from its path's bandwidth (docs/compression.md). E.g.

    python experiments/testbed_codecs.py                       # stf, stf@fp16, stf@int8+ef; seeds 0-2
    python experiments/testbed_codecs.py --systems stf,stf@int8+ef@fp16 --seeds 3,4,5
    python experiments/testbed_codecs.py --systems stf,stf@fp16,stf@int8+ef,stf@auto+ef,stf+agg@auto
    python experiments/testbed_codecs.py --systems stf,stf@auto --uniform-mbps 1000   # uniform fast links
    python experiments/testbed_codecs.py --systems stf+agg,stf+agg@topk:ratio=0.01+ef@fp16
    python experiments/testbed_codecs.py --systems stf,stf@randk:ratio=0.01,rescale=0+ef  # "," inside a codec

Per system: the median time to target [min-max over seeds], the accuracy where each run
stopped, updates applied, and the bytes that entered the server's host per applied update
(from the daemons' transfer reports: what crossed the bottleneck); per seed, the ratio of
the uncompressed system's time to each codec's (same policy). Writes
``experiments/results/testbed_codecs.{md,csv}``. Needs root, ip, tc, torch.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed_e2e as e2e

DEFAULT_SYSTEMS = "stf,stf@fp16,stf@int8+ef"


def server_ingress_bytes(transfers: list[dict[str, Any]]) -> int:
    """Bytes of the transfers that reached the server's host (``ps``) and were delivered.

    Examples
    --------
    >>> server_ingress_bytes([{"dst_host": "ps", "bytes": 10, "ok": True},
    ...                       {"dst_host": "ps", "bytes": 5, "ok": False},
    ...                       {"dst_host": "w1", "bytes": 7, "ok": True}])
    10
    """
    return sum(int(t["bytes"]) for t in transfers if t["dst_host"] == "ps" and t["ok"])


def ratios(times: dict[str, dict[int, float | None]], system: str) -> list[float]:
    """Per seed, the uncompressed system's time to target over ``system``'s (same policy).

    Examples
    --------
    >>> ratios({"stf": {0: 60.0, 1: 50.0}, "stf@fp16": {0: 30.0, 1: None}}, "stf@fp16")
    [2.0]
    """
    base = times.get(e2e.split_system(system)[0], {})
    return [b / t for seed, t in times[system].items() if t and (b := base.get(seed))]


def best_fixed_ratios(times: dict[str, dict[int, float | None]], system: str) -> list[float]:
    """Per seed, the best fixed codec's time over ``system``'s (an ``auto`` one; same policy).

    The fixed choices are the same policy's other systems with the same model codec, the
    uncompressed one included (``stf@auto@fp16`` against ``stf@fp16``, ``stf@int8+ef@fp16``).
    Below 1: slower than the best fixed choice (issue 26's target: >= 0.9).

    Examples
    --------
    >>> t = {"stf": {0: 60.0, 1: 50.0}, "stf@int8": {0: 30.0, 1: 40.0}, "stf@auto": {0: 33.0, 1: None}}
    >>> best_fixed_ratios(t, "stf@auto")
    [0.9090909090909091]
    """
    policy, _, model_codec = e2e.split_system(system)
    fixed = [
        s
        for s in times
        if s != system
        and e2e.split_system(s)[0] == policy
        and e2e.split_system(s)[2] == model_codec
        and not (e2e.split_system(s)[1] or "").startswith("auto")
    ]
    out = []
    for seed, t in times[system].items():
        best = min((x for s in fixed if (x := times[s].get(seed))), default=None)
        if t and best:
            out.append(best / t)
    return out


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """``median [min-max]`` of ``values`` ("-" when empty)."""
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _per_seed(rs: list[float]) -> str:
    """``median [min-max] (a / b / c)`` of per-seed ratios ("-" when empty)."""
    return spread(rs, "{:.2f}") + " (" + " / ".join(f"{x:.2f}" for x in rs) + ")" if rs else "-"


def run(args: argparse.Namespace, seeds: list[int], systems: list[str]) -> list[dict[str, Any]]:
    """Every system once per seed on one testbed per seed; one row per (seed, system)."""
    from mlfabric.scheduler.core.graph import load_topology
    from mlfabric.testbed.cluster import Testbed
    from mlfabric.testbed.netns import SubprocessRunner, new_prefix, sweep_stale

    sweep_stale(SubprocessRunner())
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-codecs-") as tmp_dir:
        tmp = args.workdir or Path(tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            args.seed = seed
            uplinks, workers, delays = e2e.layout(args)
            topo = e2e.write_topology(tmp / f"topology-{seed}.toml", args, uplinks, workers)
            graph = load_topology(topo)
            changes = e2e.ns_setting(graph, workers, args)
            with Testbed(graph, new_prefix(random.Random())) as testbed:
                for system in systems:
                    res = e2e.run_system(
                        system, testbed, topo, workers, args, delays, changes, tmp / f"{seed}" / system
                    )
                    reached = next(
                        (r["t"] for r in res["rows"] if e2e.reached(r["accuracy"], args.target)), None
                    )
                    row = {
                        "seed": seed,
                        "system": system,
                        "time_to_target": reached,
                        "accuracy": res["rows"][-1]["accuracy"] if res["rows"] else None,
                        "applied": res["applied"],
                        "dropped": res["dropped"],
                        "ingress_bytes": server_ingress_bytes(res.get("transfers", [])),
                    }
                    rows.append(row)
                    print(
                        f"seed {seed} {system}: time to {args.target}: {reached}, applied {row['applied']}, "
                        f"server ingress {row['ingress_bytes'] / max(1, row['applied']) / 1e6:.2f} MB/update",
                        flush=True,
                    )
    return rows


def summarize(
    rows: list[dict[str, Any]], args: argparse.Namespace, systems: list[str], seeds: list[int]
) -> str:
    """The Markdown table: medians and spread per system, ratios to the uncompressed run."""
    uniform = getattr(args, "uniform_mbps", None)
    uplinks = e2e.worker_uplinks(args.quick, uniform)
    changing = "static (uniform)" if uniform else f"changing every {args.period:g} s"
    times = {s: {r["seed"]: r["time_to_target"] for r in rows if r["system"] == s} for s in systems}
    lines = [
        "# Compression on the testbed (asynchronous SGD, the paper's setting)",
        "",
        f"Digits MLP 64-{e2e.HIDDEN}-{e2e.HIDDEN}-10 (4.5 MB float32 updates), lr {args.lr}, "
        f"batch {args.batch}; {len(uplinks)} workers (uplinks {max(uplinks)}-{min(uplinks)} Mbit/s), "
        f"server link {args.server_mbps:g} Mbit/s {changing}; "
        f"target test accuracy {args.target}; seeds {seeds}; "
        f"limit {args.time_limit:g} s per run. Each seed's systems take turns on one testbed.",
        "",
        "| system | time to target (s) | reached | x uncompressed (per seed) | auto: x best fixed (per seed) "
        "| accuracy at stop | applied | server ingress per applied update (MB) |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for s in systems:
        mine = [r for r in rows if r["system"] == s]
        reached = [r["time_to_target"] for r in mine if r["time_to_target"] is not None]
        per_update = [r["ingress_bytes"] / r["applied"] / 1e6 for r in mine if r["applied"]]
        rs = ratios(times, s) if "@" in s else []
        lines.append(
            f"| {s} | {spread(reached)} | {len(reached)}/{len(mine)} | "
            f"{_per_seed(rs)} | {_per_seed(best_fixed_ratios(times, s) if '@auto' in s else [])} | "
            f"{spread([r['accuracy'] for r in mine if r['accuracy'] is not None], '{:.3f}')} | "
            f"{spread([float(r['applied']) for r in mine], '{:.0f}')} | {spread(per_update, '{:.2f}')} |"
        )
    lines += [
        "",
        "A run stops when the server's test accuracy first reaches the target, so the accuracy at",
        "stop is at or just above it; `x uncompressed` is the same policy's time without a codec",
        "over the codec's, seed by seed (median [min-max], then each seed); `x best fixed` (an",
        "`auto` system) the fastest fixed choice's time (the same policy and model codec, none",
        "included) over auto's.",
        "",
        "Command: `python " + " ".join(["experiments/testbed_codecs.py", *sys.argv[1:]]) + "`",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = e2e.build_parser(__doc__)
    parser.set_defaults(systems=DEFAULT_SYSTEMS, out=e2e.RESULTS)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated testbed seeds (default 0,1,2)")
    args = e2e.parse(parser)
    from mlfabric.testbed.netns import missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        print("testbed unavailable: " + "; ".join(missing), file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    systems = e2e.split_systems(args.systems)
    rows = run(args, seeds, systems)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "testbed_codecs" + ("_quick" if args.quick else "")
    with open(args.out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = summarize(rows, args, systems, seeds)
    (args.out / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
