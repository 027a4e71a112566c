"""The server daemon's de-duplication of aggregates by id (DESIGN §3: every push resolves once).

An aggregate id already answered at the server is answered from that memory only for the
members it was applied with. The same id with other members (a restarted scheduler that
numbered its aggregates from 0 again) is refused, DROPPED naming the id, and its members
are DROPPED: never reported APPLIED on the earlier aggregate's verdict.
"""

from __future__ import annotations

import threading
from typing import Any

from mlfabric.daemon.channels.frames import Frame, FrameHeader, TransferStats
from mlfabric.daemon.roles.base import Verdict
from mlfabric.daemon.roles.server.handoff import ServerHandoff
from mlfabric.daemon.roles.server.rounds import ServerAggregation
from mlfabric.proto.v1 import control_pb2

APPLIED, DROPPED = control_pb2.OUTCOME_APPLIED, control_pb2.OUTCOME_DROPPED


class Server:
    """A server role whose process applies every payload at once (version + 1)."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, list[str]]] = []
        self.handoff = ServerHandoff("j", "ps0", {}, 0, self._deliver)
        self.aggregation = ServerAggregation(alloc=lambda n: None)

    def _deliver(self, update_id: str, header: Any, fd: int) -> None:
        self.applied.append((update_id, [m.update_id for m in header.members]))
        self.handoff.verdicts.resolve(update_id, Verdict(APPLIED, 0, self.handoff.version + 1, ""))

    def _hand_off(self, update_id: str, header: Any, buffer: Any) -> Verdict:
        return self.handoff.handle(update_id, header, -1, timeout=5.0)

    def push(self, update_id: str, members: tuple[str, ...] = ()) -> tuple[Verdict, dict[str, Any]]:
        header = FrameHeader(
            update_id=update_id,
            job="j",
            server="ps0",
            members=[control_pb2.AggregateMember(update_id=m, base_version=0) for m in members],
        )
        frame = Frame(header, memoryview(b""), None, TransferStats(bytes=0, start=0.0, end=0.0))
        verdict, verdicts = self.aggregation.handle(frame, self.handoff, None, self._hand_off)
        return verdict, {v.update_id: v for v in verdicts}


def test_same_members_resent_get_the_stored_verdict_and_are_not_applied_again() -> None:
    s = Server()
    first, _ = s.push("agg:ps:4", ("w0/1", "w1/1"))
    again, members_again = s.push("agg:ps:4", ("w1/1", "w0/1"))
    assert first.outcome == APPLIED and again == first
    assert {u: v.outcome for u, v in members_again.items()} == {"w0/1": APPLIED, "w1/1": APPLIED}
    assert s.applied == [("agg:ps:4", ["w0/1", "w1/1"])]


def test_aggregate_id_reused_with_other_members_is_refused_naming_it() -> None:
    s = Server()
    s.push("agg:ps:4", ("w0/1", "w1/1"))
    verdict, members = s.push("agg:ps:4", ("w0/7", "w1/7"))  # a restarted scheduler's agg:ps:4
    assert verdict.outcome == DROPPED
    assert "agg:ps:4" in verdict.reason and "already used" in verdict.reason
    assert {u: v.outcome for u, v in members.items()} == {"w0/7": DROPPED, "w1/7": DROPPED}
    assert all("agg:ps:4" in v.reason for v in members.values())
    assert s.applied == [("agg:ps:4", ["w0/1", "w1/1"])]  # the new members were not applied
    # their verdict is remembered: a direct re-send of a member gets the same DROPPED
    assert s.push("w0/7")[0].outcome == DROPPED and len(s.applied) == 1
    # and the id still answers the earlier members' re-send from memory
    again, earlier = s.push("agg:ps:4", ("w0/1", "w1/1"))
    assert again.outcome == APPLIED and set(earlier) == {"w0/1", "w1/1"}


def test_reused_id_keeps_the_verdict_of_a_member_applied_already() -> None:
    s = Server()
    s.push("agg:ps:0", ("w0/1", "w1/1"))
    s.push("w2/1")
    verdict, members = s.push("agg:ps:0", ("w2/1", "w0/2"))
    assert verdict.outcome == DROPPED
    assert (members["w2/1"].outcome, members["w0/2"].outcome) == (APPLIED, DROPPED)
    assert [u for u, _ in s.applied] == ["agg:ps:0", "w2/1"]


def test_fresh_ids_after_a_restart_are_applied() -> None:
    s = Server()
    s.push("agg:ps.1a2b:4", ("w0/1", "w1/1"))
    verdict, members = s.push("agg:ps.9c8d:4", ("w0/7", "w1/7"))
    assert verdict.outcome == APPLIED and {v.outcome for v in members.values()} == {APPLIED}
    assert len(s.applied) == 2


def test_copy_arriving_while_the_first_is_applied_gets_its_verdict() -> None:
    s = Server()
    copy: dict[str, Any] = {}
    plain = s._hand_off

    def hand_off(update_id: str, header: Any, buffer: Any) -> Verdict:
        verdict = plain(update_id, header, buffer)  # the id is answered, its members not yet
        t = threading.Thread(target=lambda: copy.update(r=s.push("agg:ps:4", ("w0/1", "w1/1"))))
        t.start()
        t.join(0.2)  # the copy now waits for the first frame's members
        copy["thread"] = t
        return verdict

    s._hand_off = hand_off  # type: ignore[method-assign]
    first, _ = s.push("agg:ps:4", ("w0/1", "w1/1"))
    copy["thread"].join(5.0)
    verdict, members = copy["r"]
    assert verdict == first and {v.outcome for v in members.values()} == {APPLIED}
    stored = s.handoff.verdicts.stored("w0/1")
    assert stored is not None and stored.outcome == APPLIED
    assert len(s.applied) == 1
