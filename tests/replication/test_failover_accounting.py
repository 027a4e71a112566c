"""The exactly-once accounting of experiments/failover_training.py (pure; no processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
try:
    import failover_accounting as acc
    from failover_training import kill_points
finally:
    sys.path.pop(0)


def _push(uid: str, status: str, norm: float = 1.0, reason: str = "") -> dict[str, object]:
    return {"id": uid, "status": status, "norm": norm, "reason": reason}


def test_a_clean_failover_is_exactly_once_and_counts_the_lost_norm() -> None:
    shadow = [{"id": "a/1", "norm": 1.0}, {"id": "a/2", "norm": 1.5}, {"id": "b/1", "norm": 0.5}]
    replica = [
        {"id": "a/1", "promoted": False},
        {"id": "b/2", "promoted": True},  # pushed after the promotion
        {"id": "b/1", "promoted": True},  # re-routed: the server's verdict was lost with it
    ]
    pushes = [
        _push("a/1", "APPLIED"),
        _push("a/2", "APPLIED", 1.5),  # applied at the server, never replicated: lost
        _push("b/1", "APPLIED", 0.5),
        _push("b/2", "APPLIED"),
        _push("b/3", "DROPPED", reason="server 'ps0' failed"),
    ]
    r = acc.account(shadow, replica, pushes, div_max=2.0)
    assert (r["lost_updates"], r["lost_applied"], r["lost_norm"]) == (1, 1, 1.5)
    assert r["within_div_max"] and r["exactly_once"]
    assert (r["applied"], r["dropped"], r["dropped_server_failed"]) == (4, 1, 1)
    assert not acc.account(shadow, replica, pushes, div_max=1.0)["within_div_max"]


@pytest.mark.parametrize(
    ("replica", "pushes", "violation"),
    [
        # re-routed and applied again by the promoted replica although it had it replicated
        ([{"id": "a/1"}, {"id": "a/1"}], [_push("a/1", "APPLIED")], "duplicated"),
        # reported APPLIED, held by neither model
        ([], [_push("a/1", "APPLIED"), _push("a/9", "APPLIED")], "applied_missing"),
        # reported DROPPED but the surviving model applied it
        (
            [{"id": "a/1"}, {"id": "b/1"}],
            [_push("a/1", "APPLIED"), _push("b/1", "DROPPED")],
            "dropped_applied",
        ),
        # no verdict within the push timeout
        ([{"id": "a/1"}], [_push("a/1", "APPLIED"), _push("b/1", "UNRESOLVED")], "unresolved"),
    ],
)
def test_each_violation_of_exactly_once_is_counted(
    replica: list[dict[str, object]], pushes: list[dict[str, object]], violation: str
) -> None:
    r = acc.account([{"id": "a/1", "norm": 1.0}], replica, pushes, div_max=1.0)
    assert r[violation] == 1
    assert not r["exactly_once"]


def test_aggregates_count_by_their_members() -> None:
    """An aggregate the server applied and the replica lacks loses its members' norms."""
    shadow = [{"id": "agg/1", "members": ["a/1", "b/1"], "norm": 3.0}]
    pushes = [_push("a/1", "APPLIED", 1.0), _push("b/1", "APPLIED", 2.0), _push("a/2", "APPLIED", 1.0)]
    replica = [{"id": "a/2", "members": ["a/2"], "promoted": True}]
    r = acc.account(shadow, replica, pushes, div_max=2.5)
    assert (r["lost_updates"], r["lost_norm"], r["within_div_max"]) == (2, 3.0, False)
    replica.insert(0, {"id": "agg/1", "members": ["a/1", "b/1"], "promoted": False})
    r = acc.account(shadow, replica, pushes, div_max=2.5)
    assert (r["lost_updates"], r["exactly_once"]) == (0, True)


def test_summary_and_kill_points() -> None:
    row = {
        "victim": "process", "first_update_s": 0.1, "promotion_s": 0.05, "lost_norm": 1.0, "div_max": 2.0,
        "time_to_target": 5.0, "within_div_max": True, "exactly_once": True, "reached": True,
        **{k: 1 for k in acc.TOTALS},
    }  # fmt: skip
    rows = [row, {**row, "first_update_s": 0.3, "lost_norm": 0.0, "reached": False, "time_to_target": None}]
    (s,) = acc.summarize(rows)
    assert s["first_update"] == (0.2, 0.1, 0.3)
    assert s["lost_norm_ratio"] == (0.25, 0.0, 0.5)
    assert (s["reached"], s["time_to_target"], s["applied"]) == (1, (5.0, 5.0, 5.0), 2)
    assert kill_points(20, 90, 10)[0] == 20 and kill_points(20, 90, 10)[-1] == 90


def test_a_dropped_update_the_failed_server_applied_is_lost_not_a_violation() -> None:
    """Re-routed after the failed server applied it (its ACK lost), then DROPPED by the promoted
    replica: the model training goes on with lacks it, as the verdict says; its norm is lost."""
    shadow = [{"id": "a/1", "norm": 1.0}, {"id": "a/2", "norm": 1.0}]
    replica = [{"id": "a/1", "promoted": False}]
    pushes = [_push("a/1", "APPLIED"), _push("a/2", "DROPPED", reason="base version 3 is ahead")]
    r = acc.account(shadow, replica, pushes, div_max=2.0)
    assert (r["dropped_applied"], r["dropped_lost"], r["lost_updates"], r["lost_applied"]) == (0, 1, 1, 0)
    assert r["exactly_once"] and r["lost_norm"] == 1.0
