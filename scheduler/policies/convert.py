"""From a planned :class:`~mlfabric.scheduler.core.schedule.Schedule` to a :class:`Decision`.

The planners (STF, aggregation groups) reserve link bandwidth over time; the service and
the simulator execute sends released as the transfers they follow end (network
time-sharing, paper §3.1.1). :func:`schedule_to_decision` is the one adapter between the
two, used by every policy that plans a schedule:

* each transfer of an update becomes a :class:`~mlfabric.scheduler.policies.base.Send` to
  its next hop (the server, or an aggregator), in the schedule's order;
* each aggregate becomes a :class:`~mlfabric.scheduler.policies.base.PlannedAggregate`
  whose ``dst`` and ``path`` are those of its transfer;
* each replica transfer becomes a :class:`~mlfabric.scheduler.policies.base.ReplicaSend`;
* each drop becomes a :class:`~mlfabric.scheduler.policies.base.Drop`, by update id.

A payload's ``after`` names the transfers — already on the network or planned to start
before it — that end on one of its links exactly when it is planned to start: the
transfers it follows on its bottleneck.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from mlfabric.scheduler.core.native import _plan_native
from mlfabric.scheduler.core.records import init_fields, instances
from mlfabric.scheduler.core.schedule import Aggregate, Link, Schedule, Transfer, TransferTimes
from mlfabric.scheduler.policies.base import Decision, Drop, PlannedAggregate, ReplicaSend, Send

__all__ = ["schedule_to_decision", "times_to_decision"]


def schedule_to_decision(
    schedule: Schedule,
    *,
    busy: Iterable[tuple[str, Sequence[Link], float]] = (),
    aggregate_ids: Mapping[str, str] | None = None,
) -> Decision:
    """The decision executing ``schedule``.

    Parameters
    ----------
    schedule : Schedule
        A plan (possibly partial: the updates it neither moves nor drops stay undecided).
    busy : iterable of (str, sequence of Link, float)
        Transfers already on the network: id, links and expected end (a planned transfer
        starting exactly then on one of those links follows it).
    aggregate_ids : mapping, optional
        Planner's aggregate id -> the id the decision gives it (unique across the
        decisions of a run, see :func:`~mlfabric.scheduler.core.schedule.aggregate_id`).
        Default: the planner's ids.

    Returns
    -------
    Decision
        Sends in the schedule's order, drops sorted by update id, aggregates and replica
        sends in the schedule's order.

    Examples
    --------
    >>> from mlfabric.scheduler.core.schedule import Aggregate
    >>> a = Transfer.at_rate("a", ("w0", "ps"), start=0, bytes=1, rate=1)
    >>> b = Transfer.at_rate("b", ("w0", "ps"), start=1, bytes=1, rate=1)
    >>> d = schedule_to_decision(Schedule((a, b), drops={"c": "stale"}), busy=[("f", [("w0", "ps")], 0.0)])
    >>> [(s.update_id, s.next_hop, s.after) for s in d.sends], d.drops
    ([('a', 'ps', ('f',)), ('b', 'ps', ('a',))], (Drop(update_id='c', reason='stale'),))
    >>> m = [Transfer.at_rate(u, (u, "x"), start=0, bytes=1, rate=1) for u in ("w2", "w3")]
    >>> out = Transfer.at_rate("agg:ps:0", ("x", "ps"), start=1, bytes=1, rate=1)
    >>> plan = Schedule.aggregated([*m, out], [Aggregate("agg:ps:0", "x", ("w2", "w3"), 1, "ps")])
    >>> d = schedule_to_decision(plan, aggregate_ids={"agg:ps:0": "agg:ps:7"})
    >>> [s.next_hop for s in d.sends], d.aggregates[0].aggregate_id, d.aggregates[0].path
    (['x', 'x'], 'agg:ps:7', ('x', 'ps'))
    """
    ids = dict(aggregate_ids or {})
    return _decision(schedule.transfers, schedule.drops, schedule.aggregates, busy, ids)


def times_to_decision(
    transfers: Sequence[TransferTimes],
    drops: Mapping[str, str],
    *,
    busy: Iterable[tuple[str, Sequence[Link], float]] = (),
) -> Decision:
    """The decision executing a plan given by its transfers' paths and times (no aggregates).

    :func:`schedule_to_decision` for a planner's light output (an STF plan's
    :class:`~mlfabric.scheduler.core.schedule.TransferTimes`, from
    :meth:`~mlfabric.scheduler.policies.stf_book.STFBook.plan_times`): the same sends,
    ``after`` and drops as for the :class:`~mlfabric.scheduler.core.schedule.Schedule` of
    those transfers.

    Parameters
    ----------
    transfers : sequence of TransferTimes
        The planned transfers, in the plan's order.
    drops : mapping
        Update id -> reason.
    busy : iterable of (str, sequence of Link, float)
        Transfers already on the network, as :func:`schedule_to_decision` takes them.

    Returns
    -------
    Decision
        Sends in the plan's order, drops sorted by update id.

    Examples
    --------
    >>> a = TransferTimes("a", "w0", "ps", ("w0", "ps"), 0.0, 1.0, 1.0)
    >>> b = TransferTimes("b", "w0", "ps", ("w0", "ps"), 1.0, 2.0, 1.0)
    >>> d = times_to_decision((a, b), {"c": "stale"}, busy=[("f", [("w0", "ps")], 0.0)])
    >>> [(s.update_id, s.next_hop, s.after) for s in d.sends], d.drops
    ([('a', 'ps', ('f',)), ('b', 'ps', ('a',))], (Drop(update_id='c', reason='stale'),))
    """
    return _decision(transfers, drops, (), busy, {})


def _decision(
    transfers: Sequence[Transfer | TransferTimes],
    drops: Mapping[str, str],
    aggregates: Sequence[Aggregate],
    busy: Iterable[tuple[str, Sequence[Link], float]],
    ids: dict[str, str],
) -> Decision:
    """The body of :func:`schedule_to_decision` and :func:`times_to_decision`."""
    after = _follows(transfers, busy, ids)
    planned = {a.aggregate_id for a in aggregates}
    replicas: list[ReplicaSend] = []
    fields = init_fields(Send)
    made = None
    if _plan_native is not None and type(transfers) is tuple and fields is not None:
        made = _plan_native.decision_sends(  # the loop below in C (None: a replica's transfer)
            transfers,
            after if isinstance(after, list) else list(after),
            ids,
            planned,
            Send,
            fields,
            TransferTimes,
        )
    if made is not None:
        sends, carried = made
    else:
        carried = {}
        rows: list[tuple[str, str, tuple[str, ...], tuple[str, ...], float, float]] = []
        for i, t in enumerate(transfers):
            pid = ids.get(t.payload_id, t.payload_id)
            if t.replica:
                replicas.append(ReplicaSend(pid, t.src, t.dst, t.path, after[i], t.start, t.end))
            elif t.payload_id in planned:
                carried[t.payload_id] = (t, after[i])
            else:
                rows.append((pid, t.dst, t.path, after[i], t.start, t.end))
        sends = instances(Send, rows)
    aggregate_rows = []
    for a in aggregates:
        out, deps = carried.get(a.aggregate_id, (None, ()))
        members = tuple(ids.get(m, m) for m in a.members)
        aggregate_rows.append(
            (
                ids.get(a.aggregate_id, a.aggregate_id),  # aggregate_id
                a.aggregator,
                members,
                a.bytes,
                out.dst if out is not None else a.dst,  # dst
                tuple(p for p in deps if p not in members),  # after
                out.path if out is not None else (),  # path
                0.0,  # hold_until
                0,  # chunk_bytes: store-and-forward
            )
        )
    dropped = tuple(Drop(uid, reason) for uid, reason in sorted(drops.items()))
    planned_aggregates = tuple(instances(PlannedAggregate, aggregate_rows))
    return Decision(
        sends=tuple(sends), drops=dropped, aggregates=planned_aggregates, replicas=tuple(replicas)
    )


def _follows(
    transfers: Sequence[Transfer | TransferTimes],
    busy: Iterable[tuple[str, Sequence[Link], float]],
    ids: Mapping[str, str],
) -> Sequence[tuple[str, ...]]:
    """Each transfer's ``after``: what ends on one of its links exactly when it starts (by index).

    In C where built (``_plan_native.follows``, the same loop), else the loop below.
    """
    busy = busy if isinstance(busy, list | tuple) else list(busy)
    if _plan_native is not None and type(transfers) is tuple and type(ids) is dict:
        native = _plan_native.follows(transfers, busy, ids, TransferTimes)
        if native is not None:  # None: a link that is not a pair of nodes
            return native
    ends: dict[Link, dict[float, list[str]]] = defaultdict(dict)  # link -> end -> payloads ending then
    for fid, links, end in busy:
        for link in links:
            ends[link].setdefault(end, []).append(fid)
    # in order of start (then the schedule's order: the sort is stable), so a transfer follows
    # only transfers that started before it or with it but earlier in the plan: never a cycle
    after: dict[int, tuple[str, ...]] = {}
    starts = [t.start for t in transfers]
    for i in sorted(range(len(transfers)), key=starts.__getitem__):
        t = transfers[i]
        if len(t.path) < 2:  # no link (the payload is at its next hop already): follows nothing
            after[i] = ()
            continue
        start, pid = t.start, t.payload_id
        found: set[str] = set()
        at_link = [ends[link] for link in itertools.pairwise(t.path)]  # t.links
        for at in at_link:
            got = at.get(start)
            if got is not None:
                found.update(got)
        found.discard(pid)
        if not found:
            after[i] = ()
        elif len(found) == 1:
            (p,) = found
            after[i] = (ids.get(p, p),)
        else:
            after[i] = tuple(sorted([ids.get(p, p) for p in found]))
        end = t.end
        for at in at_link:
            got = at.get(end)
            if got is None:
                at[end] = [pid]
            else:
                got.append(pid)
    return [after[i] for i in range(len(transfers))]
