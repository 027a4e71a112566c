"""A pipelined aggregate's members as they land: which are summed on the fly (:mod:`.stream`, :mod:`.role`).

``agg`` is the role's :class:`~.state.Aggregate`, its lock held by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlfabric.daemon.channels.payloadio import non_finite_reason
from mlfabric.daemon.roles.aggregator import tree as aggregate_tree
from mlfabric.daemon.roles.aggregator.state import Aggregate
from mlfabric.daemon.roles.aggregator.stream import SumStream, streamable

__all__ = ["MemberWatch", "accept_member", "begin_member"]


def begin_member(
    agg: Aggregate, header: Any, payload: memoryview, alloc: Callable[[int], Any], clock: Callable[[], float]
) -> bool | None:
    """Start summing a member whose payload lands in ``payload``: whether every member has begun.

    None (not summed on the fly; :meth:`~.role.AggregatorRole.on_frame` handles the frame whole)
    unless ``agg`` is pipelined, still collecting, lists the member, and the member is raw
    float32 (:func:`~.stream.streamable`) laid out as the members before it. The first such
    member opens the aggregate's :class:`~.stream.SumStream` in a buffer from ``alloc``.
    """
    member = header.update_id
    eligible = (
        agg.pipelined
        and agg.state == "collecting"
        and member in agg.members
        and member not in agg.arrived
        and (header.job, header.server) == (agg.job, agg.server)
    )
    if not eligible:
        return None
    if agg.stream is None:
        if agg.arrived or not streamable(header.tensors, header.payload_bytes):
            return None  # store-and-forward, as the members before it
        try:
            buffer = alloc(header.payload_bytes)
        except (MemoryError, OSError):
            return None  # on_frame tries again (and says why it cannot)
        agg.buffer, agg.tensors, agg.payload_bytes = buffer, list(header.tensors), header.payload_bytes
        agg.stream = SumStream(memoryview(buffer).cast("B")[: header.payload_bytes], agg.members, clock)
    elif list(header.tensors) != agg.tensors or agg.stream.begun(member):
        return None  # on_frame refuses it, failing the aggregate
    brings = aggregate_tree.carried(header, agg.members[member])
    if aggregate_tree.overlap(member, brings, agg.members, agg.summed):
        return None  # on_frame refuses it
    agg.summed[member] = brings
    return agg.stream.begin(member, payload)


def accept_member(agg: Aggregate, frame: Any, aggregator: str) -> tuple[str, str]:
    """A streamed member arrived whole: ``(problem, refused)``, both "" when it is accepted.

    ``problem``: it was not summed on the fly (not begun: not a member, or its tensors differ
    from the first member's) and gets an ERROR; ``refused``: it holds NaN or infinity and the
    job refuses them (its source resolves it DROPPED with this reason). Either fails the
    aggregate (the sum already holds some of its bytes). Accepted, the member counts as
    arrived, its frame is kept in ``agg.frames`` (the stream reads it) and the stream may
    finish the sum's last piece once every member is accepted.
    """
    h = frame.header
    assert agg.stream is not None
    if not agg.stream.begun(h.update_id):
        return (
            f"update {h.update_id} was not summed into pipelined aggregate {h.aggregate_id} as it "
            "arrived (not a member, or its tensors differ from the first member's)",
            "",
        )
    if frame.non_finite is not None and not agg.allow_non_finite:
        refused_by = f"{aggregator} (aggregate {h.aggregate_id})"
        agg.refused[h.update_id] = non_finite_reason(frame.non_finite, h.update_id, refused_by)
        return "", agg.refused[h.update_id]
    agg.arrived.append(h.update_id)
    agg.frames.append(frame)
    agg.stream.accepted(h.update_id)
    return "", ""


@dataclass(frozen=True)
class MemberWatch:
    """A member while it lands: its bytes go to the aggregate's sum, its failure to ``broke_off``.

    Examples
    --------
    >>> from mlfabric.daemon.roles.aggregator.state import Aggregate
    >>> agg = Aggregate("agg:0", "j", "ps0", "ps", "", {}, 0.0)
    >>> MemberWatch(agg, "u1", lambda agg, member, reason: print(member, reason)).abort("reset")
    u1 reset
    """

    agg: Aggregate
    member: str
    broke_off: Callable[[Aggregate, str, str], None]

    def progress(self, got: int) -> None:
        if self.agg.stream is not None:
            self.agg.stream.progress(self.member, got)

    def abort(self, reason: str) -> None:
        self.broke_off(self.agg, self.member, reason)
