"""The server role of the Python API: a parameter server of a job (paper Table 1).

:func:`register_as_server` (the paper's ``registerAsServer``) returns a :class:`Server`;
:meth:`Server.on_update` and :meth:`Server.on_request` are ``registerUpdateCallback`` and
``registerRequestCallback``; :class:`UpdateMeta` is what ``on_update`` learns about an update
besides its tensors. Re-exported by :mod:`mlfabric.api` (and as ``mlfabric.Server`` etc.); the
worker role is there.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mlfabric import tensorio
from mlfabric import tensors as tcodec
from mlfabric.aggregators.codecs import CodecError
from mlfabric.aggregators.codecs.snapshot import encode_model, parse_model_codec
from mlfabric.localclient import LocalClient, MlfabricError, check_size, connect, raise_for_error
from mlfabric.params import Params
from mlfabric.proto.v1 import control_pb2, local_pb2
from mlfabric.wire.memfd import privatize

__all__ = ["RequestFn", "Server", "UpdateFn", "UpdateMeta", "register_as_server"]

Tensors = Mapping[str, Any]
UpdateFn = Callable[[dict[str, Any], "UpdateMeta"], "Mapping[str, Any] | None"]
RequestFn = Callable[[], "Mapping[str, Any] | None"]


@dataclass(frozen=True)
class UpdateMeta:
    """What a server's ``on_update`` callback learns about an update besides its tensors.

    Attributes
    ----------
    update_id : str
    worker : str
        The pushing worker ("" for an aggregate of several workers).
    base_version : int
        The model version the update was computed from.
    delay : int
        Server version now minus ``base_version`` (at most ``tau_max``).
    num_updates : int
        Worker updates summed in it (1 for a plain update, more for an aggregate or a
        synchronous round).
    norm : float
        The update's norm (for an aggregate: the sum of its members' norms).
    member_ids, workers : tuple of str
        The worker updates summed in it and their workers, in order (one entry for a plain
        update).
    member_delays : tuple of int
        Each member's delay: server version now minus its base version (``delay`` is the
        largest, the oldest member's).
    partial_round : bool
        A synchronous round applied with fewer than ``Params.sync_workers`` updates because the
        others did not arrive within the round timeout (a worker vanished or straggled).
    """

    update_id: str
    worker: str
    base_version: int
    delay: int
    num_updates: int
    norm: float
    member_ids: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    member_delays: tuple[int, ...] = ()
    partial_round: bool = False


class Server:
    """A parameter server of a job (paper Table 1, ``register_as_server``). Create with
    :func:`register_as_server`.

    The daemon delivers each update routed to this server; :meth:`serve` applies them one
    at a time: it refuses (DROPPED, naming the numbers) an update whose delay exceeds
    ``tau_max``, else calls the ``on_update`` callback, bumps :attr:`version`, publishes the
    model to the daemon (which answers every ``get`` from it) and sends the verdict.

    Attributes
    ----------
    job, name : str
    params : Params
    model : dict
        name -> tensor; ``on_update`` changes it in place or returns a replacement.
    version : int
        +1 per applied update (or aggregate).
    """

    def __init__(
        self, client: LocalClient, job: str, name: str, model: dict, params: Params, version: int
    ) -> None:
        self._client = client
        self.job = job
        self.name = name
        self.model = model
        self.params = params
        self.version = version
        self.applied = 0
        self.dropped = 0
        self._as_torch = any(tcodec._is_torch(v) for v in model.values())
        self._model_codec = parse_model_codec(params.model_compression)
        self._update_fn: UpdateFn | None = None
        self._request_fn: RequestFn | None = None
        self._inbox: queue.Queue[tuple[Any, int | None]] = queue.Queue()
        self._stop = threading.Event()

    def on_update(self, fn: UpdateFn) -> UpdateFn:
        """Register the update callback ``fn(update, meta)`` (usable as a decorator).

        ``fn`` applies ``update`` (dict of tensors) to :attr:`model` in place, or returns the new
        model. The default subtracts the update: ``model[k] -= update[k]``. The update's tensors
        view the daemon's receive buffer (no copy); tensors kept past the call get a private copy.
        """
        self._update_fn = fn
        return fn

    def on_request(self, fn: RequestFn) -> RequestFn:
        """Register ``fn()`` giving the tensors a ``get`` returns (default: :attr:`model`).

        It is called each time the server publishes its model to the daemon (after every
        applied update); returning None publishes :attr:`model`.
        """
        self._request_fn = fn
        return fn

    def publish(self) -> None:
        """Hand the current model (or ``on_request``'s tensors) to the daemon for ``get``.

        With ``Params(model_compression=)`` its float32/float64 tensors are handed over (and
        travel) as that codec's words, rounded afresh from :attr:`model`, which stays exact
        (docs/compression.md).
        """
        tensors = self._request_fn() if self._request_fn is not None else None
        model = self.model if tensors is None else tensors
        encoded = None
        if self._model_codec is not None:
            model, encoded = encode_model(model, self._model_codec)
        fd, layouts, total = tensorio.to_memfd(model, name="mlfabric-model", encoded=encoded)
        try:
            publish = local_pb2.PublishModel(
                version=self.version,
                tensors=tcodec.layouts_to_pb(layouts),
                payload_bytes=total,
                has_payload=True,
            )
            self._client.send(local_pb2.LocalRequest(publish=publish), fd)
        finally:
            os.close(fd)

    def serve(
        self,
        max_updates: int | None = None,
        until: threading.Event | None = None,
        timeout: float | None = None,
    ) -> int:
        """Apply delivered updates until :meth:`stop`, ``max_updates`` handled, ``until`` set or ``timeout``.

        Parameters
        ----------
        max_updates : int, optional
            Return after this many updates were handled (applied or dropped).
        until : threading.Event, optional
            Return once it is set.
        timeout : float, optional
            Return after this many seconds.

        Returns
        -------
        int
            Updates handled by this call.

        Raises
        ------
        MlfabricError
            The daemon connection broke.

        Examples
        --------
        >>> stop = threading.Event()
        >>> server.serve(until=stop, timeout=60)   # doctest: +SKIP
        42
        """
        handled = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._stop.is_set() and (until is None or not until.is_set()):
            if max_updates is not None and handled >= max_updates:
                break
            wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                event, fd = self._inbox.get(timeout=wait)
            except queue.Empty:
                continue
            if event.WhichOneof("kind") == "error" and self._stop.is_set():
                break  # our own close() ended the connection
            raise_for_error(event, fd)
            if event.WhichOneof("kind") == "deliver":
                try:
                    self._handle(event.deliver, fd)
                except MlfabricError as exc:
                    if exc.code == "disconnected" and self._stop.is_set():
                        break  # closed while on_update ran: the verdict cannot be sent (UNKNOWN)
                    raise
                handled += 1
            elif event.WhichOneof("kind") == "promoted":
                self._on_promoted(event.promoted)
            elif event.WhichOneof("kind") == "resynced":
                self._on_resynced(event.resynced, fd)
            elif fd is not None:
                os.close(fd)
        return handled

    def stop(self) -> None:
        """Make :meth:`serve` return (thread-safe)."""
        self._stop.set()

    def close(self) -> None:
        """Stop serving and give up the server role."""
        self.stop()
        self._client.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_promoted(self, promoted: Any) -> None:
        """A replica's daemon says it is the server now (:class:`mlfabric.replica.Replica`)."""

    def _on_resynced(self, resynced: Any, fd: int | None) -> None:
        """A replica's model is replaced by its server's (:class:`mlfabric.replica.Replica`)."""
        if fd is not None:
            os.close(fd)

    def _meta(self, deliver: Any, delay: int) -> UpdateMeta:
        members = list(deliver.members)
        num_updates = int(deliver.num_updates or 1)
        return UpdateMeta(
            deliver.update_id,
            deliver.worker,
            int(deliver.base_version),
            delay,
            num_updates,
            float(deliver.norm),
            member_ids=tuple(m.update_id for m in members) or (deliver.update_id,),
            workers=tuple(m.worker for m in members) or (deliver.worker,),
            member_delays=tuple(self.version - int(m.base_version) for m in members) or (delay,),
            partial_round=0 < num_updates < self.params.sync_workers,
        )

    def _refusal(self, deliver: Any, delay: int) -> str | None:
        """Why an update must not be applied before its payload is read (stale or forged), or None."""
        bases = [int(deliver.base_version)] + [int(m.base_version) for m in deliver.members]
        if max(bases) > self.version:
            return (
                f"base version {max(bases)} is ahead of server {self.name!r} at version {self.version} "
                "(a base version comes from a get of this server)"
            )
        tau_max = self.params.tau_max
        if tau_max is not None and delay > tau_max:
            return (
                f"delay {delay} exceeds tau_max {tau_max} (server {self.name!r} at version {self.version}, "
                f"update base version {deliver.base_version})"
            )
        return None

    def _drop(self, verdict: Any, reason: str) -> None:
        verdict.outcome = control_pb2.OUTCOME_DROPPED
        verdict.version = self.version
        verdict.reason = reason
        self.dropped += 1
        self._client.send(local_pb2.LocalRequest(verdict=verdict))

    def _handle(self, deliver: Any, fd: int | None) -> None:
        delay = self.version - int(deliver.base_version)
        verdict = local_pb2.UpdateVerdict(update_id=deliver.update_id, delay=delay)
        # a replicated entry is applied as the server applied it (it passed these checks there)
        refusal = None if deliver.replicated else self._refusal(deliver, delay)
        if refusal is not None:
            if fd is not None:
                os.close(fd)
            self._drop(verdict, refusal)
            return
        try:  # compressed tensors are decoded here (docs/compression.md)
            update, mapping = tensorio.from_fd(deliver.tensors, fd, as_torch=self._as_torch, mapped=True)
        except CodecError as exc:  # a payload that does not decode: refused, the model untouched
            self._drop(verdict, f"update {deliver.update_id} does not decode: {exc}")
            return
        # the fallback: the daemon tests payloads in its CRC pass (finite_checked); one it could
        # not check (a synchronous round summed in the daemon) is read here
        bad = (
            tcodec.first_non_finite(update)
            if self.params.refuse_non_finite and not deliver.replicated and not deliver.finite_checked
            else None
        )
        if deliver.want_norm:  # the server has a replica: its divergence counts this norm
            verdict.norm, verdict.has_norm = tcodec.l2_norm(update), True
        if bad is not None:
            del update
            if mapping is not None:
                mapping.close()
            self._drop(
                verdict,
                f"tensor {bad!r} of {deliver.update_id} holds non-finite values (NaN or inf); server "
                f"{self.name!r} refuses them (Params(refuse_non_finite=False) allows them)",
            )
            return
        meta = self._meta(deliver, delay)
        replaced = None
        try:
            if self._update_fn is None:  # the default on_update: model[k] -= update[k]
                for key in update:  # (no loop variable left holding a view of the buffer)
                    self.model[key] -= update[key]
            else:
                replaced = self._update_fn(update, meta)
        except BaseException as exc:
            # the sender learns why instead of waiting out the daemon's verdict timeout
            verdict.outcome, verdict.version = control_pb2.OUTCOME_DROPPED, self.version
            verdict.reason = f"on_update of server {self.name!r} raised {exc!r}"
            self._client.send(local_pb2.LocalRequest(verdict=verdict))
            raise
        finally:
            del update
            if mapping is not None:
                try:
                    mapping.close()
                except BufferError:  # on_update kept a view: copy before the daemon reuses the buffer
                    privatize(mapping)
        if replaced is not None:
            self.model = dict(replaced)
        self.version += 1
        self.applied += 1
        verdict.outcome = control_pb2.OUTCOME_APPLIED
        verdict.version = self.version
        self.publish()
        self._client.send(local_pb2.LocalRequest(verdict=verdict))


def register_as_server(
    job: str,
    name: str,
    model: Tensors,
    params: Params | None = None,
    *,
    daemon: str | None = None,
    version: int = 0,
) -> Server:
    """Serve (part of) ``job``'s model as server ``name`` (paper Table 1, ``register_as_server``).

    Parameters
    ----------
    job : str
        The job's name.
    name : str
        The server's name (workers push to it by this name).
    model : dict
        name -> numpy array or torch tensor; defines the model spec pushes are checked against.
    params : Params, optional
        The job's bounds; default unbounded ``tau_max``, non-finite updates refused.
        ``div_max`` bounds how far a replica (:func:`mlfabric.register_as_replica`) may lag;
        None or 0: chain replication (every update at the replica before its push resolves).
    daemon : str, optional
        The daemon's socket; default ``$MLFABRIC_DAEMON``, else the default socket path.
    version : int
        The version the model starts at.

    Returns
    -------
    Server
        Register ``on_update``/``on_request`` callbacks, then call :meth:`Server.serve`. If
        this server failed over to its replica while it was away (docs/replication.md), a
        :class:`mlfabric.replica.Replica` of the promoted server (same name) instead: it
        serves the same way and is promoted again if that server fails.

    Raises
    ------
    MlfabricError
        No daemon at the socket, or the scheduler refused the registration (e.g. duplicate name),
        or the names and model spec exceed
        the local message limit.

    Examples
    --------
    >>> server = register_as_server("job1", "ps0", {"w": np.zeros(3)}, Params(tau_max=4))  # doctest: +SKIP
    >>> @server.on_update                                                                  # doctest: +SKIP
    ... def apply(update, meta):
    ...     server.model["w"] -= 0.1 * update["w"]
    >>> server.serve(max_updates=100)                                                      # doctest: +SKIP
    100
    """
    params = params or Params()
    model_dict = dict(model)
    layouts, _ = tcodec.plan_layout(model_dict)
    spec = [control_pb2.TensorSpec(name=x.name, dtype=x.dtype, shape=list(x.shape)) for x in layouts]
    request = local_pb2.LocalRequest(
        register_server=local_pb2.RegisterServerRequest(
            job=job, name=name, model=spec, params=params.to_pb(), version=version
        )
    )
    check_size(request, "the server registration")
    client = connect(daemon)
    server = Server(client, job, name, model_dict, params, version)
    client.set_unsolicited(lambda event, fd: server._inbox.put((event, fd)))
    try:
        client.call(request, timeout=60.0)
        server.publish()
    except MlfabricError as exc:
        client.close()
        if exc.code != "failed_over":
            raise
        # this server failed over to its replica while it was away: it comes back as the
        # replica of the promoted one (its model replaced by the promoted server's)
        from mlfabric.replica import register_as_replica

        return register_as_replica(job, name, model_dict, daemon=daemon)
    except BaseException:
        client.close()
        raise
    return server
