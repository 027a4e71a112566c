"""What the service's books ask the core to do: the one type their calls return.

The books of the service are pure: the aggregates' (:class:`~.aggregates.AggregateBook`), the
replicas' (:class:`~.replicas.Replication`) and the all-reduce operations'
(:class:`~.allreduce.AllreduceBook`) take times as arguments, mutate only their own records
and the :class:`~.state.SchedulerState` they were given, and return :class:`Effects`: the
directives for the daemons and what the core must do about them.
:meth:`~.core.SchedulerCore._execute` carries them out, in one place: it queues each directive
on its daemon's session (in order), counts the outcomes and asks for a decision when updates
were made pending again or the books' inputs changed. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.policies.base import InFlight
from mlfabric.scheduler.service.records import OutcomeKind

__all__ = ["Effects"]


@dataclass
class Effects:
    """What a book asks the service core to do.

    Attributes
    ----------
    directives : list of (str, Directive)
        Directives for the daemons of the hosts named, in the order they are to be queued.
    resolved : list of OutcomeKind
        Pushes the book resolved (counted like those the daemons report).
    requeued : int
        Updates made pending again: a decision is due (the batcher is notified).
    replan : bool
        Something the policies see changed without a ready update: a decision is asked for.
    closed : InFlight, optional
        A transfer that ended (for the bandwidth estimator), with its report.

    Examples
    --------
    >>> out = Effects()
    >>> out.send("h1", pb.Directive(drop=pb.DropDirective(update_id="h1/1")))
    >>> more = Effects(requeued=2)
    >>> more.send("h2", pb.Directive(drop=pb.DropDirective(update_id="h2/1")))
    >>> out += more
    >>> [h for h, _ in out.directives], out.requeued
    (['h1', 'h2'], 2)
    """

    directives: list[tuple[str, pb.Directive]] = field(default_factory=list)
    resolved: list[OutcomeKind] = field(default_factory=list)
    requeued: int = 0
    replan: bool = False
    closed: InFlight | None = None

    def send(self, host: str, directive: pb.Directive) -> None:
        """Queue ``directive`` for the daemon of ``host``."""
        self.directives.append((host, directive))

    def __iadd__(self, other: Effects) -> Effects:
        self.directives += other.directives
        self.resolved += other.resolved
        self.requeued += other.requeued
        self.replan = self.replan or other.replan
        self.closed = other.closed or self.closed
        return self
