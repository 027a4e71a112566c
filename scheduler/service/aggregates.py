"""Aggregates executed by the daemons: the service's books (paper §5, Fig. 6; DESIGN §3).

The policy (``stf+agg``) plans :class:`~mlfabric.scheduler.policies.base.PlannedAggregate`\\ s
and the :class:`~mlfabric.scheduler.policies.runner.DecisionRunner` releases their member
sends and, once every member is in, the aggregate itself. :class:`AggregateBook` turns that
into directives for the daemons and follows each aggregate to the end:

* the first member released: an ``AggregateDirective`` to the aggregator's daemon (members,
  the server's host and address, a timeout); every member: a ``SendDirective`` to its source
  naming the aggregate (the source keeps the payload until its push is resolved);
* the aggregator announces the aggregate (``UpdateReady`` with the aggregate's id): its members
  are in; the runner releases it (after its ``after`` transfers) and a ``SendDirective`` of the
  aggregate goes to the aggregator's daemon;
* the aggregate's ``TransferReport`` carries one verdict per member: a ``ResolveDirective`` to
  each member's source, so each push resolves exactly once, APPLIED with its own delay or
  DROPPED with the reason;
* a member that goes away before it reaches the aggregator (dropped, its source's daemon
  gone): the directive is sent again with fewer members, or the aggregate is cancelled;
* the aggregator's daemon gone, ``AggregateFailed``, a member refused, or the aggregate not in
  within the book's timeouts, before the aggregate was released to the server: every
  unresolved member becomes pending again (its source still holds the payload) and is planned
  afresh. A member sent but not yet reported by its source is re-queued when that report comes
  (its source answers every send);
* once the aggregate was released to the server (its frame may have reached the server's
  daemon, which may have applied it), its members are never planned again: the aggregator's
  report gives their verdicts (APPLIED, DROPPED, or UNKNOWN when its frame may have been sent
  and no answer came); the aggregator's daemon gone, ``AggregateFailed`` or no report within
  the forward timeout resolve them UNKNOWN with the reason. The server's daemon going away
  meanwhile waits for the aggregator's report (it knows whether the frame left).

Which hosts may aggregate (:meth:`AggregateBook.eligible`): daemons that said hello with
``can_aggregate`` on hosts whose graph node does not say ``aggregator = False``.

No I/O and no clock: times are arguments; directives are returned as ``(host, Directive)``.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, PlannedAggregate
from mlfabric.scheduler.policies.dispatch import Release
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.service import state as state_module
from mlfabric.scheduler.service import wire
from mlfabric.scheduler.service.records import (
    DuplicateUpdate,
    OutcomeKind,
    SchedulerError,
    TransferResult,
    UnknownUpdate,
)
from mlfabric.scheduler.service.state import SchedulerState

__all__ = ["AggregateBook", "Effects", "Execution"]

log = logging.getLogger(__name__)

#: seconds an aggregator waits for the members of an aggregate (``AggregateDirective.timeout_seconds``)
DEFAULT_TIMEOUT = 60.0
#: seconds the scheduler waits for a forwarded aggregate's report (synchronous rounds hold ACKs)
DEFAULT_FORWARD_TIMEOUT = 180.0
#: extra seconds the scheduler waits beyond the aggregator's own timeout before giving up
GRACE = 10.0


class Stage(enum.Enum):
    """Where one member of an aggregate is."""

    PLANNED = "planned"  # pending at its source, not released
    SENT = "sent"  # released to the aggregator, its source has not reported
    IN = "in"  # its source reported (the payload is at the aggregator, or refused)


@dataclass
class Execution:
    """One aggregate on its way: its plan, its members and where each is."""

    planned: PlannedAggregate
    job: str
    server: str
    members: dict[str, PendingUpdate]
    stage: dict[str, Stage]
    issued: tuple[str, ...] = ()  # members of the last AggregateDirective
    deadline: float = math.inf
    ready: bool = False
    forwarded: bool = False

    @property
    def aggregate_id(self) -> str:
        """The aggregate's id (``agg:<scope>:<index>``)."""
        return self.planned.aggregate_id


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


class AggregateBook:
    """The service's books of aggregates executed by daemons (see the module docstring).

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
    ) -> None:
        self.state = state
        self.runner = runner
        self.timeout = timeout
        self.forward_timeout = forward_timeout
        self.executions: dict[str, Execution] = {}
        self._can_aggregate: dict[str, bool] = {}
        self._sent: dict[str, str] = {}  # member id -> aggregate id, while its source has not reported
        self._orphans: dict[str, PendingUpdate] = {}  # sent to an aggregate that failed
        #: aggregates that failed (re-planned) and members re-queued, for inspection
        self.failures = 0
        self.requeued = 0

    # ------------------------------------------------------------------ hosts

    def hello(self, host: str, can_aggregate: bool) -> None:
        """The daemon of ``host`` connected (``Hello.can_aggregate``)."""
        self._can_aggregate[host] = can_aggregate

    def eligible(self) -> frozenset[str]:
        """Hosts that may be aggregator hops now."""
        nodes = self.state.graph.nodes
        return frozenset(
            h
            for h, ok in self._can_aggregate.items()
            if ok and h in self.state.daemons and nodes[h].get("aggregator", True) is not False
        )

    def host_lost(self, host: str, now: float) -> Effects:
        """The daemon of ``host`` disconnected (after ``state.disconnect``).

        Aggregates gathered on it fail (their members are planned afresh); its members not yet
        at their aggregator leave their aggregates, which are re-issued with fewer members.
        """
        self._can_aggregate.pop(host, None)
        out = Effects()
        for e in list(self.executions.values()):
            if e.planned.aggregator == host:
                out += self._fail(
                    e, f"the aggregator's daemon (host '{host}') disconnected", now, discard=False
                )
            elif e.planned.dst == host and not e.forwarded:
                out += self._fail(e, f"the server's daemon (host '{host}') disconnected", now, discard=True)
            # forwarded to a server whose daemon went away: the aggregator's report says whether
            # the frame may have reached it (UNKNOWN) or certainly did not (planned afresh)
        gone = []
        for m, aid in list(self._sent.items()):
            held = self.executions.get(aid)
            if held is not None and not held.ready and held.members[m].src_host == host:
                gone.append(m)
                del self._sent[m], held.members[m], held.stage[m]
        for m in [m for m, u in self._orphans.items() if u.src_host == host]:
            del self._orphans[m]
        self.runner.forget(gone)
        out += self.reconcile(now)
        return out

    # -------------------------------------------------------------- releasing

    def send_member(self, r: Release, planned: PlannedAggregate, now: float) -> Effects:
        """The runner released member ``r.send`` of ``planned``: direct it to the aggregator.

        The first member released issues the ``AggregateDirective``.
        """
        out = Effects()
        uid = r.send.update_id
        e = self.executions.get(planned.aggregate_id)
        if e is None:
            e = self._start(planned)
        elif (
            uid not in e.members and uid in planned.members and uid in self.state.pending and not e.forwarded
        ):
            # it joins the aggregate being gathered: the directive is re-issued with it, and the
            # aggregate waits for it (announced again once it is in)
            e.members[uid] = self.state.pending[uid]
            e.stage[uid] = Stage.PLANNED
            e.ready = False
        if uid not in e.members:  # not pending when the aggregate started: leave it to a re-plan
            return out
        try:
            address = self.state.address(planned.aggregator)
        except SchedulerError as exc:
            return self._fail(e, str(exc), now, discard=False)
        out += self._issue(e, now)
        if planned.aggregate_id not in self.executions:  # issuing failed (the server is gone)
            return out
        self.state.release(uid, r.send.path, r.started_at, r.expected_end)
        e.stage[uid] = Stage.SENT
        self._sent[uid] = e.aggregate_id
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
        """The runner released aggregate ``planned``: its aggregator sends it to the server."""
        e = self.executions.get(planned.aggregate_id)
        if e is None:
            out = Effects()
            out.send(planned.aggregator, wire.drop_directive(planned.aggregate_id, "unknown aggregate"))
            return out
        try:
            address = self.state.address(planned.dst)
        except SchedulerError as exc:
            return self._fail(e, str(exc), now, discard=True)
        path = planned.path or self.state.path(planned.aggregator, planned.dst)
        nbytes = int(planned.bytes)
        f = InFlight(e.aggregate_id, e.job, e.server, path, nbytes, now, now + self._duration(path, nbytes))
        self.state.track(f)
        e.forwarded = True
        e.deadline = now + self.forward_timeout
        send = pb.SendDirective(
            update_id=e.aggregate_id,
            next_hop_host=planned.dst,
            next_hop_address=address,
            dst_host=planned.dst,
        )
        out = Effects()
        out.send(planned.aggregator, pb.Directive(send=send))
        return out

    # ----------------------------------------------------------------- events

    @staticmethod
    def is_aggregate(update_id: str) -> bool:
        """Whether ``update_id`` names an aggregate (``agg:<scope>:<index>``).

        Examples
        --------
        >>> AggregateBook.is_aggregate("agg:ps:3"), AggregateBook.is_aggregate("h1/3")
        (True, False)
        """
        return update_id.startswith("agg:")

    def is_member_send(self, update_id: str) -> bool:
        """Whether a report on ``update_id`` is about a send to an aggregator."""
        return update_id in self._sent or update_id in self._orphans

    def ready(self, host: str, aggregate_id: str) -> Effects:
        """The aggregator on ``host`` announced ``aggregate_id``: every member is in."""
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
        for m, stage in e.stage.items():
            # a member its source reported in (summed); the others (a member that joined after
            # an earlier announcement) once their sources report
            if stage is Stage.IN:
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
        orphan = self._orphans.pop(uid, None)
        if orphan is not None:
            out += self._requeue([orphan])
            return out
        aid = self._sent.pop(uid, None)
        e = self.executions.get(aid) if aid is not None else None
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
            out += self._fail(e, reason, now, discard=True)
        elif e.ready:
            self.runner.arrived(uid)
        return out

    def aggregate_report(self, m: pb.TransferReport, host: str, now: float) -> Effects:
        """The aggregator reported the aggregate's transfer to the server, with member verdicts."""
        out = Effects()
        e = self.executions.get(m.update_id)
        if e is None or e.planned.aggregator != host:
            return out
        result = wire.transfer_result(host, m)
        with contextlib.suppress(UnknownUpdate):
            out.closed = self.state.report(result)
        if not result.ok and result.outcome is None:  # its frame certainly never left the aggregator
            out.closed = None
            out += self._fail(
                e, f"the aggregate did not reach the server: {result.error}", now, discard=False, left=False
            )
            return out
        if not result.ok:  # it may have reached the server: the outcome (UNKNOWN) says how it ended
            out.closed = None
        del self.executions[e.aggregate_id]
        verdicts = {v.update_id: v for v in m.member_verdicts}
        for uid, u in e.members.items():
            v = verdicts.get(uid)
            kind = wire.OUTCOMES.get(v.outcome if v is not None else m.outcome, OutcomeKind.DROPPED)
            delay = v.delay if v is not None else m.delay
            reason = (v.reason if v is not None else m.reason) if kind is not OutcomeKind.APPLIED else ""
            if kind is not OutcomeKind.APPLIED and not reason:
                reason = f"aggregate '{e.aggregate_id}' gave no verdict for the member"
            resolve = pb.ResolveDirective(
                update_id=uid,
                outcome=wire.OUTCOME_PB[kind],
                delay=delay,
                server_version=m.server_version,
                reason=reason,
            )
            out.send(u.src_host, pb.Directive(resolve=resolve))
            self.state.record(uid, kind, reason, delay, m.server_version)
            out.resolved.append(kind)
        return out

    def failed(self, host: str, m: pb.AggregateFailed, now: float) -> Effects:
        """The aggregator on ``host`` gave the aggregate up: its members are planned afresh.

        Once the aggregate was released to the server (it may have been applied) they resolve
        UNKNOWN instead.
        """
        e = self.executions.get(m.aggregate_id)
        if e is None or e.planned.aggregator != host:
            return Effects()
        return self._fail(e, f"aggregator '{host}' failed: {m.reason}", now, discard=False)

    def reconcile(self, now: float) -> Effects:
        """Follow the runner: re-issue aggregates that lost members, cancel empty ones."""
        out = Effects()
        gathering = {a.aggregate_id: a for a in self.runner.gathering}
        for e in list(self.executions.values()):
            if e.forwarded:
                continue
            planned = gathering.get(e.aggregate_id)
            keep = set(planned.members) if planned is not None else set()
            for m in [m for m in e.members if m not in keep]:
                del e.members[m], e.stage[m]
                self._sent.pop(m, None)
            if not e.members:
                del self.executions[e.aggregate_id]
                cancel = pb.AggregateDirective(aggregate_id=e.aggregate_id, job=e.job, server=e.server)
                out.send(e.planned.aggregator, pb.Directive(aggregate=cancel))
            elif e.issued and tuple(e.members) != e.issued:
                out += self._issue(e, now)
        return out

    def expire(self, now: float) -> Effects:
        """Give up aggregates past their deadline (the aggregator's timeout plus a grace)."""
        out = Effects()
        for e in [e for e in self.executions.values() if e.deadline < now]:
            stage = "its report" if e.forwarded else "its members"
            out += self._fail(
                e, f"aggregate '{e.aggregate_id}' timed out waiting for {stage}", now, discard=True
            )
        return out

    def expire_stalled(self, now: float) -> Effects:
        """Free the bottlenecks of this book's transfers with no report past their stall deadline.

        The deadline is :meth:`SchedulerState.expire_stalled`'s; call this first, so the state
        records no bare DROPPED for a member or an aggregate (a member resolves once, through
        its aggregate's verdicts):

        - an aggregate forwarded to its server: its entry leaves the links; its members resolve
          from the aggregator's report, or UNKNOWN at the forward timeout (:meth:`expire`; a
          synchronous round may hold the ACK longer than a transfer takes);
        - a member on its way to an aggregate still gathering: the aggregate fails (the others
          planned afresh) and the member is planned afresh once its source reports;
        - a member of a complete or failed aggregate: the aggregate's or its source's report.
        """
        out = Effects()
        factor, slack = state_module.STALL_FACTOR, state_module.STALL_SLACK
        for f in list(self.state.in_flight.values()):
            deadline = f.started_at + factor * max(0.0, f.expected_end - f.started_at) + slack
            uid = f.update_id
            if now <= deadline or not (self.is_aggregate(uid) or self.is_member_send(uid)):
                continue
            self.state.track(None, untrack=uid)
            why = (
                f"no report on the transfer of '{uid}' by its deadline {deadline:g} s "
                f"(expected {f.expected_end - f.started_at:g} s from {f.started_at:g} s)"
            )
            log.warning("%s: its links are free again; it resolves through its aggregate", why)
            e = self.executions.get(self._sent.get(uid, ""))
            if e is not None and not e.forwarded and not e.ready:
                out += self._fail(e, f"member {why}", now, discard=True)
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

    # -------------------------------------------------------------- internals

    def _start(self, planned: PlannedAggregate) -> Execution:
        members = {m: self.state.pending[m] for m in planned.members if m in self.state.pending}
        missing = [m for m in planned.members if m not in members]
        if missing:
            self.runner.forget(missing)
        first = next(iter(members.values()))
        e = Execution(planned, first.job, first.server, members, dict.fromkeys(members, Stage.PLANNED))
        self.executions[planned.aggregate_id] = e
        return e

    def _issue(self, e: Execution, now: float) -> Effects:
        """Send the aggregate's current members to its aggregator (if they changed)."""
        out = Effects()
        if tuple(e.members) == e.issued:
            return out
        try:
            address = self.state.address(e.planned.dst)
        except SchedulerError as exc:
            return self._fail(e, str(exc), now, discard=False)
        members = [
            pb.AggregateMember(
                update_id=u.update_id,
                worker=u.worker,
                base_version=u.base_version,
                norm=u.norm,
                src_host=u.src_host,
                bytes=u.bytes,
            )
            for u in e.members.values()
        ]
        job = self.state.jobs.get(e.job)
        directive = pb.AggregateDirective(
            aggregate_id=e.aggregate_id,
            job=e.job,
            server=e.server,
            members=members,
            dst_host=e.planned.dst,
            dst_address=address,
            timeout_seconds=self.timeout,
            allow_non_finite=job is not None and job.params.allow_non_finite,
        )
        e.issued = tuple(e.members)
        e.deadline = now + self.timeout + GRACE
        out.send(e.planned.aggregator, pb.Directive(aggregate=directive))
        return out

    def _fail(
        self, e: Execution, reason: str, now: float, *, discard: bool, left: bool | None = None
    ) -> Effects:
        """Give ``e`` up: every member not at its source's hands is planned afresh.

        An aggregate that may have left its aggregator for the server (``left``; by default:
        it was released to the server) may have been applied: its members resolve UNKNOWN
        (:meth:`_unknown`), never planned again.
        """
        if e.forwarded if left is None else left:
            out = self._unknown(e, f"aggregate '{e.aggregate_id}' may have reached the server: {reason}", now)
            if discard:
                out.send(e.planned.aggregator, wire.drop_directive(e.aggregate_id, reason))
            return out
        out = Effects()
        self.failures += 1
        self.executions.pop(e.aggregate_id, None)
        if discard:
            out.send(e.planned.aggregator, wire.drop_directive(e.aggregate_id, reason))
        abandon = getattr(self.runner.policy, "abandon", None)
        if abandon is not None:
            abandon(e.aggregate_id)
        self.runner.forget(e.members)
        if e.forwarded:
            self.state.track(None, untrack=e.aggregate_id)
        back = []
        for uid, stage in e.stage.items():
            if stage is Stage.SENT:
                self._sent.pop(uid, None)
                self._orphans[uid] = e.members[uid]
            elif stage is Stage.IN:
                back.append(e.members[uid])
        out += self._requeue(back)
        out.requeued += 1  # the aggregate's planned members need a decision too
        later = sum(stage is Stage.SENT for stage in e.stage.values())
        log.info(
            "aggregate %s failed (%s): %d members planned afresh, %d once their sources report",
            e.aggregate_id,
            reason,
            len(e.members) - later,
            later,
        )
        return out

    def _unknown(self, e: Execution, reason: str, now: float) -> Effects:
        """Resolve every member of ``e`` UNKNOWN with ``reason`` (it may have been applied)."""
        out = Effects()
        self.failures += 1
        self.executions.pop(e.aggregate_id, None)
        abandon = getattr(self.runner.policy, "abandon", None)
        if abandon is not None:
            abandon(e.aggregate_id)
        self.runner.forget(e.members)
        if e.forwarded:
            self.state.track(None, untrack=e.aggregate_id)
        for uid, u in e.members.items():
            self._sent.pop(uid, None)
            resolve = pb.ResolveDirective(update_id=uid, outcome=pb.OUTCOME_UNKNOWN, reason=reason)
            out.send(u.src_host, pb.Directive(resolve=resolve))
            self.state.record(uid, OutcomeKind.UNKNOWN, reason, 0, 0)
            out.resolved.append(OutcomeKind.UNKNOWN)
        log.warning("aggregate %s: %d members resolved UNKNOWN (%s)", e.aggregate_id, len(e.members), reason)
        return out

    def _requeue(self, updates: Iterable[PendingUpdate]) -> Effects:
        out = Effects()
        for u in updates:
            try:
                self.state.requeue(u)
            except DuplicateUpdate:
                continue  # announced again by its source meanwhile
            except SchedulerError as exc:
                reason = f"cannot re-plan after its aggregate failed: {exc}"
                out.send(u.src_host, wire.drop_directive(u.update_id, reason))
                self.state.record(u.update_id, OutcomeKind.DROPPED, reason, 0, 0)
                out.resolved.append(OutcomeKind.DROPPED)
                continue
            self.requeued += 1
            out.requeued += 1
        return out

    def _duration(self, path: tuple[str, ...], nbytes: int) -> float:
        caps = [self.state.graph.edges[a, b]["capacity"] for a, b in itertools.pairwise(path)]
        return nbytes / min(caps) if caps else 0.0
