"""The scheduler's collector and /metrics endpoint, on a state driven by hand."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.service.core import StaticEstimator
from mlfabric.scheduler.service.metrics import ServiceCollector, serve_metrics
from mlfabric.scheduler.service.observe import drop_reason_class
from mlfabric.scheduler.service.records import JobParams, OutcomeKind
from mlfabric.scheduler.service.state import SchedulerState


def _core() -> SimpleNamespace:
    state = SchedulerState(star(2, 8e9))
    state.connect("h0", "127.0.0.1:1")
    state.connect("h1", "127.0.0.1:2")
    state.register_server("h0", "j", "ps", (), JobParams(tau_max=4), version=0)
    state.register_worker("h1", "j", "w0")
    return SimpleNamespace(state=state, estimator=StaticEstimator(state.graph))


def _registry(core: SimpleNamespace) -> CollectorRegistry:
    r = CollectorRegistry()
    state, estimator = core.state, core.estimator
    r.register(ServiceCollector(lambda: state.recorder.stats(state, estimator.estimated_graph())))
    return r


def test_gauges_follow_the_state_and_outcome_counters_never_repeat() -> None:
    core = _core()
    r = _registry(core)
    state = core.state
    for i in range(3):
        state.add_update("h1", f"h1/x/{i}", "j", "ps", "w0", 1024, 1.0, 0, now=0.0)
    assert r.get_sample_value("mlfabric_pending_updates", {"job": "j", "server": "ps"}) == 3
    assert r.get_sample_value("mlfabric_daemons_connected") == 2
    assert r.get_sample_value("mlfabric_link_capacity_bytes_per_second", {"src": "h0", "dst": "sw"}) == 1e9

    state.record("h1/x/0", OutcomeKind.APPLIED, "", 3, 1)
    state.record("h1/x/1", OutcomeKind.DROPPED, "delay 9 > tau_max 4 (server version 9)", 9, 9)
    assert r.get_sample_value("mlfabric_updates_resolved_total", {"outcome": "applied"}) == 1
    assert r.get_sample_value("mlfabric_updates_resolved_total", {"outcome": "applied"}) == 1  # scraped again
    state.record("h1/x/2", OutcomeKind.APPLIED, "", 0, 2)
    assert r.get_sample_value("mlfabric_updates_resolved_total", {"outcome": "applied"}) == 2
    assert r.get_sample_value("mlfabric_updates_dropped_by_reason_total", {"reason": "delay > tau_max"}) == 1
    assert r.get_sample_value("mlfabric_update_delay_versions_bucket", {"le": "0"}) == 1
    assert r.get_sample_value("mlfabric_update_delay_versions_bucket", {"le": "4"}) == 2
    assert r.get_sample_value("mlfabric_update_delay_versions_sum") == 3


def test_drop_reasons_lose_names_and_numbers() -> None:
    assert (
        drop_reason_class("aggregate 'agg:j:3' gave no verdict for the member")
        == "aggregate gave no verdict for the member"
    )
    assert drop_reason_class("host 'h9' is not a host of the bandwidth graph (hosts: a, b)") == (
        "host is not a host of the bandwidth graph"
    )


def test_the_endpoint_serves_metrics_and_404s_the_rest() -> None:
    core = _core()
    r = _registry(core)

    async def fetch(path: bytes) -> bytes:
        server = await serve_metrics(r, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = await reader.read()
        writer.close()
        server.close()
        await server.wait_closed()
        return reply

    ok = asyncio.run(fetch(b"/metrics"))
    assert ok.startswith(b"HTTP/1.0 200 OK")
    assert ok.split(b"\r\n\r\n", 1)[1] == generate_latest(r)
    assert asyncio.run(fetch(b"/other")).startswith(b"HTTP/1.0 404")


def test_one_collector_exports_every_metric_of_the_scheduler() -> None:
    """The names the dashboard, the docs and scrapers know, from the one snapshot."""
    core = _core()
    names = {m.name for m in _registry(core).collect()}
    assert names == {
        "mlfabric_updates_ready",
        "mlfabric_updates_applied",
        "mlfabric_updates_dropped",
        "mlfabric_updates_unknown",
        "mlfabric_transfers_released",
        "mlfabric_decision_seconds",
        "mlfabric_link_capacity_bytes_per_second",
        "mlfabric_link_estimated_bytes_per_second",
        "mlfabric_link_in_flight_transfers",
        "mlfabric_link_scheduled_bytes",
        "mlfabric_link_transferred_bytes",
        "mlfabric_transfer_duration_seconds",
        "mlfabric_pending_updates",
        "mlfabric_daemons_connected",
        "mlfabric_jobs",
        "mlfabric_updates_resolved",
        "mlfabric_updates_dropped_by_reason",
        "mlfabric_update_delay_versions",
        "mlfabric_replica_server_waits",
        "mlfabric_replica_divergence",
        "mlfabric_replica_resyncing",
        "mlfabric_replica_promotions",
        "mlfabric_allreduce_plans",
        "mlfabric_codec_choices",
    }


def test_measured_transfers_and_decisions_are_counted_where_they_happen() -> None:
    core = _core()
    r = _registry(core)
    core.state.recorder.measured(("h1", "sw", "h0"), 1000, 0.002, now=1.0)
    core.state.recorder.decision_seconds.observe(0.0002)
    assert r.get_sample_value("mlfabric_link_transferred_bytes_total", {"src": "h1", "dst": "sw"}) == 1000
    assert r.get_sample_value("mlfabric_transfer_duration_seconds_bucket", {"le": "0.005"}) == 1
    assert r.get_sample_value("mlfabric_transfer_duration_seconds_bucket", {"le": "0.001"}) == 0
    assert r.get_sample_value("mlfabric_decision_seconds_bucket", {"le": "0.0005"}) == 1
    assert r.get_sample_value("mlfabric_decision_seconds_count") == 1
    assert core.state.recorder.activity.link_bytes(("h1", "sw"), now=1.0, window=10.0) == 1000
