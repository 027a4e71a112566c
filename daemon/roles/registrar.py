"""The scheduler session's side of registrations: ``RegisterRole`` and its ``RoleAck`` (DESIGN §3).

Every role of a local process (a worker, a server, a replica) is registered with the scheduler
through the :class:`Registrar`: it sends ``RegisterRole`` with a fresh request id and hands the
``RoleAck`` carrying that id to the waiter (None when there is no scheduler to ask, or the
session ends first). :meth:`Registrar.register_until` registers again after a refusal the
scheduler may lift (a job whose server's daemon is not back yet), with backoff, for as long as
the role still wants it. The registrar also keeps the :class:`~mlfabric.daemon.roles.directory.
Directory` current from ``JobUpdate`` (the servers of a job now). After a new ``Welcome`` each
role registers its processes again (:meth:`~mlfabric.daemon.roles.base.Role.register_again`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Collection
from typing import Any

from mlfabric.daemon.roles.base import Role, RoleContext, Routes
from mlfabric.daemon.roles.directory import Directory
from mlfabric.proto.v1 import control_pb2

__all__ = ["OnAck", "Registrar"]

_LOG = logging.getLogger("mlfabric.daemon")

#: ``on_ack(RoleAck or None)``: None when the scheduler could not be asked or the session ended;
#: what it returns is ignored
OnAck = Callable[[Any], object]

#: seconds between re-registrations refused for now: doubling from the first to the second
_BACKOFF = (0.2, 2.0)


class Registrar(Role):
    """Registers roles with the scheduler and hands each ``RoleAck`` to its waiter (thread-safe).

    Parameters
    ----------
    context : RoleContext
        The control stream (``send``), the task pool (retries), the stopping flag.
    directory : Directory
        Kept current from ``JobUpdate`` directives.

    Examples
    --------
    >>> acks = []
    >>> r = Registrar(RoleContext("w0", "127.0.0.1:7077"), Directory())   # no session up
    >>> r.register(control_pb2.RegisterRole(job="j", name="w0"), acks.append); acks
    [None]
    """

    def __init__(self, context: RoleContext, directory: Directory) -> None:
        self._ctx = context
        self._directory = directory
        self._lock = threading.Lock()
        self._acks: dict[int, OnAck] = {}
        self._ids = itertools.count(1)

    def routes(self) -> Routes:
        return Routes(
            directives={
                "role_ack": self.on_role_ack,
                "job_update": self.on_job_update,
                "codec_advice": self.on_codec_advice,
            }
        )

    def register(self, message: Any, on_ack: OnAck) -> None:
        """Send ``message`` (a ``RegisterRole``); ``on_ack(RoleAck or None)`` once answered."""
        request_id = next(self._ids)
        message.request_id = request_id
        with self._lock:
            self._acks[request_id] = on_ack
        if not self._ctx.send(control_pb2.DaemonMessage(register_role=message)):
            with self._lock:
                self._acks.pop(request_id, None)
            on_ack(None)

    def register_until(
        self,
        message: Any,
        on_ack: OnAck,
        *,
        retry: Collection[int],
        wanted: Callable[[], bool] = lambda: True,
        pause: float = 0.0,
    ) -> None:
        """Register ``message`` after ``pause`` s; again while refused with a code in ``retry``.

        Every answer goes to ``on_ack`` first. A refusal whose ``ErrorCode`` is in ``retry``
        (the job's or server's daemon is not back yet) is tried again on the task pool after a
        backoff (0.2 s doubling to 2 s), whatever order daemons come back in, for as long as
        ``wanted()`` (e.g. the worker's process is still connected). Nothing is sent once the
        daemon stops or the role is no longer wanted.
        """
        if self._ctx.stopping.wait(pause) or not wanted():
            return

        def answered(ack: Any) -> None:
            on_ack(ack)
            if ack is not None and not ack.ok and ack.code in retry and wanted():
                later = min(_BACKOFF[1], max(_BACKOFF[0], 2 * pause))
                self._ctx.submit(self._register_again_later, message, on_ack, retry, wanted, later)

        self.register(message, answered)

    def _register_again_later(
        self, message: Any, on_ack: OnAck, retry: Collection[int], wanted: Callable[[], bool], pause: float
    ) -> None:
        self.register_until(message, on_ack, retry=retry, wanted=wanted, pause=pause)

    def on_role_ack(self, ack: Any) -> None:
        """A ``RoleAck``: to the waiter of its request id (a late one is dropped)."""
        with self._lock:
            on_ack = self._acks.pop(ack.request_id, None)
        if on_ack is not None:
            on_ack(ack)

    def on_job_update(self, update: Any) -> None:
        """A ``JobUpdate`` lists the job's servers now: one that left is forgotten."""
        self._directory.update(update.job, update.servers, replace=True)

    def on_codec_advice(self, advice: Any) -> None:
        """A ``CodecAdvice``: the codec of this host's ``auto`` pushes to a server (docs/compression.md)."""
        self._directory.advise(advice.job, advice.server, advice.codec)
        _LOG.info(
            "job %r, server %r: pushes with codec 'auto' travel as %s (path share %.3g MB/s, %d bytes: "
            "%.3g s, uncompressed %.3g s)",
            advice.job,
            advice.server,
            advice.codec or "none",
            advice.bandwidth / 1e6,
            advice.bytes,
            advice.seconds,
            advice.seconds_none,
        )

    def log_answer(self, job: str, name: str, ack: Any) -> bool:
        """Log a failed re-registration of ``name`` of ``job``; note the servers of an ok one.

        Returns whether ``ack`` says ok.
        """
        if ack is None or not ack.ok:
            _LOG.error("re-registering %r of job %r failed: %s", name, job, ack and ack.error)
            return False
        if ack.servers:
            self._directory.update(job, ack.servers)
        return True

    def scheduler_lost(self, reason: str) -> None:
        """Every registration still waiting gets None (the session that would answer it ended)."""
        with self._lock:
            acks = list(self._acks.values())
            self._acks.clear()
        for on_ack in acks:
            on_ack(None)
