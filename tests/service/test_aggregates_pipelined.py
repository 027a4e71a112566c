"""The aggregate book's rules for pipelined aggregates (``AggregateBook(pipelined=True)``)."""

from __future__ import annotations

from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.base import PlannedAggregate
from mlfabric.scheduler.service.aggregates.book import AggregateBook
from mlfabric.scheduler.service.aggregates.records import Execution, Stage
from mlfabric.scheduler.service.state import SchedulerState


class Runner:
    """Records the members the book says are in."""

    def __init__(self) -> None:
        self.arrived_members: list[str] = []

    def arrived(self, member: str) -> None:
        self.arrived_members.append(member)


def _book(pipelined: bool, chunk_bytes: int = 0) -> tuple[AggregateBook, Runner]:
    runner = Runner()
    book = AggregateBook(SchedulerState(star(["ps", "x", "a", "b"], 8e9)), runner, pipelined=pipelined)  # type: ignore[arg-type]
    planned = PlannedAggregate("agg:ps:1", "x", ("a/1", "b/1"), 8, "ps", chunk_bytes=chunk_bytes)
    stages = {"a/1": Stage.SENT, "b/1": Stage.SENT}
    book.ledger.executions["agg:ps:1"] = Execution(planned, "j", "ps0", {}, stages)
    return book, runner


def test_an_announcement_counts_only_the_members_it_names() -> None:
    """A re-issued directive (b/1 joined) crossed an announcement made before b/1 began."""
    book, runner = _book(pipelined=True)
    assert book.pipelined("agg:ps:1")
    book.ready("x", "agg:ps:1", ("a/1",))
    assert runner.arrived_members == ["a/1"]


def test_store_and_forward_members_count_once_their_sources_report() -> None:
    book, runner = _book(pipelined=False)
    assert not book.pipelined("agg:ps:1")
    book.ready("x", "agg:ps:1", ("a/1", "b/1"))  # (a store-and-forward daemon names none)
    assert runner.arrived_members == []


def test_an_aggregate_planned_with_a_chunk_size_is_pipelined() -> None:
    book, runner = _book(pipelined=False, chunk_bytes=1 << 18)
    assert book.pipelined("agg:ps:1")
    book.ready("x", "agg:ps:1", ("a/1", "b/1"))
    assert sorted(runner.arrived_members) == ["a/1", "b/1"]
