"""experiments/testbed_codecs.py: systems, ingress bytes and its summary (pure)."""

from __future__ import annotations

import argparse
import doctest
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
try:
    import testbed_codecs as codecs
    import testbed_e2e as e2e
finally:
    sys.path.pop(0)


@pytest.mark.parametrize("module", [codecs, e2e])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0


def test_the_summary_gives_medians_spread_and_per_seed_ratios_to_the_same_policy() -> None:
    rows = [
        {"seed": s, "system": sys_, "time_to_target": t, "accuracy": 0.951, "applied": 100,
         "dropped": 0, "ingress_bytes": b}
        for s, sys_, t, b in [
            (0, "stf", 60.0, 450e6), (1, "stf", 50.0, 450e6), (2, "stf", 70.0, 450e6),
            (0, "stf@int8+ef", 30.0, 113e6), (1, "stf@int8+ef", 40.0, 113e6), (2, "stf@int8+ef", None, 113e6),
        ]
    ]  # fmt: skip
    args = argparse.Namespace(
        quick=False, lr=0.05, batch=64, server_mbps=100.0, period=5.0, target=0.95, time_limit=400.0
    )
    text = codecs.summarize(rows, args, ["stf", "stf@int8+ef"], [0, 1, 2])
    (stf,) = [line for line in text.splitlines() if line.startswith("| stf |")]
    (int8,) = [line for line in text.splitlines() if line.startswith("| stf@int8+ef |")]
    assert "60.0 [50.0-70.0]" in stf and "| 3/3 |" in stf and "4.50" in stf
    # the seed that did not reach the target has no ratio: 60/30 and 50/40
    assert "35.0 [30.0-40.0]" in int8 and "| 2/3 |" in int8 and "(2.00 / 1.25)" in int8 and "1.13" in int8


def test_sparse_codec_systems_parse_into_pushes_codec_and_the_models() -> None:
    from mlfabric.aggregators.codecs import RandomKCodec, TopKCodec
    from mlfabric.aggregators.codecs.payload import parse_codec

    systems = e2e.split_systems(
        "stf+agg,stf+agg@topk:ratio=0.01+ef@fp16,stf@randk:ratio=0.01,rescale=0+ef,fair"
    )
    assert systems == [
        "stf+agg",
        "stf+agg@topk:ratio=0.01+ef@fp16",
        "stf@randk:ratio=0.01,rescale=0+ef",
        "fair",
    ]
    policy, codec, model_codec = e2e.split_system(systems[1])
    assert (policy, model_codec) == ("stf+agg", "fp16")
    spec, feedback = e2e.split_codec(codec)
    assert feedback and parse_codec(spec) == TopKCodec(ratio=0.01)
    policy, codec, model_codec = e2e.split_system(systems[2])
    spec, feedback = e2e.split_codec(codec)
    assert (policy, model_codec, feedback) == ("stf", None, True)
    assert parse_codec(spec) == RandomKCodec(ratio=0.01, rescale=False)
    # the ratio to the uncompressed run of the same policy
    times: dict[str, dict[int, float | None]] = {"stf+agg": {0: 60.0}, systems[1]: {0: 30.0}}
    assert codecs.ratios(times, systems[1]) == [2.0]
