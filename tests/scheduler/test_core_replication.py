"""Replication keeps the divergence within div_max (paper Fig. 3)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.scheduler.policies.replication import divergence, plan_replication


def test_hold_and_preemptive_send() -> None:
    d = plan_replication({"a": 1.0, "b": 2.0}, {"a"}, div_max=2.5, to_apply=[("c", 1.0), ("d", 0.1)])
    assert d.divergence == 2.0
    assert d.apply_now == () and d.hold == ("c", "d")  # c would make it 3.0 > 2.5; d waits behind it
    assert d.send_now == ("b", "c", "d") and d.urgent
    landed = plan_replication(
        {"a": 1.0, "b": 2.0}, {"a", "c"}, div_max=2.5, to_apply=[("c", 1.0), ("d", 0.1)]
    )
    assert landed.apply_now == ("c", "d")  # c is at the replica: applying it adds nothing
    assert landed.divergence_after == pytest.approx(2.1)


def test_largest_norm_first_and_in_flight_not_resent() -> None:
    d = plan_replication({"a": 0.1, "b": 0.5, "c": 0.3}, set(), div_max=10.0, in_flight={"c"})
    assert d.send_now == ("b", "a") and not d.urgent


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="div_max"):
        plan_replication({}, set(), div_max=-1.0)
    with pytest.raises(ValueError, match="already exceeds"):
        plan_replication({"a": 2.0}, set(), div_max=1.0)


events = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.floats(0.0, 3.0, allow_nan=False)),
        st.tuples(st.just("land"), st.integers(0, 5)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(events, st.floats(0.0, 4.0, allow_nan=False))
def test_divergence_never_exceeds_div_max_and_everything_is_applied(
    ops: list[tuple[str, float]], div_max: float
) -> None:
    applied: dict[str, float] = {}
    at_replica: set[str] = set()
    in_flight: list[str] = []
    waiting: list[tuple[str, float]] = []

    def step() -> None:
        d = plan_replication(applied, at_replica, div_max=div_max, to_apply=waiting, in_flight=set(in_flight))
        for uid in d.apply_now:
            applied[uid] = dict(waiting)[uid]
        waiting[:] = [w for w in waiting if w[0] not in d.apply_now]
        in_flight.extend(d.send_now)
        assert divergence(applied, at_replica) <= div_max + 1e-9

    for i, (kind, value) in enumerate(ops):
        if kind == "push":
            waiting.append((f"u{i}", float(value)))
        else:
            k = int(value) % (len(in_flight) + 1)
            at_replica.update(in_flight[:k])  # replica transfers land in any batch
            del in_flight[:k]
        step()
    for _ in range(len(ops) + 2):  # liveness: once the replica catches up, everything is applied
        at_replica.update(in_flight)
        in_flight.clear()
        step()
    assert not waiting
