"""What a fault-injection run proved: per fault kind, every push checked against the final model.

Used by ``faults.py``. A push is counted under the last fault injected before it resolved
(``none`` before the first fault). Its cell of the final model says how often it was
applied (0, 1, 2, ...); with its status that makes the columns:

- ``lost``: APPLIED, yet in no model (count 0);
- ``twice``: applied more than once (any status);
- ``false``: DROPPED, or failed with an error other than a broken daemon connection, yet applied;
- ``unk+`` / ``unk-``: UNKNOWN, applied / not applied (allowed: the status says it cannot be known);
- ``conn+`` / ``conn-``: the worker's own daemon went away with the push in flight
  (``disconnected``), applied / not applied (allowed: the same as UNKNOWN);
- ``unres``: no verdict within the resolve timeout, or applied without any record.

The target is 0 lost, 0 twice, 0 false, 0 unresolved.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from faults_roles import replay

COLUMNS = ("faults", "pushes", "applied", "dropped", "unk+", "unk-", "conn+", "conn-",
           "lost", "twice", "false", "unres", "recover_med_s", "recover_max_s")  # fmt: skip
FAILURES = ("lost", "twice", "false", "unres")


@dataclass
class Fault:
    """One injected fault: its kind, the process it hit, when it started and was undone."""

    kind: str
    target: str
    t0: float
    t1: float
    note: str = ""


def _records(out: Path, workers: int) -> dict[tuple[int, int], dict[str, Any]]:
    records = {}
    for rank in range(workers):
        path = out / f"worker{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            r = json.loads(line)
            records[(rank, int(r["index"]))] = r
    return records


def _classify(status: str, count: int) -> list[str]:
    cols = ["twice"] if count >= 2 else []
    if status == "APPLIED":
        return cols + (["applied"] if count else ["lost"])
    if status == "UNKNOWN":
        return cols + (["unk+"] if count else ["unk-"])
    if status == "ERROR:disconnected":
        return cols + (["conn+"] if count else ["conn-"])
    if status == "UNRESOLVED":
        return [*cols, "unres"]
    return cols + (["false"] if count else ["dropped"])  # DROPPED or another error


def analyse(
    out: Path, workers: int, pushes: int, faults: list[Fault], final: dict[str, Any], started: float
) -> dict[str, Any]:
    """Check every push against the final model; the table rows per fault kind and the verdict."""
    records = _records(out, workers)
    journal_model, journal_version = replay(out / "journal.jsonl", workers, pushes)
    counts = final["model"]["count"] if final else journal_model["count"]
    model_ok = (
        bool(final) and np.array_equal(counts, journal_model["count"]) and final["version"] == journal_version
    )
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: dict.fromkeys(COLUMNS, 0))
    examples: dict[str, list[str]] = defaultdict(list)
    ordered = sorted(faults, key=lambda f: f.t0)

    def kind_at(t: float) -> str:
        kind = "none"
        for f in ordered:
            if f.t0 > t:
                break
            kind = f.kind
        return kind

    for f in ordered:
        rows[f.kind]["faults"] += 1
    for (rank, index), r in records.items():
        row = rows[kind_at(r["t1"])]
        row["pushes"] += 1
        for col in _classify(r["status"], int(counts[rank, index])):
            row[col] += 1
            if col in FAILURES and len(examples[col]) < 5:
                examples[col].append(
                    f"w{rank}#{index} {r['status']} x{int(counts[rank, index])} {r.get('reason', '')}"
                )
    for rank, index in zip(*np.nonzero(counts), strict=True):
        if (int(rank), int(index)) not in records:
            rows["none"]["unres"] += 1
            examples["unres"].append(f"w{rank}#{index} applied x{int(counts[rank, index])} without a record")
    reasons = Counter(
        f"{r['status']}: " + re.sub(r"[0-9a-f]{16}|\d+", "N", r.get("reason", ""))[:160]
        for r in records.values()
        if r["status"] != "APPLIED"
    )
    recover: dict[str, list[float]] = defaultdict(list)
    applied = sorted((r["t0"], r["t1"]) for r in records.values() if r["status"] == "APPLIED")
    for f in ordered:
        after = [t1 for t0, t1 in applied if t0 >= f.t0]
        if after:
            recover[f.kind].append(min(after) - f.t0)
    for kind, times in recover.items():
        rows[kind]["recover_med_s"] = round(statistics.median(times), 2)
        rows[kind]["recover_max_s"] = round(max(times), 2)
    total: dict[str, float] = dict.fromkeys(COLUMNS, 0)
    for row in rows.values():
        for col in COLUMNS[:12]:
            total[col] += row[col]
    all_recover = [t for times in recover.values() for t in times]
    if all_recover:
        total["recover_med_s"] = round(statistics.median(all_recover), 2)
        total["recover_max_s"] = round(max(all_recover), 2)
    dead = final.get("survivors", []) if final else ["(no final model)"]
    ok = model_ok and not dead and all(total[c] == 0 for c in FAILURES)
    return {
        "rows": dict(sorted(rows.items())),
        "total": total,
        "examples": dict(examples),
        "model_matches_journal": model_ok,
        "dead_processes": dead,
        "version": final.get("version") if final else None,
        "elapsed_s": round((max((r["t1"] for r in records.values()), default=started) - started), 1),
        "faults": [f.__dict__ for f in ordered],
        "reasons": reasons.most_common(10),
        # pushes resolved by the daemon's push deadline: never planned, or held for an aggregate's
        # verdict that never came (a directive was lost)
        "deadline_drops": sum("push deadline" in r.get("reason", "") for r in records.values()),
        "ok": ok,
    }


def table(result: dict[str, Any]) -> str:
    """The result as a Markdown table (one row per fault kind, then the total)."""
    lines = ["| fault | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for kind, row in [*result["rows"].items(), ("**total**", result["total"])]:
        lines.append(f"| {kind} | " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def write_results(base: Path, result: dict[str, Any], cfg: Any, command: str) -> None:
    """Print the table and write ``base.md`` and ``base.csv``."""
    text = table(result)
    verdict = "PASS (0 lost / 0 twice / 0 false / 0 unresolved)" if result["ok"] else "FAIL"
    notes = [f"- {f['kind']} of {f['target']}: {f['note']}" for f in result["faults"] if f["note"]]
    examples = [f"- {col}: {e}" for col, items in result["examples"].items() for e in items]
    body = [
        "# Fault-injection harness",
        "",
        f"Command: `{command}`",
        "",
        f"Seed {cfg.seed}, policy {cfg.policy}, {cfg.workers} workers x {cfg.pushes} pushes, window "
        f"{cfg.window}; {len(result['faults'])} faults injected; {result['total']['pushes']} pushes "
        f"resolved in {result['elapsed_s']} s; final model version {result['version']}; model fetched "
        f"with get() equals the server's journal: {result['model_matches_journal']}; scheduler/daemons "
        f"not running at the end: {result['dead_processes'] or 'none'}.",
        "",
        f"**{verdict}**",
        "",
        text,
        "",
        "Columns: see experiments/faults_report.py (a push counts under the last fault injected "
        "before it resolved; recover = fault to the first APPLIED verdict of a push submitted after it).",
    ]
    if notes:
        body += ["", "Faults with a note:", *notes]
    if examples:
        body += ["", "Examples of failures:", *examples]
    if result["reasons"]:
        body += ["", "Most frequent outcomes other than APPLIED (numbers as N):"]
        body += [f"- {count} x {reason}" for reason, count in result["reasons"]]
    print(text)
    print(verdict)
    for line in notes + examples:
        print(line)
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".md").write_text("\n".join(body) + "\n")
    with open(base.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["fault", *COLUMNS])
        for kind, row in [*result["rows"].items(), ("total", result["total"])]:
            writer.writerow([kind, *(row[c] for c in COLUMNS)])
