"""The Python API of mlfabric: the paper's Table 1 (MLfabric §4, "Architecture and APIs"), Pythonic.

Training code talks only to its host's daemon, over the local API (a Unix socket; the
tensors go in a memfd, see :mod:`mlfabric.localclient`)::

    import mlfabric

    worker = mlfabric.register_as_worker("job1")
    version, model = worker.get("ps0")
    handle = worker.push("ps0", {"w": grad})          # norm defaults to the L2 norm
    result = handle.wait(timeout=30)                   # APPLIED (delay, version) or DROPPED (reason)
                                                       # (or UNKNOWN: the server went away mid-apply)

    server = mlfabric.register_as_server("job1", "ps0", {"w": w0}, mlfabric.Params(tau_max=8))

    @server.on_update
    def apply(update, meta):                           # meta: worker, base_version, delay, ...
        server.model["w"] -= 0.1 * update["w"]

    server.serve()

The daemon's socket: the ``daemon`` argument, else the ``MLFABRIC_DAEMON`` environment
variable, else :data:`mlfabric.wire.framing.DEFAULT_SOCKET`
(``$TMPDIR/mlfabric-<uid>/daemon.sock``).

Tensors are dicts of name -> numpy array or torch tensor, dtype float32, float16, bfloat16
or float64 (numpy bfloat16: raw ``uint16`` words). Torch is optional.

Table 1 of the paper, and its names here: ``registerAsWorker(params)`` ->
:func:`register_as_worker`; ``push(server, update, update norm)`` -> :meth:`Worker.push`;
``get(server, model)`` -> :meth:`Worker.get`; ``registerAsServer(params)`` ->
:func:`register_as_server`; ``registerUpdateCallback()`` -> :meth:`Server.on_update`;
``registerRequestCallback()`` -> :meth:`Server.on_request`; ``registerAsReplica`` ->
:func:`register_as_replica` (:mod:`mlfabric.replica`); ``params`` (tau_max, div_max) ->
:class:`Params`.

The worker role lives here; the server role (:class:`Server`, :class:`UpdateMeta`,
:func:`register_as_server`) in :mod:`mlfabric.server`, re-exported here.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from mlfabric import tensorio
from mlfabric import tensors as tcodec
from mlfabric.aggregators.codecs.feedback import ErrorFeedback
from mlfabric.aggregators.codecs.payload import WireCodec, encode_update, parse_codec
from mlfabric.aggregators.codecs.sparse import RandomKCodec, version_rng
from mlfabric.allreduce import DEFAULT_TIMEOUT as ALLREDUCE_TIMEOUT
from mlfabric.allreduce import AllreduceGroup, AllreduceHandle, join_allreduce, submit_allreduce
from mlfabric.localclient import (
    APPLIED,
    DROPPED,
    UNKNOWN,
    LocalClient,
    MlfabricError,
    PushHandle,
    PushResult,
    check_size,
    connect,
)
from mlfabric.localsgd import LocalSGD
from mlfabric.params import Params
from mlfabric.proto.v1 import local_pb2
from mlfabric.replica import Replica, register_as_replica
from mlfabric.scheduler.core.codec_choice import is_auto
from mlfabric.server import Server, UpdateMeta, register_as_server
from mlfabric.wire.memfd import MemfdPool
from mlfabric.wire.tensors import TensorError, check_update

__all__ = [
    "APPLIED",
    "DROPPED",
    "UNKNOWN",
    "AllreduceGroup",
    "AllreduceHandle",
    "LocalSGD",
    "MlfabricError",
    "Params",
    "PushHandle",
    "PushResult",
    "Replica",
    "Server",
    "TensorError",
    "UpdateMeta",
    "Worker",
    "join_allreduce",
    "register_as_replica",
    "register_as_server",
    "register_as_worker",
]

_log = logging.getLogger("mlfabric")

#: Capacity of a worker's idle update memfds kept for reuse (in-flight pushes hold their own).
PUSH_POOL_BYTES = 1 << 30

Tensors = Mapping[str, Any]


def _check_base_version(base: int) -> None:
    """Refuse a negative base version, naming it (the daemon refuses one too).

    Examples
    --------
    >>> _check_base_version(0)
    >>> _check_base_version(-3)
    Traceback (most recent call last):
    ...
    mlfabric.wire.errors.MlfabricError: base_version -3 is negative: a model version is 0 or more
    """
    if base < 0:
        raise MlfabricError(
            f"base_version {base} is negative: a model version is 0 or more", code="bad_request"
        )


class Worker:
    """A worker of a job (paper Table 1, ``register_as_worker``). Create with :func:`register_as_worker`.

    Attributes
    ----------
    job, name : str
    params : Params
        The job's bounds, as the scheduler reports them.
    servers : dict
        Server name -> ``{"host", "version", "model"}`` where ``model`` maps tensor name to
        ``(dtype, shape)``.
    """

    def __init__(self, client: LocalClient, job: str, name: str, reply: Any) -> None:
        self._client = client
        self.job = job
        self.name = name
        self.params = Params.from_pb(reply.params)
        self.servers = {
            s.name: {
                "host": s.host,
                "version": int(s.version),
                "model": {t.name: (t.dtype, tuple(t.shape)) for t in s.model},
            }
            for s in reply.servers
        }
        self._base_versions: dict[str, int] = {}
        # update memfds, reused once their push resolved (the daemon reads them until then)
        self._buffers = MemfdPool(PUSH_POOL_BYTES, name="mlfabric-update")
        self._allreduce_seqs: dict[str, int] = {}
        self._allreduce_lock = threading.Lock()
        #: The random bits of stochastic rounding (int8) and random-k's positions; replace it
        #: (``numpy.random.default_rng(seed)``) to make pushes reproducible.
        self.rng = np.random.default_rng()
        self._job_auto = is_auto(self.params.compression)
        self._job_codec = None if self._job_auto else parse_codec(self.params.compression)
        #: server -> the codec the scheduler advises for this host's pushes there (``auto``)
        self._advice: dict[str, str] = {s.name: s.codec for s in reply.servers}
        self._feedback: dict[str, ErrorFeedback] = {}  # server -> residuals of its pushes
        #: Device staging (:class:`mlfabric.torch.staging.Stager`) for CUDA tensors; None: the
        #: process's default, created when a CUDA tensor first comes (tests inject a fake here).
        self.stager: Any = None

    def _staging(self, tensors: Tensors) -> Any:
        """The stager for ``tensors`` when any is on a device (CUDA), else None (host tensors)."""
        if self.stager is not None:
            return self.stager if any(self.stager.ops.is_device(v) for v in tensors.values()) else None
        if not any(getattr(v, "is_cuda", False) is True for v in tensors.values()):
            return None
        from mlfabric.torch.staging import default_stager

        return default_stager()

    def push(
        self,
        server: str,
        update: Tensors,
        norm: float | None = None,
        *,
        base_version: int | None = None,
        codec: object = None,
        error_feedback: bool = False,
    ) -> PushHandle:
        """Push an update to ``server`` (asynchronous; paper Table 1, ``push``).

        Parameters
        ----------
        server : str
            The server's name.
        update : dict
            name -> numpy array or torch tensor; names, shapes and dtypes must match the
            server's model (the daemon refuses the push otherwise, naming the tensor). CUDA
            tensors are copied to pinned host buffers on a side stream (the caller waits for
            that copy's event, not for its own stream; :mod:`mlfabric.torch.staging`).
        norm : float, optional
            The update's norm (for divergence bounds); default its L2 norm.
        base_version : int, optional
            The model version the update was computed from (0 or more); default the version
            of the last :meth:`get` from this server (0 before any).
        codec : str or codec, optional
            How the update travels (docs/compression.md): ``"none"``, ``"fp16"``, ``"bf16"``,
            ``"int8"`` (own scales per block of 256), ``"int8:bound=B"`` (one shared scale
            ``B / 127``, summed by aggregator hops without decoding; values beyond ``B`` are
            clipped), ``"topk:ratio=R"`` (the ``ceil(R x n)`` largest magnitudes of each tensor
            and their positions), ``"randk:ratio=R"`` (as many positions drawn from
            :attr:`rng`, rescaled by ``n/k``; ``rescale=0`` for error feedback), or a codec
            object of those; default the job's ``Params(compression=)``.
            ``"auto"`` (a job registered with ``Params(compression="auto")``; its default):
            the codec the scheduler chose for this host's pushes to ``server`` from the
            path's bandwidth and the job's error budget (:meth:`advised`; none until it says).
            float16/float32/float64 tensors are encoded (bfloat16 ones travel as they are);
            the server applies the decoded update (zeros outside a sparse tensor's positions).
            Stochastic int8 rounding and random-k's positions draw from :attr:`rng`.
        error_feedback : bool
            With a codec: add what the codec lost on this server's earlier pushes (the
            residual kept here per tensor name, :meth:`feedback`) to this update before
            encoding it, and keep what it loses now (Seide et al. 2014): the decoded pushes sum
            to the updates minus the last residual. A push with another codec starts afresh.
            Top-k: the residual is what was not sent; random-k needs ``rescale=0``.

        Returns
        -------
        PushHandle
            ``wait()`` gives APPLIED (delay, version) or DROPPED (reason); UNKNOWN (reason)
            when the server process went away after the update was handed to it and before
            its verdict, so whether it was applied cannot be known (never a false DROPPED).

        Raises
        ------
        ValueError
            An unknown codec or a bad codec parameter (naming it and the known codecs); a
            :class:`~mlfabric.aggregators.codecs.CodecError` (a ValueError) for a value the
            codec cannot carry (int8: NaN or infinity; fp16: beyond its range; top-k: NaN),
            naming the tensor; error feedback with a rescaled random-k. All before anything is
            sent.
        TypeError
            ``update`` is not a dict (mapping) of name -> tensor.
        TensorError
            A tensor of an unsupported dtype (checked before anything is sent).
        MlfabricError
            With code ``bad_tensor``: a tensor's name, shape or dtype differs from the
            server's model (checked before the update is copied; the message names the tensor
            and both shapes and dtypes). With code ``bad_request``: a negative
            ``base_version`` (named; the daemon refuses one too).

        Examples
        --------
        >>> worker = register_as_worker("job1")                       # doctest: +SKIP
        >>> r = worker.push("ps0", {"w": np.ones(3)}).wait(timeout=30)  # doctest: +SKIP
        >>> r.status, r.delay, r.version                               # doctest: +SKIP
        ('APPLIED', 0, 1)
        """
        base = self._base_versions.get(server, 0) if base_version is None else int(base_version)
        _check_base_version(base)
        chosen = self._codec(server, codec)
        self._check_update(server, update)
        feedback = self._feedback_for(server, chosen) if error_feedback else None
        stager = self._staging(update)
        if stager is None:
            return self._push(server, update, norm, base, chosen, feedback)
        # CUDA tensors: copied on a side stream into pinned buffers; only their event is waited for
        staged = stager.to_host(update)
        try:
            return self._push(server, staged.wait(), norm, base, chosen, feedback)
        finally:
            staged.release()  # the bytes are in the update's memfd now

    def _codec(self, server: str, codec: object) -> WireCodec | None:
        """The codec of a push to ``server``: ``codec``, else the job's; ``auto``: the advice."""
        if codec is None and not self._job_auto:
            return self._job_codec
        if codec is None or is_auto(codec):
            if not self._job_auto or (isinstance(codec, str) and codec.strip() != "auto"):
                raise ValueError(
                    f"codec {codec!r}: the scheduler chooses codecs for jobs registered with "
                    "Params(compression='auto') (its error budget: 'auto:budget=E,bound=B'), "
                    f"not for job {self.job!r} (compression {self.params.compression or 'none'!r}); "
                    "a push's 'auto' takes no parameters"
                )
            return parse_codec(self.advised(server))
        return parse_codec(codec)

    def advised(self, server: str) -> str:
        """The codec the scheduler advises for pushes to ``server`` (``""``: none), as last told.

        The daemon passes the scheduler's choice on at registration and with every accepted
        push, so a change reaches the push after the next one (docs/compression.md, ``auto``).
        """
        return self._advice.get(server, "")

    def feedback(self, server: str) -> ErrorFeedback | None:
        """The error feedback of pushes to ``server`` (its residual per tensor name), if any."""
        return self._feedback.get(server)

    def _feedback_for(self, server: str, codec: WireCodec | None) -> ErrorFeedback | None:
        """The error feedback of ``server``'s pushes with ``codec`` (a new one for a new codec)."""
        if codec is None:
            return None
        kept = self._feedback.get(server)
        if kept is None or kept.codec != codec:
            kept = self._feedback[server] = ErrorFeedback(codec)
        return kept

    def _push(
        self,
        server: str,
        update: Tensors,
        norm: float | None,
        base: int,
        codec: WireCodec | None,
        feedback: ErrorFeedback | None = None,
    ) -> PushHandle:
        if norm is None:
            norm = tcodec.l2_norm(update)
        if codec is None:
            words, encoded = update, None
        else:
            shared = isinstance(codec, RandomKCodec) and codec.shared  # the version's positions
            rng = version_rng(base) if shared else self.rng
            words, encoded = encode_update(update, codec, rng, feedback)
        buf, layouts, total, crc = tensorio.encode_pooled(self._buffers, words, crc=True, encoded=encoded)
        # lost connection: the daemon may still read the buffer, so it is never reused
        handle = PushHandle(server, on_final=lambda lost: buf.discard() if lost else buf.release())
        push = local_pb2.PushRequest(
            server=server,
            norm=float(norm),
            base_version=base,
            tensors=tcodec.layouts_to_pb(layouts),
            payload_bytes=total,
            has_payload=True,
            payload_crc32=crc,
            has_crc32=True,
        )
        request = local_pb2.LocalRequest(push=push)
        ids: list[int] = []

        def on_event(event: Any, event_fd: int | None) -> None:
            if event.WhichOneof("kind") == "push_accepted":  # the scheduler's codec now (auto)
                self._advice[server] = event.push_accepted.codec
            if handle._on_event(event, event_fd) and ids:
                self._client.forget(ids[0])

        try:
            ids.append(self._client.submit(request, on_event, buf.fd))
        except BaseException:
            buf.discard()
            raise
        if handle.done():
            self._client.forget(ids[0])
        return handle

    def _check_update(self, server: str, update: Any) -> None:
        """Refuse an update that is not a dict, or does not match the server's model, before any copy."""
        if not isinstance(update, Mapping):
            raise TypeError(
                f"push() takes the update as a dict of tensor name -> numpy array or torch tensor, "
                f"got {type(update).__name__}"
            )
        known = self.servers.get(server)
        if known is None:  # a server that joined after registration: its daemon checks
            return
        layouts = [
            tcodec.Layout(str(name), tcodec.dtype_name(value), tuple(value.shape), 0, 0)
            for name, value in update.items()
        ]
        problem = check_update(known["model"], layouts, f"server {server!r} of job {self.job!r}")
        if problem is not None:
            raise MlfabricError(problem, code="bad_tensor")

    def get(
        self,
        server: str,
        *,
        min_version: int | None = None,
        as_torch: bool = False,
        timeout: float | None = 60.0,
        device: Any = None,
    ) -> tuple[int, dict]:
        """The server's current model (paper Table 1, ``get``), or one at least ``min_version``.

        Parameters
        ----------
        server : str
            The server's name.
        min_version : int, optional
            A version floor: the model returned is never older. The daemon answers from its
            model cache when it holds a version at or above it (no transfer), else fetches one
            from its upstream (the server's daemon or a relay of the rack,
            docs/model-relays.md), waiting up to ``timeout`` for the server to publish one.
            Without it: the server's current model.
        as_torch : bool
            Return torch tensors instead of numpy arrays.
        timeout : float, optional
            Seconds to wait for the model (None: the daemon's default wait, 60 s, for a floor).
        device : str or torch.device, optional
            Return torch tensors on this device. A CUDA device: copied from pinned host
            buffers on a side stream; the caller's current stream waits for them (the host
            does not; :mod:`mlfabric.torch.staging`).

        Returns
        -------
        version : int
            The model version; later pushes use it as their base version.
        model : dict
            name -> tensor, in the server's dtypes: a model that travelled compressed
            (``Params(model_compression="fp16")``, docs/compression.md) is decoded here, each
            float32/float64 tensor the codec's rounding of the server's.

        Raises
        ------
        MlfabricError
            ``unavailable`` naming both versions when no model at or above ``min_version``
            came within ``timeout``; ``bad_request`` for a negative ``min_version``.

        Examples
        --------
        >>> version, model = worker.get("ps0")   # doctest: +SKIP
        >>> version, model["w"].dtype            # doctest: +SKIP
        (12, dtype('float32'))
        >>> version, model = worker.get("ps0", min_version=13)   # after a round  # doctest: +SKIP
        """
        get = local_pb2.GetRequest(server=server, wait_seconds=timeout or 0.0)
        if min_version is not None:
            get.min_version, get.has_min_version = int(min_version), True
        request = local_pb2.LocalRequest(get=get)
        # the daemon's own answer at the wait's end names the versions: give it time to come
        event, fd = self._client.call(request, timeout=None if timeout is None else timeout + 5.0)
        model = tensorio.from_fd(event.model.tensors, fd, as_torch=as_torch or device is not None)
        self._base_versions[server] = int(event.model.version)
        if device is not None:
            model = self._to_device(model, device)
        return int(event.model.version), model

    def _to_device(self, model: dict, device: Any) -> dict:
        import torch

        dev = torch.device(device)
        if dev.type == "cpu":
            return model
        if dev.type == "cuda":
            from mlfabric.torch.staging import default_stager

            return (self.stager or default_stager()).to_device(model, dev)
        return {k: v.to(dev) for k, v in model.items()}

    def allreduce_async(
        self,
        tensors: Tensors,
        *,
        world_size: int,
        name: str = "allreduce",
        timeout: float = ALLREDUCE_TIMEOUT,
    ) -> AllreduceHandle:
        """Start an all-reduce over ``world_size`` participants of this job (docs/allreduce.md).

        The participant is this worker (its name); see
        :meth:`mlfabric.allreduce.AllreduceGroup.allreduce_async` for the rules and errors.
        """
        with self._allreduce_lock:
            seq = self._allreduce_seqs[name] = self._allreduce_seqs.get(name, 0) + 1
        return submit_allreduce(
            self._client,
            self._buffers,
            job=self.job,
            participant=self.name,
            world_size=world_size,
            name=name,
            seq=seq,
            tensors=tensors,
            timeout=timeout,
        )

    def allreduce(
        self,
        tensors: Tensors,
        *,
        world_size: int,
        name: str = "allreduce",
        timeout: float = ALLREDUCE_TIMEOUT,
    ) -> dict:
        """The sum of ``tensors`` over ``world_size`` participants of this job (blocks)."""
        return self.allreduce_async(tensors, world_size=world_size, name=name, timeout=timeout).wait()

    def close(self) -> None:
        """Give up the worker role and close the connection."""
        self._client.close()
        self._buffers.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register_as_worker(
    job: str,
    params: Params | None = None,
    *,
    name: str | None = None,
    daemon: str | None = None,
    wait: float = 30.0,
) -> Worker:
    """Join ``job`` as a worker (paper Table 1, ``register_as_worker``).

    Parameters
    ----------
    job : str
        The job's name.
    params : Params, optional
        Unused by workers (the servers set the job's bounds); accepted for symmetry with the paper.
    name : str, optional
        The worker's name (default ``"<hostname>-<pid>"``).
    daemon : str, optional
        The daemon's socket; default ``$MLFABRIC_DAEMON``, else the default socket path.
    wait : float
        Seconds to wait for the job's servers to register (0: fail at once), so workers may
        start before their servers. When the job has no server yet, a WARNING on the
        ``mlfabric`` logger says so at once, naming the jobs the scheduler knows (a typo in
        the job's name shows there) and how long it waits.

    Returns
    -------
    Worker

    Raises
    ------
    MlfabricError
        No daemon at the socket, or the job has no servers after ``wait`` seconds
        (``unknown_job``, naming the known jobs).

    Examples
    --------
    >>> worker = register_as_worker("job1", name="w0", daemon="/tmp/w0.sock")  # doctest: +SKIP
    >>> sorted(worker.servers)                                                 # doctest: +SKIP
    ['ps0']
    """
    del params
    worker_name = name or f"{os.uname().nodename}-{os.getpid()}"

    def request(seconds: float) -> Any:
        register = local_pb2.RegisterWorkerRequest(job=job, name=worker_name, wait_seconds=seconds)
        return local_pb2.LocalRequest(register_worker=register)

    check_size(request(wait), "the worker registration")
    client = connect(daemon)
    try:
        try:  # first without waiting: a job without servers is said at once, not after `wait` s
            event, _ = client.call(request(0.0), timeout=30.0)
        except MlfabricError as exc:
            if exc.code != "unknown_job" or wait <= 0:
                raise
            _log.warning(
                "%s; waiting up to %g s for a server of job %r to register (register_as_worker(wait=...))",
                exc,
                wait,
                job,
            )
            event, _ = client.call(request(wait), timeout=wait + 30.0)
    except BaseException:
        client.close()
        raise
    return Worker(client, job, worker_name, event.registered)
