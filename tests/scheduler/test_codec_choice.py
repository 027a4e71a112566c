"""The ``auto`` codec rule (issue 26): none where the link is fast, compressed where it is slow."""

from __future__ import annotations

import math

import pytest

from mlfabric.scheduler.core.codec_choice import (
    MEASURED_RATES,
    AutoSpec,
    CodecRate,
    auto_spec,
    choose_codec,
    is_auto,
    parse_auto,
)

MB = 4_500_000  # the testbed's digits MLP update, float32


def mbps(rate: float) -> float:
    """Mbit/s in bytes/s."""
    return rate * 1e6 / 8


def test_a_fast_uniform_path_is_not_compressed() -> None:
    for rate in (10_000, 40_000, 100_000):  # 10-100 Gbit/s: encoding costs more than the link saves
        c = choose_codec(mbps(rate), MB, MEASURED_RATES)
        assert c.codec == "" and c.seconds == c.seconds_none == pytest.approx(MB / mbps(rate))


def test_a_slow_uplink_is_compressed_with_the_cheapest_codec_in_the_budget() -> None:
    for rate in (25, 100, 200):  # the testbed's uplinks and server link
        c = choose_codec(mbps(rate), MB, MEASURED_RATES)
        assert c.codec == "int8"  # 3.94x for ~8 ms of encode and decode
        assert c.seconds < c.seconds_none / 3
        assert c.bandwidth == mbps(rate) and c.nbytes == MB
    # a budget below int8's error leaves the casts; below fp16's, nothing
    assert choose_codec(mbps(25), MB, MEASURED_RATES, auto=AutoSpec(budget=5e-3)).codec == "bf16"
    assert choose_codec(mbps(25), MB, MEASURED_RATES, auto=AutoSpec(budget=1e-3)).codec == "fp16"
    assert choose_codec(mbps(25), MB, MEASURED_RATES, auto=AutoSpec(budget=1e-4)).codec == ""
    assert choose_codec(mbps(25), MB, MEASURED_RATES, auto=AutoSpec(budget=0)).codec == ""


def test_the_rule_is_link_time_saved_against_encode_and_decode_time() -> None:
    rates = {"fp16": CodecRate(encode=1e9, decode=1e9, ratio=2.0, error=1e-4, summable=True)}
    nbytes = 1_000_000
    # fp16 costs 2 ms (1 ms encode, 1 ms decode) and saves half the link time: worth it when
    # the link takes more than 4 ms, i.e. below 250 MB/s
    assert choose_codec(240e6, nbytes, rates).codec == "fp16"
    assert choose_codec(260e6, nbytes, rates).codec == ""
    assert choose_codec(250e6, nbytes, rates).codec == ""  # a tie: none
    assert choose_codec(1e3, 0, rates).codec == ""  # nothing to move


def test_an_aggregator_next_allows_only_codecs_it_sums() -> None:
    # own-scale int8 is decoded at an aggregator and forwarded raw: not chosen when it must sum
    assert choose_codec(mbps(25), MB, MEASURED_RATES, must_sum=True).codec == "bf16"
    with_bound = AutoSpec(bound=6.0)
    assert (
        choose_codec(mbps(25), MB, MEASURED_RATES, auto=with_bound, must_sum=True).codec == "int8:bound=6.0"
    )
    # the bound's int8 (error 1.9e-2) only within the budget
    tight = AutoSpec(budget=0.015, bound=6.0)
    assert choose_codec(mbps(25), MB, MEASURED_RATES, auto=tight, must_sum=True).codec == "bf16"


def test_hop_by_hop_in_rack_none_across_the_uplink_compressed() -> None:
    # the rule is per transfer: a member's hop to an aggregator in its rack (40 Gbit/s) goes
    # uncompressed; the aggregate's hop across the 100 Mbit/s uplink to the server compressed
    # in a codec the next aggregator could sum again
    member = choose_codec(mbps(40_000), MB, MEASURED_RATES, must_sum=True)
    aggregate = choose_codec(mbps(100), MB, MEASURED_RATES, auto=AutoSpec(bound=6.0))
    assert member.codec == "" and aggregate.codec == "int8:bound=6.0"


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        choose_codec(0.0, MB, MEASURED_RATES)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        choose_codec(math.nan, MB, MEASURED_RATES)
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        choose_codec(1e6, -1, MEASURED_RATES)
    assert choose_codec(math.inf, MB, MEASURED_RATES).codec == ""  # the server's own host


def test_auto_specs_parse_and_print_back() -> None:
    assert is_auto("auto") and is_auto(" auto:budget=0.1") and not is_auto("int8") and not is_auto(None)
    assert parse_auto("auto") == AutoSpec()
    spec = parse_auto("auto:budget=0.001, bound=6")
    assert spec == AutoSpec(0.001, 6.0) and parse_auto(auto_spec(spec)) == spec
    for bad, match in [
        ("auto:budget=-1", "budget must be finite and >= 0"),
        ("auto:budget=x", "budget must be a number"),
        ("auto:bound=0", "bound must be finite and > 0"),
        ("auto:bound=inf", "bound must be finite and > 0"),
        ("auto:level=3", "unknown parameter 'level=3'"),
        ("auto:budget", "unknown parameter 'budget'"),
        ("int8", "is not 'auto'"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_auto(bad)


@pytest.mark.parametrize("mbps", [10, 100, 1000, 10_000])
def test_a_margin_or_busier_cores_never_turn_none_into_a_codec(mbps: float) -> None:
    from mlfabric.scheduler.core.codec_choice import LinkUse

    bandwidth, n = mbps * 1e6 / 8, 4_500_000
    for links in (None, [LinkUse(bandwidth, 4, 0.3)], [LinkUse(bandwidth, 4, 1.5)]):
        chosen = [
            choose_codec(
                bandwidth, n, MEASURED_RATES, links=links, cpu_load=(load, load), margin=margin
            ).codec
            for margin in (0.0, 0.25, 0.5)
            for load in (0.0, 4.0, 16.0)
        ]
        # once none (a larger margin, then busier cores), none from there on
        for margin_row in range(3):
            row = chosen[3 * margin_row : 3 * margin_row + 3]
            assert "" not in row or all(c == "" for c in row[row.index("") :]), (links, row)
        firsts = chosen[0::3]
        assert "" not in firsts or all(c == "" for c in firsts[firsts.index("") :]), (links, firsts)


def test_a_lightly_loaded_link_costs_less_than_its_share_and_a_saturated_one_its_share() -> None:
    from mlfabric.scheduler.core.codec_choice import LinkUse, link_seconds

    s = 4.5e6 / 125e6
    assert link_seconds([LinkUse(125e6, 8, 0.0)], 4.5e6) == pytest.approx(s)
    assert link_seconds([LinkUse(125e6, 8, 0.5)], 4.5e6) == pytest.approx(2 * s)
    assert link_seconds([LinkUse(125e6, 8, 0.99)], 4.5e6) == pytest.approx(8 * s)  # capped at the share
    assert link_seconds([LinkUse(125e6, 8, 3.0)], 4.5e6) == pytest.approx(8 * s)
    # compressed 4x: a quarter of the bytes on a link a quarter as loaded; the slowest link counts
    # (a link only its own host uses: never more than its transfer alone)
    two = [LinkUse(125e6, 8, 0.5), LinkUse(12.5e6, 1, 0.1)]
    assert link_seconds(two, 4.5e6, 4.0) == pytest.approx(max(s / 4 / (1 - 0.125), 10 * s / 4))
    with pytest.raises(ValueError, match="margin"):
        choose_codec(1e6, 10, MEASURED_RATES, margin=1.0)
