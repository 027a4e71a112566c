"""Post-local SGD on mlfabric's all-reduce: torch's state and schedule, mlfabric's transport.

PyTorch ships post-local SGD as a DDP communication hook (``post_localSGD_hook`` with a
``PostLocalSGDState``: every step's gradients all-reduced for the first
``start_localSGD_iter`` steps, then local steps) and a model averager
(``PeriodicModelAverager``: from ``warmup_steps`` on, the parameters averaged every
``period`` steps). Both reach the other ranks through a torch process group. This module
keeps torch's state object and its schedule and moves the bytes through mlfabric
(issue 26): the gradient all-reduce of the first steps by :func:`mlfabric.torch.allreduce_hook`
(the scheduler's reduction trees), the periodic averaging of the parameters by
:meth:`~mlfabric.allreduce.AllreduceGroup.allreduce` — so on a heterogeneous network the
averaging takes the trees the scheduler plans from the bandwidth graph, and between
averagings nothing crosses the network.

Usage, for a DDP model (``group`` from :func:`mlfabric.join_allreduce`)::

    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
    import mlfabric.torch as mt

    state = mt.LocalSGDState(PostLocalSGDState(None, None, start_localSGD_iter=K,
                                               post_local_gradient_allreduce=False),
                             mt.HookState(group))
    model.register_comm_hook(state, mt.post_local_sgd_hook)
    averager = mt.PeriodicModelAverager(group, period=H, warmup_steps=K)
    for batch in data:
        ...; loss.backward(); optimizer.step()
        averager.average_parameters(model.parameters())

which trains exactly as torch's own hook and averager over a process group do
(``tests/allreduce/test_local_sgd.py`` compares them step for step).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
from torch.distributed.algorithms.model_averaging.utils import get_params_to_average

from mlfabric.allreduce import DEFAULT_TIMEOUT, AllreduceGroup
from mlfabric.torch.hook import HookState, allreduce_hook

__all__ = ["LocalSGDState", "PeriodicModelAverager", "post_local_sgd_hook"]


@dataclass
class LocalSGDState:
    """What :func:`post_local_sgd_hook` needs: torch's post-local SGD state and mlfabric's hook state.

    Attributes
    ----------
    torch_state : PostLocalSGDState
        torch's state (``start_localSGD_iter``, the step counter ``iter``). Its
        ``process_group`` is not used; ``post_local_gradient_allreduce`` must be False (the
        intra-node gradient all-reduce after the switch is not offered here).
    hook : HookState
        The rank's all-reduce group for the first steps' gradients
        (:class:`mlfabric.torch.HookState`).
    """

    torch_state: PostLocalSGDState
    hook: HookState

    def __post_init__(self) -> None:
        if self.torch_state.post_local_gradient_allreduce:
            raise ValueError(
                "post_local_gradient_allreduce=True (an all-reduce within each node after the switch) "
                "is not offered by mlfabric's post-local SGD hook; pass False (local steps, "
                "then PeriodicModelAverager)"
            )


def post_local_sgd_hook(state: LocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: torch's post-local SGD with the first steps all-reduced by mlfabric.

    For the first ``start_localSGD_iter`` steps the bucket is averaged over the ranks by
    :func:`mlfabric.torch.allreduce_hook` (torch's step counter advancing at each step's
    last bucket, as torch's ``post_localSGD_hook`` does); afterwards the local gradient is
    used as it is.

    Parameters
    ----------
    state : LocalSGDState
        Given to ``register_comm_hook``.
    bucket : torch.distributed.GradBucket
        DDP's bucket.

    Returns
    -------
    torch.futures.Future
        The averaged bucket (first steps) or the bucket itself.
    """
    ts = state.torch_state
    if ts.iter < ts.start_localSGD_iter:
        ts.maybe_increase_iter(bucket)
        return allreduce_hook(state.hook, bucket)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class PeriodicModelAverager(ModelAverager):
    """torch's ``PeriodicModelAverager`` with the parameters averaged by mlfabric's all-reduce.

    From ``warmup_steps`` on, every ``period`` calls of :meth:`average_parameters` average
    the parameters over the group's ranks (one all-reduce of all of them, flattened); the
    step counting is torch's.

    Parameters
    ----------
    group : AllreduceGroup
        From :func:`mlfabric.join_allreduce` (every rank of the job).
    period : int
        Steps between two averagings (>= 1; 1 averages every step).
    warmup_steps : int
        Steps before the first averaging (post-local SGD's ``start_localSGD_iter``).
    timeout : float
        Seconds an averaging may take before it raises.
    """

    def __init__(
        self, group: AllreduceGroup, period: int, warmup_steps: int = 0, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        if period < 1:
            raise ValueError(f"period must be a positive integer, got {period}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        # torch's base holds the step counter and a process group, which is not used here (its
        # constructor would ask for torch's default group)
        self.process_group = None  # type: ignore[assignment]
        self.step = 0
        self.group, self.period, self.warmup_steps, self.timeout = group, period, warmup_steps, timeout
        self.averagings = 0

    def average_parameters(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> None:
        """Average ``params`` (a model's parameters or an optimizer's groups) when the step is due."""
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            tensors = [p.data for p in get_params_to_average(params)]
            if tensors:
                flat = torch.cat([t.reshape(-1) for t in tensors])
                name = f"model-average-{self.averagings}"
                total = self.group.allreduce({"params": flat}, name=name, timeout=self.timeout)["params"]
                total = torch.as_tensor(total).div_(self.group.world_size)
                offset = 0
                for t in tensors:
                    n = t.numel()
                    t.copy_(total[offset : offset + n].view_as(t))
                    offset += n
                self.averagings += 1
        self.step += 1
