"""A rogue control client cannot hold a bottleneck: oversized announcements are refused and a
transfer that never reports is forgotten after its deadline (DESIGN §3, §4)."""

from __future__ import annotations

from typing import Any

from mlfabric.scheduler.service import state as state_module
from mlfabric.scheduler.service.records import OutcomeKind
from tests.service.test_service_stream import _job, cluster, run


def test_announcement_larger_than_the_model_is_dropped_naming_the_size() -> None:
    async def main() -> None:
        async with cluster("stf") as c:
            _, a, _ = await _job(c)
            await a.ready("a/huge", 10**12, "wa")
            d = await a.recv()
            assert d.WhichOneof("kind") == "drop" and d.drop.update_id == "a/huge"
            assert "1000000000000 bytes" in d.drop.reason and "4000000-byte model" in d.drop.reason
            assert not c.core.state.in_flight and not c.core.state.pending

    run(main())


def test_transfer_that_never_reports_is_forgotten(monkeypatch: Any) -> None:
    monkeypatch.setattr(state_module, "STALL_SLACK", 0.3)
    monkeypatch.setattr(state_module, "STALL_FACTOR", 1.0)

    async def main() -> None:
        async with cluster("stf") as c:
            _, a, b = await _job(c)
            await a.ready("a/rogue", 100_000, "wa")  # released, and never reported
            assert (await a.recv()).send.update_id == "a/rogue"
            await c.until(lambda: "a/rogue" not in c.core.state.in_flight)
            out = c.core.state.outcomes["a/rogue"]
            assert out.kind is OutcomeKind.DROPPED and "no report" in out.reason
            await b.ready("b/1", 100_000, "wb")  # the bottleneck is free
            assert (await b.recv()).send.update_id == "b/1"
            assert set(c.core.state.in_flight) == {"b/1"}

    run(main())
