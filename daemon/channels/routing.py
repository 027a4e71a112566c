"""Routing keys of what reaches a daemon: data-plane frames, local requests, directives (DESIGN §12).

The host hands every message to the role that registered its key, with one dict lookup; the
key is computed here, once, from the message alone:

- :func:`frame_route`: a data-plane frame's :class:`FrameRoute` (an all-reduce chunk, a member
  for an aggregate here, a model re-syncing a replica here, an update for a server here, a GET);
- :func:`request_kind`: a local request's kind (the ``LocalRequest.kind`` oneof name);
- :func:`directive_kind`: a directive's kind (the ``Directive.kind`` oneof name), except that a
  send or a drop naming an aggregate (:func:`names_aggregate`) is ``send_aggregate`` or
  ``drop_aggregate``: it is for the aggregator hop that runs it, not for a worker's push.
"""

from __future__ import annotations

import enum
from typing import Any

from mlfabric.proto.v1 import dataplane_pb2

__all__ = [
    "AGGREGATE_PREFIX",
    "FrameRoute",
    "directive_kind",
    "frame_route",
    "names_aggregate",
    "request_kind",
]

#: aggregate ids are "agg:<scope>:<index>" (mlfabric.scheduler.core.schedule.aggregate_id)
AGGREGATE_PREFIX = "agg:"


class FrameRoute(enum.Enum):
    """Which role a data-plane frame is for."""

    #: a chunk of an all-reduce (``header.allreduce`` set)
    ALLREDUCE_CHUNK = "allreduce_chunk"
    #: an UPDATE naming an aggregate other than itself: a member to sum here
    AGGREGATE_MEMBER = "aggregate_member"
    #: a MODEL naming a replica: a replica of this host is re-synced
    REPLICA_RESYNC = "replica_resync"
    #: any other UPDATE: for a server (or replica) of this host
    UPDATE = "update"
    #: a GET: a server's model
    GET = "get"
    #: a frame no role takes (an ACK, MODEL or ERROR sent as a request)
    OTHER = "other"


def names_aggregate(update_id: str) -> bool:
    """Whether ``update_id`` is an aggregate's id (``agg:<scope>:<index>``).

    Examples
    --------
    >>> names_aggregate("agg:ps:3"), names_aggregate("h1/3")
    (True, False)
    """
    return update_id.startswith(AGGREGATE_PREFIX)


def frame_route(header: Any) -> FrameRoute:
    """The route of a received frame, from its header.

    Examples
    --------
    >>> H, K = dataplane_pb2.FrameHeader, dataplane_pb2
    >>> frame_route(H(kind=K.FRAME_KIND_UPDATE, update_id="w/1", aggregate_id="agg:j:0")).name
    'AGGREGATE_MEMBER'
    >>> frame_route(H(kind=K.FRAME_KIND_UPDATE, update_id="agg:j:0", aggregate_id="agg:j:0")).name
    'UPDATE'
    >>> frame_route(H(kind=K.FRAME_KIND_MODEL, replica="r0")).name, frame_route(H(kind=K.FRAME_KIND_ACK)).name
    ('REPLICA_RESYNC', 'OTHER')
    """
    kind = header.kind
    if kind == dataplane_pb2.FRAME_KIND_UPDATE:
        if header.HasField("allreduce"):
            return FrameRoute.ALLREDUCE_CHUNK
        if header.aggregate_id and header.update_id != header.aggregate_id:
            return FrameRoute.AGGREGATE_MEMBER
        return FrameRoute.UPDATE
    if kind == dataplane_pb2.FRAME_KIND_GET:
        return FrameRoute.GET
    if kind == dataplane_pb2.FRAME_KIND_MODEL and header.replica:
        return FrameRoute.REPLICA_RESYNC
    return FrameRoute.OTHER


def request_kind(request: Any) -> str:
    """A ``LocalRequest``'s kind (``""`` when none is set).

    Examples
    --------
    >>> from mlfabric.proto.v1 import local_pb2
    >>> request_kind(local_pb2.LocalRequest(get=local_pb2.GetRequest(server="ps0")))
    'get'
    >>> request_kind(local_pb2.LocalRequest())
    ''

    """
    return request.WhichOneof("kind") or ""


def directive_kind(directive: Any) -> str:
    """A ``Directive``'s kind; ``send_aggregate``/``drop_aggregate`` for a send or drop of an aggregate.

    Examples
    --------
    >>> from mlfabric.proto.v1 import control_pb2 as pb
    >>> directive_kind(pb.Directive(send=pb.SendDirective(update_id="h/x/1")))
    'send'
    >>> directive_kind(pb.Directive(drop=pb.DropDirective(update_id="agg:ps.1:4")))
    'drop_aggregate'
    """
    kind = directive.WhichOneof("kind") or ""
    if kind in ("send", "drop") and names_aggregate(getattr(directive, kind).update_id):
        return f"{kind}_aggregate"
    return kind
