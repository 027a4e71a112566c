"""What the service's aggregate book keeps per aggregate.

:class:`Execution` is one aggregate on its way (its plan, its worker members and where each
is; in a multi-level tree also its parent aggregate, its member aggregates and the worker
updates they brought); :class:`Stage` is where one member is. Pure data.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from mlfabric.scheduler.policies.base import PendingUpdate, PlannedAggregate

__all__ = ["Execution", "Stage"]


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
