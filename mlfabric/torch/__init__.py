"""PyTorch integration: a DDP communication hook that all-reduces gradient buckets through mlfabric.

torch is an optional extra (``pip install mlfabric[torch]``); :mod:`mlfabric` imports without
it, and this module raises ``ImportError`` naming the extra when torch is missing.

An existing DDP script switches its gradient all-reduce to mlfabric with one line (DDP still
needs a process group for its own setup — the initial broadcast of the parameters —, for
which gloo serves)::

    import torch.distributed as dist
    import mlfabric, mlfabric.torch

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(net)
    group = mlfabric.join_allreduce("job1", world_size=world, participant=f"rank{rank}")
    model.register_comm_hook(mlfabric.torch.HookState(group), mlfabric.torch.allreduce_hook)

Each bucket is summed by the daemons' reduction tree (docs/allreduce.md) and divided by the
world size, which is what DDP expects of a hook (its default hook averages). Buckets are
matched across ranks by their index (operation name ``ddp-bucket-<index>``, one sequence
number per call), so every rank must build the same buckets — as DDP does for identical models.
"""

try:
    import torch  # noqa: F401 - only that it imports: named in the error below when it does not
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "mlfabric.torch needs PyTorch: pip install 'mlfabric[torch]' (see the README for the CPU build)"
    ) from exc

from mlfabric.torch.groups import GroupServers, plan_groups
from mlfabric.torch.hook import HookState, allreduce_hook
from mlfabric.torch.launch import Context, exit_rank, init
from mlfabric.torch.localsgd import LocalSGDState, PeriodicModelAverager, post_local_sgd_hook
from mlfabric.torch.optimizer import DistributedOptimizer
from mlfabric.torch.staging import Stager

__all__ = [
    "Context",
    "DistributedOptimizer",
    "GroupServers",
    "HookState",
    "LocalSGDState",
    "PeriodicModelAverager",
    "Stager",
    "allreduce_hook",
    "exit_rank",
    "init",
    "plan_groups",
    "post_local_sgd_hook",
]
