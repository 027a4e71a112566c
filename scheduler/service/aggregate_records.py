"""What the service's aggregate book keeps per aggregate, and what it asks the service to do.

:class:`Execution` is one aggregate on its way (its plan, its worker members and where each
is; in a multi-level tree also its parent aggregate, its member aggregates and the worker
updates they brought); :class:`Effects` are the directives and outcomes an
:class:`~mlfabric.scheduler.service.aggregates.AggregateBook` call returns. Pure data.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, PlannedAggregate
from mlfabric.scheduler.service.records import OutcomeKind

__all__ = ["Effects", "Execution", "Stage"]


class Stage(enum.Enum):
    """Where one member of an aggregate is."""

    PLANNED = "planned"  # pending at its source, not released
    SENT = "sent"  # released to the aggregator, its source has not reported
    IN = "in"  # its source reported (the payload is at the aggregator, or refused)


@dataclass
class Execution:
    """One aggregate on its way: its plan, its members and where each is.

    ``members``/``stage`` are its worker updates; in a multi-level tree ``nested`` are its
    member aggregates (PLANNED: gathering at their aggregators; SENT: released into this one;
    IN: summed here, their worker updates then in ``absorbed``), and ``parent`` is the
    aggregate this one is summed into ("": it goes to the server).
    """

    planned: PlannedAggregate
    job: str
    server: str
    members: dict[str, PendingUpdate]
    stage: dict[str, Stage]
    issued: tuple[str, ...] = ()  # members of the last AggregateDirective
    deadline: float = math.inf
    ready: bool = False
    forwarded: bool = False
    parent: str = ""
    nested: dict[str, Stage] = field(default_factory=dict)
    absorbed: dict[str, PendingUpdate] = field(default_factory=dict)

    @property
    def aggregate_id(self) -> str:
        """The aggregate's id (``agg:<scope>:<index>``)."""
        return self.planned.aggregate_id

    def listed(self) -> tuple[str, ...]:
        """Its members as its ``AggregateDirective`` lists them: worker updates, then aggregates."""
        return (*self.members, *self.nested)

    def carried(self) -> dict[str, PendingUpdate]:
        """Every worker update it carries or expects: its own members and those absorbed."""
        return {**self.members, **self.absorbed}


@dataclass
class Effects:
    """What the book asks the service to do: directives to send, outcomes to count."""

    directives: list[tuple[str, pb.Directive]] = field(default_factory=list)
    resolved: list[OutcomeKind] = field(default_factory=list)
    #: updates made pending again (a decision is due)
    requeued: int = 0
    #: a transfer that ended (for the bandwidth estimator), with its report
    closed: InFlight | None = None

    def send(self, host: str, directive: pb.Directive) -> None:
        """Queue ``directive`` for the daemon of ``host``."""
        self.directives.append((host, directive))

    def __iadd__(self, other: Effects) -> Effects:
        self.directives += other.directives
        self.resolved += other.resolved
        self.requeued += other.requeued
        self.closed = other.closed or self.closed
        return self
