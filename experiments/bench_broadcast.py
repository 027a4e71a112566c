"""The model down the trees (issue 23): direct copies against the relay tree, and the relay limit.

The server sends a 20 MB model to every worker. Simulated in the fluid simulator
(``Simulator.broadcast_model``, DESIGN §6) both ways:

* **direct**: one copy per worker from the server (what synchronous rounds did before);
* **tree**: down the relay tree ``plan_broadcast`` chooses (``scheduler/policies/broadcast.py``),
  the model in the chunk rule's chunks, a relay forwarding chunk ``i`` once it is in;

against the **relay limit** ``broadcast_bound`` (a lower bound for the plan's chunk count: one
copy across the slowest cut plus one chunk's hop behind it; ``docs/broadcast.md``).

1. **Two racks**: two racks of six hosts, 10 Gbit/s NICs, 1 Gbit/s uplinks
   (``two_tier(2, 6, 10e9, oversubscription=60)``), the server ``ps`` on the core switch at
   10 Gbit/s, all 12 workers receive. Target: tree / limit <= 1.3.
2. **Random two-tier**: the 50 seeded instances of ``bench_trees.py``'s ``sim_instance`` per seed
   (2-8 racks of 4-8 hosts, 2:1, 4:1 or 8:1 uplinks, mixed NICs), server ``h0``, every other
   host a worker: median and spread of tree / limit and direct / tree.

Run (about two minutes on the shared 2-core machine)::

    python experiments/bench_broadcast.py          # writes experiments/results/bench_broadcast.{md,json}
    python experiments/bench_broadcast.py --seeds 0 --instances 10 --out /tmp/b.md   # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import networkx as nx
from bench_trees import sim_instance

from mlfabric.scheduler.core.graph import hosts, two_tier
from mlfabric.scheduler.policies.broadcast import broadcast_bound, check_broadcast, plan_broadcast
from mlfabric.scheduler.policies.fair import FairPolicy
from mlfabric.scheduler.sim.engine import Simulator, UpdateRecord

MB = 1_000_000
MODEL = 20 * MB
TARGET = 1.3
OUT = Path(__file__).resolve().parent / "results" / "bench_broadcast.md"


def two_racks() -> tuple[nx.DiGraph, str, list[str]]:
    """The issue's instance: ``two_tier(2, 6, 10e9, oversubscription=60)`` plus ``ps`` on the core."""
    g = two_tier(2, 6, 10e9, oversubscription=60)
    g.add_node("ps", kind="host")
    for a, b in (("ps", "core"), ("core", "ps")):
        g.add_edge(a, b, capacity=10e9 / 8, latency=0.0)
    return g, "ps", [f"h{i}" for i in range(12)]


class BroadcastOnce:
    """An iteration model that only broadcasts the model once and records who has it when."""

    accumulates = True

    def __init__(self) -> None:
        self.got: dict[str, list[tuple[float, int]]] = {}

    def start(self, sim: Simulator) -> None:
        sim.broadcast_model(sim.workers, lambda w, v: self.got.setdefault(w, []).append((sim.now, v)))

    def resolved(self, sim: Simulator, record: UpdateRecord) -> None:
        raise AssertionError("nothing is pushed")


def simulate(g: nx.DiGraph, source: str, receivers: Sequence[str], mode: str) -> float:
    """Simulated seconds until the last receiver has the model (each receives it once, version 0)."""
    it = BroadcastOnce()
    sim = Simulator(
        g,
        FairPolicy(),
        it,
        server_host=source,
        workers=receivers,
        update_bytes=1.0,
        model_bytes=MODEL,
        model_broadcast=mode,
    )
    sim.run()
    if sorted(it.got) != sorted(receivers) or any(v != [(v[0][0], 0)] for v in it.got.values()):
        raise RuntimeError(f"{mode}: not every receiver got version 0 exactly once")
    return max(v[0][0] for v in it.got.values())


def measure(g: nx.DiGraph, source: str, receivers: list[str]) -> dict[str, Any]:
    """Direct, tree, the plan's estimate and the relay limit on one instance."""
    t0 = time.process_time()
    plan = plan_broadcast(g, source, receivers, MODEL)
    cpu = time.process_time() - t0
    check_broadcast(g, plan, source, receivers)
    bound = broadcast_bound(g, source, receivers, MODEL, chunks=plan.chunks)
    direct, tree = simulate(g, source, receivers, "direct"), simulate(g, source, receivers, "tree")
    return {
        "receivers": len(receivers),
        "chunks": plan.chunks,
        "shape": plan.shape,
        "direct": direct,
        "tree": tree,
        "estimate": plan.makespan,
        "limit": bound.value,
        "limit_cut": bound.cut,
        "limit_fanout": bound.fanout,
        "limit_where": bound.where,
        "tree/limit": tree / bound.value,
        "direct/tree": direct / tree,
        "plan_cpu_s": cpu,
        "source_copies": len(plan.children(source)),
    }


def random_instance(seed: int, i: int) -> dict[str, Any]:
    spec = sim_instance(seed, i)
    g = two_tier(spec["racks"], spec["per_rack"], spec["nics"], oversubscription=spec["over"])
    out = {k: spec[k] for k in ("racks", "per_rack", "over")}
    out.update(measure(g, "h0", [h for h in hosts(g) if h != "h0"]))
    return out


def spread(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def report(two: dict[str, Any], sims: dict[int, list[dict[str, Any]]], command: str) -> str:
    lines = [
        "# Model broadcast: direct copies vs the relay tree (issue 23)",
        "",
        f"`{command}`; 20 MB model, simulated in the fluid simulator (`Simulator.broadcast_model`).",
        "Relay limit: `broadcast_bound` for the plan's chunk count (one copy across the slowest cut",
        "plus one chunk's hop behind it; a lower bound). Times in seconds.",
        "",
        "## 1. Two racks of six, 10 Gbit/s NICs, 1 Gbit/s uplinks, server `ps` on the core at 10 Gbit/s",
        "",
        "| direct | tree | tree (plan's estimate) | relay limit | tree / limit | direct / tree "
        "| chunks | plan |",
        "|---|---|---|---|---|---|---|---|",
        f"| {two['direct']:.4f} | {two['tree']:.4f} | {two['estimate']:.4f} | {two['limit']:.4f} "
        f"| {two['tree/limit']:.3f} | {two['direct/tree']:.2f} | {two['chunks']} | {two['shape']} |",
        "",
        f"Target tree / limit <= {TARGET}: {'met' if two['tree/limit'] <= TARGET else 'NOT met'} "
        f"({two['limit_where']}: cut {two['limit_cut']:.4f} s + fan-out {two['limit_fanout']:.4f} s).",
        "",
        "## 2. Random two-tier instances (`bench_trees.py`'s `sim_instance`), server `h0`",
        "",
        "Median [min-max] over the instances.",
        "",
        "| seed | instances | tree / limit | <= 1.3 | direct / tree | tree faster | chunks | plan CPU (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    every = [r for rows in sims.values() for r in rows]
    for label, rows in [*((str(s), r) for s, r in sims.items()), ("all", every)]:
        tl = [r["tree/limit"] for r in rows]
        dt = [r["direct/tree"] for r in rows]
        lines.append(
            f"| {label} | {len(rows)} | {spread(tl)} | {sum(x <= TARGET for x in tl)}/{len(rows)} "
            f"| {spread(dt)} | {sum(x > 1 for x in dt)}/{len(rows)} "
            f"| {spread([float(r['chunks']) for r in rows], '{:.0f}')} "
            f"| {spread([r['plan_cpu_s'] for r in rows], '{:.3f}')} |"
        )
    lines += ["", "By oversubscription and by the binding part of the limit (all seeds):", ""]
    lines += ["| group | instances | tree / limit | direct / tree |", "|---|---|---|---|"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in every:
        groups.setdefault(f"{r['over']}:1", []).append(r)
    for r in every:
        kind = "uplink (link)" if r["limit_where"].startswith("link") else "a NIC (receiver)"
        groups.setdefault(f"limit at {kind}", []).append(r)
    for name, rows in groups.items():
        lines.append(
            f"| {name} | {len(rows)} | {spread([r['tree/limit'] for r in rows])} "
            f"| {spread([r['direct/tree'] for r in rows])} |"
        )
    worst = sorted(every, key=lambda r: -r["tree/limit"])[:5]
    lines += ["", "Largest tree / limit:", ""]
    lines += ["| racks x hosts | over | chunks | tree | limit (where) | tree / limit | plan |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for r in worst:
        lines.append(
            f"| {r['racks']} x {r['per_rack']} | {r['over']}:1 | {r['chunks']} | {r['tree']:.4f} "
            f"| {r['limit']:.4f} ({r['limit_where']}) | {r['tree/limit']:.3f} | {r['shape'][:80]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--instances", type=int, default=50, help="random instances per seed (default 50)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"report (and .json beside it; default {OUT})")
    args = ap.parse_args(argv)
    started = time.monotonic()
    two = measure(*two_racks())
    sims: dict[int, list[dict[str, Any]]] = {}
    for seed in args.seeds:
        sims[seed] = [random_instance(seed, i) for i in range(args.instances)]
        print(f"seed {seed}: {len(sims[seed])} instances", file=sys.stderr)
    command = "python experiments/bench_broadcast.py" + (
        "" if argv is None and not sys.argv[1:] else " " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    text = report(two, sims, command)
    text += f"\nTotal benchmark time: {time.monotonic() - started:.0f} s.\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    doc = {"model_bytes": MODEL, "two_racks": two, "random": sims}
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
