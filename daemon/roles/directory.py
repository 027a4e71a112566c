"""Where every job's servers are, as this daemon knows them (DESIGN §3).

:class:`Directory` is kept current from the scheduler's ``RoleAck`` and ``JobUpdate`` and
from the servers registered on this host; the worker role looks a push's server up in it, the
fallback sends directly to the address it names, and a worker's transfer to a replicated server
that failed waits in it for the failover (docs/replication.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mlfabric.proto.v1 import control_pb2
from mlfabric.wire.tensors import Spec

__all__ = ["Directory", "ServerLocation", "spec_from_pb"]


def spec_from_pb(model: Iterable[Any]) -> Spec:
    """A :data:`Spec` from ``TensorSpec`` messages.

    Examples
    --------
    >>> spec_from_pb([control_pb2.TensorSpec(name="w", dtype="float64", shape=[2])])
    {'w': ('float64', (2,))}
    """
    return {t.name: (t.dtype, tuple(int(d) for d in t.shape)) for t in model}


@dataclass
class ServerLocation:
    """Where a job's server lives (from ``ServerInfo``)."""

    name: str
    host: str
    data_address: str
    spec: Spec
    version: int
    #: the server has a replica / the host it was on before its replica took over
    replicated: bool = False
    failed_over_from: str = ""


class Directory:
    """Every known job's servers, kept current from ``RoleAck`` and ``JobUpdate`` (thread-safe).

    Examples
    --------
    >>> d = Directory()
    >>> d.update("j", [control_pb2.ServerInfo(name="ps0", host="h1", data_address="1.2.3.4:5")])
    >>> d.lookup("j", "ps0").host
    'h1'
    >>> d.lookup("j", "ps9") is None
    True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, ServerLocation]] = {}
        self._changed = threading.Condition(self._lock)
        #: (job, server) -> the codec the scheduler advised for pushes from this host (``auto``)
        self._advice: dict[tuple[str, str], str] = {}

    def update(self, job: str, servers: Iterable[Any], *, replace: bool = False) -> None:
        """Record ``ServerInfo`` messages for ``job`` (``replace``: forget servers not listed)."""
        with self._lock:
            known = {} if replace else dict(self._jobs.get(job, {}))
            for s in servers:
                known[s.name] = ServerLocation(
                    s.name,
                    s.host,
                    s.data_address,
                    spec_from_pb(s.model),
                    int(s.version),
                    s.replicated,
                    s.failed_over_from,
                )
            self._jobs[job] = known
            self._changed.notify_all()

    def add(self, job: str, location: ServerLocation) -> None:
        """Record one server (e.g. one registered on this host)."""
        with self._lock:
            self._jobs.setdefault(job, {})[location.name] = location
            self._changed.notify_all()

    def advise(self, job: str, server: str, codec: str) -> None:
        """The scheduler's ``CodecAdvice``: pushes to ``server`` of ``job`` with ``auto`` use ``codec``."""
        with self._lock:
            self._advice[(job, server)] = codec

    def advice(self, job: str, server: str) -> str:
        """The codec advised for pushes to ``server`` of ``job`` (``""``: none, or none advised).

        Examples
        --------
        >>> d = Directory()
        >>> d.advise("j", "ps0", "int8"); d.advice("j", "ps0"), d.advice("j", "ps1")
        ('int8', '')
        """
        with self._lock:
            return self._advice.get((job, server), "")

    def lookup(self, job: str, server: str) -> ServerLocation | None:
        """The server's location, or None."""
        with self._lock:
            return self._jobs.get(job, {}).get(server)

    def servers(self, job: str) -> list[str]:
        """Names of the job's known servers."""
        with self._lock:
            return sorted(self._jobs.get(job, {}))

    def wait_for_servers(self, job: str, timeout: float) -> bool:
        """Block until ``job`` has a server or ``timeout`` passes; True if it has one."""
        with self._lock:
            return self._changed.wait_for(lambda: bool(self._jobs.get(job)), timeout)

    def info(self, job: str, name: str) -> Any:
        """The ``ServerInfo`` of server ``name`` of ``job`` (as a process learns it), or None."""
        loc = self.lookup(job, name)
        if loc is None:
            return None
        return control_pb2.ServerInfo(
            name=loc.name,
            host=loc.host,
            data_address=loc.data_address,
            version=loc.version,
            model=[control_pb2.TensorSpec(name=n, dtype=d, shape=list(s)) for n, (d, s) in loc.spec.items()],
            codec=self.advice(job, name),
        )

    def wait_for_failover(
        self, job: str, server: str, host: str, timeout: float, cancel: threading.Event
    ) -> ServerLocation | None:
        """Where ``server`` went when it failed over from ``host``; None if it does not (docs/replication.md).

        Only a server that has a replica (or already failed over from ``host``) may: its new
        location (the promoted replica, from the ``JobUpdate``) is awaited up to ``timeout``
        seconds, or until ``cancel`` is set.

        Examples
        --------
        >>> d = Directory()
        >>> d.add("j", ServerLocation("ps0", "h2", "10.0.0.2:7000", {}, 0, failed_over_from="h1"))
        >>> d.wait_for_failover("j", "ps0", "h1", 1.0, threading.Event()).host
        'h2'
        >>> d.wait_for_failover("j", "ps0", "h9", 1.0, threading.Event()) is None   # not replicated
        True
        """
        loc = self.lookup(job, server)
        if loc is None or not (loc.replicated or loc.failed_over_from == host):
            return None
        deadline = time.monotonic() + timeout
        while loc is None or loc.host == host or loc.failed_over_from != host:
            if time.monotonic() >= deadline or cancel.is_set():
                return None
            time.sleep(0.02)
            loc = self.lookup(job, server)
        return loc
