"""The aggregates' book: the runner's releases and the daemons' messages about aggregates.

:class:`AggregateBook` is what the service core calls for aggregates (see the package
docstring for the life of one); it keeps which hosts may aggregate and hands every aggregate
on its way to its :class:`~.ledger.Ledger`, which carries out how each ends:

- a member released by the runner: the first one starts the aggregate and issues its
  ``AggregateDirective``; each gets a ``SendDirective`` naming the aggregate; one that joins
  an aggregate being gathered re-issues the directive (the aggregate waits for it);
- the aggregator's ``UpdateReady`` (all members in), the sources' reports of the member
  sends (in, refused before summing, or lost: the aggregate fails);
- the aggregate's release: a ``SendDirective`` to its aggregator, to the server or, in a
  multi-level tree, into its parent aggregate (whose directive goes out first if it has none);
- a daemon lost, ``AggregateFailed``, a timeout, a transfer with no report past its stall
  deadline.

No I/O and no clock: times are arguments; directives are returned as
:class:`~mlfabric.scheduler.service.effects.Effects`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.schedule import is_aggregate_id
from mlfabric.scheduler.policies.base import InFlight, PlannedAggregate
from mlfabric.scheduler.policies.dispatch import Release
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.service import wire
from mlfabric.scheduler.service.aggregates.ledger import GRACE, Ledger
from mlfabric.scheduler.service.aggregates.records import Execution, Stage
from mlfabric.scheduler.service.effects import Effects
from mlfabric.scheduler.service.records import OutcomeKind, SchedulerError, TransferResult, UnknownUpdate
from mlfabric.scheduler.service.state import SchedulerState, stalled_after

__all__ = ["DEFAULT_FORWARD_TIMEOUT", "DEFAULT_TIMEOUT", "AggregateBook"]

log = logging.getLogger(__name__)

#: seconds an aggregator waits for the members of an aggregate (``AggregateDirective.timeout_seconds``)
DEFAULT_TIMEOUT = 60.0
#: seconds the scheduler waits for a forwarded aggregate's report (synchronous rounds hold ACKs)
DEFAULT_FORWARD_TIMEOUT = 180.0


class AggregateBook:
    """The service's book of aggregates executed by daemons (see the module docstring).

    Parameters
    ----------
    state : SchedulerState
        Pending and in-flight updates, daemons and jobs (members move through it).
    runner : DecisionRunner
        The decision pipeline: which aggregates are gathering, which members are in.
    timeout : float
        Seconds an aggregator waits for the members (restarted by every re-issue).
    forward_timeout : float
        Seconds the scheduler waits for a forwarded aggregate's report.
    pipelined : bool
        Aggregates are pipelined (``AggregateDirective.pipelined``, docs/aggregation-trees.md):
        an aggregator announces one as soon as every member has begun to arrive, and the
        members sent to it count as in from then on (its forward may be released while they
        land).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.policies.runner import DecisionRunner
    >>> from mlfabric.scheduler.policies.fair import FairPolicy
    >>> s = SchedulerState(star(["ps", "a", "x"], 8e9))
    >>> book = AggregateBook(s, DecisionRunner(FairPolicy()))
    >>> for i, h in enumerate(("ps", "a", "x")):
    ...     _ = s.connect(h, f"127.0.0.1:{9000 + i}"); book.hello(h, can_aggregate=h != "a")
    >>> sorted(book.eligible())
    ['ps', 'x']
    """

    def __init__(
        self,
        state: SchedulerState,
        runner: DecisionRunner,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        forward_timeout: float = DEFAULT_FORWARD_TIMEOUT,
        pipelined: bool = False,
    ) -> None:
        self.state = state
        self.runner = runner
        self.timeout = timeout
        self.forward_timeout = forward_timeout
        #: the aggregates on their way and how each ends
        self.ledger = Ledger(state, runner, timeout, pipelined=pipelined)
        self._can_aggregate: dict[str, bool] = {}

    @property
    def executions(self) -> dict[str, Execution]:
        """The aggregates on their way, by id (the ledger's)."""
        return self.ledger.executions

    @property
    def failures(self) -> int:
        """Aggregates that failed (their members planned afresh or resolved UNKNOWN)."""
        return self.ledger.failures

    # ------------------------------------------------------------------ hosts

    def hello(self, host: str, can_aggregate: bool) -> None:
        """The daemon of ``host`` connected (``Hello.can_aggregate``)."""
        self._can_aggregate[host] = can_aggregate

    def eligible(self) -> frozenset[str]:
        """Hosts that may be aggregator hops now.

        Daemons that said hello with ``can_aggregate`` on hosts whose graph node does not say
        ``aggregator = False``.
        """
        nodes = self.state.graph.nodes
        return frozenset(
            h
            for h, ok in self._can_aggregate.items()
            if ok and h in self.state.daemons and nodes[h].get("aggregator", True) is not False
        )

    def host_lost(self, host: str, now: float) -> Effects:
        """The daemon of ``host`` disconnected (after ``state.disconnect``).

        Aggregates gathered on it fail (their members are planned afresh); its members not yet
        at their aggregator leave their aggregates, which are re-issued with fewer members. An
        aggregate its aggregator announced complete (``ready``: no deadline any more) that
        still waits for the report of such a member fails too, its aggregator told to drop it:
        that report will never come, and the runner would hold the aggregate, and every
        update planned after it, for ever.
        """
        self._can_aggregate.pop(host, None)
        out = Effects()
        for e in list(self.executions.values()):
            if e.aggregate_id not in self.executions:  # failed with its parent meanwhile
                continue
            if e.planned.aggregator == host:
                why = f"the aggregator's daemon (host '{host}') disconnected"
                out += self.ledger.fail(e, why, now, discard=False)
            elif e.planned.dst == host and not e.forwarded:
                why = f"the server's daemon (host '{host}') disconnected"
                out += self.ledger.fail(e, why, now, discard=True)
            elif e.ready and not e.forwarded and self._unreported_from(e, host):
                why = f"the daemon of host '{host}' disconnected before reporting the send of its member(s)"
                out += self.ledger.fail(e, why, now, discard=True)
            # forwarded to a server whose daemon went away: the aggregator's report says whether
            # the frame may have reached it (UNKNOWN) or certainly did not (planned afresh)
        self.runner.forget(self.ledger.leave_host(host))
        out += self.reconcile(now)
        return out

    @staticmethod
    def _unreported_from(e: Execution, host: str) -> list[str]:
        """The members of ``e`` sent from ``host`` whose source has not reported them."""
        return [m for m, stage in e.stage.items() if stage is Stage.SENT and e.members[m].src_host == host]

    # -------------------------------------------------------------- releasing

    def send_member(self, r: Release, planned: PlannedAggregate, now: float) -> Effects:
        """The runner released member ``r.send`` of ``planned``: direct it to the aggregator.

        The first member released issues the ``AggregateDirective``.
        """
        out = Effects()
        uid = r.send.update_id
        e = self.executions.get(planned.aggregate_id)
        if e is None:
            e = self.ledger.start(planned)
        elif (
            uid not in e.members and uid in planned.members and uid in self.state.pending and not e.forwarded
        ):
            # it joins the aggregate being gathered: the directive is re-issued with it, and the
            # aggregate waits for it (announced again once it is in)
            e.members[uid] = self.state.pending[uid]
            e.stage[uid] = Stage.PLANNED
            e.ready = False
        if uid not in e.members:
            # it cannot join (the aggregate left, or it was not pending when the aggregate
            # started): the runner has let it go, so only a decision plans it again — ask for
            # one now (waiting for the next arrival could wait for a round that needs it)
            log.info(
                "%s cannot join aggregate %s at %s (%s): planned afresh",
                uid,
                planned.aggregate_id,
                planned.aggregator,
                "it left" if e.forwarded else "not one of its members",
            )
            self.runner.forget([uid])
            out.requeued += 1
            return out
        try:
            address = self.state.address(planned.aggregator)
        except SchedulerError as exc:
            return self.ledger.fail(e, str(exc), now, discard=False)
        out += self.ledger.issue(e, now)
        if planned.aggregate_id not in self.executions:  # issuing failed (the server is gone)
            return out
        self.state.release(uid, r.send.path, r.started_at, r.expected_end)
        self.ledger.member_sent(e, uid)
        if self.pipelined(e.aggregate_id):
            # its aggregator forwards each piece as the members land (a send directed before
            # they began waits for them there): it may leave once every member is on its way
            self.runner.arrived(uid)
        send = pb.SendDirective(
            update_id=uid,
            next_hop_host=planned.aggregator,
            next_hop_address=address,
            dst_host=planned.dst,
            aggregate_id=planned.aggregate_id,
        )
        out.send(e.members[uid].src_host, pb.Directive(send=send))
        return out

    def forward(self, planned: PlannedAggregate, now: float) -> Effects:
        """The runner released aggregate ``planned``: its aggregator sends it on.

        To the server; or, in a multi-level tree, into its parent aggregate (whose directive
        goes out first if it has none yet).
        """
        e = self.executions.get(planned.aggregate_id)
        out = Effects()
        if e is None:
            out.send(planned.aggregator, wire.drop_directive(planned.aggregate_id, "unknown aggregate"))
            return out
        next_hop = planned.dst
        if e.parent:
            pe = self.ledger.parent_execution(e)
            if pe is None:
                return self.ledger.fail(e, f"its parent aggregate '{e.parent}' is gone", now, discard=True)
            pe.nested[e.aggregate_id] = Stage.SENT
            out += self.ledger.issue(pe, now)
            if pe.aggregate_id not in self.executions:  # issuing failed: e failed with it
                return out
            if self.pipelined(pe.aggregate_id):
                self.runner.arrived(e.aggregate_id)  # as a member sent (send_member)
            next_hop = pe.planned.aggregator
        try:
            address = self.state.address(next_hop)
        except SchedulerError as exc:
            out += self.ledger.fail(e, str(exc), now, discard=True)
            return out
        path = planned.path or self.state.path(planned.aggregator, next_hop)
        nbytes = int(planned.bytes)
        f = InFlight(e.aggregate_id, e.job, e.server, path, nbytes, now, now + self._duration(path, nbytes))
        self.state.track(f)
        e.forwarded = True
        # into a parent: its daemon answers on receipt (the aggregator's own timeout bounds it)
        e.deadline = now + (self.timeout + GRACE if e.parent else self.forward_timeout)
        send = pb.SendDirective(
            update_id=e.aggregate_id,
            next_hop_host=next_hop,
            next_hop_address=address,
            dst_host=self.ledger.server_host(e),
            aggregate_id=e.parent,
        )
        out.send(planned.aggregator, pb.Directive(send=send))
        return out

    # ----------------------------------------------------------------- events

    def pipelined(self, aggregate_id: str) -> bool:
        """Whether ``aggregate_id`` (on its way) is pipelined: its forward streams as its members land."""
        e = self.executions.get(aggregate_id)
        return e is not None and self.ledger.streams(e)

    def is_member_send(self, update_id: str) -> bool:
        """Whether a report on ``update_id`` is about a send to an aggregator."""
        return self.ledger.is_member_send(update_id)

    def ready(self, host: str, aggregate_id: str, begun: tuple[str, ...] = ()) -> Effects:
        """The aggregator on ``host`` announced ``aggregate_id``: every member is in.

        Pipelined, every member in ``begun`` has begun to arrive (and counts as in from now).
        """
        out = Effects()
        e = self.executions.get(aggregate_id)
        if e is not None and e.planned.aggregator == host and e.forwarded:
            # announced again (re-opened for a member that joined) after the scheduler released
            # it: the send directive is on its way, and the aggregator's report settles it
            return out
        if e is None or e.planned.aggregator != host:
            out.send(host, wire.drop_directive(aggregate_id, f"aggregate '{aggregate_id}' is not expected"))
            return out
        e.ready = True
        e.deadline = math.inf  # released once its ``after`` transfers are done
        # a member its source reported in (summed); the others (a member that joined after an
        # earlier announcement) once their sources report. Pipelined: also every member the
        # announcement says has begun to arrive (it sums them as they land)
        landing = set(begun) if self.pipelined(aggregate_id) else set()
        for m, stage in [*e.stage.items(), *e.nested.items()]:  # nested: member aggregates
            if stage is Stage.IN or (stage is Stage.SENT and m in landing):
                self.runner.arrived(m)
        return out

    def member_report(self, result: TransferResult, now: float) -> Effects:
        """The source reported the send of a member to its aggregator."""
        out = Effects()
        uid = result.update_id
        with contextlib.suppress(UnknownUpdate):
            out.closed = self.state.report(result)
        if not result.ok:
            out.closed = None
        orphan = self.ledger.take_orphan(uid)
        if orphan is not None:
            out += self.ledger.requeue([orphan])
            return out
        e = self.ledger.take_sent(uid)
        if e is None or uid not in e.members:
            return out
        if result.ok and result.outcome is OutcomeKind.DROPPED:
            # the aggregator refused it before summing (e.g. NaN or inf) and its source resolved
            # the push DROPPED with the reason: the aggregate goes on without it (re-issued)
            self.runner.forget([uid])
            out += self.reconcile(now)
            out.resolved.append(OutcomeKind.DROPPED)  # counted like any dropped update
            return out
        e.stage[uid] = Stage.IN
        if not result.ok:
            reason = f"member '{uid}' did not reach aggregator '{e.planned.aggregator}': {result.error}"
            out += self.ledger.fail(e, reason, now, discard=True)
        elif e.ready:
            self.runner.arrived(uid)
        return out

    def aggregate_report(self, m: pb.TransferReport, host: str, now: float) -> Effects:
        """The aggregator reported the aggregate's transfer, with member verdicts (:meth:`.Ledger.report`)."""
        out = Effects()
        e = self.executions.get(m.update_id)
        if e is None or e.planned.aggregator != host:
            return out
        result = wire.transfer_result(host, m)
        with contextlib.suppress(UnknownUpdate):
            out.closed = self.state.report(result)
        if not e.parent and not result.ok:  # the frame never left, or its outcome says how it ended
            out.closed = None
        out += self.ledger.report(e, m, result, now)
        return out

    def failed(self, host: str, m: pb.AggregateFailed, now: float) -> Effects:
        """The aggregator on ``host`` gave the aggregate up: its members are planned afresh.

        Once the aggregate was released to the server (it may have been applied) they resolve
        UNKNOWN instead.
        """
        e = self.executions.get(m.aggregate_id)
        if e is None or e.planned.aggregator != host:
            return Effects()
        return self.ledger.fail(e, f"aggregator '{host}' failed: {m.reason}", now, discard=False)

    def reconcile(self, now: float) -> Effects:
        """Follow the runner: re-issue aggregates that lost members, cancel empty ones."""
        return self.ledger.reconcile(now)

    def expire(self, now: float) -> Effects:
        """Give up aggregates past their deadline (the aggregator's timeout plus a grace)."""
        out = Effects()
        for e in [e for e in self.executions.values() if e.deadline < now]:
            stage = "its report" if e.forwarded else "its members"
            why = f"aggregate '{e.aggregate_id}' timed out waiting for {stage}"
            out += self.ledger.fail(e, why, now, discard=True)
        return out

    def expire_stalled(self, now: float) -> Effects:
        """Free the bottlenecks of this book's transfers with no report past their stall deadline.

        The deadline is :meth:`SchedulerState.expire_stalled`'s; call this first, so the state
        records no bare DROPPED for a member or an aggregate (a member resolves once, through
        its aggregate's verdicts):

        - an aggregate forwarded to its server: its entry leaves the links; its members resolve
          from the aggregator's report, or UNKNOWN at the forward timeout (:meth:`expire`; a
          synchronous round may hold the ACK longer than a transfer takes); in a multi-level
          tree, one forwarded into its parent fails at the aggregator's timeout (its members
          planned afresh);
        - a member on its way to an aggregate still gathering: the aggregate fails (the others
          planned afresh) and the member is planned afresh once its source reports;
        - a member of a complete or failed aggregate: the aggregate's or its source's report.
        """
        out = Effects()
        for f in list(self.state.in_flight.values()):
            deadline = stalled_after(f)
            uid = f.update_id
            if now <= deadline or not (is_aggregate_id(uid) or self.is_member_send(uid)):
                continue
            self.state.track(None, untrack=uid)
            why = (
                f"no report on the transfer of '{uid}' by its deadline {deadline:g} s "
                f"(expected {f.expected_end - f.started_at:g} s from {f.started_at:g} s)"
            )
            log.warning("%s: its links are free again; it resolves through its aggregate", why)
            e = self.ledger.sent_to(uid)
            if e is not None and not e.forwarded and not e.ready:
                out += self.ledger.fail(e, f"member {why}", now, discard=True)
        return out

    def gathering(self, now: float) -> tuple[InFlight, ...]:
        """Aggregates being gathered, as transfers into their servers (for the policy's snapshot).

        Each is expected to take the server's link for one update's time from ``now``, so
        the next group to that server is gathered meanwhile (online aggregation).
        """
        out = []
        for e in self.executions.values():
            if e.forwarded:
                continue
            path = e.planned.path or self.state.path(e.planned.aggregator, e.planned.dst)
            nbytes = int(e.planned.bytes)
            out.append(
                InFlight(
                    e.aggregate_id, e.job, e.server, path, nbytes, now, now + self._duration(path, nbytes)
                )
            )
        return tuple(out)

    def next_deadline(self) -> float | None:
        """The earliest deadline of an aggregate on its way (``None`` if there is none)."""
        return min((e.deadline for e in self.executions.values()), default=None)

    def _duration(self, path: tuple[str, ...], nbytes: int) -> float:
        caps = [self.state.graph.edges[a, b]["capacity"] for a, b in itertools.pairwise(path)]
        return nbytes / min(caps) if caps else 0.0
