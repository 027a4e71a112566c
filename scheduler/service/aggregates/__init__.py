"""Aggregates executed by the daemons: the service's books (paper §5, Fig. 6; DESIGN §3).

The policy (``stf+agg``, ``stf+tree``) plans :class:`~mlfabric.scheduler.policies.base.PlannedAggregate`\\ s
and the :class:`~mlfabric.scheduler.policies.runner.DecisionRunner` releases their member
sends and, once every member is in, the aggregate itself. :class:`AggregateBook` turns that
into directives for the daemons and follows each aggregate to the end:

the first member released issues an ``AggregateDirective`` to the aggregator's daemon and
each member a ``SendDirective`` to its source (which keeps the payload until its push
resolves); the aggregator's ``UpdateReady`` says the members are in; the aggregate's release
is a ``SendDirective`` to the aggregator's daemon; its ``TransferReport``'s member verdicts
become a ``ResolveDirective`` per member, so each push resolves exactly once. Members that go
away are removed by re-issuing the directive; an aggregator lost, ``AggregateFailed``, a member
refused or a timeout before the release make the unresolved members pending again (their
sources hold the payloads); after the release they resolve from the aggregator's report, or
UNKNOWN (the frame may have reached the server). docs/aggregation-service.md has the table of
events, docs/exactly-once.md the faults.

Multi-level trees (``stf+tree``): an aggregate may be summed into another aggregate instead of
going to the server: its directive names the parent, its release sends it into the parent, its
members resolve through the root's report; a failure takes its member aggregates with it and
re-issues its parent without it.

- :mod:`.book`: :class:`AggregateBook`, what the service core calls: the runner's releases,
  the daemons' messages about aggregates, deadlines and stalled transfers, which hosts may
  aggregate;
- :mod:`.ledger`: :class:`Ledger`, the aggregates on their way and the member sends not yet
  reported, and every way an aggregate ends (its report, a failure, a re-issue);
- :mod:`.records`: :class:`Execution` (one aggregate on its way) and :class:`Stage`.

No I/O and no clock: times are arguments; what the service must do is returned as
:class:`~mlfabric.scheduler.service.effects.Effects`.
"""

from mlfabric.scheduler.service.aggregates.book import DEFAULT_FORWARD_TIMEOUT, DEFAULT_TIMEOUT, AggregateBook
from mlfabric.scheduler.service.aggregates.ledger import GRACE, Ledger
from mlfabric.scheduler.service.aggregates.records import Execution, Stage

__all__ = [
    "DEFAULT_FORWARD_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "GRACE",
    "AggregateBook",
    "Execution",
    "Ledger",
    "Stage",
]
