"""The DDP communication hook that all-reduces gradient buckets through mlfabric (:mod:`mlfabric.torch`).

:func:`allreduce_hook` and its state live here so that the hooks built on it
(:mod:`mlfabric.torch.localsgd`) import it directly; :mod:`mlfabric.torch` re-exports both.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects
# (``bucket: dist.GradBucket``, returning ``torch.futures.Future[torch.Tensor]``).
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mlfabric.allreduce import DEFAULT_TIMEOUT, AllreduceGroup
from mlfabric.localclient import MlfabricError
from mlfabric.torch.staging import Stager, default_stager

__all__ = ["HookState", "allreduce_hook"]


@dataclass
class HookState:
    """What :func:`allreduce_hook` needs: the rank's all-reduce group and the per-bucket deadline.

    Attributes
    ----------
    group : AllreduceGroup
        From :func:`mlfabric.join_allreduce` (its ``world_size`` is DDP's).
    timeout : float
        Seconds each bucket's all-reduce may take before it fails (the future then carries
        the :class:`~mlfabric.MlfabricError`, and DDP's backward raises it).
    """

    group: AllreduceGroup
    timeout: float = DEFAULT_TIMEOUT
    #: CUDA buckets over the daemons: their staging (default :func:`default_stager`; tests inject a fake)
    stager: Stager | None = None


def allreduce_hook(
    state: HookState | AllreduceGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over the ranks by mlfabric.

    Parameters
    ----------
    state : HookState or AllreduceGroup
        Given to ``register_comm_hook``.
    bucket : torch.distributed.GradBucket
        DDP's bucket (its flat ``buffer()``).

    Returns
    -------
    torch.futures.Future
        Completed with a tensor of the buffer's shape and dtype: the sum over the ranks divided
        by the world size; or with the error of the all-reduce.
    """
    if isinstance(state, AllreduceGroup):
        state = HookState(state)
    buffer = bucket.buffer()
    world = state.group.world_size
    stager = state.stager or (default_stager() if buffer.is_cuda else None)
    if state.group.executor is None and stager is not None and stager.ops.is_device(buffer):
        return _staged_hook(state, stager, buffer, bucket.index())
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    handle = state.group.allreduce_async(
        {"bucket": buffer.detach()},
        name=f"ddp-bucket-{bucket.index()}",
        timeout=state.timeout,
        inplace=True,
        trusted=True,  # DDP verifies its parameters across ranks and builds the same buckets
    )

    def done(h: Any) -> None:
        try:
            total = h.wait(0)["bucket"]
        except (MlfabricError, TimeoutError) as exc:  # handed to DDP through the future
            future.set_exception(exc)  # type: ignore[arg-type]  # torch stubs type it as the value
            return
        future.set_result(total.view_as(buffer).div_(world))

    handle.add_done_callback(done)
    return future


_STAGING_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlfabric-ddp-staging")


def _staged_hook(
    state: HookState, stager: Stager, buffer: torch.Tensor, index: int
) -> torch.futures.Future[torch.Tensor]:
    """A device bucket over the daemons: to pinned host memory on a side stream, summed, and back.

    The hook returns at once; a helper thread waits for the copy's event (not the training
    stream), starts the all-reduce, and the sum goes back to the device on the side stream. The
    future is a CUDA-aware one (``devices=``): DDP's use of the result waits for it on the device.
    """
    world = state.group.world_size
    devices: list[int | str | torch.device] | None = [buffer.device] if buffer.is_cuda else None
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    staged = stager.to_host({"bucket": buffer.detach()})

    def done(h: Any) -> None:
        try:
            total = h.wait(0)["bucket"]
        except (MlfabricError, TimeoutError) as exc:
            future.set_exception(exc)  # type: ignore[arg-type]  # torch stubs type it as the value
            return
        finally:
            staged.release()
        back = stager.to_device({"bucket": torch.as_tensor(total)}, buffer.device)["bucket"]
        future.set_result(back.view_as(buffer).div_(world))

    def start() -> None:
        try:
            handle = state.group.allreduce_async(
                staged.wait(), name=f"ddp-bucket-{index}", timeout=state.timeout, trusted=True
            )
        except MlfabricError as exc:
            staged.release()
            future.set_exception(exc)  # type: ignore[arg-type]
            return
        handle.add_done_callback(done)

    _STAGING_THREAD.submit(start)
    return future
