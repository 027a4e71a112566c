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
going to the server (:mod:`.aggregate_tree`: its directive names the parent, its release
sends it into the parent, its members resolve through the root's report; a failure takes its
member aggregates with it and re-issues its parent without it).

Which hosts may aggregate (:meth:`AggregateBook.eligible`): daemons that said hello with
``can_aggregate`` on hosts whose graph node does not say ``aggregator = False``.

No I/O and no clock: times are arguments; directives are returned as ``(host, Directive)``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Iterable

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, PlannedAggregate
from mlfabric.scheduler.policies.dispatch import Release
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.service import aggregate_stalls as stalls
from mlfabric.scheduler.service import aggregate_tree as tree
from mlfabric.scheduler.service import wire
from mlfabric.scheduler.service.aggregate_records import Effects, Execution, Stage
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
            if e.aggregate_id not in self.executions:  # failed with its parent meanwhile
                continue
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
            pe = self._parent_execution(e)
            if pe is None:
                return self._fail(e, f"its parent aggregate '{e.parent}' is gone", now, discard=True)
            pe.nested[e.aggregate_id] = Stage.SENT
            out += self._issue(pe, now)
            if pe.aggregate_id not in self.executions:  # issuing failed: e failed with it
                return out
            next_hop = pe.planned.aggregator
        try:
            address = self.state.address(next_hop)
        except SchedulerError as exc:
            out += self._fail(e, str(exc), now, discard=True)
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
            dst_host=self._server_host(e),
            aggregate_id=e.parent,
        )
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
        for m, stage in e.nested.items():  # member aggregates reported summed here
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
        if e.parent:
            out += tree.nested_report(self, e, m, result, now)
            return out
        if not result.ok and result.outcome is None:  # its frame certainly never left the aggregator
            out.closed = None
            out += self._fail(
                e, f"the aggregate did not reach the server: {result.error}", now, discard=False, left=False
            )
            return out
        if not result.ok:  # it may have reached the server: the outcome (UNKNOWN) says how it ended
            out.closed = None
        del self.executions[e.aggregate_id]
        out += self._resolve(e, m)
        return out

    def _resolve(self, e: Execution, m: pb.TransferReport) -> Effects:
        """Resolve every worker update ``e`` carries by the verdicts of report ``m``."""
        out = Effects()
        verdicts = {v.update_id: v for v in m.member_verdicts}
        for uid, u in e.carried().items():
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
            if e.forwarded or e.aggregate_id not in self.executions:
                continue
            planned = gathering.get(e.aggregate_id)
            keep = set(planned.members) if planned is not None else set()
            for m in [m for m in e.members if m not in keep]:
                del e.members[m], e.stage[m]
                self._sent.pop(m, None)
            if any(m not in keep for m in e.nested):
                out += tree.drop_nested(self, e, keep, now)
                if e.aggregate_id not in self.executions:
                    continue
            if not e.members and not e.nested:
                del self.executions[e.aggregate_id]
                cancel = pb.AggregateDirective(aggregate_id=e.aggregate_id, job=e.job, server=e.server)
                out.send(e.planned.aggregator, pb.Directive(aggregate=cancel))
            elif e.issued and e.listed() != e.issued:
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
        """Free the links of this book's transfers with no report past their stall deadline.

        Call it before :meth:`SchedulerState.expire_stalled` (see
        :func:`.aggregate_stalls.expire_stalled`).
        """
        return stalls.expire_stalled(self, now)

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

    def _start(self, planned: PlannedAggregate, job: str = "", server: str = "") -> Execution:
        """Book ``planned`` (its worker members pending now; its member aggregates; its parent)."""
        members = {m: self.state.pending[m] for m in planned.members if m in self.state.pending}
        nested = [m for m in planned.members if self.is_aggregate(m)]
        missing = [m for m in planned.members if m not in members and m not in nested]
        if missing:
            self.runner.forget(missing)
        first = next(iter(members.values()), None)
        job, server = (first.job, first.server) if first is not None else (job, server)
        up = self.runner.aggregate_of(planned.aggregate_id)
        e = Execution(
            planned,
            job,
            server,
            members,
            dict.fromkeys(members, Stage.PLANNED),
            parent=up.aggregate_id if up is not None else "",
            nested=dict.fromkeys(nested, Stage.PLANNED),
        )
        self.executions[planned.aggregate_id] = e
        return e

    def _parent_execution(self, e: Execution) -> Execution | None:
        """The execution of the aggregate ``e`` is summed into (booked now if needed); None if gone."""
        pe = self.executions.get(e.parent)
        if pe is None:
            up = self.runner.aggregate_of(e.aggregate_id)
            if up is None or up.aggregate_id != e.parent:
                return None
            pe = self._start(up, e.job, e.server)
        return pe if e.aggregate_id in pe.nested else None

    def _server_host(self, e: Execution) -> str:
        """The host of the server the tree of ``e`` ends at."""
        while e.parent in self.executions:
            e = self.executions[e.parent]
        return e.planned.dst

    def _issue(self, e: Execution, now: float) -> Effects:
        """Send the aggregate's current members to its aggregator (if they changed)."""
        out = Effects()
        if e.listed() == e.issued:
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
        members += tree.nested_members(self, e)
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
            dst_aggregate_id=e.parent,
        )
        e.issued = e.listed()
        e.deadline = now + self.timeout + GRACE
        if e.parent:
            log.info(
                "aggregate %s at host %s (%d members) to be summed into %s at host %s",
                e.aggregate_id,
                e.planned.aggregator,
                len(members),
                e.parent,
                e.planned.dst,
            )
        out.send(e.planned.aggregator, pb.Directive(aggregate=directive))
        return out

    def _fail(
        self, e: Execution, reason: str, now: float, *, discard: bool, left: bool | None = None
    ) -> Effects:
        """Give ``e`` up: every member not at its source's hands is planned afresh.

        An aggregate that may have left its aggregator for the server (``left``; by default:
        it was released to the server) may have been applied: its members resolve UNKNOWN
        (:meth:`_unknown`), never planned again. In a multi-level tree an aggregate summed
        into a parent never reaches the server by itself: it leaves its parent (re-issued
        without it: a parent that summed it fails whole at its daemon) and its member
        aggregates fail with it (:func:`.aggregate_tree.fail_nested`); the worker updates they
        carried are planned afresh too.
        """
        if e.aggregate_id not in self.executions:  # failed already (e.g. with its parent)
            return Effects()
        if not e.parent and (e.forwarded if left is None else left):
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
        self.runner.forget([*e.members, e.aggregate_id])  # out of its parent too, if it has one
        if e.forwarded:
            self.state.track(None, untrack=e.aggregate_id)
        back = list(e.absorbed.values())  # brought by member aggregates summed here
        for uid, stage in e.stage.items():
            if stage is Stage.SENT:
                self._sent.pop(uid, None)
                self._orphans[uid] = e.members[uid]
            elif stage is Stage.IN:
                back.append(e.members[uid])
        out += self._requeue(back)
        if e.nested or e.parent:
            out += tree.fail_nested(self, e, reason, now)
        out.requeued += 1  # the aggregate's planned members need a decision too
        later = sum(stage is Stage.SENT for stage in e.stage.values())
        log.info(
            "aggregate %s%s failed (%s): %d members planned afresh, %d once their sources report",
            e.aggregate_id,
            f" (to be summed into {e.parent})" if e.parent else "",
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
        for uid, u in e.carried().items():
            self._sent.pop(uid, None)
            resolve = pb.ResolveDirective(update_id=uid, outcome=pb.OUTCOME_UNKNOWN, reason=reason)
            out.send(u.src_host, pb.Directive(resolve=resolve))
            self.state.record(uid, OutcomeKind.UNKNOWN, reason, 0, 0)
            out.resolved.append(OutcomeKind.UNKNOWN)
        log.warning(
            "aggregate %s: %d members resolved UNKNOWN (%s)", e.aggregate_id, len(e.carried()), reason
        )
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
