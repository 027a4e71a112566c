"""Stall expiry of an aggregate's transfers resolves each member once, through the aggregate.

Issue #16: a transfer with no report past its stall deadline is forgotten so it cannot hold
its bottleneck (``SchedulerState.expire_stalled``). For an aggregate's transfers that used to
write a bare DROPPED record for the aggregate or the member (the member could later resolve
APPLIED through the aggregate as well). Now the aggregate book frees their links and each
member resolves exactly once: from the aggregator's report or, with none, UNKNOWN at the
forward timeout; a stalled member's aggregate fails and the member is planned afresh when its
source reports. The service core runs without gRPC, as in ``test_service_aggregates.py``.
"""

from __future__ import annotations

from typing import Any

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.service.records import OutcomeKind
from tests.service.test_service_aggregates import drain, members_in, report
from tests.service.test_service_aggregates import env as env


def _forwarded(env: dict[str, Any]) -> None:
    core, s = env["core"], env["s"]
    drain(s)
    members_in(env)
    report(core, s["w0"], "u0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=1)
    [(kind, send)] = drain(s)["x"]
    assert (kind, send.update_id) == ("send", "agg:ps:0")
    assert "agg:ps:0" in core.state.in_flight


def test_a_stalled_forwarded_aggregate_frees_its_links_and_resolves_from_its_report(
    env: dict[str, Any],
) -> None:
    core, s, clock = env["core"], env["s"], env["clock"]
    _forwarded(env)
    clock.now = 100.0  # past the stall deadline (30 s + 4 x the expected time), before the forward timeout
    core.expire_stalled()
    assert "agg:ps:0" not in core.state.in_flight  # the server's link is free
    assert "agg:ps:0" not in core.state.outcomes  # no bare DROPPED record
    assert not any(u in core.state.outcomes for u in ("u1", "u2", "u3"))
    assert drain(s) == {}  # nothing resolved yet: the aggregate may still be applied
    verdicts = [
        pb.MemberVerdict(update_id=u, outcome=pb.OUTCOME_APPLIED, delay=1) for u in ("u1", "u2", "u3")
    ]
    report(
        core, s["x"], "agg:ps:0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=2, member_verdicts=verdicts
    )
    out = drain(s)
    assert {h: [(k, d.update_id, d.outcome) for k, d in ds] for h, ds in out.items()} == {
        f"w{i}": [("resolve", f"u{i}", pb.OUTCOME_APPLIED)] for i in (1, 2, 3)
    }
    assert [core.state.outcomes[u].kind for u in ("u1", "u2", "u3")] == [OutcomeKind.APPLIED] * 3
    assert not core.aggregates.executions


def test_a_stalled_forwarded_aggregate_without_a_report_resolves_each_member_unknown_once(
    env: dict[str, Any],
) -> None:
    core, s, clock = env["core"], env["s"], env["clock"]
    _forwarded(env)
    clock.now = 100.0
    core.expire_stalled()
    assert drain(s) == {}
    clock.now = 1000.0  # the forward timeout
    core._execute(core.aggregates.expire(clock.now))
    core.expire_stalled()
    out = drain(s)
    resolves = {h: [d for k, d in ds if k == "resolve"] for h, ds in out.items() if h != "x"}
    assert {h: [(d.update_id, d.outcome) for d in ds] for h, ds in resolves.items()} == {
        f"w{i}": [(f"u{i}", pb.OUTCOME_UNKNOWN)] for i in (1, 2, 3)
    }
    assert all("timed out waiting for its report" in ds[0].reason for ds in resolves.values())
    assert "agg:ps:0" not in core.state.outcomes
    assert [core.state.outcomes[u].kind for u in ("u1", "u2", "u3")] == [OutcomeKind.UNKNOWN] * 3
    # a late report finds nothing to resolve again
    report(core, s["x"], "agg:ps:0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=2)
    assert drain(s) == {}


def test_a_stalled_member_fails_its_aggregate_and_is_planned_again_once_its_source_reports(
    env: dict[str, Any],
) -> None:
    core, s, clock = env["core"], env["s"], env["clock"]
    drain(s)
    report(core, s["w1"], "u1", "x")  # u1 in at x; u2 released to x and never reported
    drain(s)
    assert "u2" in core.state.in_flight
    clock.now = 100.0
    core.expire_stalled()
    assert "u2" not in core.state.in_flight and "u2" not in core.state.outcomes  # no bare DROPPED
    out = drain(s)
    [drop] = [d for k, d in out["x"] if k == "drop"]
    assert drop.update_id == "agg:ps:0" and "member no report on the transfer of 'u2'" in drop.reason
    assert "u1" in core.state.pending and "u2" not in core.state.pending  # u2: its source holds it
    report(core, s["w2"], "u2", "x", ok=False, error="the aggregate was abandoned")
    assert "u2" in core.state.pending  # planned afresh, once
    assert not any(u in core.state.outcomes for u in ("u1", "u2", "u3"))
