"""One aggregate an aggregator daemon runs: its members, its sum, where it goes (:mod:`.role`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from mlfabric.aggregators.codecs.payloadsum import EncodedSum
from mlfabric.aggregators.kernels import Accumulator
from mlfabric.daemon.channels.frames import Frame, FrameHeader
from mlfabric.daemon.roles.aggregator import tree as aggregate_tree
from mlfabric.daemon.roles.aggregator.stream import SumStream
from mlfabric.proto.v1 import dataplane_pb2

__all__ = ["Aggregate"]

_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE


@dataclass
class Aggregate:
    """One aggregate this daemon runs."""

    aggregate_id: str
    job: str
    server: str
    dst_host: str
    dst_address: str
    members: dict[str, Any]  # update id -> AggregateMember, in the directive's order
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: list[str] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)  # TensorLayout messages of the first member
    payload_bytes: int = 0
    buffer: Any = None
    acc: Accumulator | EncodedSum | None = None  # EncodedSum: the first member came encoded
    state: str = "collecting"  # -> ready -> forwarding -> (removed); or abandoned
    allow_non_finite: bool = False  # the job's option (AggregateDirective.allow_non_finite)
    refused: dict[str, str] = field(default_factory=dict)  # member id -> why it was not summed
    dst_aggregate_id: str = ""  # the parent aggregate (multi-level tree); "": the server
    summed: dict[str, list[Any]] = field(default_factory=dict)  # member id -> worker updates it brought
    pipelined: bool = False  # the directive's: forward the sum while the members land
    stream: SumStream | None = None  # pipelined, once its first member began (raw float32 members)
    #: a stream's members, received whole: kept until it ends
    frames: list[Frame] = field(default_factory=list)
    pending_send: Any = None  # pipelined: a SendDirective that came before every member began

    def missing(self) -> list[str]:
        arrived = set(self.arrived)
        return [m for m in self.members if m not in arrived]

    def header(self, host: str) -> Any:
        """The UPDATE frame header that carries the sum to the server (or into its parent aggregate)."""
        members = aggregate_tree.flatten(self.members, self.summed)
        return FrameHeader(
            kind=_UPDATE,
            update_id=self.aggregate_id,
            aggregate_id=self.dst_aggregate_id or self.aggregate_id,
            job=self.job,
            server=self.server,
            worker="",
            base_version=min(m.base_version for m in members),
            norm=sum(m.norm for m in members),
            num_updates=len(members),
            members=members,
            tensors=self.tensors,
            src_host=host,
        )
