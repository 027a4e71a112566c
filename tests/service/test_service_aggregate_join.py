# ruff: noqa: F811  (the tests take the imported ``env`` fixture)
"""The service lets a later update join an aggregate being gathered (stf+agg online).

Same hosts as ``test_service_aggregates``: ``u0`` goes to ``ps`` directly (1 s on its 1 MB/s
ingress) while ``u1..u3`` are gathered at ``x``; ``u4`` becomes ready meanwhile and joins.
"""

from __future__ import annotations

from typing import Any

from mlfabric.proto.v1 import control_pb2 as pb
from tests.service.test_service_aggregates import drain, env, report  # noqa: F401  (env: the fixture)

msg = pb.DaemonMessage


def _joined(env: dict[str, Any]) -> dict[str, list[Any]]:
    core, s, clock = env["core"], env["s"], env["clock"]
    drain(s)
    for i in (1, 2):
        report(core, s[f"w{i}"], f"u{i}", "x")  # u1, u2 in; u3 released after them
    drain(s)
    clock.now = 0.1
    ready = pb.UpdateReady(update_id="u4", job="j", server="s", worker="w0", bytes=10**6)
    core.on_message(s["w0"], msg(update_ready=ready))
    core.decide()
    return drain(s)


def test_a_later_update_joins_the_aggregate_and_the_directive_is_reissued(env: dict[str, Any]) -> None:
    out = _joined(env)
    [(_, directive)] = [x for x in out["x"] if x[0] == "aggregate"]
    assert directive.aggregate_id == "agg:ps:0"
    assert [m.update_id for m in directive.members] == ["u1", "u2", "u3", "u4"]
    sends = [d for k, d in out.get("w0", []) if k == "send"]
    assert [(d.update_id, d.next_hop_host, d.aggregate_id) for d in sends] == [("u4", "x", "agg:ps:0")]


def test_the_aggregate_waits_for_its_joined_member_then_resolves_it_once(env: dict[str, Any]) -> None:
    core, s, clock = env["core"], env["s"], env["clock"]
    _joined(env)
    report(core, s["w3"], "u3", "x")
    # the aggregator announced the aggregate before u4 joined: that announcement must not let
    # it leave without u4
    core.on_message(s["x"], msg(update_ready=pb.UpdateReady(update_id="agg:ps:0", job="j", server="s")))
    report(core, s["w0"], "u0", "ps", outcome=pb.OUTCOME_APPLIED, server_version=1)
    clock.now = 1.5
    core.release()
    assert not [d for k, d in drain(s).get("x", []) if k == "send"]
    report(core, s["w0"], "u4", "x")
    core.release()
    [fwd] = [d for k, d in drain(s).get("x", []) if k == "send"]
    assert fwd.update_id == "agg:ps:0" and fwd.next_hop_host == "ps"
    verdicts = [pb.MemberVerdict(update_id=f"u{i}", outcome=pb.OUTCOME_APPLIED, delay=1) for i in range(1, 5)]
    m = pb.TransferReport(
        update_id="agg:ps:0",
        dst_host="ps",
        bytes=10**6,
        start=1.5,
        end=2.5,
        ok=True,
        outcome=pb.OUTCOME_APPLIED,
        server_version=2,
        member_verdicts=verdicts,
    )
    core.on_message(s["x"], msg(transfer_report=m))
    out = drain(s)
    resolved = sorted(d.update_id for h in out.values() for k, d in h if k == "resolve")
    assert resolved == ["u1", "u2", "u3", "u4"]
    assert all(core.state.outcomes[f"u{i}"].kind.name == "APPLIED" for i in range(1, 5))
