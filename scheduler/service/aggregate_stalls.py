"""Transfers of the aggregate book with no report past their stall deadline (links freed).

Used by :meth:`~mlfabric.scheduler.service.aggregates.AggregateBook.expire_stalled`; kept apart
so the book stays readable. No I/O and no clock.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mlfabric.scheduler.service import state as state_module
from mlfabric.scheduler.service.aggregate_records import Effects

if TYPE_CHECKING:
    from mlfabric.scheduler.service.aggregates import AggregateBook

__all__ = ["expire_stalled"]

log = logging.getLogger("mlfabric.scheduler.service.aggregates")


def expire_stalled(book: AggregateBook, now: float) -> Effects:
    """Free the bottlenecks of this book's transfers with no report past their stall deadline.

    The deadline is :meth:`SchedulerState.expire_stalled`'s; call this first, so the state
    records no bare DROPPED for a member or an aggregate (a member resolves once, through
    its aggregate's verdicts):

    - an aggregate forwarded to its server: its entry leaves the links; its members resolve
      from the aggregator's report, or UNKNOWN at the forward timeout
      (:meth:`AggregateBook.expire`; a synchronous round may hold the ACK longer than a
      transfer takes); in a multi-level tree, one forwarded into its parent fails at the
      aggregator's timeout (its members planned afresh);
    - a member on its way to an aggregate still gathering: the aggregate fails (the others
      planned afresh) and the member is planned afresh once its source reports;
    - a member of a complete or failed aggregate: the aggregate's or its source's report.
    """
    out = Effects()
    factor, slack = state_module.STALL_FACTOR, state_module.STALL_SLACK
    for f in list(book.state.in_flight.values()):
        deadline = f.started_at + factor * max(0.0, f.expected_end - f.started_at) + slack
        uid = f.update_id
        if now <= deadline or not (book.is_aggregate(uid) or book.is_member_send(uid)):
            continue
        book.state.track(None, untrack=uid)
        why = (
            f"no report on the transfer of '{uid}' by its deadline {deadline:g} s "
            f"(expected {f.expected_end - f.started_at:g} s from {f.started_at:g} s)"
        )
        log.warning("%s: its links are free again; it resolves through its aggregate", why)
        e = book.executions.get(book._sent.get(uid, ""))
        if e is not None and not e.forwarded and not e.ready:
            out += book._fail(e, f"member {why}", now, discard=True)
    return out
