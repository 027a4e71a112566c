"""The invariant checker rejects every kind of violation and accepts valid plans."""

from __future__ import annotations

import pytest

from mlfabric.scheduler.core.checker import ScheduleError, check_schedule
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.core.schedule import Aggregate, Reservation, Schedule, Transfer, Update

G = star(["ps", "w1", "w2", "agg"], 8.0)  # every NIC 1 byte/s each way
U1 = Update("u1", "w1", "ps", 2.0, base_version=0)
U1_NEW = Update("u1", "w1", "ps", 2.0, base_version=2)
U2 = Update("u2", "w2", "ps", 2.0, base_version=0)


def direct(uid: str, src: str, start: float, rate: float = 1.0, nbytes: float = 2.0) -> Transfer:
    return Transfer.at_rate(uid, (src, "sw", "ps"), start=start, bytes=nbytes, rate=rate)


def test_time_shared_plan_passes_and_reports_delays() -> None:
    s = Schedule(transfers=(direct("u1", "w1", 0.0), direct("u2", "w2", 2.0)))
    result = check_schedule(G, s, updates=[U1, U2], server_version=3)
    assert result.delays == {"u1": 3, "u2": 4}
    assert result.arrivals == {"ps": ("u1", "u2")}


def test_concurrent_transfers_overload_the_server_link() -> None:
    s = Schedule(transfers=(direct("u1", "w1", 0.0), direct("u2", "w2", 1.0)))
    with pytest.raises(ScheduleError, match=r"link \('sw', 'ps'\) over capacity at t=1"):
        check_schedule(G, s, updates=[U1, U2])


def test_fair_sharing_at_half_rate_fits() -> None:
    s = Schedule(transfers=(direct("u1", "w1", 0.0, rate=0.5), direct("u2", "w2", 0.0, rate=0.5)))
    assert check_schedule(G, s, updates=[U1, U2]).delays == {"u1": 0, "u2": 1}


def test_missing_update_is_named() -> None:
    with pytest.raises(ScheduleError, match="'u2' is neither delivered, dropped nor aggregated"):
        check_schedule(G, Schedule(transfers=(direct("u1", "w1", 0.0),)), updates=[U1, U2])


def test_update_delivered_twice() -> None:
    s = Schedule(transfers=(direct("u1", "w1", 0.0), direct("u1", "w1", 2.0)))
    with pytest.raises(ScheduleError, match="'u1' is delivered twice"):
        check_schedule(G, s, updates=[U1])


def test_dropped_update_must_not_move() -> None:
    s = Schedule(transfers=(direct("u1", "w1", 0.0),), drops={"u1": "stale"})
    with pytest.raises(ScheduleError, match="dropped"):
        check_schedule(G, s, updates=[U1])


def test_start_before_ready() -> None:
    late = Update("u1", "w1", "ps", 2.0, ready_at=5.0)
    with pytest.raises(ScheduleError, match="ready at w1 at t=5"):
        check_schedule(G, Schedule(transfers=(direct("u1", "w1", 0.0),)), updates=[late])


def test_reservation_must_carry_the_bytes_on_every_link() -> None:
    t = direct("u1", "w1", 0.0)
    short = Transfer(t.payload_id, t.src, t.dst, t.path, t.start, t.end, t.bytes, t.reservations[:1])
    with pytest.raises(ScheduleError, match=r"link \('sw', 'ps'\) carries 0 of its 2 bytes"):
        check_schedule(G, Schedule(transfers=(short,)), updates=[U1])


def test_reservation_off_path() -> None:
    t = direct("u1", "w1", 0.0)
    bad = Transfer(
        t.payload_id, t.src, t.dst, t.path, t.start, t.end, t.bytes,
        (*t.reservations, Reservation(("w2", "sw"), 0.0, 1.0, 1.0)),
    )  # fmt: skip
    with pytest.raises(ScheduleError, match="not on its path"):
        check_schedule(G, Schedule(transfers=(bad,)), updates=[U1])


def aggregated(agg_start: float, agg_bytes: float = 2.0) -> Schedule:
    to_agg = tuple(
        Transfer.at_rate(u, (w, "sw", "agg"), start=0.0, bytes=2.0, rate=0.5)
        for u, w in [("u1", "w1"), ("u2", "w2")]
    )
    out = Transfer.at_rate("a1", ("agg", "sw", "ps"), start=agg_start, bytes=agg_bytes, rate=1.0)
    return Schedule(transfers=(*to_agg, out), aggregates=(Aggregate("a1", "agg", ("u1", "u2"), agg_bytes),))


def test_aggregate_after_members_passes() -> None:
    result = check_schedule(G, aggregated(4.0), updates=[U1, U2], tau_max=0)
    assert result.delays == {"u1": 0, "u2": 0}  # one model step for both
    assert result.arrivals == {"ps": ("a1",)}


def test_aggregate_leaving_early() -> None:
    with pytest.raises(
        ScheduleError, match="aggregate 'a1' leaves agg at t=3 before member 'u1' arrived at t=4"
    ):
        check_schedule(G, aggregated(3.0), updates=[U1, U2])


def test_aggregate_size_is_one_updates() -> None:
    with pytest.raises(ScheduleError, match="not one update's size"):
        check_schedule(G, aggregated(4.0, agg_bytes=4.0), updates=[U1, U2])


def test_member_sent_to_the_server_instead_of_its_aggregator() -> None:
    s = aggregated(4.0)
    wrong = (direct("u1", "w1", 10.0), *s.transfers[1:])
    with pytest.raises(ScheduleError, match="'u1' is delivered to ps, its next hop is agg"):
        check_schedule(G, Schedule(transfers=wrong, aggregates=s.aggregates), updates=[U1, U2])


def test_tau_max_violation_names_update_and_numbers() -> None:
    old = Update("u2", "w2", "ps", 2.0, base_version=1)
    s = Schedule(transfers=(direct("u1", "w1", 0.0), direct("u2", "w2", 2.0)))
    check_schedule(G, s, updates=[U1_NEW, old], tau_max=2, server_version=2)
    with pytest.raises(ScheduleError, match=r"'u2' applied at server ps at t=4 with delay 2 > tau_max 1"):
        check_schedule(G, s, updates=[U1_NEW, old], tau_max=1, server_version=2)


def test_arrivals_must_follow_end_times() -> None:
    s = Schedule(transfers=(direct("u1", "w1", 0.0), direct("u2", "w2", 2.0)), arrivals=("u2", "u1"))
    with pytest.raises(ScheduleError, match="'u1' is listed after 'u2' but arrives earlier"):
        check_schedule(G, s, updates=[U1, U2])


def test_replica_copies_use_capacity_but_are_not_deliveries() -> None:
    copy = Transfer.at_rate("u1", ("w1", "sw", "agg"), start=0.0, bytes=2.0, rate=1.0, replica=True)
    s = Schedule(transfers=(direct("u1", "w1", 0.0), copy))
    with pytest.raises(ScheduleError, match=r"link \('w1', 'sw'\) over capacity"):
        check_schedule(G, s, updates=[U1])
    later = Transfer.at_rate("u1", ("w1", "sw", "agg"), start=2.0, bytes=2.0, rate=1.0, replica=True)
    assert check_schedule(G, Schedule(transfers=(direct("u1", "w1", 0.0), later)), updates=[U1]).delays == {
        "u1": 0
    }


def test_capacity_profile_is_honoured() -> None:
    s = Schedule(transfers=(direct("u1", "w1", 0.0),))
    with pytest.raises(ScheduleError, match=r"over capacity at t=1: 1 B/s reserved of 0.5 B/s"):
        check_schedule(G, s, updates=[U1], capacity_profiles={("sw", "ps"): [(1.0, 0.5)]})
