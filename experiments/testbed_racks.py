"""Synchronous training on two racks under an oversubscribed uplink (issue 23; DESIGN §5, §6).

The topology of the paper's rack settings (§7) on the namespace testbed: ``--racks`` racks of
``--per-rack`` workers under top-of-rack switches joined by a core switch; every worker NIC
at ``--rate-mbps`` R; each rack's uplink (both directions) at ``per_rack * R /
oversubscription`` (as :func:`mlfabric.scheduler.core.graph.two_tier` defines it: 4 workers,
4:1, an uplink of R); the parameter server ``ps`` outside the racks, on the core switch, with
a link of R. The digits MLP 64-1024-1024-10 (4.5 MB of float32 per update, the model of
``testbed_aggregation.py``) trains synchronously (every round sums one update of each worker)
to test accuracy ``--target``, with

- ``fair``     — mlfabric, every ready update sent at once (TCP shares the uplinks and the
  server's link);
- ``stf+agg``  — mlfabric, shortest transfer first with aggregation groups summed at worker
  hosts (paper Fig. 6);
- ``stf+tree`` — mlfabric, multi-level aggregation trees read off the bandwidth graph (in-rack
  sums at a worker host, then across the racks; docs/aggregation-trees.md), aggregators the
  worker hosts;
- ``ddp``      — torch DistributedDataParallel over gloo (its ring all-reduce between the
  workers, no server);
- ``ddp+hook`` — the same DDP script with ``mlfabric.torch.allreduce_hook``: the scheduler
  plans each bucket's all-reduce from the bandwidth graph (a tree where its model beats the
  ring), the ranks run it over gloo (docs/allreduce.md);
- ``ddp@fp16`` — DDP with torch's ``fp16_compress_hook`` (gradients all-reduced as float16);
- ``POLICY@CODEC[@MODEL_CODEC]`` — an mlfabric system whose workers push with a codec and whose
  server publishes the model with the model codec (``stf+tree@fp16@fp16``; docs/compression.md).

The mlfabric runs are :func:`testbed_aggregation.run_one` (static rates, no straggler unless
``--slowdown``), the DDP runs :func:`testbed_ddp.run_one` (rank ``i`` on a seeded permutation of
the workers, the same for ``ddp`` and ``ddp+hook`` in one seed; both train on the same seeded
batches). Before the runs a concurrent-flow link check (:mod:`mlfabric.testbed.linkcheck`)
prints what the shaped links deliver with one flow on each link, and what each of the rack's
flows gets when all of a rack's workers send across the uplink at once (the oversubscription).

Seeds are the outer loop and the systems the inner one, as in ``testbed_aggregation.py``. Per
run: time to target (from the first round, or DDP's first step), final accuracy, rounds, the
median round, and for the mlfabric systems the round split read off the server's accuracy log
(one row per applied round, Unix times) and the daemons' transfer reports: ``lead`` (from the
previous round's apply to the first push transfer: the model pull, the compute, the
scheduler's release; split further, from the workers' step logs, into ``model``, the apply to
the model in a worker's hands, and ``compute``, from there to its update handed to its daemon),
``transfer`` (first push transfer to the last payload at the server, aggregates included) and
``tail`` (to the round's apply: summing and applying at the server).
The summary gives per system the median over the seeds, the min-max spread, the ratios against
``fair`` and ``ddp`` (> 1: faster) and ``ddp / ddp+hook`` per seed.

    python experiments/testbed_racks.py --quick                     # target 0.85, seed 0, ~10 min
    python experiments/testbed_racks.py                             # target 0.95, seeds 0,1,2, ~1.5-2.5 h
    python experiments/testbed_racks.py --rate-mbps 1000

The full run's length: 15 runs, each up to ``--time-limit`` (600 s) from its first round plus
start-up (a minute on a loaded machine); in the quick run the parameter-server rounds at
100 Mbit/s took about 5 s (plus ~30 s stalls in some ``stf+agg``/``stf+tree`` rounds, see
README.md), DDP's steps 1-1.4 s.

Writes experiments/results/testbed_racks[_quick][_r<rate>].{csv,md} (the rate suffix when it is
not 100). Needs root, ip, tc, torch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed_aggregation as agg  # the mlfabric runs (server and worker roles)
import testbed_ddp as tddp  # the DDP runs (plain and with the hook)
from bench_allreduce import _commit
from harness import save_results

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("fair", "stf+agg", "stf+tree", "ddp", "ddp+hook")
#: testbed_ddp's name of each DDP system
DDP_COMM = {"ddp": "gloo", "ddp+hook": "mlfabric", "ddp@fp16": "gloo+fp16"}
SERVER = "ps"
#: the round split's parts, in order
PARTS = ("lead", "transfer", "tail")
#: the lead's parts, from the workers' steps (:func:`lead_split`)
LEAD_PARTS = ("model", "compute")
#: the round split's columns
COLUMNS = ("lead", *LEAD_PARTS, "transfer", "tail")


# ----------------------------------------------------------------------------- pure parts


def racks_topology(racks: int, per_rack: int, rate_mbps: float, oversubscription: float) -> dict[str, Any]:
    """Racks of workers ``w0..`` under ``tor0..``, a core switch, the server ``ps`` on the core.

    A rack's uplink runs at ``per_rack * rate_mbps / oversubscription`` (as
    :func:`mlfabric.scheduler.core.graph.two_tier`); the server's link at ``rate_mbps``.

    Examples
    --------
    >>> t = racks_topology(2, 4, 100, 4)
    >>> t["hosts"][:3], t["switches"]
    (['ps', 'w0', 'w1'], ['core', 'tor0', 'tor1'])
    >>> [link for link in t["links"] if "core" in (link["a"], link["b"])]
    ... # doctest: +NORMALIZE_WHITESPACE
    [{'a': 'tor0', 'b': 'core', 'mbps': 100.0}, {'a': 'tor1', 'b': 'core', 'mbps': 100.0},
     {'a': 'ps', 'b': 'core', 'mbps': 100}]
    >>> racks_topology(2, 4, 1000, 2)["links"][8]
    {'a': 'tor0', 'b': 'core', 'mbps': 2000.0}
    """
    from mlfabric.testbed.topologies import two_tier

    if racks < 1 or per_rack < 1 or rate_mbps <= 0 or oversubscription <= 0:
        raise ValueError("racks, per-rack, the rate and the oversubscription must be positive")
    rack_hosts = [{f"w{r * per_rack + i}": rate_mbps for i in range(per_rack)} for r in range(racks)]
    t = two_tier(rack_hosts, [per_rack * rate_mbps / oversubscription] * racks)
    t["hosts"] = [SERVER, *t["hosts"]]
    t["links"].append({"a": SERVER, "b": "core", "mbps": rate_mbps})
    return t


def rack_of(workers: Sequence[str], per_rack: int) -> list[list[str]]:
    """The workers rack by rack.

    Examples
    --------
    >>> rack_of(["w0", "w1", "w2", "w3"], 2)
    [['w0', 'w1'], ['w2', 'w3']]
    """
    return [list(workers[i : i + per_rack]) for i in range(0, len(workers), per_rack)]


def round_split(log: Mapping[str, Any], transfers: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Median round and its parts, from the server's accuracy log and the transfer reports.

    A round is the time between two consecutive applied versions (``log["start"] + t`` of the
    log's rows); its transfers are the successful reports that end inside it. ``lead``: from
    the previous apply to the first of them starting; ``transfer``: to the last one ending;
    ``tail``: to the apply; ``longest``: the longest round (a stall shows there, not in the
    medians). Rounds without a transfer, or skipping a version, are left out.

    Examples
    --------
    >>> log = {"start": 100.0, "rows": [{"t": 0.0, "version": 1}, {"t": 4.0, "version": 2},
    ...                                 {"t": 9.0, "version": 3}]}
    >>> tr = [{"ok": True, "start": 101.0, "end": 103.0}, {"ok": True, "start": 101.5, "end": 103.5},
    ...       {"ok": True, "start": 106.0, "end": 108.5}, {"ok": False, "start": 0.0, "end": 0.0}]
    >>> round_split(log, tr)
    {'rounds': 2, 'round': 4.5, 'lead': 1.5, 'transfer': 2.5, 'tail': 0.5, 'longest': 5.0}
    >>> round_split({"start": None, "rows": []}, tr)["round"] is None
    True
    """
    start, rows = log.get("start"), log.get("rows") or []
    parts: dict[str, list[float]] = {p: [] for p in ("round", *PARTS)}
    if start is not None:
        done = [(r["version"], start + r["t"]) for r in rows]
        spans = [(t.get("start", 0.0), t.get("end", 0.0)) for t in transfers if t.get("ok")]
        for (v0, a), (v1, b) in itertools.pairwise(done):
            inside = [(s, e) for s, e in spans if a < e <= b and s > 0]
            if v1 != v0 + 1 or not inside:
                continue
            first = max(a, min(s for s, _ in inside))
            last = max(e for _, e in inside)
            for part, value in zip(
                ("round", *PARTS), (b - a, first - a, last - first, b - last), strict=True
            ):
                parts[part].append(value)
    out: dict[str, float | None] = {"rounds": len(parts["round"])}
    out.update({p: float(statistics.median(xs)) if xs else None for p, xs in parts.items()})
    out["longest"] = max(parts["round"], default=None)
    return out


def lead_split(log: Mapping[str, Any], steps: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """The lead's parts, from the workers' steps (``testbed_e2e.StepsLog``) of each round.

    A round's lead starts at the apply of version ``v`` (the accuracy log's row). Each
    worker's step on ``v``: ``model`` from the apply to the model in the worker's hands (its
    way down: the server's daemon, the relays, the ``get``), ``compute`` from there to the
    update handed to the worker's daemon (load, gradient, the compute delay). Medians over the
    round's workers, then over the rounds; rounds that skip a version are left out.

    Examples
    --------
    >>> log = {"start": 100.0, "rows": [{"t": 0.0, "version": 1}, {"t": 4.0, "version": 2},
    ...                                 {"t": 9.0, "version": 4}]}
    >>> steps = [{"version": 1, "got": 100.5, "handed": 101.5}, {"version": 1, "got": 100.7, "handed": 102.7},
    ...          {"version": 2, "got": 105.0, "handed": 105.5}]
    >>> lead_split(log, steps)
    {'model': 0.6, 'compute': 1.5}
    """
    start, rows = log.get("start"), log.get("rows") or []
    parts: dict[str, list[float]] = {p: [] for p in LEAD_PARTS}
    if start is not None:
        by_version: dict[int, list[Mapping[str, Any]]] = {}
        for step in steps:
            by_version.setdefault(int(step["version"]), []).append(step)
        for r0, r1 in itertools.pairwise(rows):
            mine = by_version.get(int(r0["version"]), [])
            if r1["version"] != r0["version"] + 1 or not mine:
                continue
            applied = start + r0["t"]
            parts["model"].append(statistics.median(s["got"] - applied for s in mine))
            parts["compute"].append(statistics.median(s["handed"] - s["got"] for s in mine))
    return {p: round(float(statistics.median(xs)), 6) if xs else None for p, xs in parts.items()}


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(statistics.median(vals)) if vals else None


def system_stats(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system (in first-seen order): runs, reached, median/min/max time, medians of the rest.

    Examples
    --------
    >>> rows = [{"system": "fair", "time_to_target": t, "final_accuracy": 0.95, "round_s": 2.0}
    ...         for t in (10.0, 30.0, None)]
    >>> s = system_stats(rows)["fair"]
    >>> s["runs"], s["reached"], s["median"], s["min"], s["max"], s["round_s"]
    (3, 2, 20.0, 10.0, 30.0, 2.0)
    """
    stats: dict[str, dict[str, Any]] = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        rs = [r for r in rows if r["system"] == system]
        times = [r["time_to_target"] for r in rs if r.get("time_to_target") is not None]
        stats[system] = {
            "runs": len(rs),
            "reached": len(times),
            "median": _median(times),
            "min": min(times) if times else None,
            "max": max(times) if times else None,
            **{
                k: _median([r.get(k) for r in rs])
                for k in ("final_accuracy", "rounds", "round_s", "longest_s")
            },
            **{f"{p}_s": _median([r.get(f"{p}_s") for r in rs]) for p in COLUMNS},
        }
    return stats


def ratio(base: float | None, mine: float | None) -> float | None:
    """``base / mine``: > 1 when ``mine`` is faster; None if either is missing.

    Examples
    --------
    >>> ratio(30.0, 20.0), ratio(None, 20.0)
    (1.5, None)
    """
    return base / mine if base and mine else None


def per_seed_ratios(rows: Sequence[Mapping[str, Any]], base: str, mine: str) -> list[float]:
    """``base``'s time over ``mine``'s, for each seed where both reached the target.

    Examples
    --------
    >>> rows = [{"seed": 0, "system": "ddp", "time_to_target": 30.0},
    ...         {"seed": 0, "system": "ddp+hook", "time_to_target": 20.0},
    ...         {"seed": 1, "system": "ddp", "time_to_target": 10.0},
    ...         {"seed": 1, "system": "ddp+hook", "time_to_target": None}]
    >>> per_seed_ratios(rows, "ddp", "ddp+hook")
    [1.5]
    """
    times: dict[Any, dict[str, float]] = {}
    for r in rows:
        if r.get("time_to_target") is not None:
            times.setdefault(r["seed"], {})[r["system"]] = r["time_to_target"]
    return [t[base] / t[mine] for _, t in sorted(times.items()) if base in t and mine in t]


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def summary(rows: Sequence[Mapping[str, Any]], args: argparse.Namespace, checks: Sequence[str]) -> str:
    """The markdown summary: per system the median time, spread, ratios and the round split.

    Examples
    --------
    >>> a = argparse.Namespace(quick=True, racks=2, per_rack=4, rate_mbps=100.0, oversubscription=4.0,
    ...                        lr=0.05, batch=64, compute=0.02, slowdown=1.0, target=0.85, seeds="0",
    ...                        systems="fair,ddp,ddp+hook", commit="abc")
    >>> rows = [{"seed": 0, "system": "fair", "time_to_target": 60.0, "final_accuracy": 0.86,
    ...          "rounds": 12, "round_s": 5.0, "longest_s": 9.0, "lead_s": 1.0, "model_s": 0.3,
    ...          "compute_s": 0.6, "transfer_s": 3.5, "tail_s": 0.5, "load1": 3.0},
    ...         {"seed": 0, "system": "ddp", "time_to_target": 20.0, "final_accuracy": 0.86,
    ...          "rounds": 15, "round_s": 1.3, "load1": 3.0},
    ...         {"seed": 0, "system": "ddp+hook", "time_to_target": 16.0, "final_accuracy": 0.87,
    ...          "rounds": 15, "round_s": 1.0, "load1": 3.0}]
    >>> text = summary(rows, a, ["link check: ..."])
    >>> print(next(line for line in text.splitlines() if line.startswith("| fair")).replace(" | ", "|"))
    | fair|1|1|60.0|60.0-60.0|1.00x|0.33x|0.860|12|5.00|9.00|1.00|0.30|0.60|3.50|0.50 |
    >>> [line for line in text.splitlines() if line.startswith("ddp / ddp+hook")]
    ['ddp / ddp+hook (> 1: the hook faster): median 1.25x; per seed 1.25']
    """
    stats = system_stats(rows)
    uplink = args.per_rack * args.rate_mbps / args.oversubscription
    fair, ddp = (stats.get(s, {}).get("median") for s in ("fair", "ddp"))
    lines = [
        f"# Synchronous training on {args.racks} racks, {args.oversubscription:g}:1 uplinks "
        f"({'quick' if args.quick else 'full'})",
        "",
        f"Commit {args.commit}. Digits MLP 64-1024-1024-10 (4.5 MB float32 updates), lr {args.lr}, "
        f"batch {args.batch} per worker, compute {args.compute:g} s per step"
        f"{f' (one straggler {args.slowdown:g}x)' if args.slowdown != 1 else ''}; {args.racks} racks "
        f"of {args.per_rack} workers, NICs {args.rate_mbps:g} Mbit/s, rack uplinks {uplink:g} Mbit/s, "
        f"the parameter server on the core switch at {args.rate_mbps:g} Mbit/s. Synchronous rounds "
        f"of every worker's update; target {args.target}; seeds {args.seeds}. Command: "
        f"`python experiments/testbed_racks.py{' --quick' if args.quick else ''} --rate-mbps "
        f"{args.rate_mbps:g} --oversubscription {args.oversubscription:g} --racks {args.racks} "
        f"--per-rack {args.per_rack} --target {args.target} --seeds {args.seeds} --systems {args.systems}`.",
        "",
        *(f"- {c}" for c in checks),
        "",
        "| system | runs | reached | median time to target (s) | min-max (s) | vs fair | vs ddp "
        "| final accuracy | rounds | round (s) | longest round (s) | lead (s) | lead: model (s) "
        "| lead: compute (s) | transfer (s) | tail (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for system, s in stats.items():
        spread = f"{s['min']:.1f}-{s['max']:.1f}" if s["reached"] else "-"
        lines.append(
            f"| {system} | {s['runs']} | {s['reached']} | {_fmt(s['median'])} | {spread} | "
            f"{_fmt(ratio(fair, s['median']), '.2f', 'x')} | {_fmt(ratio(ddp, s['median']), '.2f', 'x')} | "
            f"{_fmt(s['final_accuracy'], '.3f')} | {_fmt(s['rounds'], '.0f')} | "
            + " | ".join(_fmt(s[k], ".2f") for k in ("round_s", "longest_s", *(f"{p}_s" for p in COLUMNS)))
            + " |"
        )
    hook = per_seed_ratios(rows, "ddp", "ddp+hook")
    if hook:
        each = ", ".join(f"{x:.2f}" for x in hook)
        lines += [
            "",
            f"ddp / ddp+hook (> 1: the hook faster): median {statistics.median(hook):.2f}x; per seed {each}",
        ]
    loads = [r["load1"] for r in rows if r.get("load1") is not None]
    if loads:
        lines += [
            "",
            f"Load average (1 min) at the end of each run: {min(loads):g} to {max(loads):g} (2 cores).",
        ]
    lines += [
        "",
        "Ratios: the baseline's median time over the system's (> 1: faster). Time to target counts",
        "from the first applied round (mlfabric) or rank 0's first step (DDP). Round: median time",
        "between two applied versions (DDP: a step); longest round: per run, then the median over",
        "the seeds (a stall shows there). The mlfabric round split (medians over rounds,",
        "then over seeds): lead = previous apply to the first push transfer (model pull, compute,",
        "the scheduler's release), of which (medians over a round's workers) model = the apply to",
        "the model in a worker's hands and compute = from there to its update handed to its daemon;",
        "transfer = first push transfer to the last payload at the server, tail = to the apply (the",
        "server process's apply time; before 2026-12-07 the rows were timed after the server's",
        "serve() call returned and its evaluation, which put 0.2-0.5 s of lead into tail at",
        "1 Gbit/s). The machine is shared, so times are noisy.",
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- runs


def link_checks(testbed: Any, graph: Any, workers: list[str], per_rack: int) -> list[str]:
    """One flow per link (a ring over the server and the workers), then a rack sending across."""
    from mlfabric.testbed.linkcheck import measure_concurrent, ring_pairs

    lines = [measure_concurrent(testbed, graph, ring_pairs([SERVER, *workers]), seconds=3.0).summary()]
    racks = rack_of(workers, per_rack)
    if len(racks) > 1:
        pairs = list(zip(racks[0], racks[1], strict=False))
        check = measure_concurrent(testbed, graph, pairs, seconds=2.0)
        up = graph.edges["tor0", "core"]["capacity"]
        # the flows start together; together they move their bytes in the longest one's time
        ratios = sorted(check.ratios())
        together = sum(m.bytes for m in check.measurements) / max(m.seconds for m in check.measurements)
        lines.append(
            f"across the uplink tor0->core ({up * 8 / 1e6:g} Mbit/s): {len(pairs)} concurrent flows "
            f"together {together * 8 / 1e6:.1f} Mbit/s ({together / up:.2f} of the uplink); per flow "
            f"{statistics.median(ratios):.2f} of its path's rate alone (worst {ratios[0]:.2f})"
        )
    for line in lines:
        print(line, flush=True)
    return lines


def run_mlfabric(
    system: str, testbed: Any, topo: Path, workers: list[str], args: argparse.Namespace, seed: int
) -> dict:
    """One synchronous mlfabric run (static rates) and its round split."""
    res = agg.run_one(system, True, testbed, topo, workers, args, seed, changes=[])
    split = {**round_split(res, res.get("transfers", [])), **lead_split(res, res.get("steps", []))}
    return {
        "time_to_target": res.get("time_to_target"),
        "final_accuracy": res["rows"][-1]["accuracy"] if res.get("rows") else None,
        "rounds": res.get("version"),
        "round_s": split["round"],
        "longest_s": split["longest"],
        **{f"{p}_s": split[p] for p in COLUMNS},
    }


def run_ddp(
    system: str,
    testbed: Any,
    topo: Path,
    workers: list[str],
    args: argparse.Namespace,
    seed: int,
    attempt: int,
) -> dict:
    """One DDP run (plain or with the hook) with a scheduler and daemons on the workers' hosts."""
    from mlfabric.testbed.launch import TestbedCluster

    ddp_args = argparse.Namespace(**{**vars(args), "tmp": args.tmp / f"{system}-{seed}-try{attempt}"})
    ddp_args.tmp.mkdir(parents=True)
    with TestbedCluster(
        testbed,
        topo,
        policy="fair",
        workdir=ddp_args.tmp / "run",
        hosts=workers,
        ready_timeout=180,
        log_level=args.log_level,
    ) as cluster:
        res = tddp.run_one(DDP_COMM[system], cluster, testbed, workers, ddp_args, seed)
    return {
        "time_to_target": res.get("time_to_target"),
        "final_accuracy": res["rows"][-1]["accuracy"] if res.get("rows") else None,
        "rounds": res.get("steps"),
        "round_s": res.get("step_seconds"),
        "longest_s": None,
        **{f"{p}_s": None for p in COLUMNS},
    }


def driver(args: argparse.Namespace) -> int:
    from mlfabric.scheduler.core.graph import load_topology
    from mlfabric.testbed.cluster import Testbed
    from mlfabric.testbed.netns import SubprocessRunner, missing_prerequisites, new_prefix, sweep_stale
    from mlfabric.testbed.topologies import to_toml

    missing = missing_prerequisites()
    if missing:
        print("testbed unavailable: " + "; ".join(missing), file=sys.stderr)
        return 2
    systems = [s for s in args.systems.split(",") if s]
    unknown = {s for s in systems if s not in DDP_COMM and agg.e2e.split_system(s)[0] not in SYSTEMS}
    if unknown:
        print(f"unknown systems {sorted(unknown)} (known: {', '.join(SYSTEMS)})", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    workers = [f"w{i}" for i in range(args.racks * args.per_rack)]
    args.commit, args.rate = _commit(), args.rate_mbps
    name = "testbed_racks" + ("_quick" if args.quick else "")
    name += f"_r{args.rate_mbps:g}" if args.rate_mbps != 100 else ""
    sweep_stale(SubprocessRunner())
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-racks-") as tmp_dir:
        args.tmp = args.workdir or Path(tmp_dir)
        args.tmp.mkdir(parents=True, exist_ok=True)
        topo = args.tmp / "topology.toml"
        topo.write_text(
            to_toml(racks_topology(args.racks, args.per_rack, args.rate_mbps, args.oversubscription))
        )
        graph = load_topology(topo)
        with Testbed(graph, new_prefix(random.Random())) as testbed:
            checks = link_checks(testbed, graph, workers, args.per_rack)
            for seed in seeds:
                for system in systems:
                    started = time.monotonic()
                    res: dict[str, Any] = {}
                    for attempt in range(1, agg.START_ATTEMPTS + 1):
                        try:
                            if system in DDP_COMM:
                                res = run_ddp(system, testbed, topo, workers, args, seed, attempt)
                            else:
                                res = run_mlfabric(system, testbed, topo, workers, args, seed)
                            break
                        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
                            print(
                                f"{system} seed {seed} failed (attempt {attempt}): {exc!r}",
                                file=sys.stderr,
                                flush=True,
                            )
                    row = {
                        "seed": seed,
                        "system": system,
                        "time_to_target": None,
                        "final_accuracy": None,
                        "rounds": None,
                        "round_s": None,
                        "longest_s": None,
                        **{f"{p}_s": None for p in COLUMNS},
                        **res,
                        "load1": round(os.getloadavg()[0], 1),
                    }
                    rows.append(row)
                    print(json.dumps({**row, "wall": round(time.monotonic() - started, 1)}), flush=True)
    text = summary(rows, args, checks)
    save_results(args.out, name, rows, text)
    print(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="target 0.85, seed 0, 150 s limit per run")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated: {', '.join(SYSTEMS)}")
    parser.add_argument("--seeds", help="comma-separated (default 0,1,2; quick: 0)")
    parser.add_argument("--target", type=float, help="test accuracy (default 0.95; quick: 0.85)")
    parser.add_argument(
        "--time-limit", type=float, help="seconds per run from its first round (150 quick, 600 full)"
    )
    parser.add_argument(
        "--rate-mbps", type=float, default=100.0, help="worker NICs and the server's link, Mbit/s"
    )
    parser.add_argument(
        "--oversubscription", type=float, default=4.0, help="a rack's NIC total over its uplink"
    )
    parser.add_argument("--racks", type=int, default=2)
    parser.add_argument("--per-rack", type=int, default=4, help="workers per rack")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--compute", type=float, default=0.02, help="compute delay per step, s")
    parser.add_argument(
        "--slowdown", type=float, default=1.0, help="one straggler's compute factor (1: none)"
    )
    parser.add_argument("--tau-max", type=int, default=32)
    parser.add_argument(
        "--aggregate-plan", choices=["async", "sync"], default="async", help="stf+agg's planner"
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, help="keep logs and per-run files here (default: a temp dir)")
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="of the scheduler and the daemons (DEBUG: each update's readiness, get and verdict)",
    )
    args = parser.parse_args()
    args.seeds = args.seeds or ("0" if args.quick else "0,1,2")
    args.target = args.target or (0.85 if args.quick else 0.95)
    args.time_limit = args.time_limit or (150.0 if args.quick else 600.0)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
