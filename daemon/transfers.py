"""The worker side of a daemon: moving held updates to their next hop, and fetching models.

On a ``SendDirective`` the daemon sends the update's memfd with ``sendfile`` to the next hop
(MLfabric §4: daemons move the bytes, the scheduler only decides). A peer that cannot be
reached or vanishes mid-transfer is retried a bounded number of times with exponential
backoff — safe, because the receiving daemon de-duplicates by ``update_id`` — and then the
push resolves DROPPED naming the peer and the error. Either way the push is resolved (never
silently lost) and the transfer is reported to the scheduler with its bytes, start, end,
measured throughput and outcome.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from mlfabric.daemon.dataplane import FileSpan, FrameHeader
from mlfabric.daemon.localapi import LocalConnection
from mlfabric.daemon.roles import OutgoingPushes, PendingPush, Verdict
from mlfabric.daemon.serving import MemfdBuffer
from mlfabric.daemon.transport import Connection, PeerPool, PeerUnavailable, Reply
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.tensors import layouts_to_pb

__all__ = ["PushSender"]

_LOG = logging.getLogger("mlfabric.daemon")
_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE
_ACK = dataplane_pb2.FRAME_KIND_ACK
_GET = dataplane_pb2.FRAME_KIND_GET
_MODEL = dataplane_pb2.FRAME_KIND_MODEL
_DROPPED = control_pb2.OUTCOME_DROPPED


class PushSender:
    """Executes send directives for the pushes a daemon holds, and fetches remote models.

    Parameters
    ----------
    host : str
        This daemon's host name.
    pool : PeerPool
        Connections to peer daemons.
    outgoing : OutgoingPushes
        The pushes held until they resolve.
    report : callable
        ``report(TransferReport)`` sends a report to the scheduler.
    send_attempts : int
        Tries per transfer.
    retry_backoff : float
        Seconds before the first retry, doubling per retry.
    """

    def __init__(
        self,
        host: str,
        pool: PeerPool,
        outgoing: OutgoingPushes,
        report: Callable[[Any], Any],
        send_attempts: int = 3,
        retry_backoff: float = 0.2,
    ) -> None:
        self.host = host
        self._pool = pool
        self.outgoing = outgoing
        self._report = report
        self._attempts = send_attempts
        self._backoff = retry_backoff
        self._lock = threading.Lock()
        self._active: set[Connection] = set()
        self._stopping = threading.Event()

    def stop(self) -> None:
        """Cut the transfers in flight (they fail now, not at their I/O timeout); no new ones."""
        self._stopping.set()
        with self._lock:
            active = list(self._active)
        for conn in active:
            conn.close()

    def finish(self, push: PendingPush, verdict: Verdict) -> None:
        """Resolve a push: close its memfd, tell its process."""
        os.close(push.fd)
        result = local_pb2.PushResult(
            update_id=push.update_id,
            outcome=verdict.outcome,
            delay=verdict.delay,
            version=verdict.version,
            reason=verdict.reason,
        )
        push.owner.send(local_pb2.LocalEvent(request_id=push.request_id, push_result=result))

    def transfer(self, push: PendingPush, send: Any) -> None:
        """Move one update to its next hop (retrying a vanished peer), then resolve and report it."""
        header = FrameHeader(
            kind=_UPDATE,
            update_id=push.update_id,
            job=push.job,
            server=push.server,
            worker=push.worker,
            base_version=push.base_version,
            norm=push.norm,
            num_updates=1,
            tensors=layouts_to_pb(push.layouts),
            src_host=self.host,
        )
        span = FileSpan(push.fd, 0, push.payload_bytes)
        attempts = max(1, self._attempts)
        report = control_pb2.TransferReport(
            update_id=push.update_id,
            src_host=self.host,
            dst_host=send.next_hop_host,
            bytes=push.payload_bytes,
        )
        errors: list[str] = []
        for attempt in range(attempts):
            if attempt and self._stopping.wait(self._backoff * 2 ** (attempt - 1)):
                errors.append("daemon shutting down")
                break
            try:
                reply = self.request(send.next_hop_address, header, span)
            except PeerUnavailable as exc:
                _LOG.warning("transfer %s, attempt %d/%d: %s", push.update_id, attempt + 1, attempts, exc)
                errors.append(str(exc))
                continue
            h = reply.header
            if h.kind == _ACK:
                verdict = Verdict(h.outcome or _DROPPED, h.delay, h.version, h.reason)
            else:
                reason = f"daemon of host {send.next_hop_host!r} refused {push.update_id}: {h.reason}"
                verdict = Verdict.dropped(reason, h.version)
            report.start, report.end, report.throughput = (
                reply.sent.start,
                reply.sent.end,
                reply.sent.throughput,
            )
            report.ok = True
            break
        else:
            verdict = Verdict.dropped(
                f"transfer of {push.update_id} to host {send.next_hop_host!r} ({send.next_hop_address}) "
                f"failed after {attempts} attempts: {errors[-1] if errors else 'no attempt'}"
            )
            report.ok, report.error = False, verdict.reason
        report.outcome, report.delay, report.server_version = verdict.outcome, verdict.delay, verdict.version
        report.reason = verdict.reason
        taken = self.outgoing.take(push.update_id)
        if taken is not None:
            self.finish(taken, verdict)
        self._report(report)

    def request(self, address: str, header: Any, payload: Any = None, alloc: Any = bytearray) -> Reply:
        """One request/reply with a peer daemon over a pooled connection that :meth:`stop` can cut.

        Raises
        ------
        PeerUnavailable
            The peer cannot be reached or vanished (also when the daemon is stopping).
        """
        if self._stopping.is_set():
            raise PeerUnavailable(address, f"daemon of host {self.host!r} is stopping")
        conn = self._pool.acquire(address)
        with self._lock:
            self._active.add(conn)
        try:
            reply = conn.request(header, payload, alloc=alloc)
        except BaseException:
            conn.close()
            raise
        finally:
            with self._lock:
                self._active.discard(conn)
        self._pool.release(conn)
        return reply

    def remote_model(self, conn: LocalConnection, rid: int, job: str, server: str, address: str) -> None:
        """Answer a local ``get`` for a server on another host: GET frame -> MODEL -> memfd to ``conn``."""
        header = FrameHeader(kind=_GET, job=job, server=server, src_host=self.host)
        try:
            reply = self.request(address, header, alloc=MemfdBuffer.allocate)
        except PeerUnavailable as exc:
            conn.error(rid, "unavailable", f"get from server {server!r} of job {job!r}: {exc}")
            return
        buffer = reply.buffer if isinstance(reply.buffer, MemfdBuffer) else MemfdBuffer.allocate(0)
        reply.payload.release()
        try:
            if reply.header.kind != _MODEL:
                conn.error(
                    rid, "unavailable", f"get from server {server!r} of job {job!r}: {reply.header.reason}"
                )
                return
            model = local_pb2.ModelReply(
                version=reply.header.version,
                tensors=reply.header.tensors,
                payload_bytes=reply.header.payload_bytes,
                has_payload=True,
            )
            conn.send(local_pb2.LocalEvent(request_id=rid, model=model), buffer.fd)
        finally:
            buffer.release()
