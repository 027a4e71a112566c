"""The daemon's pure books: spec checks, update ids, and de-duplicated server hand-off."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from mlfabric.daemon.roles.base import Verdict
from mlfabric.daemon.roles.server.handoff import ServerHandoff
from mlfabric.daemon.roles.worker.pushes import OutgoingPushes, PendingPush, PushState
from mlfabric.proto.v1 import control_pb2
from mlfabric.tensors import Layout
from mlfabric.wire.tensors import check_update

SPEC = {"w": ("float32", (2, 3)), "b": ("float64", (4,))}


def _layouts(**tensors: tuple[str, tuple[int, ...]]) -> list[Layout]:
    return [Layout(n, d, s, 0, 0) for n, (d, s) in tensors.items()]


def test_matching_update_passes() -> None:
    assert check_update(SPEC, _layouts(b=("float64", (4,)), w=("float32", (2, 3))), "ps0") is None


@pytest.mark.parametrize(
    ("layouts", "words"),
    [
        (_layouts(w=("float32", (3, 2)), b=("float64", (4,))), ["'w'", "(3, 2)", "(2, 3)"]),
        (_layouts(w=("float32", (2, 3)), b=("float16", (4,))), ["'b'", "float16", "float64"]),
        (_layouts(w=("float32", (2, 3))), ["'b'", "missing"]),
        (
            _layouts(w=("float32", (2, 3)), b=("float64", (4,)), z=("float32", (1,))),
            ["'z'", "not in the model"],
        ),
    ],
)
def test_mismatch_names_tensor_and_both_sides(layouts: list[Layout], words: list[str]) -> None:
    message = check_update(SPEC, layouts, "server 'ps0'")
    assert message is not None
    for word in words:
        assert word in message


def test_duplicate_tensor_names_are_refused() -> None:
    layouts = _layouts(w=("float32", (2, 3))) * 2
    assert "more than once" in (check_update(SPEC, layouts, "ps0") or "")


class _Gone:
    """A pushing process that has gone (the book never tells it anything)."""

    def send(self, event: Any) -> bool:
        return False


def test_outgoing_book_states() -> None:
    book = OutgoingPushes("h")
    pushes: list[PendingPush] = []
    for _ in range(3):
        uid = book.new_update_id()
        push = PendingPush(uid, "j", "ps0", "w0", -1, [], 0, 0.0, 0, 0.0, 0, _Gone())
        pushes.append(push)
        book.add(push)
    assert book.start_sending("h/1") is pushes[0]
    assert book.start_sending("h/1") is None  # a duplicate directive does not send twice
    assert book.hold("h/1", 0.0) and pushes[0].state is PushState.HELD  # sent to an aggregator
    assert not book.hold("h/2", 0.0)  # only a push being sent is held
    assert book.unhold("j", "w0") == [pushes[0]] and pushes[0].state is PushState.READY
    assert book.waiting("h/1") is pushes[0] and book.start_sending("h/1") is pushes[0]
    assert [p.update_id for p in book.take_waiting()] == ["h/2", "h/3"]
    assert len(book) == 1 and book.take("h/1") is pushes[0] and book.take("h/1") is None


def test_concurrent_retries_deliver_once_and_share_the_verdict() -> None:
    delivered: list[str] = []
    handoff: ServerHandoff

    def deliver(update_id: str, header: Any, fd: int) -> None:
        delivered.append(update_id)
        threading.Timer(
            0.1, handoff.verdicts.resolve, (update_id, Verdict(control_pb2.OUTCOME_APPLIED, 0, 1, ""))
        ).start()

    handoff = ServerHandoff("j", "ps0", {}, 0, deliver)
    results: list[Verdict] = []
    threads = [
        threading.Thread(target=lambda: results.append(handoff.handle("u", None, -1, 5))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert delivered == ["u"]
    assert [r.version for r in results] == [1, 1, 1, 1]
    assert handoff.version == 1


def test_closed_server_answers_delivered_updates_unknown_and_drops_new_ones() -> None:
    """Handed over but no verdict: applied or not cannot be known, so UNKNOWN, never DROPPED."""
    handoff = ServerHandoff("j", "ps0", {}, 3, lambda *a: None)
    results: list[Verdict] = []
    t = threading.Thread(target=lambda: results.append(handoff.handle("u", None, -1, 5)))
    t.start()
    threading.Event().wait(0.05)
    handoff.close("server process gone")
    t.join(5)
    assert results[0].outcome == control_pb2.OUTCOME_UNKNOWN and "server process gone" in results[0].reason
    assert handoff.handle("u", None, -1, 5).outcome == control_pb2.OUTCOME_UNKNOWN  # a retry: the same
    again = handoff.handle("v", None, -1, 5)  # never handed over: certainly not applied
    assert again.outcome == control_pb2.OUTCOME_DROPPED and "gone" in again.reason


def test_failed_hand_off_is_dropped_and_a_verdict_timeout_is_unknown() -> None:
    def unreachable(*args: Any) -> None:
        raise ConnectionError("server process 'ps0' disconnected")

    failed = ServerHandoff("j", "ps0", {}, 0, unreachable).handle("u", None, -1, 5)
    assert failed.outcome == control_pb2.OUTCOME_DROPPED and "disconnected" in failed.reason
    silent = ServerHandoff("j", "ps0", {}, 0, lambda *a: None).handle("u", None, -1, 0.05)
    assert silent.outcome == control_pb2.OUTCOME_UNKNOWN and "no verdict" in silent.reason


def test_verdict_cache_is_bounded() -> None:
    handoff = ServerHandoff("j", "ps0", {}, 0, lambda *a: None, max_verdicts=2)
    for i in range(3):
        handoff.verdicts.resolve(f"u{i}", Verdict(control_pb2.OUTCOME_APPLIED, 0, i + 1, ""))
    assert handoff.handle("u2", None, -1, 1).version == 3
    assert handoff.handle("u0", None, -1, 0.05).outcome == control_pb2.OUTCOME_UNKNOWN  # forgotten: times out
