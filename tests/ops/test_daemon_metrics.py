"""A daemon's counters, fed the reports and frame headers a daemon sees, as its collector reports them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from mlfabric.daemon.channels.routing import frame_route
from mlfabric.daemon.metrics import DaemonCollector
from mlfabric.daemon.stats import Counters
from mlfabric.proto.v1 import control_pb2, dataplane_pb2


def _registry(counters: Counters, host: str) -> CollectorRegistry:
    """A registry whose one collector reads ``counters`` at every scrape, as ``--metrics-port`` does."""
    registry = CollectorRegistry()
    registry.register(DaemonCollector(lambda: counters.snapshot(host)))
    return registry


def test_reports_count_bytes_errors_outcomes_and_aggregates() -> None:
    m = Counters()
    m.report(
        control_pb2.TransferReport(
            update_id="w1/a/1", dst_host="ps", bytes=100, ok=True, outcome=control_pb2.OUTCOME_APPLIED
        )
    )
    m.report(
        control_pb2.TransferReport(update_id="w1/a/2", dst_host="ps", bytes=100, ok=False, error="reset")
    )
    m.report(control_pb2.TransferReport(update_id="agg:ps:0", dst_host="ps", bytes=50, ok=True))
    get = _registry(m, "w1").get_sample_value
    assert get("mlfabric_daemon_sent_bytes_total", {"host": "w1", "dst": "ps"}) == 150
    assert get("mlfabric_daemon_transfers_total", {"host": "w1", "result": "failed"}) == 1
    assert get("mlfabric_daemon_dataplane_errors_total", {"host": "w1"}) == 1
    assert get("mlfabric_daemon_updates_resolved_total", {"host": "w1", "outcome": "applied"}) == 1
    assert get("mlfabric_daemon_updates_resolved_total", {"host": "w1", "outcome": "dropped"}) == 0
    assert get("mlfabric_daemon_aggregates_sent_total", {"host": "w1", "result": "ok"}) == 1


def test_frames_count_received_bytes_and_aggregate_members() -> None:
    m = Counters()
    update = dataplane_pb2.FRAME_KIND_UPDATE
    for header in (
        dataplane_pb2.FrameHeader(kind=update, update_id="w1/a/1", src_host="w1", payload_bytes=64),
        dataplane_pb2.FrameHeader(
            kind=update, update_id="w2/a/1", aggregate_id="agg:x:0", src_host="w2", payload_bytes=32
        ),
        dataplane_pb2.FrameHeader(
            kind=update, update_id="agg:x:0", aggregate_id="agg:x:0", src_host="w3", payload_bytes=32
        ),
    ):
        m.frame(header, frame_route(header))
    get = _registry(m, "agg").get_sample_value
    assert get("mlfabric_daemon_received_bytes_total", {"host": "agg", "src": "w1"}) == 64
    assert get("mlfabric_daemon_received_frames_total", {"host": "agg"}) == 3
    assert get("mlfabric_daemon_aggregate_members_total", {"host": "agg"}) == 1  # not the aggregate itself
    assert get("mlfabric_daemon_aggregate_member_bytes_total", {"host": "agg"}) == 32


def test_every_metric_name_has_a_series_before_anything_happened() -> None:
    """A dashboard sees zeros rather than no series (the names grafana/ and docs/operations.md use)."""
    get = _registry(Counters(), "h").get_sample_value
    for name, labels in (
        ("mlfabric_daemon_transfers_total", {"result": "ok"}),
        ("mlfabric_daemon_updates_resolved_total", {"outcome": "dropped"}),
        ("mlfabric_daemon_dataplane_errors_total", {}),
        ("mlfabric_daemon_received_frames_total", {}),
        ("mlfabric_daemon_aggregate_members_total", {}),
        ("mlfabric_daemon_aggregate_member_bytes_total", {}),
        ("mlfabric_daemon_local_clients", {}),
        ("mlfabric_daemon_fallback_active", {}),
        ("mlfabric_daemon_unannounced_pushes", {}),
        ("mlfabric_daemon_pool_idle_bytes", {}),
    ):
        assert get(name, {"host": "h", **labels}) == 0, name
