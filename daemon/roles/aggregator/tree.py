"""Multi-level aggregation trees at an aggregator hop: nested members and forwarding upwards.

An aggregate of a multi-level tree (``stf+tree``, docs/aggregation-trees.md) is summed into
another aggregate at another daemon instead of going to the server
(``AggregateDirective.dst_aggregate_id``). Its UPDATE frame names, in ``members``, every worker
update it carries (nested aggregates flattened), so the parent's sum carries the union of its
members' worker updates and the server resolves each of them. The rules kept here, used by
:class:`~mlfabric.daemon.roles.aggregator.role.AggregatorRole`:

* a member frame carries the worker updates in its ``members`` (an aggregate), or itself (a
  plain update) (:func:`carried`);
* a member is summed only if the worker updates it carries are disjoint from those of every
  other member of the aggregate, summed or expected (:func:`overlap`), so no worker update is
  counted twice;
* the aggregate's own frame lists the worker updates of its members in member order
  (:func:`flatten`);
* the ACK of a parent aggregator says "received" (no outcome): the report of that forward has
  no outcome and no member verdicts (the members resolve through the root aggregate's report);
  a DROPPED ACK (refused before summing) drops every member; an ERROR (not summed) makes the
  forward fail (:func:`fill_parent_report`).

:func:`fill_server_report` fills the report of a forward to the server (the root);
:func:`fill_forward_report` fills the report of any forward from how its delivery went.

Pure: no sockets, no threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from mlfabric.proto.v1 import control_pb2, dataplane_pb2

if TYPE_CHECKING:
    from mlfabric.daemon.channels.peers import Delivery, Reply

__all__ = [
    "carried",
    "fill_forward_report",
    "fill_parent_report",
    "fill_server_report",
    "flatten",
    "member_ack",
    "overlap",
]

_ACK = dataplane_pb2.FRAME_KIND_ACK
_DROPPED = control_pb2.OUTCOME_DROPPED


def carried(header: Any, member: Any) -> list[Any]:
    """The worker updates a member frame brings: its ``members`` (an aggregate) or ``member`` itself.

    Parameters
    ----------
    header : FrameHeader
        The member's UPDATE frame header.
    member : AggregateMember
        The member as the aggregate's directive lists it.

    Examples
    --------
    >>> m = control_pb2.AggregateMember(update_id="w0/1")
    >>> [x.update_id for x in carried(dataplane_pb2.FrameHeader(update_id="w0/1"), m)]
    ['w0/1']
    >>> w1 = control_pb2.AggregateMember(update_id="w1/1")
    >>> inner = dataplane_pb2.FrameHeader(update_id="agg:j:1", members=[m, w1])
    >>> [x.update_id for x in carried(inner, control_pb2.AggregateMember(update_id="agg:j:1"))]
    ['w0/1', 'w1/1']
    """
    return list(header.members) if header.members else [member]


def overlap(
    member_id: str, brings: Iterable[Any], members: Mapping[str, Any], summed: Mapping[str, list[Any]]
) -> list[str]:
    """Worker updates ``member_id`` would bring that the aggregate already carries or expects.

    Parameters
    ----------
    member_id : str
        The arriving member (an update or an aggregate id).
    brings : iterable of AggregateMember
        The worker updates it carries (:func:`carried`).
    members : mapping
        The aggregate's members (id -> ``AggregateMember``) from its directive.
    summed : mapping
        Member id -> the worker updates it brought, for the members summed already.

    Returns
    -------
    list of str
        The worker update ids counted twice if it were summed (sorted; empty: disjoint).

    Examples
    --------
    >>> M = control_pb2.AggregateMember
    >>> members = {"w0/1": M(update_id="w0/1"), "agg:j:1": M(update_id="agg:j:1")}
    >>> overlap("agg:j:1", [M(update_id="w0/1"), M(update_id="w2/1")], members, {})
    ['w0/1']
    >>> overlap("agg:j:1", [M(update_id="w2/1")], members, {"w0/1": [M(update_id="w0/1")]})
    []
    """
    taken = {m for m in members if m != member_id and m not in summed}  # expected, not in yet
    for other, ws in summed.items():
        if other != member_id:
            taken.update(w.update_id for w in ws)
    return sorted({w.update_id for w in brings} & taken)


def flatten(members: Mapping[str, Any], summed: Mapping[str, list[Any]]) -> list[Any]:
    """The worker updates an aggregate carries, in member order (nested aggregates expanded).

    Examples
    --------
    >>> M = control_pb2.AggregateMember
    >>> members = {"w0/1": M(update_id="w0/1"), "agg:j:1": M(update_id="agg:j:1")}
    >>> [m.update_id for m in flatten(members, {"agg:j:1": [M(update_id="w1/1"), M(update_id="w2/1")]})]
    ['w0/1', 'w1/1', 'w2/1']
    """
    out: list[Any] = []
    for mid, m in members.items():
        out.extend(summed.get(mid, [m]))
    return out


def fill_parent_report(report: Any, reply: Reply, members: Iterable[Any]) -> str:
    """Fill the report of a forward into a parent aggregate from the parent's reply.

    Parameters
    ----------
    report : TransferReport
        The report to fill (``update_id``, hosts and bytes already set).
    reply : Reply
        The parent aggregator daemon's reply (``header``).
    members : iterable of AggregateMember
        The worker updates the forwarded aggregate carries.

    Returns
    -------
    str
        Empty when the parent answered (summed: ok and no outcome; refused before summing:
        ok, DROPPED, each member DROPPED); else why the forward failed (the parent did not sum
        it: the report has ``ok`` false and no outcome, the members may be planned afresh).
    """
    h = reply.header
    if h.kind != _ACK:
        failure = f"aggregator {report.dst_host!r} refused aggregate {report.update_id}: {h.reason}"
        report.ok, report.error = False, failure
        return failure
    report.ok = True
    if h.outcome == _DROPPED:
        reason = f"aggregator {report.dst_host!r} refused aggregate {report.update_id}: {h.reason}"
        report.outcome, report.reason = _DROPPED, reason
        report.member_verdicts.extend(
            control_pb2.MemberVerdict(update_id=m.update_id, outcome=_DROPPED, reason=reason) for m in members
        )
    return ""


def fill_server_report(report: Any, reply: Reply, members: Iterable[Any]) -> None:
    """Fill the report of a forward to the server from its daemon's reply (ACK or ERROR).

    The ACK's verdict and its member verdicts (each member the aggregate's verdict when the
    ACK has none); an ERROR: DROPPED, every member DROPPED naming the refusal.
    """
    h = reply.header
    report.ok = True
    if h.kind == _ACK:
        report.outcome, report.delay, report.server_version, report.reason = (
            h.outcome or _DROPPED,
            h.delay,
            h.version,
            h.reason,
        )
        report.member_verdicts.extend(h.member_verdicts)
        if not h.member_verdicts:
            report.member_verdicts.extend(
                control_pb2.MemberVerdict(update_id=m.update_id, outcome=report.outcome, reason=h.reason)
                for m in members
            )
        return
    reason = f"daemon of host {report.dst_host!r} refused aggregate {report.update_id}: {h.reason}"
    report.outcome, report.server_version, report.reason = _DROPPED, h.version, reason
    report.member_verdicts.extend(
        control_pb2.MemberVerdict(update_id=m.update_id, outcome=_DROPPED, reason=reason) for m in members
    )


def fill_forward_report(report: Any, delivery: Delivery, members: Iterable[Any], parent: str) -> str:
    """Fill the report of an aggregate's forward from its delivery; why it failed ("": it did not).

    Parameters
    ----------
    report : TransferReport
        The report to fill (``update_id`` the aggregate, ``dst_host`` the next hop).
    delivery : Delivery
        How :meth:`~mlfabric.daemon.channels.peers.PeerPool.deliver` went.
    members : iterable of AggregateMember
        The worker updates the aggregate carries.
    parent : str
        The parent aggregate it went into (multi-level), or "" (the server).

    Returns
    -------
    str
        Empty when the forward is over for the scheduler (answered, or UNKNOWN: it may have
        reached the server, its members are never re-planned); else the failure, reported with
        ``ok`` false and no outcome, so that the members are planned afresh (``AggregateFailed``).
    """
    what, host, reply = f"aggregate {report.update_id}", report.dst_host, delivery.reply
    if parent and reply is None:
        # not known to be summed: the scheduler removes it from the parent (a parent that
        # summed it then fails whole) and plans its members afresh
        how = "may have reached" if delivery.maybe_sent else "did not reach"
        failure = (
            f"{what} {how} aggregate {parent} at host {host!r} ({delivery.address}): {delivery.last_error}"
        )
        report.ok, report.error = False, failure
        return failure
    if reply is not None:
        report.start, report.end, report.throughput = reply.timing()
        if parent:
            return fill_parent_report(report, reply, members)
        fill_server_report(report, reply, members)
        return ""
    if delivery.maybe_sent:  # the server's daemon may have applied it: UNKNOWN, each member too
        unknown = delivery.unknown_reason(what, host)
        report.ok, report.error = False, unknown
        report.outcome, report.reason = control_pb2.OUTCOME_UNKNOWN, unknown
        report.member_verdicts.extend(
            control_pb2.MemberVerdict(
                update_id=m.update_id, outcome=control_pb2.OUTCOME_UNKNOWN, reason=unknown
            )
            for m in members
        )
        return ""
    failure = delivery.failed_reason(f"forwarding {what}", host)
    report.ok, report.error = False, failure
    return failure


def member_ack(h: Any, host: str, seconds: float, refused: str = "") -> Any:
    """The ACK header for member frame ``h`` at ``host``: received, or ``refused`` (DROPPED, not summed).

    Examples
    --------
    >>> from mlfabric.daemon.channels.frames import FrameHeader
    >>> member_ack(FrameHeader(update_id="u", aggregate_id="agg:0"), "a0", 0.1, "NaN").outcome
    2
    """
    return dataplane_pb2.FrameHeader(
        kind=_ACK,
        update_id=h.update_id,
        aggregate_id=h.aggregate_id,
        job=h.job,
        server=h.server,
        src_host=host,
        receive_seconds=seconds,
        outcome=_DROPPED if refused else control_pb2.OUTCOME_UNSPECIFIED,
        reason=refused,
    )
