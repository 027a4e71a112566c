"""Compressed members at an aggregator hop (docs/compression.md), driven as in test_aggregation.py.

Members of one summable codec (fp16, int8 with a shared bound) are summed on their words and
the aggregate forwarded in that codec (its bytes on the wire show it); mixed codecs, int8 with
own scales, top-k or raw members are decoded (top-k: scattered at its positions), summed
densely and forwarded as they are. The server
applies the decoded sum: equal to the sum of ``aggregators.codecs.decode`` of the members.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.proto.v1 import control_pb2
from tests.daemon.test_aggregation import (
    MODEL,
    AggScheduler,
    _aggregate,
    _close,
    _cluster,
    _model,
    _send,
    _update,
    held_scheduler,
    wait_until,
)
from tests.daemon.test_compression import _sent

APPLIED = control_pb2.OUTCOME_APPLIED
ELEMENTS = 6 + 4  # MODEL's "w" (2, 3) and "b" (4,), float64


@pytest.fixture
def scheduler() -> Iterator[AggScheduler]:
    yield from held_scheduler()


@pytest.fixture
def cluster(make_daemon: Any) -> Iterator[dict[str, Any]]:
    c = _cluster(make_daemon, mlfabric.Params(tau_max=4))
    yield c
    _close(c)


def _push(c: dict[str, Any], sched: AggScheduler, worker: str, value: float, codec: str) -> tuple[Any, Any]:
    def mine() -> list[Any]:
        with sched.lock:
            return [r for r in sched.ready if r.worker == worker]

    n = len(mine())
    handle = c["workers"][worker].push("ps0", _update(value), norm=value, codec=codec)
    wait_until(lambda: len(mine()) > n)
    return handle, mine()[-1]


def _through_aggregator(c: dict[str, Any], sched: AggScheduler, codecs: list[str], agg_id: str) -> Any:
    """Push ``_update(i + 1)`` from worker i with ``codecs[i]``, aggregate them, forward; the report."""
    pushed = [_push(c, sched, f"w{i}", float(i + 1), spec) for i, spec in enumerate(codecs)]
    ready = [r for _, r in pushed]
    _aggregate(sched, agg_id, ready)
    for r in ready:
        _send(sched, r.update_id, "agg", agg_id)
    wait_until(lambda: sched.ready_for(agg_id))
    _send(sched, agg_id, "ps")
    report = wait_until(lambda: sched.report_for(agg_id))[0]
    assert report.ok and report.outcome == APPLIED, report.error
    assert [v.outcome for v in report.member_verdicts] == [APPLIED] * len(codecs)
    return report


def _expected(codecs: list[str]) -> dict[str, np.ndarray]:
    """The model after the decoded members are applied (float64 sums of the decodes)."""
    sent = [_sent(_update(float(i + 1)), spec) for i, spec in enumerate(codecs)]
    return {k: MODEL[k] - sum(np.asarray(s[k], np.float64) for s in sent) for k in MODEL}


@pytest.mark.parametrize(
    ("codecs", "words"),
    [
        (["int8:bound=32,stochastic=0"] * 3, 1),  # int32 sum of the words, forwarded as int8
        (["fp16"] * 3, 2),  # float32 sum of the words, forwarded as fp16
        (["bf16"] * 2, 2),
    ],
)
def test_members_of_a_summable_codec_are_summed_on_their_words_and_forwarded_in_it(
    cluster: dict[str, Any], scheduler: AggScheduler, codecs: list[str], words: int
) -> None:
    report = _through_aggregator(cluster, scheduler, codecs, "agg:job:c1")
    assert report.bytes == ELEMENTS * words  # the aggregate left the aggregator compressed
    codec = codecs[0].split(":")[0]  # announced with its codec, as the members were (the trace)
    assert scheduler.ready_for("agg:job:c1").codec == codec
    assert {r.codec for r in scheduler.ready if r.worker} == {codec}
    model, expected = _model(cluster), _expected(codecs)
    for k in MODEL:  # the decode of the forwarded sum: the sum of the decodes, within float32
        np.testing.assert_allclose(model[k], expected[k], rtol=0, atol=1e-5)
        exact = MODEL[k] - sum(_update(float(i + 1))[k] for i in range(len(codecs)))
        error = {"fp16": 2**-10, "bf16": 2**-7}.get(codec, 32 / 127)
        assert np.abs(model[k] - exact).max() <= error * len(codecs) * max(1.0, np.abs(exact).max())


@pytest.mark.parametrize(
    "codecs",
    [
        ["fp16", "int8:bound=16,stochastic=0", "none"],  # mixed, and a raw member
        ["int8:block=4,stochastic=0", "int8:block=4,stochastic=0"],  # own scales: not summable
        ["int8:bound=16,stochastic=0", "int8:bound=8,stochastic=0"],  # different shared scales
    ],
)
def test_mixed_or_non_summable_members_are_decoded_summed_and_forwarded_as_they_are(
    cluster: dict[str, Any], scheduler: AggScheduler, codecs: list[str]
) -> None:
    report = _through_aggregator(cluster, scheduler, codecs, "agg:job:c2")
    assert report.bytes == ELEMENTS * 8  # forwarded dense, in the tensors' own dtype (float64)
    assert scheduler.ready_for("agg:job:c2").codec == ""
    model, expected = _model(cluster), _expected(codecs)
    for k in MODEL:  # summed in float64 (the tensors' dtype) from the decodes
        np.testing.assert_allclose(model[k], expected[k], rtol=1e-12, atol=1e-12)


def test_a_raw_first_member_then_encoded_ones_are_summed_decoded(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    codecs = ["none", "int8:bound=16,stochastic=0", "fp16"]
    report = _through_aggregator(cluster, scheduler, codecs, "agg:job:c3")
    assert report.bytes == ELEMENTS * 8
    model, expected = _model(cluster), _expected(codecs)
    for k in MODEL:
        np.testing.assert_allclose(model[k], expected[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("codecs", "codec", "forwarded"),
    [
        # "w": 2 of 6 values kept, "b": 1 of 4; every member keeps the same positions (w's ties
        # broken alike, b's largest): the union is 3 positions, 24 bytes against 80 dense
        (["topk:ratio=0.2"] * 3, "topk", 24),
        (["topk:ratio=0.2", "int8:bound=16,stochastic=0", "none"], "", ELEMENTS * 8),  # mixed: dense
    ],
)
def test_topk_members_are_summed_forwarded_on_their_positions_or_dense_and_applied_once(
    cluster: dict[str, Any], scheduler: AggScheduler, codecs: list[str], codec: str, forwarded: int
) -> None:
    report = _through_aggregator(cluster, scheduler, codecs, "agg:job:c4")  # each member APPLIED once
    members = [r for r in scheduler.ready if r.worker and r.codec == "topk"]
    assert members and all(r.bytes == (2 + 1) * 8 for r in members)  # values and positions
    ready = scheduler.ready_for("agg:job:c4")
    assert (ready.codec, ready.bytes) == (codec, forwarded)  # announced as it is forwarded
    assert report.bytes == forwarded
    model, expected = _model(cluster), _expected(codecs)
    for k in MODEL:  # the sum of the members' decodes: nothing outside the positions lost
        np.testing.assert_allclose(model[k], expected[k], rtol=1e-7, atol=1e-12)
