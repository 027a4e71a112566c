"""Exactly-once accounting of a failover during training (pure; used by failover_training.py).

A trial leaves three logs behind:

* the server's **shadow log**: every payload the server process applied (its update id, the
  worker update ids summed in it and its norm), one line per payload, flushed as applied, so
  it survives the SIGKILL;
* the replica's **apply log**: every payload the replica applied, replicated before the
  promotion or pushed by a worker after it;
* each worker's **push log**: every push with its update id, its L2 norm and its verdict
  (APPLIED, DROPPED, UNKNOWN), or UNRESOLVED when ``wait`` timed out, or ERROR when the
  daemon answered with an error (the id is then known only if the push had been accepted).

:func:`account` compares them at the level of worker updates (an aggregate counts as its
members): what the surviving model (the promoted replica) holds, what it lacks of what the
failed server applied (the **norm lost**, to be compared with ``div_max``), and every
violation of exactly-once: an update applied twice, a push reported APPLIED that neither
model holds, a push reported DROPPED that a model applied, a push with no verdict.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["account", "spread", "summarize"]

#: counts of :func:`account` that :func:`summarize` adds up over the trials
TOTALS = (
    "pushes", "applied", "dropped", "unknown", "unresolved", "duplicated", "applied_missing",
    "dropped_applied", "lost_updates",
)  # fmt: skip


def _members(entry: Mapping[str, Any]) -> list[str]:
    return list(entry.get("members") or [entry["id"]])


def account(
    shadow: Sequence[Mapping[str, Any]],
    replica: Sequence[Mapping[str, Any]],
    pushes: Sequence[Mapping[str, Any]],
    div_max: float,
) -> dict[str, Any]:
    """Compare the logs of one trial.

    Parameters
    ----------
    shadow : sequence of dict
        The failed server's applied payloads: ``id``, ``members`` (worker update ids; empty or
        missing: just ``id``), ``norm`` (the payload's norm).
    replica : sequence of dict
        The replica's applied payloads, in order: ``id``, ``members``, ``promoted`` (applied
        after its promotion).
    pushes : sequence of dict
        Every worker push: ``id`` ("" if never accepted), ``status`` (APPLIED, DROPPED,
        UNKNOWN, UNRESOLVED, ERROR), ``norm`` (its L2 norm), ``reason``.
    div_max : float
        The job's bound (the norm lost must not exceed it).

    Returns
    -------
    dict
        ``pushes`` and one count per status (``applied``, ``dropped``, ``unknown``,
        ``unresolved``, ``errors``), ``dropped_server_failed`` (DROPPED naming the failed
        server), ``unknown_in_model`` (UNKNOWN pushes the surviving model holds),
        ``lost_updates``/``lost_norm`` (worker updates the server applied that the replica
        never did, and their norm), ``lost_applied`` (of them, reported APPLIED),
        ``within_div_max``, ``duplicated`` (worker updates applied more than once by the
        surviving model, or by the failed server), ``applied_missing`` (reported APPLIED,
        held by neither model), ``dropped_applied`` (reported DROPPED, held by the surviving
        model), ``dropped_lost`` (reported DROPPED, applied by the failed server only: like
        the lost APPLIED ones, absent from the model training goes on with, and counted in
        ``lost_norm``) and ``exactly_once`` (no duplicate, no APPLIED missing beyond the lost
        ones, no DROPPED in the surviving model, none unresolved).

    Examples
    --------
    >>> shadow = [{"id": "a/1", "norm": 1.0}, {"id": "b/1", "norm": 2.0}]
    >>> replica = [{"id": "a/1", "promoted": False}, {"id": "b/2", "promoted": True}]
    >>> pushes = [{"id": "a/1", "status": "APPLIED", "norm": 1.0},
    ...           {"id": "b/1", "status": "APPLIED", "norm": 2.0},
    ...           {"id": "b/2", "status": "APPLIED", "norm": 2.0}]
    >>> r = account(shadow, replica, pushes, div_max=2.0)
    >>> r["lost_updates"], r["lost_norm"], r["within_div_max"], r["exactly_once"]
    (1, 2.0, True, True)
    """
    norms = {p["id"]: float(p["norm"]) for p in pushes if p.get("id")}
    at_server = Counter(m for e in shadow for m in _members(e))
    at_replica = Counter(m for e in replica for m in _members(e))
    entry_norm = {}
    for e in shadow:
        ms = _members(e)
        for m in ms:
            entry_norm[m] = float(e["norm"]) / len(ms)
    lost = [m for m in at_server if m not in at_replica]
    lost_norm = sum(norms.get(m, entry_norm[m]) for m in lost)
    status = Counter(p["status"] for p in pushes)
    by_status: dict[str, set[str]] = {}
    for p in pushes:
        if p.get("id"):
            by_status.setdefault(p["status"], set()).add(p["id"])
    applied, dropped = by_status.get("APPLIED", set()), by_status.get("DROPPED", set())
    twice = {m for m, n in at_replica.items() if n > 1} | {m for m, n in at_server.items() if n > 1}
    duplicated = sorted(twice)
    applied_missing = sorted(m for m in applied if m not in at_replica and m not in at_server)
    dropped_applied = sorted(m for m in dropped if m in at_replica)
    dropped_lost = sorted(m for m in dropped if m in at_server and m not in at_replica)
    unresolved = status.get("UNRESOLVED", 0)
    return {
        "pushes": len(pushes),
        "applied": status.get("APPLIED", 0),
        "dropped": status.get("DROPPED", 0),
        "dropped_server_failed": sum(
            1 for p in pushes if p["status"] == "DROPPED" and "fail" in str(p.get("reason", ""))
        ),
        "drop_reasons": dict(
            Counter(str(p.get("reason", ""))[:80] for p in pushes if p["status"] == "DROPPED")
        ),
        "unknown": status.get("UNKNOWN", 0),
        "unknown_in_model": sum(1 for m in by_status.get("UNKNOWN", set()) if m in at_replica),
        "unresolved": unresolved,
        "errors": status.get("ERROR", 0),
        "lost_updates": len(lost),
        "lost_applied": sum(1 for m in lost if m in applied),
        "lost_norm": lost_norm,
        "within_div_max": lost_norm <= div_max * (1 + 1e-6) + 1e-12,
        "duplicated": len(duplicated),
        "duplicated_ids": duplicated[:5],
        "applied_missing": len(applied_missing),
        "applied_missing_ids": applied_missing[:5],
        "dropped_applied": len(dropped_applied),
        "dropped_applied_ids": dropped_applied[:5],
        "dropped_lost": len(dropped_lost),
        "exactly_once": not duplicated and not applied_missing and not dropped_applied and not unresolved,
    }


def spread(values: Iterable[float | None]) -> tuple[float, float, float] | None:
    """Median, min and max of the values that are not None (None if there are none).

    Examples
    --------
    >>> spread([3.0, None, 1.0, 2.0])
    (2.0, 1.0, 3.0)
    >>> spread([None]) is None
    True
    """
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return float(statistics.median(xs)), min(xs), max(xs)


def summarize(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per victim: trials, medians and spread of the times and the norm lost, totals of the pushes.

    Parameters
    ----------
    rows : sequence of dict
        One per trial: ``victim``, ``kill_point`` (updates applied at the kill),
        ``promotion_s``, ``first_update_s`` (from the kill; None: never),
        ``lost_norm``, ``div_max``, ``within_div_max``, the push counts of :func:`account`,
        ``exactly_once``, ``reached`` (bool) and ``time_to_target`` (s, None if not reached).

    Returns
    -------
    list of dict
        Per victim in order of appearance: ``victim``, ``trials``, ``first_update``,
        ``promotion``, ``lost_norm_ratio`` (norm lost / div_max) and ``time_to_target``
        as (median, min, max) or None, ``within_div_max``, ``exactly_once`` and ``reached``
        (counts of trials), and totals of ``pushes``, ``applied``, ``dropped``, ``unknown``,
        ``unresolved``, ``duplicated``, ``applied_missing``, ``dropped_applied``,
        ``lost_updates``.
    """
    out = []
    for victim in dict.fromkeys(r["victim"] for r in rows):
        mine = [r for r in rows if r["victim"] == victim]
        out.append(
            {
                "victim": victim,
                "trials": len(mine),
                "first_update": spread(r["first_update_s"] for r in mine),
                "promotion": spread(r["promotion_s"] for r in mine),
                "lost_norm_ratio": spread(r["lost_norm"] / r["div_max"] for r in mine if r["div_max"] > 0),
                "time_to_target": spread(r["time_to_target"] for r in mine),
                "within_div_max": sum(1 for r in mine if r["within_div_max"]),
                "exactly_once": sum(1 for r in mine if r["exactly_once"]),
                "reached": sum(1 for r in mine if r["reached"]),
                **{k: sum(int(r[k]) for r in mine) for k in TOTALS},
            }
        )
    return out
