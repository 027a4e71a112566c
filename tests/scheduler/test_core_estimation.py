"""Bandwidth estimation follows changes within a few transfers and does not over-trust."""

from __future__ import annotations

import pytest

from mlfabric.scheduler.core.estimation import BandwidthEstimator
from mlfabric.scheduler.core.graph import star

GB = 1e9
PATH = ["w", "sw", "ps"]


def make() -> BandwidthEstimator:
    # worker NIC 1 GB/s, server NIC 2 GB/s: the worker's uplink is the path's bottleneck
    return BandwidthEstimator(star(["ps", "w", "v"], {"ps": 16e9, "w": 8e9, "v": 8e9}), recovery=float("inf"))


def report(est: BandwidthEstimator, rate: float, t: float, nbytes: int = 100_000_000) -> None:
    est.observe(PATH, nbytes, nbytes / rate, now=t)


def test_follows_a_drop_within_two_transfers_and_only_on_the_bottleneck() -> None:
    est = make()
    report(est, 0.25 * GB, 1.0)
    first = est.estimates()[("w", "sw")]
    assert 0.25 * GB < first < GB  # one low sample is not trusted fully
    report(est, 0.25 * GB, 2.0)
    e = est.estimates()
    assert e[("w", "sw")] == pytest.approx(0.25 * GB)
    assert e[("sw", "ps")] == pytest.approx(2 * GB)  # the other links keep their estimates
    g = est.estimated_graph()
    assert g["w"]["sw"]["capacity"] == pytest.approx(0.25 * GB)
    assert est.estimated_graph() is g  # cached until the next measurement


def test_follows_a_recovery_at_once_capped_at_nominal() -> None:
    est = make()
    for t in range(3):
        report(est, 0.25 * GB, float(t))
    report(est, 0.8 * GB, 3.0)  # a measurement is a lower bound on every link of the path
    assert est.estimates()[("w", "sw")] == pytest.approx(0.8 * GB)
    report(est, 5 * GB, 4.0)
    assert est.estimates()[("w", "sw")] == pytest.approx(GB)


def test_small_noise_is_averaged_not_followed() -> None:
    est = make()
    report(est, 0.9 * GB, 1.0)
    report(est, 0.9 * GB, 2.0)
    assert est.estimates()[("w", "sw")] == pytest.approx(
        GB * (1 - 0.3 * 0.1) ** 1 - 0.3 * (GB * 0.97 - 0.9 * GB)
    )


def test_shared_transfers_and_tiny_transfers() -> None:
    est = make()
    report(est, 0.5 * GB, 1.0, nbytes=1000)  # latency-bound: ignored
    assert est.estimates()[("w", "sw")] == GB
    est.observe(PATH, 100_000_000, 0.2, now=2.0, shared=2)  # 0.5 GB/s each, two at once
    assert est.estimates()[("w", "sw")] == GB


def test_floor_recovery_and_errors() -> None:
    est = BandwidthEstimator(star(["ps", "w"], 8e9), floor=0.1, recovery=10.0)
    est.observe(PATH, 100_000_000, 100.0, now=0.0)
    est.observe(PATH, 100_000_000, 100.0, now=0.0)
    assert est.estimates()[("w", "sw")] == pytest.approx(0.1 * GB)
    est.observe(["v"], 0, 1.0, now=10.0)  # no links: only advances time
    assert est.estimates()[("w", "sw")] == pytest.approx(GB - 0.9 * GB / 2)  # one half-life later
    with pytest.raises(KeyError, match="not in the bandwidth graph"):
        est.observe(["w", "ps"], 100_000_000, 1.0, now=11.0)
    with pytest.raises(ValueError):
        BandwidthEstimator(star(["a"], 8.0), alpha=0.0)
