"""Where the server's ingress time goes in one testbed run (stf+agg vs fair diagnosis).

Reads a run directory kept by ``testbed_aggregation.py --workdir DIR`` (``DIR/<mode>-<system>-<seed>``)
and prints, from the daemons' transfer reports and the server's result file:

- payloads into the server (direct updates, aggregates) and worker updates applied per payload;
- bytes into the server and through each worker's uplink;
- how busy the server's ingress was: the union of the transfers into it over the run, and the
  idle gaps (time no transfer into the server was under way), split into idle time while
  members were on their way to an aggregator (an aggregate waiting for them) and idle time
  with nothing moving at all (no update ready: the workers computing or waiting for verdicts);
- the workers' turnaround: from an update's bytes being in at the server (directly, or its
  aggregate's: the first forward from its aggregator after it arrived there) to its worker's
  next update starting to move (verdict, get, gradient on the loaded machine);
- the bytes per second into the server over the run, and per aggregator host the forwards it
  sent and their median rate (an aggregator whose own uplink is narrower than the server's
  ingress forwards the group's sum at that uplink's rate);
- for each aggregate, how long it waited at its aggregator between its last member's arrival
  there and its forward to the server (the scheduler holding it behind the transfers ahead).

    python experiments/agg_diagnostics.py DIR/async-stf+agg-0 [DIR/async-fair-0 ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _reports(run: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted((run / "run" / "reports").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _union(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total covered time and the gaps between covered stretches."""
    covered, gaps, cur = 0.0, [], None
    for s, e in sorted(intervals):
        if cur is None:
            cur = [s, e]
        elif s <= cur[1]:
            cur[1] = max(cur[1], e)
        else:
            covered += cur[1] - cur[0]
            gaps.append((cur[1], s))
            cur = [s, e]
    if cur is not None:
        covered += cur[1] - cur[0]
    return covered, gaps


def _overlap(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """How much of ``[start, end]`` the union of ``intervals`` covers."""
    clipped = [(max(s, start), min(e, end)) for s, e in intervals if e > start and s < end]
    return _union(clipped)[0]


def _turnarounds(reps: list[dict[str, Any]], server: str) -> list[float]:
    """Seconds from each update being in at ``server`` to its worker's next update moving."""
    aggs = sorted((r for r in reps if str(r["update_id"]).startswith("agg:")), key=lambda r: r["start"])
    first: dict[tuple[str, int], dict[str, Any]] = {}  # (worker/incarnation, n) -> first transfer
    for r in sorted(reps, key=lambda r: r["start"]):
        uid = str(r["update_id"])
        if uid.startswith("agg:") or uid.count("/") != 2:
            continue
        stem, _, seq = uid.rpartition("/")
        if seq.isdigit():
            first.setdefault((stem, int(seq)), r)
    out = []
    for (worker, n), r in first.items():
        nxt = first.get((worker, n + 1))
        if nxt is None:
            continue
        if r["dst_host"] == server:
            arrived = r["end"]
        else:
            later = (a for a in aggs if a["src_host"] == r["dst_host"] and a["start"] >= r["end"] - 0.01)
            fwd = next(later, None)
            if fwd is None:
                continue
            arrived = fwd["end"]
        out.append(nxt["start"] - arrived)
    return out


def diagnose(run: Path, server: str = "ps") -> dict[str, Any]:
    """The numbers listed in the module docstring for one run directory."""
    reps = [r for r in _reports(run) if r.get("ok") and r.get("end", 0) > r.get("start", 0)]
    into = [r for r in reps if r["dst_host"] == server]
    aggs = [r for r in into if str(r["update_id"]).startswith("agg:")]
    members = [r for r in reps if r["dst_host"] != server and r["src_host"] != server]
    t0 = min((r["start"] for r in reps), default=0.0)
    t1 = max((r["end"] for r in into), default=t0)
    busy, gaps = _union([(r["start"], r["end"]) for r in into])
    moving = [(m["start"], m["end"]) for m in members]
    idle_moving = sum(_overlap(s, e, moving) for s, e in gaps)
    idle_total = sum(e - s for s, e in gaps)
    forwards: dict[str, list[float]] = {}
    for a in aggs:
        forwards.setdefault(a["src_host"], []).append(int(a["bytes"]) / (a["end"] - a["start"]))
    waits = []
    for a in aggs:
        ins = [m["end"] for m in members if m["dst_host"] == a["src_host"] and m["end"] <= a["start"]]
        if ins:
            waits.append(a["start"] - max(ins))
    turns = _turnarounds(reps, server)
    res = json.loads((run / "server.json").read_text()) if (run / "server.json").exists() else {}
    uplink: dict[str, int] = {}
    for r in reps:
        uplink[r["src_host"]] = uplink.get(r["src_host"], 0) + int(r["bytes"])
    return {
        "run": run.name,
        "payloads_into_server": len(into),
        "aggregates": len(aggs),
        "member_sends": len(members),
        "updates_applied": res.get("updates"),
        "updates_per_payload": round(res["updates"] / res["payloads"], 2) if res.get("payloads") else None,
        "server_ingress_MB": round(sum(int(r["bytes"]) for r in into) / 1e6, 1),
        "span_s": round(t1 - t0, 1),
        "server_ingress_busy_s": round(busy, 1),
        "server_ingress_busy_frac": round(busy / (t1 - t0), 2) if t1 > t0 else None,
        "idle_gaps_over_0.2s": sum(1 for s, e in gaps if e - s > 0.2),
        "idle_members_moving_s": round(idle_moving, 1),
        "idle_nothing_moving_s": round(idle_total - idle_moving, 1),
        "server_ingress_MB_per_s": round(sum(int(r["bytes"]) for r in into) / 1e6 / (t1 - t0), 2)
        if t1 > t0
        else None,
        "forwards_by_aggregator": {
            h: {"n": len(v), "median_MB_per_s": round(statistics.median(v) / 1e6, 2)}
            for h, v in sorted(forwards.items())
        },
        "aggregate_wait_at_aggregator_s_median": round(statistics.median(waits), 2) if waits else None,
        "turnaround_s_median": round(statistics.median(turns), 2) if turns else None,
        "turnaround_s_max": round(max(turns), 2) if turns else None,
        "uplink_MB": {h: round(b / 1e6, 1) for h, b in sorted(uplink.items())},
    }


def main() -> int:
    for arg in sys.argv[1:]:
        print(json.dumps(diagnose(Path(arg))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
