"""Conversions between the control stream's messages (``control.proto``) and the state's plain data.

Split out of :mod:`mlfabric.scheduler.service.core`, whose servicer and core use them to unpack a
daemon's messages for :class:`~mlfabric.scheduler.service.state.SchedulerState` and to build the
directives sent back. Pure: no I/O, no state.
"""

from __future__ import annotations

from typing import cast

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.policies.base import PendingUpdate
from mlfabric.scheduler.service.records import (
    JobParams,
    OutcomeKind,
    SchedulerError,
    ServerRole,
    TransferResult,
)

__all__ = [
    "OUTCOMES",
    "OUTCOME_PB",
    "aggregate_member",
    "drop_directive",
    "error_code",
    "job_params",
    "job_params_pb",
    "role_refused",
    "server_info",
    "transfer_result",
]

#: wire ``Outcome`` -> :class:`~mlfabric.scheduler.service.records.OutcomeKind` (unspecified: absent)
OUTCOMES = {
    pb.OUTCOME_APPLIED: OutcomeKind.APPLIED,
    pb.OUTCOME_DROPPED: OutcomeKind.DROPPED,
    pb.OUTCOME_UNKNOWN: OutcomeKind.UNKNOWN,
}
#: :class:`~mlfabric.scheduler.service.records.OutcomeKind` -> wire ``Outcome``
OUTCOME_PB = {kind: value for value, kind in OUTCOMES.items()}


#: what an ``AggregateMember`` says of the worker update it lists (the same names on both sides)
_MEMBER_FIELDS = ("update_id", "worker", "base_version", "norm", "src_host", "bytes")


def aggregate_member(u: PendingUpdate) -> pb.AggregateMember:
    """Update ``u`` as a member of an ``AggregateDirective``.

    Examples
    --------
    >>> u = PendingUpdate("h1/1", "j", "ps", "w0", "h1", "h0", 1024, norm=2.0, base_version=3, ready_at=0.0)
    >>> m = aggregate_member(u)
    >>> (m.update_id, m.worker, m.src_host, m.bytes, m.norm, m.base_version)
    ('h1/1', 'w0', 'h1', 1024, 2.0, 3)
    """
    return pb.AggregateMember(**{name: getattr(u, name) for name in _MEMBER_FIELDS})


def job_params(p: pb.JobParams) -> JobParams:
    """A job's bounds from its ``JobParams`` message.

    Examples
    --------
    >>> job_params(pb.JobParams(tau_max=4, div_max=0.5))  # doctest: +NORMALIZE_WHITESPACE
    JobParams(tau_max=4, div_max=0.5, allow_non_finite=False, sync_workers=0, compression='',
              model_compression='')
    >>> job_params(pb.JobParams(sync_workers=8)).sync_workers
    8
    """
    return JobParams(
        tau_max=p.tau_max,
        div_max=p.div_max,
        allow_non_finite=p.allow_non_finite,
        sync_workers=p.sync_workers,
        compression=p.compression,
        model_compression=p.model_compression,
    )


def job_params_pb(p: JobParams) -> pb.JobParams:
    """The ``JobParams`` message of a job's bounds.

    Examples
    --------
    >>> job_params_pb(JobParams(tau_max=4)).tau_max
    4
    >>> job_params_pb(JobParams(allow_non_finite=True)).allow_non_finite
    True
    >>> job_params_pb(JobParams(sync_workers=8)).sync_workers
    8
    """
    return pb.JobParams(
        tau_max=p.tau_max,
        div_max=p.div_max,
        allow_non_finite=p.allow_non_finite,
        sync_workers=p.sync_workers,
        compression=p.compression,
        model_compression=p.model_compression,
    )


def server_info(s: ServerRole, address: str) -> pb.ServerInfo:
    """The ``ServerInfo`` message of server ``s`` whose daemon's data plane is at ``address``.

    Examples
    --------
    >>> from mlfabric.scheduler.service.records import TensorSpec
    >>> s = ServerRole("j", "ps", "h0", (TensorSpec("w", "float32", (2, 3)),), version=7)
    >>> m = server_info(s, "127.0.0.1:9000")
    >>> m.data_address, m.version, list(m.model[0].shape)
    ('127.0.0.1:9000', 7, [2, 3])
    """
    model = [pb.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in s.model]
    return pb.ServerInfo(name=s.name, host=s.host, data_address=address, model=model, version=s.version)


def transfer_result(host: str, m: pb.TransferReport) -> TransferResult:
    """A ``TransferReport`` from the daemon of ``host`` as plain data (``src_host`` defaults to ``host``).

    Examples
    --------
    >>> r = transfer_result("a", pb.TransferReport(update_id="a/1", dst_host="ps", bytes=8,
    ...                                            outcome=pb.OUTCOME_APPLIED))
    >>> r.src_host, r.bytes, r.outcome
    ('a', 8, <OutcomeKind.APPLIED: 'applied'>)
    """
    return TransferResult(
        update_id=m.update_id,
        src_host=m.src_host or host,
        dst_host=m.dst_host,
        bytes=m.bytes,
        start=m.start,
        end=m.end,
        ok=m.ok,
        error=m.error,
        outcome=OUTCOMES.get(m.outcome),
        delay=m.delay,
        server_version=m.server_version,
        reason=m.reason,
    )


def error_code(exc: SchedulerError) -> pb.ErrorCode:
    """The wire ``ErrorCode`` of a scheduler error: the one its class declares (``code``).

    Examples
    --------
    >>> from mlfabric.scheduler.service.records import UnknownJob
    >>> pb.ErrorCode.Name(error_code(UnknownJob("unknown job 'j'")))
    'ERROR_CODE_UNKNOWN_JOB'
    >>> pb.ErrorCode.Name(error_code(SchedulerError("a server needs a name")))
    'ERROR_CODE_REFUSED'
    """
    return cast(pb.ErrorCode, pb.ErrorCode.Value(f"ERROR_CODE_{exc.code}"))


def role_refused(request_id: int, exc: SchedulerError) -> pb.Directive:
    """The ``RoleAck`` refusing registration ``request_id``: the error's code and message.

    Examples
    --------
    >>> from mlfabric.scheduler.service.records import DuplicateServer
    >>> ack = role_refused(7, DuplicateServer("job 'j' already has a server 'ps'")).role_ack
    >>> ack.ok, pb.ErrorCode.Name(ack.code), ack.error
    (False, 'ERROR_CODE_DUPLICATE_SERVER', "job 'j' already has a server 'ps'")
    """
    return pb.Directive(
        role_ack=pb.RoleAck(request_id=request_id, ok=False, error=str(exc), code=error_code(exc))
    )


def drop_directive(
    update_id: str, reason: str, code: pb.ErrorCode = pb.ERROR_CODE_UNSPECIFIED
) -> pb.Directive:
    """The directive dropping update ``update_id`` for ``reason`` (``code``: set for a refusal).

    Examples
    --------
    >>> drop_directive("a/1", "no path").drop.reason
    'no path'
    """
    return pb.Directive(drop=pb.DropDirective(update_id=update_id, reason=reason, code=code))
