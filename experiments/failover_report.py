"""Output of failover_training.py: one line per trial, the CSV, the Markdown report (pure but git)."""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import failover_accounting as acc

__all__ = ["commit", "markdown", "trial_line", "write_csv"]

#: CSV columns (the row's lists of example ids are left out)
COLUMNS = (
    "victim", "kill_point", "kill_after_s", "server_accuracy_at_kill", "server_reached_before_kill",
    "promotion_s", "first_update_s", "div_max", "lost_updates", "lost_applied", "lost_norm",
    "lost_norm_over_div_max", "within_div_max", "pushes", "applied", "dropped", "dropped_server_failed",
    "drop_reasons", "unknown", "unknown_in_model", "unresolved", "errors", "duplicated", "applied_missing",
    "dropped_applied", "dropped_lost", "exactly_once", "replica_updates_after", "reached", "time_to_target",
    "final_accuracy", "load1",
)  # fmt: skip


def _num(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(r: Mapping[str, Any]) -> str:
    """The norm lost in units of div_max ("-" for chain replication, div_max 0)."""
    return f"{r['lost_norm'] / r['div_max']:.2f}" if r["div_max"] > 0 else "-"


def trial_line(r: Mapping[str, Any]) -> str:
    """One human-readable line per trial.

    Examples
    --------
    >>> r = {"victim": "process", "kill_point": 40, "kill_after_s": 3.2, "promotion_s": 0.01,
    ...      "first_update_s": 0.05, "lost_norm": 0.1, "div_max": 0.2, "lost_updates": 2,
    ...      "applied": 90, "dropped": 1, "unknown": 0, "unresolved": 0, "duplicated": 0,
    ...      "exactly_once": True, "reached": True, "time_to_target": 12.5}
    >>> print(trial_line(r).replace("; ", ";\\n"))
    process kill at 40 updates (3.2 s): promoted +0.010 s, first update +0.050 s;
    lost 2 updates, norm 0.1000 = 0.50 div_max;
    pushes applied 90 dropped 1 unknown 0 unresolved 0 duplicated 0 (exactly once: yes);
    target reached at 12.5 s
    """
    ttt = f"reached at {r['time_to_target']:.1f} s" if r["reached"] else "NOT reached"
    return (
        f"{r['victim']} kill at {r['kill_point']} updates ({r['kill_after_s']:.1f} s): "
        f"promoted +{_num(r['promotion_s'], '.3f')} s, first update +{_num(r['first_update_s'], '.3f')} s; "
        f"lost {r['lost_updates']} updates, norm {r['lost_norm']:.4f} = {_ratio(r)} "
        f"div_max; pushes applied {r['applied']} dropped {r['dropped']} unknown {r['unknown']} "
        f"unresolved {r['unresolved']} duplicated {r['duplicated']} "
        f"(exactly once: {'yes' if r['exactly_once'] else 'NO'}); target {ttt}"
    )


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write the trials (rewritten after each, so a run cut short keeps what it did)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def commit() -> str:
    """The checked-out commit (short hash; "unknown" outside a git work tree)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def _link(a: argparse.Namespace) -> str:
    if a.replica_mbps is None:
        return "every link 10 Gbit/s, not enforced: CPU is the limit"
    return f"its link {a.replica_mbps:g} Mbit/s, every other 10 Gbit/s, enforced by the daemons"


def _med(s: tuple[float, float, float] | None, spec: str) -> str:
    if s is None:
        return "-"
    return f"{format(s[0], spec)} [{format(s[1], spec)}-{format(s[2], spec)}]"


def markdown(
    rows: Sequence[Mapping[str, Any]],
    a: argparse.Namespace,
    load_before: Sequence[float],
    load_after: Sequence[float],
    started: str,
    argv: str,
) -> str:
    """The report: setting, command, commit and load, the summary per victim, every trial."""
    before, after = (", ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after))
    loads = f"{before} before, {after} after"
    lines = [
        "# Failover during training (loopback, real processes)",
        "",
        f"Command: `python experiments/failover_training.py {argv}`; commit {a.commit}; started {started}, "
        f"{a.wall_minutes:.0f} min; load average (1, 5, 15 min) {loads} (2 cores shared with other jobs).",
        "",
        f"Asynchronous SGD on the digits MLP 64-{a.hidden}-10 (float32), {a.workers} workers (one host "
        f"each), lr {a.lr}, batch {a.batch}, tau_max {a.tau_max}, policy `{a.policy}`; the server on host "
        f"`ps`, its replica on `rep` ({_link(a)}); div_max = {a.div_updates:g} x {a.reference_norm:.5f} "
        f"(median update norm of local SGD) = {a.div_max:.5f}. SIGKILL of the server's process or of its "
        f"daemon once the server applied K updates (K spread over {a.kill_after}); the promoted replica "
        f"trains on to test accuracy {a.target} (limit {a.time_limit:g} s from the first push).",
        "",
        "| killed | trials | kill to first update at the replica, s: median [min-max] | kill to promotion, s "
        "| norm lost / div_max: median [min-max] | within div_max | exactly once "
        "| pushes applied / dropped / unknown / unresolved / duplicated | reached target "
        "| time to target, s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in acc.summarize(rows):
        n = s["trials"]
        lines.append(
            f"| {s['victim']} | {n} | {_med(s['first_update'], '.3f')} | {_med(s['promotion'], '.3f')} | "
            f"{_med(s['lost_norm_ratio'], '.2f')} | {s['within_div_max']}/{n} | {s['exactly_once']}/{n} | "
            f"{s['applied']} / {s['dropped']} / {s['unknown']} / {s['unresolved']} / {s['duplicated']} | "
            f"{s['reached']}/{n} | {_med(s['time_to_target'], '.1f')} |"
        )
    lines += [
        "",
        "Per trial (times from the kill; time to target from the first push; lost = worker updates the "
        "failed server applied that the promoted replica never did):",
        "",
        "| killed | K | kill at (s) | server accuracy at kill | promotion (s) | first update (s) "
        "| lost updates (APPLIED) | norm lost / div_max | applied | dropped (server failed) | unknown "
        "(in model) | unresolved | duplicated | APPLIED missing | DROPPED in model (lost) "
        "| time to target (s) | load1 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    for r in rows:
        cells = [
            r["victim"], r["kill_point"], _num(r["kill_after_s"], ".1f"),
            _num(r["server_accuracy_at_kill"], ".3f"), _num(r["promotion_s"], ".3f"),
            _num(r["first_update_s"], ".3f"), f"{r['lost_updates']} ({r['lost_applied']})",
            _ratio(r), r["applied"], f"{r['dropped']} ({r['dropped_server_failed']})",
            f"{r['unknown']} ({r['unknown_in_model']})", r["unresolved"], r["duplicated"],
            r["applied_missing"], f"{r['dropped_applied']} ({r.get('dropped_lost', 0)})",
            _num(r["time_to_target"], ".1f") if r["reached"] else "not reached",
            r["load1"],
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    reasons: dict[str, int] = {}
    for r in rows:
        for reason, n in r.get("drop_reasons", {}).items():
            kind = re.sub(r"\d+", "N", reason)  # one line per kind of reason
            reasons[kind] = reasons.get(kind, 0) + n
    if reasons:
        lines += ["", "Why pushes were DROPPED (all trials):", ""]
        lines += [f"- {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n"
