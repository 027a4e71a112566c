"""Multi-level aggregation trees in the service's aggregate book (``stf+tree``).

An aggregate of a tree may be summed into another aggregate (its *parent*, at another
daemon) instead of going to the server (docs/aggregation-trees.md). The
:class:`~mlfabric.scheduler.service.aggregates.AggregateBook` keeps each as an
:class:`~mlfabric.scheduler.service.aggregate_records.Execution` whose ``parent`` names it and
whose ``nested`` are its member aggregates; this module holds what only trees need:

* a member aggregate is listed in its parent's ``AggregateDirective`` as an
  ``AggregateMember`` whose ``update_id`` is its aggregate id and ``src_host`` its aggregator
  (:func:`nested_members`);
* the report of a forward into the parent (:func:`nested_report`): summed (ok, no outcome):
  its worker updates become the parent's (``absorbed``), resolved by the root's report; refused
  before summing (DROPPED): its worker updates resolve DROPPED and the parent goes on without
  it; failed (not summed, or not known to be): it fails (:func:`fail_nested`);
* an aggregate that fails takes its member aggregates with it (their daemons discard their
  sums, their worker updates are planned afresh) and leaves its parent, which is re-issued
  without it: a parent whose daemon had summed it then refuses the directive and fails whole,
  so no worker update reaches the server twice or is lost (:func:`fail_nested`,
  :func:`drop_nested`).

No I/O and no clock, like the book.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.service.aggregate_records import Effects, Execution, Stage
from mlfabric.scheduler.service.records import TransferResult

if TYPE_CHECKING:
    from mlfabric.scheduler.service.aggregates import AggregateBook

__all__ = ["drop_nested", "fail_nested", "nested_members", "nested_report"]


def nested_members(book: AggregateBook, e: Execution) -> list[pb.AggregateMember]:
    """The member aggregates of ``e`` as its directive lists them (after its worker updates)."""
    gathering = {a.aggregate_id: a for a in book.runner.gathering} if e.nested else {}
    out = []
    for cid in e.nested:
        ce = book.executions.get(cid)
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


def fail_nested(book: AggregateBook, e: Execution, reason: str, now: float) -> Effects:
    """After ``e`` failed: its member aggregates fail too, its parent is re-issued without it."""
    out = Effects()
    for cid in e.nested:
        ce = book.executions.get(cid)
        if ce is not None:
            why = f"its parent aggregate '{e.aggregate_id}' failed: {reason}"
            out += book._fail(ce, why, now, discard=True, left=False)
    if e.parent:
        out += book.reconcile(now)
    return out


def drop_nested(book: AggregateBook, e: Execution, keep: set[str], now: float) -> Effects:
    """Member aggregates of ``e`` that left it (they failed): out of its member list.

    If its daemon may have summed one (``e`` was complete, or the member was reported
    summed), ``e`` fails whole instead: its daemon would refuse the shorter list anyway.
    """
    gone = [c for c in e.nested if c not in keep]
    if e.ready or any(e.nested[c] is Stage.IN for c in gone):
        return book._fail(
            e, f"member aggregate(s) {gone} left it after it may have summed them", now, discard=True
        )
    out = Effects()
    for cid in gone:
        del e.nested[cid]
        ce = book.executions.get(cid)
        if ce is not None:
            why = f"it left its parent aggregate '{e.aggregate_id}'"
            out += book._fail(ce, why, now, discard=True, left=False)
    return out


def nested_report(
    book: AggregateBook, e: Execution, m: pb.TransferReport, result: TransferResult, now: float
) -> Effects:
    """The aggregator of ``e`` reported its forward into the parent aggregate ``e.parent``."""
    out = Effects()
    if not result.ok:  # not summed there, or not known to be: the parent goes on without it
        why = f"aggregate '{e.aggregate_id}' was not summed into '{e.parent}': {result.error}"
        out += book._fail(e, why, now, discard=False, left=False)
        return out
    book.executions.pop(e.aggregate_id, None)
    if result.outcome is not None:  # the parent's daemon refused it before summing
        abandon = getattr(book.runner.policy, "abandon", None)
        if abandon is not None:
            abandon(e.aggregate_id)
        book.runner.forget([*e.members, e.aggregate_id])
        out += book._resolve(e, m)
        out += book.reconcile(now)
        return out
    pe = book.executions.get(e.parent)
    if pe is None or e.aggregate_id not in pe.nested:  # the parent was given up meanwhile
        out += book._requeue(e.carried().values())
        return out
    pe.nested[e.aggregate_id] = Stage.IN
    pe.absorbed.update(e.carried())
    if pe.ready:
        book.runner.arrived(e.aggregate_id)
    return out
