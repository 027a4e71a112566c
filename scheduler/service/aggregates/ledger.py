"""The aggregates on their way and how each one ends (paper §5, Fig. 6; DESIGN §10).

:class:`Ledger` holds the aggregates being executed (:class:`~.records.Execution`, by id) and
the member sends whose source has not reported yet, and carries out every transition that
keeps each worker update resolved exactly once; :class:`~.book.AggregateBook` turns the
runner's releases and the daemons' messages into these transitions.

- **Issuing** (:meth:`Ledger.issue`): the ``AggregateDirective`` with the aggregate's current
  members, re-issued whenever they change. In a multi-level tree (``stf+tree``,
  docs/aggregation-trees.md) a member aggregate is listed as an ``AggregateMember`` whose
  ``update_id`` is its aggregate id and ``src_host`` its aggregator.
- **Its report** (:meth:`Ledger.report`): each worker update it carries resolves by its
  verdict (one ``ResolveDirective`` each). Forwarded into a parent aggregate: summed (ok, no
  outcome), its worker updates become the parent's (``absorbed``), resolved by the root's
  report; refused before summing (DROPPED), they resolve DROPPED and the parent goes on
  without it; failed (not summed, or not known to be), it fails.
- **A failure** (:meth:`Ledger.fail`): the members are planned afresh (their sources hold the
  payloads), or resolve UNKNOWN once the aggregate may have reached the server; members whose
  send is on its way become orphans, planned afresh once their source reports. In a tree the
  failure takes the member aggregates with it (their daemons discard their sums) and the
  parent is re-issued without it: a parent whose daemon had summed it then refuses the
  directive and fails whole, so no worker update reaches the server twice or is lost.
- **Following the runner** (:meth:`Ledger.reconcile`): members that left are removed (the
  directive re-issued with fewer), empty aggregates cancelled.

No I/O and no clock: times are arguments; directives are returned as
:class:`~mlfabric.scheduler.service.effects.Effects`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.schedule import is_aggregate_id
from mlfabric.scheduler.policies.base import PendingUpdate, PlannedAggregate
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.service import wire
from mlfabric.scheduler.service.aggregates.records import Execution, Stage
from mlfabric.scheduler.service.effects import Effects
from mlfabric.scheduler.service.records import DuplicateUpdate, OutcomeKind, SchedulerError, TransferResult
from mlfabric.scheduler.service.state import SchedulerState

__all__ = ["GRACE", "Ledger"]

log = logging.getLogger(__name__)

#: extra seconds the scheduler waits beyond the aggregator's own timeout before giving up
GRACE = 10.0


class Ledger:
    """The aggregates being executed and the member sends not yet reported (see the module docstring).

    Parameters
    ----------
    state : SchedulerState
        Where members move (pending, in flight, pending again) and their outcomes are recorded.
    runner : DecisionRunner
        Told which members and aggregates to forget, and which are in.
    timeout : float
        The aggregators' wait for the members (``AggregateDirective.timeout_seconds``).

    Examples
    --------
    An aggregate of one member aggregate, given up before it was issued:

    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.policies.base import PlannedAggregate
    >>> from mlfabric.scheduler.policies.fair import FairPolicy
    >>> ledger = Ledger(SchedulerState(star(["ps", "x"], 8e9)), DecisionRunner(FairPolicy()), timeout=60.0)
    >>> e = ledger.start(PlannedAggregate("agg:ps:1", "x", ("agg:x:0",), 8, "ps"))
    >>> list(e.nested), e.parent
    (['agg:x:0'], '')
    >>> out = ledger.fail(e, "its aggregator went away", now=1.0, discard=True)
    >>> [(h, d.drop.update_id) for h, d in out.directives], ledger.failures, ledger.executions
    ([('x', 'agg:ps:1')], 1, {})
    """

    def __init__(
        self, state: SchedulerState, runner: DecisionRunner, timeout: float, *, pipelined: bool = False
    ) -> None:
        self.state = state
        self.runner = runner
        self.timeout = timeout
        #: the aggregates are pipelined (``AggregateDirective.pipelined``): announced while
        #: their members land, forwarded piece by piece
        self.pipelined = pipelined
        self.executions: dict[str, Execution] = {}
        self._sent: dict[str, str] = {}  # member id -> aggregate id, while its source has not reported
        self._orphans: dict[str, PendingUpdate] = {}  # sent to an aggregate that failed
        #: aggregates that failed (re-planned) and members re-queued, for inspection
        self.failures = 0
        self.requeued = 0

    def streams(self, e: Execution) -> bool:
        """Whether ``e`` is pipelined: every aggregate under the option, or one planned with a chunk size."""
        return self.pipelined or e.planned.chunk_bytes > 0

    # ----------------------------------------------------------- member sends

    def is_member_send(self, update_id: str) -> bool:
        """Whether a report on ``update_id`` is about a send to an aggregator."""
        return update_id in self._sent or update_id in self._orphans

    def member_sent(self, e: Execution, update_id: str) -> None:
        """Member ``update_id`` of ``e`` was released to its aggregator."""
        e.stage[update_id] = Stage.SENT
        self._sent[update_id] = e.aggregate_id

    def take_orphan(self, update_id: str) -> PendingUpdate | None:
        """The member sent to an aggregate that failed meanwhile (its source reported it), if so."""
        return self._orphans.pop(update_id, None)

    def take_sent(self, update_id: str) -> Execution | None:
        """The aggregate a member was sent to (its source reported it); None if it is gone."""
        aid = self._sent.pop(update_id, None)
        return self.executions.get(aid) if aid is not None else None

    def sent_to(self, update_id: str) -> Execution | None:
        """The aggregate a member on its way was sent to (None: no such send, or it is gone)."""
        return self.executions.get(self._sent.get(update_id, ""))

    def leave_host(self, host: str) -> list[str]:
        """The daemon of ``host`` went away: its members not yet at their aggregator leave.

        Returns the members taken out of aggregates still gathering (the runner must forget
        them); its orphans are forgotten (nobody reports them any more).
        """
        gone = []
        for m, aid in list(self._sent.items()):
            held = self.executions.get(aid)
            if held is not None and not held.ready and held.members[m].src_host == host:
                gone.append(m)
                del self._sent[m], held.members[m], held.stage[m]
        for m in [m for m, u in self._orphans.items() if u.src_host == host]:
            del self._orphans[m]
        return gone

    # ------------------------------------------------------------- executions

    def start(self, planned: PlannedAggregate, job: str = "", server: str = "") -> Execution:
        """Book ``planned`` (its worker members pending now; its member aggregates; its parent)."""
        members = {m: self.state.pending[m] for m in planned.members if m in self.state.pending}
        nested = [m for m in planned.members if is_aggregate_id(m)]
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

    def parent_execution(self, e: Execution) -> Execution | None:
        """The execution of the aggregate ``e`` is summed into (booked now if needed); None if gone."""
        pe = self.executions.get(e.parent)
        if pe is None:
            up = self.runner.aggregate_of(e.aggregate_id)
            if up is None or up.aggregate_id != e.parent:
                return None
            pe = self.start(up, e.job, e.server)
        elif e.aggregate_id not in pe.nested and not pe.forwarded:
            up = self.runner.aggregate_of(e.aggregate_id)
            if up is not None and up.aggregate_id == pe.aggregate_id:
                # it joined the parent after the parent's first member was sent (a round's
                # aggregate listed again with it): the parent's directive is re-issued with it,
                # and the parent waits for it (announced again once it is in)
                pe.nested[e.aggregate_id] = Stage.PLANNED
                pe.ready = False
        return pe if e.aggregate_id in pe.nested else None

    def server_host(self, e: Execution) -> str:
        """The host of the server the tree of ``e`` ends at."""
        while e.parent in self.executions:
            e = self.executions[e.parent]
        return e.planned.dst

    def issue(self, e: Execution, now: float) -> Effects:
        """Send the aggregate's current members to its aggregator (if they changed)."""
        out = Effects()
        if e.listed() == e.issued:
            return out
        try:
            address = self.state.address(e.planned.dst)
        except SchedulerError as exc:
            return self.fail(e, str(exc), now, discard=False)
        members = [wire.aggregate_member(u) for u in e.members.values()]
        members += self._nested_members(e)
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
            pipelined=self.streams(e),
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

    def _nested_members(self, e: Execution) -> list[pb.AggregateMember]:
        """The member aggregates of ``e`` as its directive lists them (after its worker updates)."""
        gathering = {a.aggregate_id: a for a in self.runner.gathering} if e.nested else {}
        out = []
        for cid in e.nested:
            ce = self.executions.get(cid)
            planned = ce.planned if ce is not None else gathering.get(cid)
            carried = list(ce.carried().values()) if ce is not None else []
            out.append(
                pb.AggregateMember(
                    update_id=cid,
                    base_version=min((u.base_version for u in carried), default=0),
                    norm=sum(u.norm for u in carried),
                    src_host=planned.aggregator if planned is not None else "",
                    bytes=int(planned.bytes) if planned is not None else 0,
                )
            )
        return out

    # ------------------------------------------------------------------ endings

    def report(self, e: Execution, m: pb.TransferReport, result: TransferResult, now: float) -> Effects:
        """The aggregator of ``e`` reported its transfer: to the server (verdicts) or into its parent."""
        if e.parent:
            return self._nested_report(e, m, result, now)
        if not result.ok and result.outcome is None:  # its frame certainly never left the aggregator
            return self.fail(
                e, f"the aggregate did not reach the server: {result.error}", now, discard=False, left=False
            )
        del self.executions[e.aggregate_id]
        return self._resolve(e, m)

    def _nested_report(
        self, e: Execution, m: pb.TransferReport, result: TransferResult, now: float
    ) -> Effects:
        """The aggregator of ``e`` reported its forward into the parent aggregate ``e.parent``."""
        out = Effects()
        if not result.ok:  # not summed there, or not known to be: the parent goes on without it
            why = f"aggregate '{e.aggregate_id}' was not summed into '{e.parent}': {result.error}"
            out += self.fail(e, why, now, discard=False, left=False)
            return out
        self.executions.pop(e.aggregate_id, None)
        if result.outcome is not None:  # the parent's daemon refused it before summing
            self._abandon(e.aggregate_id)
            self.runner.forget([*e.members, e.aggregate_id])
            out += self._resolve(e, m)
            out += self.reconcile(now)
            return out
        pe = self.executions.get(e.parent)
        if pe is None or e.aggregate_id not in pe.nested:  # the parent was given up meanwhile
            out += self.requeue(e.carried().values())
            return out
        pe.nested[e.aggregate_id] = Stage.IN
        pe.absorbed.update(e.carried())
        if pe.ready:
            self.runner.arrived(e.aggregate_id)
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

    def fail(
        self, e: Execution, reason: str, now: float, *, discard: bool, left: bool | None = None
    ) -> Effects:
        """Give ``e`` up: every member not at its source's hands is planned afresh.

        An aggregate that may have left its aggregator for the server (``left``; by default:
        it was released to the server) may have been applied: its members resolve UNKNOWN
        (:meth:`_unknown`), never planned again. In a multi-level tree an aggregate summed
        into a parent never reaches the server by itself: it leaves its parent (re-issued
        without it: a parent that summed it fails whole at its daemon) and its member
        aggregates fail with it (:meth:`_fail_nested`); the worker updates they carried are
        planned afresh too. ``discard``: its aggregator is told to drop it.
        """
        if e.aggregate_id not in self.executions:  # failed already (e.g. with its parent)
            return Effects()
        if not e.parent and (e.forwarded if left is None else left):
            out = self._unknown(e, f"aggregate '{e.aggregate_id}' may have reached the server: {reason}")
            if discard:
                out.send(e.planned.aggregator, wire.drop_directive(e.aggregate_id, reason))
            return out
        out = Effects()
        self.failures += 1
        self.executions.pop(e.aggregate_id, None)
        if discard:
            out.send(e.planned.aggregator, wire.drop_directive(e.aggregate_id, reason))
        self._abandon(e.aggregate_id)
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
        out += self.requeue(back)
        if e.nested or e.parent:
            out += self._fail_nested(e, reason, now)
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

    def _fail_nested(self, e: Execution, reason: str, now: float) -> Effects:
        """After ``e`` failed: its member aggregates fail too, its parent is re-issued without it."""
        out = Effects()
        for cid in e.nested:
            ce = self.executions.get(cid)
            if ce is not None:
                why = f"its parent aggregate '{e.aggregate_id}' failed: {reason}"
                out += self.fail(ce, why, now, discard=True, left=False)
        if e.parent:
            out += self.reconcile(now)
        return out

    def _unknown(self, e: Execution, reason: str) -> Effects:
        """Resolve every member of ``e`` UNKNOWN with ``reason`` (it may have been applied)."""
        out = Effects()
        self.failures += 1
        self.executions.pop(e.aggregate_id, None)
        self._abandon(e.aggregate_id)
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

    def _abandon(self, aggregate_id: str) -> None:
        """Tell a policy that keeps aggregates across decisions (``stf+tree``) to let it go."""
        abandon = getattr(self.runner.policy, "abandon", None)
        if abandon is not None:
            abandon(aggregate_id)

    def requeue(self, updates: Iterable[PendingUpdate]) -> Effects:
        """Make ``updates`` pending again (their sources hold the payloads); DROPPED if they cannot be."""
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
                out += self._drop_nested(e, keep, now)
                if e.aggregate_id not in self.executions:
                    continue
            if not e.members and not e.nested:
                del self.executions[e.aggregate_id]
                cancel = pb.AggregateDirective(aggregate_id=e.aggregate_id, job=e.job, server=e.server)
                out.send(e.planned.aggregator, pb.Directive(aggregate=cancel))
            elif e.issued and e.listed() != e.issued:
                out += self.issue(e, now)
        return out

    def _drop_nested(self, e: Execution, keep: set[str], now: float) -> Effects:
        """Member aggregates of ``e`` that left it (they failed): out of its member list.

        If its daemon may have summed one (``e`` was complete, or the member was reported
        summed), ``e`` fails whole instead: its daemon would refuse the shorter list anyway.
        """
        gone = [c for c in e.nested if c not in keep]
        if e.ready or any(e.nested[c] is Stage.IN for c in gone):
            return self.fail(
                e, f"member aggregate(s) {gone} left it after it may have summed them", now, discard=True
            )
        out = Effects()
        for cid in gone:
            del e.nested[cid]
            ce = self.executions.get(cid)
            if ce is not None:
                why = f"it left its parent aggregate '{e.aggregate_id}'"
                out += self.fail(ce, why, now, discard=True, left=False)
        return out
