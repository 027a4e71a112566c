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


def test_the_aggregation_summary_gives_per_seed_ratios_to_the_same_policy_without_a_codec() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
    try:
        import testbed_aggregation as agg
    finally:
        sys.path.pop(0)
    assert doctest.testmod(agg).failed == 0
    rows = [
        {"seed": s, "mode": "sync", "system": sys_, "time_to_target": t, "updates": 80, "payloads": 40,
         "dropped": 0, "ingress_per_update": b, "final_accuracy": 0.951, "updates_per_s": 1.0, "load1": 3.0}
        for s, sys_, t, b in [
            (0, "stf+agg", 60.0, 1.7e6), (1, "stf+agg", 50.0, 1.7e6), (2, "stf+agg", 70.0, 1.7e6),
            (0, "stf+agg@fp16", 30.0, 0.9e6), (1, "stf+agg@fp16", 40.0, 0.9e6),
            (2, "stf+agg@fp16", None, 0.9e6),
        ]
    ]  # fmt: skip
    args = argparse.Namespace(
        quick=False, lr=0.05, batch=64, server_mbps=100.0, server_egress_mbps=1000.0, scale=1.0,
        period=5.0, compute=0.02, slowdown=4.0, target=0.95, tau_max=32, seeds="0,1,2", modes="sync",
    )  # fmt: skip
    lines = agg.summary(rows, args).splitlines()
    (plain,) = [line for line in lines if line.startswith("| sync | stf+agg |")]
    (fp16,) = [line for line in lines if line.startswith("| sync | stf+agg@fp16 |")]
    assert plain.split(" | ")[8] == "-"
    # seeds 0 and 1 reached with both: 60/30 and 50/40; seed 2 did not with fp16
    assert fp16.split(" | ")[8] == "2.00 / 1.25 (median 1.62)"
    assert fp16.split(" | ")[2:5] == ["3", "2", "35.0"]


def _parse(argv: list[str]) -> argparse.Namespace:
    old = sys.argv
    sys.argv = ["testbed_codecs.py", *argv]
    try:
        return e2e.parse(e2e.build_parser())
    finally:
        sys.argv = old


def test_auto_systems_parse_with_and_without_a_model_codec() -> None:
    assert e2e.split_system("stf@auto") == ("stf", "auto", None)
    assert e2e.split_system("stf+agg@auto@fp16") == ("stf+agg", "auto", "fp16")
    assert e2e.split_codec("auto+ef") == ("auto", True)
    args = _parse(["--role", "mlf-server", "--codec", "auto", "--model-codec", "fp16"])
    params = e2e.job_params(args)
    assert (params.compression, params.model_compression) == ("auto", "fp16")
    # a fixed codec stays the workers' own: the job is registered without one
    assert e2e.job_params(_parse(["--codec", "int8+ef"])).compression is None


def test_uniform_links_replace_the_heterogeneous_setting() -> None:
    args = _parse(["--quick", "--uniform-mbps", "1000"])
    assert args.server_mbps == 1000.0
    uplinks, workers, _ = e2e.layout(args)
    assert uplinks == [1000.0] * 4 and len(workers) == 4
    assert e2e.ns_setting(None, workers, args) == []  # no bandwidth changes
    hetero = _parse(["--quick"])
    assert e2e.layout(hetero)[0] == [100, 100, 50, 50] and hetero.server_mbps == 100.0


def test_the_summary_compares_auto_with_the_best_fixed_choice() -> None:
    rows = [
        {"seed": s, "system": sys_, "time_to_target": t, "accuracy": 0.95, "applied": 10,
         "dropped": 0, "ingress_bytes": 1e6}
        for s, sys_, t in [
            (0, "stf", 60.0), (1, "stf", 50.0),
            (0, "stf@int8+ef", 30.0), (1, "stf@int8+ef", 40.0),
            (0, "stf@auto+ef", 33.0), (1, "stf@auto+ef", 40.0),
        ]
    ]  # fmt: skip
    args = argparse.Namespace(
        quick=True, lr=0.05, batch=64, server_mbps=1000.0, period=5.0, target=0.9, time_limit=150.0,
        uniform_mbps=1000.0,
    )  # fmt: skip
    text = codecs.summarize(rows, args, ["stf", "stf@int8+ef", "stf@auto+ef"], [0, 1])
    (auto,) = [line for line in text.splitlines() if line.startswith("| stf@auto+ef |")]
    assert "(0.91 / 1.00)" in auto  # 30/33 and 40/40
    assert "static (uniform)" in text and "uplinks 1000.0-1000.0" in text


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


def test_local_sgd_systems_reach_the_workers_as_their_schedule() -> None:
    import testbed_aggregation as agg

    system = "stf+agg@int8+ef@h4k10s0.5"
    assert e2e.split_system(system) == ("stf+agg", "int8+ef", None)
    argv = ["--role", "mlf-worker", "--name", "w0", *e2e.worker_argv(system)]
    args, _ = agg.build_parser().parse_known_args(argv)
    assert (args.codec, args.local_period, args.local_warmup, args.local_scale) == ("int8+ef", 4, 10, 0.5)
    plain, _ = agg.build_parser().parse_known_args(["--role", "mlf-worker", *e2e.worker_argv("stf+agg")])
    assert (plain.codec, plain.local_period, plain.local_warmup) == (None, 1, 0)
    # compared with the same policy's uncompressed run, every step pushed
    times: dict[str, dict[int, float | None]] = {"stf+agg": {0: 60.0}, "stf+agg@h4": {0: 40.0}}
    assert codecs.ratios(times, "stf+agg@h4") == [1.5]
