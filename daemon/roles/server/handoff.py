"""A server role's hand-off on its daemon: each update to the process once, and its model.

:class:`ServerHandoff` is the server side of exactly-once (DESIGN §10): each arriving update
goes to the server process once; a retried update (same ``update_id``) gets the stored verdict
and is never applied twice (its :class:`~mlfabric.daemon.roles.server.verdicts.VerdictStore`).
:class:`ModelSnapshot` is the model the process last published, which ``get`` answers from.

Nothing here does I/O; the serving role passes in the function that talks to the process.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlfabric.daemon.channels import payloadio
from mlfabric.daemon.roles.base import Verdict
from mlfabric.daemon.roles.server.verdicts import VerdictStore
from mlfabric.proto.v1 import control_pb2, local_pb2
from mlfabric.wire.tensors import Layout, Spec, layouts_to_pb

__all__ = ["ModelSnapshot", "ServerHandoff"]


@dataclass
class ModelSnapshot:
    """A model published by the server process: an immutable memfd and its mapping."""

    version: int
    layouts: list[Layout]
    payload_bytes: int
    fd: int
    mapping: mmap.mmap | None
    crc32: int | None = None

    def checksum(self) -> int:
        """The payload's CRC-32, computed on first use (a peer's GET) and kept."""
        if self.crc32 is None:
            self.crc32 = payloadio.payload_crc32(self.mapping)
        return self.crc32

    def local_event(self, request_id: int) -> local_pb2.LocalEvent:
        """The answer to a local ``get`` with this model (sent with :attr:`fd`)."""
        reply = local_pb2.ModelReply(
            version=self.version,
            tensors=layouts_to_pb(self.layouts),
            payload_bytes=self.payload_bytes,
            has_payload=True,
        )
        return local_pb2.LocalEvent(request_id=request_id, model=reply)

    def close(self) -> None:
        """Close the fd; the mapping lives on while a reply still sends from it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ServerHandoff:
    """A server role on this host: hands updates to its process, once each (thread-safe).

    What it decided is in :attr:`verdicts` (the server's :class:`VerdictStore`).

    Parameters
    ----------
    job, name : str
        The server.
    spec : Spec
        Its model.
    version : int
        Its model version at registration.
    deliver : callable
        ``deliver(update_id, header, fd)`` passes an update to the server process; raises
        ``OSError`` if the process is gone.
    max_verdicts : int
        How many past verdicts are remembered for de-duplication.

    Examples
    --------
    >>> sent = []
    >>> def deliver(update_id, header, fd):  # the process applies it and answers at once
    ...     sent.append(update_id)
    ...     h.verdicts.resolve(update_id, Verdict(control_pb2.OUTCOME_APPLIED, 0, 1, ""))
    >>> h = ServerHandoff("j", "ps0", {}, 0, deliver)
    >>> h.handle("u1", None, -1, timeout=5).version
    1
    >>> h.handle("u1", None, -1, timeout=5).version, sent      # a retry: stored verdict, not re-delivered
    (1, ['u1'])
    """

    def __init__(
        self,
        job: str,
        name: str,
        spec: Spec,
        version: int,
        deliver: Callable[[str, Any, int], None],
        max_verdicts: int = 100_000,
    ) -> None:
        self.job = job
        self.name = name
        self.spec = spec
        self._deliver = deliver
        #: the server's exactly-once memory (verdicts, deliveries, aggregates' members, claims)
        self.verdicts = VerdictStore(version, max_verdicts)
        self._lock = threading.Lock()
        #: notified at every publish (a ``get`` with a version floor waits on it)
        self._published = threading.Condition(self._lock)
        self._snapshot: ModelSnapshot | None = None
        #: a replica's replicated entries and its re-sync take turns under it (replica/log.py)
        self.replicating = threading.Lock()

    @property
    def version(self) -> int:
        """The server's model version, as far as this daemon knows."""
        return self.verdicts.version

    def handle(self, update_id: str, header: Any, fd: int, timeout: float | None) -> Verdict:
        """The verdict on an arriving update: stored, awaited, or delivered now and awaited.

        ``timeout`` None waits until the process answers or disconnects. A timeout answers
        UNKNOWN (the process may still apply the update later), as does a process that
        disconnects after the update was handed to it; an update never handed over (the
        process was gone already) is DROPPED.

        The caller keeps ownership of ``fd`` (the process gets its own copy).
        """
        stored, delivery, first = self.verdicts.begin(update_id)
        if stored is not None:
            return stored
        assert delivery is not None
        if first:
            try:
                self._deliver(update_id, header, fd)
            except OSError as exc:
                reason = f"server process {self.name!r} unreachable: {exc}"
                verdict = Verdict(control_pb2.OUTCOME_DROPPED, 0, self.version, reason, False)
                self.verdicts.resolve(update_id, verdict)
        if not delivery.done.wait(timeout):
            return Verdict.unknown(
                f"server process {self.name!r} gave no verdict on {update_id} within {timeout} s "
                "(it may still apply it)",
                self.version,
            )
        assert delivery.verdict is not None
        return delivery.verdict

    def close(self, reason: str) -> None:
        """The process went away: every update handed to it without a verdict resolves UNKNOWN.

        It may have been applied just before the process went (its verdict lost), so neither
        APPLIED nor DROPPED would be true. Updates arriving later are DROPPED with ``reason``.
        """
        pending = self.verdicts.close(reason)
        with self._lock:
            snapshot, self._snapshot = self._snapshot, None
        for update_id in pending:
            self.verdicts.resolve(
                update_id,
                Verdict.unknown(
                    f"{reason} after {update_id} was handed to it and before its verdict: "
                    "whether it was applied is unknown",
                    self.version,
                ),
            )
        if snapshot is not None:
            snapshot.close()

    def publish(self, snapshot: ModelSnapshot) -> None:
        """Replace the model ``get`` answers from (the old snapshot's fd is closed)."""
        with self._lock:
            old, self._snapshot = self._snapshot, snapshot
            self._published.notify_all()
        if old is not None:
            old.close()

    def wait_published(self, min_version: int, timeout: float) -> ModelSnapshot | None:
        """The model last published once its version is ``min_version`` or more (up to ``timeout`` s).

        Returns the snapshot then, or whatever is published at the timeout (None if nothing;
        the caller compares the version).
        """
        with self._lock:
            self._published.wait_for(
                lambda: self._snapshot is not None and self._snapshot.version >= min_version, timeout
            )
            return self._snapshot

    def snapshot(self) -> ModelSnapshot | None:
        """The model last published, or None."""
        with self._lock:
            return self._snapshot

    def with_snapshot(self, fn: Callable[[ModelSnapshot | None], Any]) -> Any:
        """Call ``fn(snapshot)`` while no publish can close the snapshot's fd."""
        with self._lock:
            return fn(self._snapshot)
