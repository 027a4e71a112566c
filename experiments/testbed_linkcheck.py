"""Link check on the namespace testbed: one transfer per link vs its configured rate (DESIGN §5, §6).

Builds a testbed (root, ``ip``, ``tc``), then for every directed link runs one bulk TCP
transfer between two hosts whose path crosses it (plain sockets, no mlfabric daemon) and
compares the receiver's throughput with the path's configured bottleneck rate. Goal: at
least 0.95 of the rate. The throughput is TCP payload (goodput); a shaped Ethernet link
carries at most 1448/1514 = 0.956 of its rate as payload (MSS 1448 with timestamps), so
the wire-rate ratio (goodput * 1514/1448) is reported too.

    python experiments/testbed_linkcheck.py --quick     # 3 hosts, 50 Mbit/s, ~20 s
    python experiments/testbed_linkcheck.py             # two racks, 20-500 Mbit/s, ~2 min

Writes experiments/results/testbed_linkcheck[_quick].{csv,png,md}.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_csv

from mlfabric.scheduler.core.graph import load_topology
from mlfabric.testbed.cluster import Testbed
from mlfabric.testbed.linkcheck import measure_transfer, plan_link_checks
from mlfabric.testbed.netns import (
    SubprocessRunner,
    TestbedUnavailable,
    missing_prerequisites,
    new_prefix,
    sweep_stale,
)
from mlfabric.testbed.topologies import bottleneck_star, to_toml, two_tier

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 0.95
#: TCP payload per Ethernet frame with a 1500-byte MTU and TCP timestamps.
PAYLOAD_PER_FRAME = 1448 / 1514
BITS = 8


def topology(quick: bool) -> dict:
    if quick:
        return bottleneck_star("ps", 50, {"w0": 50, "w1": 50})
    return two_tier(
        [{"ps": 200, "w0": 100, "w1": 50}, {"w2": 100, "w3": 20, "w4": 500}],
        uplink_mbps=[300, 80],
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: 3 hosts at 50 Mbit/s")
    parser.add_argument("--seconds", type=float, help="seconds of traffic per transfer (2 quick, 4 full)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    missing = missing_prerequisites()
    if missing:
        print("testbed unavailable: " + "; ".join(missing), file=sys.stderr)
        return 2
    seconds = args.seconds or (2.0 if args.quick else 4.0)
    name = "testbed_linkcheck" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    sweep_stale(SubprocessRunner())
    with tempfile.TemporaryDirectory(prefix="mlfabric-linkcheck-") as tmp:
        topo_path = Path(tmp) / "topology.toml"
        topo_path.write_text(to_toml(topology(args.quick)))
        graph = load_topology(topo_path)
        checks = plan_link_checks(graph)
        measured = {}
        try:
            testbed = Testbed(graph, new_prefix(random.Random()))
            with testbed:
                for check in checks:
                    pair = (check.src, check.dst)
                    if pair not in measured:
                        m = measure_transfer(testbed, check.src, check.dst, int(check.expected * seconds))
                        measured[pair] = m
                        print(
                            f"{check.src:>4} -> {check.dst:<4} {m.throughput * BITS / 1e6:8.2f} Mbit/s "
                            f"of {check.expected * BITS / 1e6:6.1f} ({m.throughput / check.expected:.3f})",
                            flush=True,
                        )
                notes = list(testbed.notes)
        except TestbedUnavailable as exc:
            print(exc, file=sys.stderr)
            return 2
    rows = []
    for check in checks:
        m = measured[(check.src, check.dst)]
        ratio = m.throughput / check.expected
        rows.append(
            {
                "link": f"{check.link[0]}->{check.link[1]}",
                "src": check.src,
                "dst": check.dst,
                "configured_mbps": round(graph.edges[check.link]["capacity"] * BITS / 1e6, 3),
                "path_bottleneck_mbps": round(check.expected * BITS / 1e6, 3),
                "measured_mbps": round(m.throughput * BITS / 1e6, 3),
                "bytes": m.bytes,
                "seconds": round(m.seconds, 4),
                "goodput_ratio": round(ratio, 4),
                "wire_ratio": round(ratio / PAYLOAD_PER_FRAME, 4),
            }
        )
    write_csv(args.out / f"{name}.csv", rows)
    plot(rows, args.out / f"{name}.png")
    summary(rows, args, seconds, notes, args.out / f"{name}.md")
    print((args.out / f"{name}.md").read_text())
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
    labels = [r["link"] for r in rows]
    ax.bar(labels, [r["goodput_ratio"] for r in rows], label="TCP goodput / configured rate")
    ax.plot(labels, [r["wire_ratio"] for r in rows], "k.", label="wire rate (goodput x 1514/1448)")
    ax.axhline(GOAL, color="r", linestyle="--", label=f"goal {GOAL}")
    ax.axhline(PAYLOAD_PER_FRAME, color="gray", linestyle=":", label="payload ceiling 1448/1514")
    ax.set_ylim(0.8, 1.05)
    ax.set_ylabel("measured / configured")
    ax.set_title("testbed link check: one transfer per directed link")
    ax.tick_params(axis="x", rotation=60)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(rows: list[dict], args: argparse.Namespace, seconds: float, notes: list[str], path: Path) -> None:
    ratios = [r["goodput_ratio"] for r in rows]
    wire = [r["wire_ratio"] for r in rows]
    passed = sum(r >= GOAL for r in ratios)
    lines = [
        f"# Testbed link check ({'quick' if args.quick else 'full'})",
        "",
        f"One bulk TCP transfer (~{seconds:.0f} s of traffic) per directed link between two network",
        "namespaces whose path crosses it; tbf shaping on each sender's egress. Goal: >= "
        f"{GOAL} of the configured rate.",
        "",
        f"- links: {len(rows)}; goodput >= {GOAL}: {passed}/{len(rows)}",
        f"- goodput / configured: min {min(ratios):.3f}, mean {sum(ratios) / len(ratios):.3f}",
        f"- wire rate / configured: min {min(wire):.3f}, mean {sum(wire) / len(wire):.3f}",
        "- TCP payload is at most 1448/1514 = 0.956 of an Ethernet link's rate; the wire ratio",
        "  adds the headers back.",
        "",
        "| link | src -> dst | configured Mbit/s | path bottleneck | measured | goodput ratio | wire ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['link']} | {r['src']} -> {r['dst']} | {r['configured_mbps']:g} | "
            f"{r['path_bottleneck_mbps']:g} | {r['measured_mbps']:.2f} | {r['goodput_ratio']:.3f} | "
            f"{r['wire_ratio']:.3f} |"
        )
    lines += ["", *(f"Note: {n}" for n in notes)]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
