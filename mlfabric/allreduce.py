"""All-reduce through mlfabric (paper Table 1, ``AllReduce``; docs/allreduce.md).

Every participant of a job calls :meth:`AllreduceGroup.allreduce` with the same tensors'
names, dtypes and shapes; each gets the element-wise sum over all participants. The daemons
execute it as a reduction tree up and a broadcast down that the scheduler plans from the
bandwidth graph::

    import mlfabric

    group = mlfabric.join_allreduce("job1", world_size=4)        # no server needed
    total = group.allreduce({"w": grad})                          # blocks; the sum
    handle = group.allreduce_async({"w": grad}); ...; total = handle.wait(timeout=60)

A :class:`~mlfabric.api.Worker` of a parameter-server job can all-reduce too
(``worker.allreduce(tensors, world_size=N)``).

Participants that share a ``torch.distributed`` process group pass it
(``join_allreduce(..., process_group=group)``): the plan then runs in the processes
themselves over that group (the group's own collective where it is at least as fast, else
mlfabric's tree through its point-to-point operations), kept between calls, with no daemon
and no scheduler round trip per call (:mod:`mlfabric.torch.executor`, docs/allreduce.md).

Calls are matched by ``(name, sequence number)``: each participant numbers its calls of one
name 1, 2, 3, ... so the ``k``-th call of every participant is one operation. Errors
(:class:`~mlfabric.localclient.MlfabricError`, by ``code``): ``allreduce_mismatch`` (another
participant's tensors or world size differ; the message names both), ``allreduce_peer_lost``
(a participant's process or daemon went away), ``allreduce_timeout`` (no result within the
timeout: a participant never came), ``allreduce_failed``, ``bad_tensor``, ``unavailable`` (no
scheduler).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Mapping
from typing import Any

from mlfabric import tensorio
from mlfabric import tensors as tcodec
from mlfabric.localclient import LocalClient, MlfabricError, connect
from mlfabric.proto.v1 import local_pb2
from mlfabric.wire.memfd import MemfdPool

__all__ = ["DEFAULT_TIMEOUT", "AllreduceGroup", "AllreduceHandle", "join_allreduce", "submit_allreduce"]

#: Seconds an all-reduce waits for its result by default (the participant's deadline).
DEFAULT_TIMEOUT = 60.0


class AllreduceHandle:
    """An all-reduce in flight; :meth:`wait` gives the sum.

    Attributes
    ----------
    name : str
    seq : int
    plan : str
        The tree the scheduler chose (once done).
    """

    def __init__(self, name: str, seq: int, as_torch: bool, on_final: Any) -> None:
        self.name, self.seq, self.plan = name, seq, ""
        self._as_torch = as_torch
        self._on_final = on_final
        self._done = threading.Event()
        self._result: dict[str, Any] | None = None
        self._error: MlfabricError | None = None
        self._callbacks: list[Any] = []
        self._callback_lock = threading.Lock()

    def done(self) -> bool:
        """True once the sum (or an error) is in."""
        return self._done.is_set()

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(handle)`` once the sum (or an error) is in (at once if it already is).

        It runs on the connection's reader thread: keep it short.
        """
        with self._callback_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the sum is in.

        Parameters
        ----------
        timeout : float, optional
            Seconds (None: until the operation's own deadline resolves it).

        Returns
        -------
        dict
            name -> the sum (numpy arrays, or torch tensors when the input was torch).

        Raises
        ------
        MlfabricError
            The operation failed (``code`` says why, the message names the problem).
        TimeoutError
            No result within ``timeout`` (the operation goes on).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"all-reduce {self.name!r}#{self.seq}: no result within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _on_event(self, event: Any, fd: int | None) -> None:
        kind = event.WhichOneof("kind")
        result: dict[str, Any] | None = None
        error: MlfabricError | None = None
        plan = ""
        if kind == "allreduce_result":
            r = event.allreduce_result
            try:
                result = tensorio.from_fd(r.tensors, fd, as_torch=self._as_torch)
            except (OSError, ValueError) as exc:
                error = MlfabricError(f"all-reduce {self.name!r}#{self.seq}: bad result: {exc}", "bad_reply")
            plan = r.plan
        else:
            if fd is not None:
                os.close(fd)
            code, message = (
                (event.error.code, event.error.message) if kind == "error" else ("bad_reply", kind)
            )
            error = MlfabricError(message, code=code)
        self._finish(result, error, plan)

    def _finish(self, result: dict[str, Any] | None, error: MlfabricError | None, plan: str) -> None:
        """Resolve the handle with the sums or an error (once), then run the callbacks."""
        self._result, self._error, self.plan = result, error, plan
        with self._callback_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        self._on_final(self._error is not None)
        for fn in callbacks:
            fn(self)


def submit_allreduce(
    client: LocalClient,
    pool: MemfdPool,
    *,
    job: str,
    participant: str,
    world_size: int,
    name: str,
    seq: int,
    tensors: Mapping[str, Any],
    timeout: float,
) -> AllreduceHandle:
    """Send one ``AllreduceRequest`` on ``client`` and return its handle (shared by the API's callers)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(
            "allreduce() takes a dict of tensor name -> numpy array or torch tensor, "
            f"got {type(tensors).__name__}"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    as_torch = any(tcodec._is_torch(v) for v in tensors.values())
    buf, layouts, total = tensorio.encode_pooled(pool, tensors)
    ids: list[int] = []

    def on_final(failed: bool) -> None:
        if ids:
            client.forget(ids[0])
        if failed:
            buf.discard()  # the daemon may still read it
        else:
            buf.release()

    handle = AllreduceHandle(name, seq, as_torch, on_final)
    request = local_pb2.LocalRequest(
        allreduce=local_pb2.AllreduceRequest(
            job=job,
            name=name,
            seq=seq,
            participant=participant,
            world_size=world_size,
            tensors=tcodec.layouts_to_pb(layouts),
            payload_bytes=total,
            has_payload=True,
            timeout_seconds=timeout,
        )
    )
    try:
        ids.append(client.submit(request, handle._on_event, buf.fd))
    except BaseException:
        buf.discard()
        raise
    if handle.done():
        client.forget(ids[0])
    return handle


class AllreduceGroup:
    """A participant of a job's all-reduces. Create with :func:`join_allreduce`.

    Attributes
    ----------
    job, participant : str
    world_size : int
    executor : GroupExecutor or None
        Runs the all-reduces over the participants' process group (None: the daemons run them).
    """

    def __init__(self, client: LocalClient, job: str, participant: str, world_size: int) -> None:
        self._client = client
        self.job, self.participant, self.world_size = job, participant, world_size
        self._seqs: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()
        self._buffers = MemfdPool(1 << 30, name="mlfabric-allreduce")
        self.executor: Any = None

    def _next_seq(self, name: str) -> int:
        with self._lock:
            return next(self._seqs.setdefault(name, itertools.count(1)))

    def run_over(self, process_group: Any, timeout: float) -> None:
        """Run this participant's all-reduces over ``process_group`` (collective: every rank calls it).

        Needs torch (:mod:`mlfabric.torch.executor`).
        """
        from mlfabric.torch.executor import GroupExecutor

        executor = GroupExecutor(process_group, self._plan, timeout=timeout)
        self._client.set_unsolicited(self._pushed_plan)
        executor.start()
        if executor.world_size != self.world_size:
            executor.stop()
            raise ValueError(
                f"world_size {self.world_size} but the process group has {executor.world_size} ranks"
            )
        self.executor = executor

    def _plan(self, name: str, layouts: Any, signature: int, rank: int) -> Any:
        """Ask the scheduler (through the daemon) for the plan of a process-group operation."""
        seq = self._next_seq(name)
        request = local_pb2.LocalRequest(
            allreduce=local_pb2.AllreduceRequest(
                job=self.job,
                name=name,
                seq=seq,
                participant=self.participant,
                world_size=self.world_size,
                tensors=tcodec.layouts_to_pb(layouts),
                payload_bytes=sum(x.nbytes for x in layouts),
                has_payload=False,
                timeout_seconds=self.executor.timeout,
                plan_only=True,
                process_rank=rank,
                signature=signature,
            )
        )
        try:
            event, fd = self._client.call(request, timeout=self.executor.timeout + 5.0)
        except TimeoutError as exc:
            raise MlfabricError(f"all-reduce {name!r}: no plan: {exc}", "allreduce_timeout") from exc
        if fd is not None:
            os.close(fd)
        if event.WhichOneof("kind") != "allreduce_plan":
            kind = event.WhichOneof("kind")
            raise MlfabricError(f"all-reduce {name!r}: unexpected reply {kind!r}", "bad_reply")
        return rank_plan(event.allreduce_plan)

    def _pushed_plan(self, event: Any, fd: int | None) -> None:
        """A newer plan the scheduler pushed (the bandwidth graph changed): kept for the next calls."""
        if fd is not None:
            os.close(fd)
        if event.WhichOneof("kind") == "allreduce_plan" and self.executor is not None:
            p = event.allreduce_plan
            self.executor.on_plan(p.name, int(p.signature), rank_plan(p))

    def allreduce_async(
        self,
        tensors: Mapping[str, Any],
        *,
        name: str = "allreduce",
        timeout: float = DEFAULT_TIMEOUT,
        inplace: bool = False,
        trusted: bool = False,
    ) -> AllreduceHandle:
        """Start an all-reduce of ``tensors``; ``wait()`` on the handle gives the sum.

        Parameters
        ----------
        tensors : dict
            name -> numpy array or torch tensor (float32, float16, bfloat16, float64); the same
            names, dtypes and shapes at every participant.
        name : str
            Operations are matched by name and per-name sequence number.
        timeout : float
            The operation's deadline at this participant (seconds; over a process group the
            group's timeout, given to :func:`join_allreduce`, applies).
        inplace : bool
            Over a process group, torch tensors may be summed into (a DDP bucket: no copy).
        trusted : bool
            Over a process group: every participant's tensors of this ``name`` agree by
            construction (DDP's buckets), so they are compared only every few calls
            (:data:`mlfabric.torch.executor.AGREE_EVERY`). Anything else must not pass it: a
            mismatch between those checks would abort the processes in the native collective.
        """
        if self.executor is not None:
            return self.executor.submit(name, tensors, seq=0, inplace=inplace, trusted=trusted)
        seq = self._next_seq(name)
        return submit_allreduce(
            self._client,
            self._buffers,
            job=self.job,
            participant=self.participant,
            world_size=self.world_size,
            name=name,
            seq=seq,
            tensors=tensors,
            timeout=timeout,
        )

    def allreduce(
        self, tensors: Mapping[str, Any], *, name: str = "allreduce", timeout: float = DEFAULT_TIMEOUT
    ) -> dict[str, Any]:
        """The sum of ``tensors`` over the job's participants (blocks; see :meth:`allreduce_async`).

        Examples
        --------
        >>> group = join_allreduce("job1", world_size=2, participant="r0")   # doctest: +SKIP
        >>> group.allreduce({"w": np.ones(3)})["w"].tolist()                 # doctest: +SKIP
        [2.0, 2.0, 2.0]
        """
        return self.allreduce_async(tensors, name=name, timeout=timeout).wait()

    def close(self) -> None:
        """Close the connection (operations in flight fail at the other participants)."""
        if self.executor is not None:
            self.executor.stop()
        self._client.close()
        self._buffers.close()

    def __enter__(self) -> AllreduceGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def join_allreduce(
    job: str,
    world_size: int,
    *,
    participant: str | None = None,
    daemon: str | None = None,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> AllreduceGroup:
    """Take part in the all-reduces of ``job`` (no parameter server needed).

    Parameters
    ----------
    job : str
        The job's name.
    world_size : int
        Participants of every all-reduce (all must say the same).
    participant : str, optional
        Unique in the job (default ``"<hostname>-<pid>"``).
    daemon : str, optional
        The daemon's socket (default ``$MLFABRIC_DAEMON``, else the default path).
    process_group : torch.distributed.ProcessGroup, optional
        The participants' process group (its size is ``world_size``): run the all-reduces in
        the processes over it (needs torch; collective: every rank of the default group calls
        ``join_allreduce`` at the same point, since mlfabric makes a group of its own).
    timeout : float
        Over a process group: seconds any operation of the group may wait (its timeout).

    Returns
    -------
    AllreduceGroup
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    client = connect(daemon)
    group = AllreduceGroup(client, job, participant or f"{os.uname().nodename}-{os.getpid()}", world_size)
    if process_group is not None:
        try:
            group.run_over(process_group, timeout)
        except BaseException:
            group.close()
            raise
    return group


def rank_plan(p: Any) -> Any:
    """A :class:`~mlfabric.torch.collective.RankPlan` from an ``AllreducePlan`` message."""
    from mlfabric.torch.collective import RankPlan

    if p.kind == "tree":
        parent = {r: (None if q < 0 else int(q)) for r, q in enumerate(p.parent_ranks)}
        return RankPlan.tree(parent, chunk_bytes=int(p.chunk_bytes), epoch=int(p.epoch), description=p.plan)
    return RankPlan.native(epoch=int(p.epoch), description=p.plan)
