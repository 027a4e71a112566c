"""The character LM's roles through :class:`mlfabric.torch.DistributedOptimizer` (issue 25).

:mod:`mlfabric.examples.charlm` with ``--optimizer``: the same model, data and update rule, but
the way a PyTorch user writes it — a ``torch.nn.Module``, ``torch.optim.SGD(lr)`` wrapped by
:class:`~mlfabric.torch.DistributedOptimizer`, ``clip_grad_norm_(1.0)`` between backward and
``step()`` — and, on the server's side, :class:`~mlfabric.torch.GroupServers` (one mlfabric
server per parameter group, named ``"<name>.<i>"``). The optimizer pushes ``before - after``
of SGD's step, which is ``lr`` times the clipped gradient: the update
:func:`~mlfabric.examples.charlm.gradient_step` computes, so the runs compare with the
hand-written loop sample for sample. Gradient clipping changes the gradients after backward,
so the optimizer runs with ``wait_free=False`` (every group pushed by ``step()``); everything
else is its default (groups of :data:`~mlfabric.torch.GROUP_BYTES`, pipelined pulls).

Run next to the hosts' daemons::

    python -m mlfabric.examples.charlm server --name ps0 --optimizer --model-file /tmp/m.npz
    python -m mlfabric.examples.charlm worker --rank 0 --world 4 --steps 150 --optimizer
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import numpy as np

__all__ = ["build_module", "serve_groups", "train_with_optimizer"]


def build_module(config: Any, model: dict[str, Any]) -> Any:
    """A ``torch.nn.Module`` of ``config``'s shape holding ``model``'s tensors (copied).

    Examples
    --------
    >>> from mlfabric.examples.charlm import Config, init_model
    >>> cfg = Config(layers=1, d_model=16, heads=2, context=8)
    >>> module = build_module(cfg, init_model(cfg, seed=0))
    >>> sorted(dict(module.named_parameters())) == sorted(init_model(cfg, seed=0))
    True
    """
    import torch

    from mlfabric.examples.charlm import _skeleton

    module = copy.deepcopy(_skeleton(config))
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(torch.as_tensor(model[name]))
    return module


def serve_groups(args: argparse.Namespace, model: dict[str, Any], stop: Any, status: Any) -> dict[str, Any]:
    """Serve ``model`` as :class:`~mlfabric.torch.GroupServers` until ``stop`` is set; the final model.

    ``status(counts, final)`` is called with the servers' counts once they serve and at the end; a
    worker update counts once over its groups (each group's server applies one per step).
    """
    import torch

    import mlfabric
    from mlfabric.torch import GroupServers

    params = mlfabric.Params(tau_max=args.tau_max, sync_workers=args.sync_workers)
    named = [(name, torch.as_tensor(value)) for name, value in model.items()]
    with GroupServers(args.job, named, prefix=args.name, params=params, daemon=args.daemon) as servers:

        def counts() -> dict[str, Any]:
            groups = max(1, len(servers.servers))
            return {
                "payloads": servers.payloads // groups,
                "worker_updates": servers.worker_updates // groups,
                "aggregated": servers.aggregated // groups,
                "partial_rounds": servers.partial_rounds,
                "dropped": servers.dropped,
                "groups": groups,
                "mean_delay": float(np.mean(servers.delays)) if servers.delays else 0.0,
                "max_delay": max(servers.delays, default=0),
            }

        status(counts(), False)
        while not stop.wait(0.25):
            servers.check()
        final = {name: value.numpy().copy() for name, value in servers.model().items()}
        status(counts(), True)
    return final


def train_with_optimizer(args: argparse.Namespace, stop: Any) -> list[dict[str, Any]]:
    """``--steps`` steps of the user's loop through the optimizer; a record per group's push (its status)."""
    import torch

    import mlfabric
    from mlfabric.examples.charlm import _config, batches, init_model, load_data, shard
    from mlfabric.examples.digits import start_together
    from mlfabric.torch import DistributedOptimizer

    torch.set_num_threads(1)
    config = _config(args)
    train, _ = load_data(args.budget)
    mine = shard(train, args.rank, args.world)
    rng = np.random.default_rng(1000 * args.seed + args.rank)
    module = build_module(config, init_model(config, args.seed))  # replaced by the servers' model
    worker = mlfabric.register_as_worker(args.job, name=f"worker{args.rank}", daemon=args.daemon, wait=60.0)
    sgd = torch.optim.SGD(module.parameters(), lr=args.lr)
    opt = DistributedOptimizer(
        sgd,
        module.named_parameters(),
        worker,
        mode="sync" if args.sync else "async",
        prefix=args.server,
        wait_free=False,  # the gradients are clipped after backward
        on_drop="count",
        timeout=args.push_timeout,
    )
    with worker:
        opt.pull()  # warm up (imports, connections) before the clock starts
        start_together(args, stop)
        opt.pull()
        while not stop.is_set() and opt.steps < args.steps:
            x, y = batches(mine, config.context, args.batch, rng)
            opt.zero_grad()
            logits = module(x)
            torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab), y.reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
        opt.close()
    unresolved = opt.pushed - opt.applied - opt.dropped  # none: an UNKNOWN verdict raises in step()
    statuses = ["APPLIED"] * opt.applied + ["DROPPED"] * opt.dropped + ["UNKNOWN"] * unresolved
    return [{"status": status} for status in statuses]  # one per group's push
