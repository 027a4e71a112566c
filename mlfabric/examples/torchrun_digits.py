"""The digits MLP trained with :class:`mlfabric.torch.DistributedOptimizer`, launched by torchrun.

One script for every rank: rank 0 serves the model (one mlfabric server per parameter group),
the other ranks train it. Each process talks to its host's mlfabric daemon
(``MLFABRIC_DAEMON`` or ``--daemon``)::

    MLFABRIC_DAEMON=/run/mlfabric/daemon.sock \\
        torchrun --standalone --nnodes 1 --nproc-per-node 4 \\
        -m mlfabric.examples.torchrun_digits --steps 50 --out /tmp/digits-run

Every rank writes ``<out>/rank<R>.json``: the server its applied counts and the ids of the
updates it applied, a worker its pushes and their verdicts. The training loop of a worker
is the plain PyTorch one; the optimizer is wrapped once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.examples.digits import load_data

__all__ = ["build_model", "main"]


def build_model(hidden: int, seed: int) -> Any:
    """The digits MLP (64 -> hidden -> 10) as a ``torch.nn.Module``, identically seeded on every rank."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def _accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(dim=1).numpy() == y).mean())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """This rank's part: serve, or train ``--steps`` steps; what it did."""
    import torch

    import mlfabric
    import mlfabric.torch as mtorch

    torch.set_num_threads(1)  # the ranks share this machine's cores
    ctx = mtorch.init(args.job, server_ranks=args.server_ranks, daemon=args.daemon)
    model = build_model(args.hidden, args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    workers = len(ctx.worker_ranks)
    if ctx.is_server:
        params = mlfabric.Params(tau_max=args.tau_max, sync_workers=workers if args.mode == "sync" else 0)
        with ctx.serve(model.named_parameters(), params=params, group_bytes=args.group_bytes) as servers:
            ctx.barrier()  # registered: the workers may join
            ctx.barrier()  # every worker is done
            servers.check()
            served = servers.model()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in served:
                        p.copy_(served[name])
            return {
                "rank": ctx.rank,
                "role": "server",
                "servers": [s.name for s in servers.servers],
                "applied": servers.applied,
                "dropped": servers.dropped,
                "worker_updates": servers.worker_updates,
                "update_ids": servers.update_ids,
                "accuracy": _accuracy(model, x_test, y_test) if len(ctx.server_ranks) == 1 else None,
            }
    ctx.barrier()
    worker = ctx.register_worker()
    opt = mtorch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum),
        model.named_parameters(),
        worker,
        mode=args.mode,
        group_bytes=args.group_bytes,
        wait_free=not args.in_step,
        on_drop="count",
    )
    shard = np.arange(len(x_train))[ctx.worker_index :: workers]
    rng = np.random.default_rng(1000 + ctx.rank)
    update_ids: list[str] = []
    opt.pull()
    started = time.monotonic()
    for _ in range(args.steps):
        batch = rng.choice(shard, size=args.batch_size)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(torch.from_numpy(x_train[batch])), torch.from_numpy(y_train[batch])
        )
        loss.backward()
        opt.step()
        update_ids += [r.update_id for r in opt.last_results]
    seconds = time.monotonic() - started
    opt.close()
    worker.close()
    ctx.barrier()
    return {
        "rank": ctx.rank,
        "role": "worker",
        "steps": opt.steps,
        "pushed": opt.pushed,
        "applied": opt.applied,
        "dropped": opt.dropped,
        "update_ids": update_ids,
        "seconds": seconds,
        "loss": loss.item(),
    }


def build_parser() -> argparse.ArgumentParser:
    """The example's command line."""
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m mlfabric.examples.torchrun_digits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--daemon", help="this host's daemon socket (default: $MLFABRIC_DAEMON)")
    parser.add_argument("--job", default="torchrun-digits")
    parser.add_argument("--server-ranks", type=int, nargs="+", default=[0])
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--group-bytes", type=int, default=0, help="bytes per parameter group (0: one per tensor)"
    )
    parser.add_argument("--tau-max", type=int, default=None)
    parser.add_argument("--in-step", action="store_true", help="push in step() (for clipping/GradScaler)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write <out>/rank<R>.json")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (every rank)."""
    from mlfabric.localclient import MlfabricError

    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except MlfabricError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{result['rank']}.json").write_text(json.dumps(result))
    print(
        f"rank {result['rank']} ({result['role']}): "
        + ", ".join(f"{k} {v}" for k, v in result.items() if k not in ("rank", "role", "update_ids")),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
