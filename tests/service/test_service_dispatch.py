"""Dispatcher: releases sends when predecessors are done or nearly done (fake clock)."""

from __future__ import annotations

import pytest

from mlfabric.scheduler.policies.base import Decision, InFlight, Send
from mlfabric.scheduler.policies.dispatch import Dispatcher


def _send(uid: str, after: tuple[str, ...] = (), start: float = 0.0, end: float = 0.0) -> Send:
    return Send(uid, "s", ("w", "s"), after, start, end)


def _flight(uid: str, end: float) -> InFlight:
    return InFlight(uid, "j", "ps", ("w", "s"), 100, 0.0, end)


def _ids(releases) -> list[str]:
    return [r.send.update_id for r in releases]


def test_independent_sends_go_at_once_in_plan_order() -> None:
    d = Dispatcher(margin=0.0)
    d.adopt(Decision(sends=(_send("b"), _send("a"))))
    assert _ids(d.release(now=3.0, in_flight={})) == ["b", "a"]
    assert d.planned == () and d.next_wakeup({}) is None


def test_successor_waits_until_near_expected_end_of_in_flight_predecessor() -> None:
    d = Dispatcher(margin=0.01)
    d.adopt(Decision(sends=(_send("b", after=("a",), start=1.0, end=3.0),)))
    in_flight = {"a": _flight("a", end=1.0)}
    assert d.release(now=0.5, in_flight=in_flight) == []
    assert d.next_wakeup(in_flight) == pytest.approx(0.99)
    assert d.release(now=0.98, in_flight=in_flight) == []
    (r,) = d.release(now=0.99, in_flight=in_flight)
    # released early: its planned duration counts from its predecessor's expected end
    assert (r.send.update_id, r.started_at, r.expected_end) == ("b", 0.99, pytest.approx(3.0))
    d.adopt(Decision(sends=(_send("c", after=("a",), start=1.0, end=3.0),)))
    (late,) = d.release(now=1.5, in_flight=in_flight)
    # released late: counted from the release
    assert late.expected_end == pytest.approx(3.5)


def test_report_of_predecessor_releases_successor_early() -> None:
    d = Dispatcher(margin=0.001)
    d.adopt(Decision(sends=(_send("b", after=("a",), start=1.0, end=2.0),)))
    assert d.release(now=0.2, in_flight={"a": _flight("a", end=1.0)}) == []
    # "a" reported done: no longer in flight, nor planned
    assert _ids(d.release(now=0.3, in_flight={})) == ["b"]


def test_chain_behind_planned_predecessor_is_released_link_by_link() -> None:
    d = Dispatcher(margin=0.0)
    plan = (_send("a", start=0.0, end=1.0), _send("b", ("a",), 1.0, 3.0), _send("c", ("b",), 3.0, 4.0))
    d.adopt(Decision(sends=plan))
    first = d.release(now=0.0, in_flight={})
    assert _ids(first) == ["a"]
    in_flight = {"a": _flight("a", first[0].expected_end)}
    assert d.next_wakeup(in_flight) == 1.0  # "c" waits for "b", which is still planned
    assert _ids(d.release(now=1.0, in_flight=in_flight)) == ["b"]
    assert _ids(d.release(now=2.5, in_flight={"b": _flight("b", 3.0)})) == []
    assert _ids(d.release(now=3.0, in_flight={"b": _flight("b", 3.0)})) == ["c"]


def test_short_chain_goes_in_one_call_only_as_far_as_the_margin_reaches() -> None:
    d = Dispatcher(margin=0.25)
    chain = [_send("a", (), 0.0, 0.1)]
    for prev, uid in zip("abcd", "bcde", strict=True):
        chain.append(_send(uid, (prev,), 0.0, 0.1))
    d.adopt(Decision(sends=tuple(chain)))
    released = d.release(now=0.0, in_flight={})
    # a ends at 0.1, b at 0.2, c at 0.3 (each after the one before); d may start at 0.3 - 0.25
    assert _ids(released) == ["a", "b", "c"]
    assert [r.expected_end for r in released] == pytest.approx([0.1, 0.2, 0.3])
    in_flight = {r.send.update_id: _flight(r.send.update_id, r.expected_end) for r in released}
    assert d.next_wakeup(in_flight) == pytest.approx(0.05)


def test_adopt_replaces_unreleased_sends_and_forget_removes() -> None:
    d = Dispatcher(margin=0.0)
    in_flight = {"x": _flight("x", end=5.0)}
    d.adopt(Decision(sends=(_send("a", ("x",), 5.0, 6.0), _send("b", ("a",), 6.0, 7.0))))
    assert d.release(now=1.0, in_flight=in_flight) == []
    # a shorter update arrives: the policy re-plans every unreleased update
    d.adopt(
        Decision(
            sends=(_send("c", ("x",), 5.0, 5.5), _send("a", ("c",), 5.5, 6.5), _send("b", ("a",), 6.5, 7.5))
        )
    )
    assert [s.update_id for s in d.planned] == ["c", "a", "b"]
    d.forget(["c"])
    assert _ids(d.release(now=5.0, in_flight=in_flight)) == ["a"]


def test_negative_margin_is_refused() -> None:
    with pytest.raises(ValueError, match="margin"):
        Dispatcher(margin=-1.0)
