"""The replica role of the Python API: a hot standby of a parameter server (paper §4, Fig. 3).

:func:`register_as_replica` (the paper's ``registerAsReplica``) returns a :class:`Replica`,
a :class:`~mlfabric.server.Server` that starts from the server's model (fetched at
registration) and is fed, by the daemons, every update the server applied, in the server's
order; register the *same* ``on_update`` (and ``on_request``) as the server and call
:meth:`Server.serve`: the replica stays within the job's ``div_max`` of the server and is
bit-identical to it once caught up. When the server's process or daemon fails, the
scheduler promotes the replica: :attr:`Replica.promoted` is set and the same ``serve`` loop
goes on applying workers' updates as the server (docs/replication.md). A replica detached
while its daemon was away from the scheduler longer than the grace is re-synced when its
daemon registers it again: its model is replaced by the server's (:attr:`Replica.resyncs`)
and replication goes on from there.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from mlfabric import tensorio
from mlfabric import tensors as tcodec
from mlfabric.localclient import LocalClient, MlfabricError, check_size, connect
from mlfabric.params import Params
from mlfabric.proto.v1 import control_pb2, local_pb2
from mlfabric.server import Server

__all__ = ["Replica", "register_as_replica"]


class Replica(Server):
    """A replica of a job's server (create with :func:`register_as_replica`).

    Attributes
    ----------
    server : str
        The server it replicates (and whose name it takes when promoted).
    promoted : threading.Event
        Set once the scheduler promoted this replica to be the server.
    promotion_reason : str
        Why (the server's process or daemon failed), once promoted.
    resyncs : int
        Times its model was replaced by the server's after it had been detached (its daemon
        away from the scheduler longer than the grace; docs/replication.md).
    """

    def __init__(
        self, client: LocalClient, job: str, name: str, model: dict, params: Params, version: int
    ) -> None:
        super().__init__(client, job, name, model, params, version)
        self.server = name
        self.promoted = threading.Event()
        self.promotion_reason = ""
        self.resyncs = 0
        self._registered = False  # until then publish() goes through (the registration's model)

    def publish(self) -> None:
        """Hand the model to the daemon for ``get`` — only once promoted (and at registration)."""
        if self.promoted.is_set() or not self._registered:
            super().publish()

    def _handle(self, deliver: Any, fd: int | None) -> None:
        """Apply or refuse an update; once promoted, a base version ahead of this model is accepted.

        A worker's update computed on a model it got from the failed server may name a version
        this replica never reached: the server had applied updates the replica lacked (at most
        ``div_max`` worth) when it failed. It is a legitimate update of the job, re-routed here
        or pushed after the failover, so it is applied with its base version (and its members')
        taken as this model's version (delay 0) instead of refused as "ahead".
        """
        if self.promoted.is_set() and not deliver.replicated:
            if int(deliver.base_version) > self.version:
                deliver.base_version = self.version
            for m in deliver.members:
                if int(m.base_version) > self.version:
                    m.base_version = self.version
        super()._handle(deliver, fd)

    def _on_resynced(self, resynced: Any, fd: int | None) -> None:
        """Replace the model by the server's at ``resynced.model.version`` (in place where possible).

        Sent by the daemons when this replica, detached while its daemon was away from the
        scheduler, is attached again: the replicated updates that follow apply on top of it.
        """
        tensors = tensorio.from_fd(resynced.model.tensors, fd, as_torch=self._as_torch)
        for key, value in tensors.items():
            current: Any = self.model.get(key)
            if hasattr(current, "copy_") and tuple(current.shape) == tuple(value.shape):
                current.copy_(value)  # a torch tensor: same object, new values
            elif isinstance(current, np.ndarray) and current.shape == value.shape and current.flags.writeable:
                current[...] = value
            else:
                self.model[key] = value
        self.version = int(resynced.model.version)
        self.resyncs += 1

    def _on_promoted(self, promoted: Any) -> None:
        self.promotion_reason = promoted.reason
        self.promoted.set()
        self.publish()  # gets are answered from here now


def register_as_replica(
    job: str,
    server: str,
    model: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    daemon: str | None = None,
    as_torch: bool = False,
    timeout: float = 60.0,
) -> Replica:
    """Replicate server ``server`` of ``job`` (paper Table 1, ``registerAsReplica``).

    Parameters
    ----------
    job, server : str
        The job and the server to replicate (registered already, on another host's daemon).
    model : dict, optional
        name -> tensor: when given, its names, shapes and dtypes must match the server's model
        (checked by the scheduler); the values are replaced by the server's model.
    name : str, optional
        The replica's name (default ``"<server>-replica"``).
    daemon : str, optional
        The daemon's socket; default ``$MLFABRIC_DAEMON``, else the default socket path.
    as_torch : bool
        Hold the model as torch tensors.
    timeout : float
        Seconds to wait for the registration and the model.

    Returns
    -------
    Replica
        Register the server's ``on_update``/``on_request``, then call :meth:`Replica.serve`.

    Raises
    ------
    MlfabricError
        No daemon at the socket; or the scheduler refused: ``unknown_job``, ``unknown_server``,
        ``model_mismatch`` (the spec differs, naming the tensor), ``duplicate_replica``
        (the server has a replica already), ``refused`` (e.g. the replica's host is the
        server's); or the server's daemon could not be reached for the model.

    Examples
    --------
    >>> replica = register_as_replica("job1", "ps0", daemon="/tmp/h2.sock")  # doctest: +SKIP
    >>> replica.on_update(apply)                                             # doctest: +SKIP
    >>> replica.serve(until=stop)                                            # doctest: +SKIP
    """
    spec = []
    if model is not None:
        layouts, _ = tcodec.plan_layout(dict(model))
        spec = [control_pb2.TensorSpec(name=x.name, dtype=x.dtype, shape=list(x.shape)) for x in layouts]
    request = local_pb2.LocalRequest(
        register_replica=local_pb2.RegisterReplicaRequest(
            job=job, server=server, name=name or f"{server}-replica", model=spec
        )
    )
    check_size(request, "the replica registration")
    client = connect(daemon)
    replica: Replica | None = None
    inbox: list[tuple[Any, int | None]] = []
    lock = threading.Lock()  # deliveries racing the registration reply keep their order

    def unsolicited(event: Any, fd: int | None) -> None:
        with lock:
            if replica is None:
                inbox.append((event, fd))
            else:
                replica._inbox.put((event, fd))

    client.set_unsolicited(unsolicited)
    try:
        event, fd = client.call(request, timeout=timeout)
        reply = event.registered
        if not reply.model.has_payload or fd is None:
            raise MlfabricError(f"the daemon sent no model for the replica of {server!r}", code="unavailable")
        tensors = tensorio.from_fd(reply.model.tensors, fd, as_torch=as_torch)
        params = Params.from_pb(reply.params)
        if params.model_compression:  # its model would be the rounded copy, not the server's
            raise MlfabricError(
                f"job {job!r} publishes its model compressed (model_compression="
                f"{params.model_compression!r}): a replica needs the exact model and is not "
                "supported with it yet (docs/compression.md)",
                code="bad_request",
            )
        with lock:
            replica = Replica(client, job, server, dict(tensors), params, int(reply.model.version))
            for item in inbox:
                replica._inbox.put(item)
        replica.publish()
        replica._registered = True
    except BaseException:
        client.close()
        raise
    return replica
