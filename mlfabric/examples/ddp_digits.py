"""DDP training on scikit-learn's bundled digits, gradients all-reduced by mlfabric (or by gloo).

The same script trains with PyTorch's ``DistributedDataParallel`` either way; ``--comm
mlfabric`` adds the one line that sends every gradient bucket through mlfabric's all-reduce
(:func:`mlfabric.torch.allreduce_hook`): planned by the scheduler from the bandwidth graph and
run over the ranks' process group (gloo's own all-reduce where the graph is uniform,
mlfabric's tree through gloo's point-to-point operations where that is faster), with the plan
kept between steps. ``--comm mlfabric-daemons`` runs the same plans through the daemons
instead (no process group needed by the hook), ``--comm gloo`` leaves DDP's own gloo
all-reduce. DDP's setup (the initial broadcast of the parameters) uses gloo in every case.
Nothing is downloaded (``load_digits`` ships inside scikit-learn).

One rank per process, next to its host's daemon (``MLFABRIC_DAEMON`` or ``--daemon``)::

    python -m mlfabric.examples.ddp_digits rank --rank 0 --world-size 2 \\
        --init-method file:///tmp/ddp-store --comm mlfabric --out /tmp/rank0.npz
    python -m mlfabric.examples.ddp_digits rank --rank 1 ...

or everything on this machine (a scheduler and one daemon per rank on loopback)::

    python -m mlfabric.examples.ddp_digits launch --world-size 2 --comm mlfabric

Every rank trains on its own shard with the same seeded batches, so a run with mlfabric and
one with gloo start from the same parameters and see the same buckets: their final
parameters agree to float32 rounding (``tests/allreduce/test_ddp_hook.py``).

``--compress fp16`` sends the buckets as half-precision floats the way torch composes
compression with any hook: ``fp16_compress_wrapper(mlfabric.torch.allreduce_hook)``
(torch's own wrapper around mlfabric's hook; with ``--comm gloo`` torch's
``fp16_compress_hook``), half the bytes per all-reduce (docs/allreduce.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.examples.digits import load_data

#: Who all-reduces the buckets: mlfabric over the process group, mlfabric's daemons, or gloo.
COMMS = ("mlfabric", "mlfabric-daemons", "gloo")
#: What ``--compress`` takes: the bucket cast to this dtype around the hook (torch's wrapper;
#: torch's bf16 wrapper needs CUDA 11+ and NCCL 2.10+, DDP refuses it on CPU).
COMPRESS = ("fp16",)

__all__ = ["build_model", "launch", "main", "train_rank"]


def build_model(seed: int, hidden: int = 32) -> Any:
    """The MLP 64 -> hidden -> 10, initialised from ``seed``."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def train_rank(
    *,
    rank: int,
    world_size: int,
    init_method: str,
    comm: str,
    steps: int,
    batch: int = 32,
    lr: float = 0.1,
    seed: int = 0,
    bucket_cap_mb: float = 0.004,
    job: str = "ddp-digits",
    daemon: str | None = None,
    local_sgd: tuple[int, int] | None = None,
    compress: str | None = None,
) -> dict[str, Any]:
    """Train one rank for ``steps`` SGD steps; return its final parameters, accuracy and time.

    Parameters
    ----------
    comm : {"mlfabric", "mlfabric-daemons", "gloo"}
        Who all-reduces the gradient buckets.
    bucket_cap_mb : float
        DDP's bucket size (small by default, so the tiny model still has several buckets).
    local_sgd : (int, int), optional
        Post-local SGD ``(K, H)``: gradients all-reduced for the first ``K`` steps, then local
        steps with the parameters averaged every ``H`` steps — torch's hook and averager over
        gloo (``gloo``), or the same schedule over mlfabric (:mod:`mlfabric.torch.localsgd`).
    compress : {"fp16"}, optional
        The buckets all-reduced as float16: torch's ``fp16_compress_wrapper`` around the hook
        (mlfabric's or, with ``gloo``, torch's ``allreduce_hook``). Not with ``local_sgd``.
    """
    import torch
    import torch.distributed as dist

    if comm not in COMMS:
        raise ValueError(f"--comm must be one of {COMMS}, got {comm!r}")
    if compress is not None and compress not in COMPRESS:
        raise ValueError(f"--compress must be one of {COMPRESS}, got {compress!r}")
    if compress is not None and local_sgd is not None:
        raise ValueError("--compress and --local-sgd do not combine (local SGD's averaging is not a hook)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    group = None
    averager: Any = None
    try:
        model = torch.nn.parallel.DistributedDataParallel(build_model(seed), bucket_cap_mb=bucket_cap_mb)
        if local_sgd is not None:
            from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

            warmup, period = local_sgd
            post_local = PostLocalSGDState(None, None, warmup, post_local_gradient_allreduce=False)
        if comm.startswith("mlfabric"):
            import mlfabric
            import mlfabric.torch

            group = mlfabric.join_allreduce(
                job,
                world_size=world_size,
                participant=f"rank{rank}",
                daemon=daemon,
                process_group=dist.group.WORLD if comm == "mlfabric" else None,
            )
            hook_state = mlfabric.torch.HookState(group, timeout=60.0)
            if local_sgd is None:
                model.register_comm_hook(hook_state, _compressed(mlfabric.torch.allreduce_hook, compress))
            else:
                state = mlfabric.torch.LocalSGDState(post_local, hook_state)
                model.register_comm_hook(state, mlfabric.torch.post_local_sgd_hook)
                averager = mlfabric.torch.PeriodicModelAverager(group, period, warmup, timeout=60.0)
        elif local_sgd is not None:  # torch's own, over gloo
            from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import post_localSGD_hook
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            model.register_comm_hook(post_local, post_localSGD_hook)
            averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
        elif compress is not None:  # torch's own hook, compressed by torch's wrapper
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            model.register_comm_hook(dist.group.WORLD, _compressed(allreduce_hook, compress))
        x_train, y_train, x_test, y_test = load_data(seed)
        shard = np.arange(rank, len(x_train), world_size)
        rng = np.random.default_rng(seed * 1000 + rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        start = time.perf_counter()
        for _ in range(steps):
            idx = rng.choice(shard, size=batch, replace=False)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                model(torch.from_numpy(x_train[idx])), torch.from_numpy(y_train[idx])
            )
            loss.backward()
            optimizer.step()
            if averager is not None:
                averager.average_parameters(model.parameters())
        seconds = time.perf_counter() - start
        with torch.no_grad():
            predicted = model.module(torch.from_numpy(x_test)).argmax(dim=1).numpy()
        params = {name: p.detach().numpy().copy() for name, p in model.module.named_parameters()}
        return {"params": params, "accuracy": float((predicted == y_test).mean()), "seconds": seconds}
    finally:
        if group is not None:
            group.close()
        dist.destroy_process_group()


def _compressed(hook: Any, compress: str | None) -> Any:
    """``hook`` wrapped by torch's ``fp16_compress_wrapper`` (or as it is)."""
    if compress is None:
        return hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

    return fp16_compress_wrapper(hook)


def launch(
    world_size: int,
    comm: str,
    steps: int,
    seed: int = 0,
    local_sgd: tuple[int, int] | None = None,
    compress: str | None = None,
) -> list[dict[str, Any]]:
    """Run every rank on this machine: a scheduler and one daemon per rank on loopback (mlfabric).

    Returns
    -------
    list of dict
        Per rank: ``accuracy``, ``seconds`` and the final ``params`` (read back from the ranks).
    """
    from mlfabric.cluster import LocalCluster, python_module

    hosts = [f"h{i}" for i in range(world_size)]
    with tempfile.TemporaryDirectory(prefix="mlfddp-") as tmp:
        work = Path(tmp)
        topo = work / "topology.toml"
        lines = ["hosts = [" + ", ".join(f'"{h}"' for h in hosts) + "]", 'switches = ["sw"]']
        for h in hosts:
            lines += ["[[links]]", f'a = "{h}"', 'b = "sw"', "gbps = 10"]
        topo.write_text("\n".join(lines) + "\n")
        with LocalCluster(topo, policy="fair", workdir=work / "run", ready_timeout=120) as cluster:
            procs = []
            for rank in range(world_size):
                argv = [
                    *python_module("mlfabric.examples.ddp_digits"), "rank",
                    "--rank", str(rank), "--world-size", str(world_size),
                    "--init-method", f"file://{work / 'store'}", "--comm", comm,
                    "--steps", str(steps), "--seed", str(seed), "--out", str(work / f"rank{rank}.npz"),
                ]  # fmt: skip
                if local_sgd is not None:
                    argv += ["--local-sgd", f"{local_sgd[0]}:{local_sgd[1]}"]
                argv += ["--compress", compress] if compress else []
                procs.append(cluster.spawn(hosts[rank], argv, name=f"rank{rank}"))
            for p in procs:
                cluster.wait(p, timeout=600)
        return [read_result(work / f"rank{rank}.npz") for rank in range(world_size)]


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Save a rank's result (parameters, accuracy, seconds) as ``.npz``."""
    np.savez(
        path,
        **{f"param:{k}": v for k, v in result["params"].items()},
        accuracy=result["accuracy"],
        seconds=result["seconds"],
    )


def read_result(path: Path) -> dict[str, Any]:
    """A rank's result saved by :func:`write_result`."""
    with np.load(path) as data:
        params = {k[len("param:") :]: data[k] for k in data.files if k.startswith("param:")}
        return {"params": params, "accuracy": float(data["accuracy"]), "seconds": float(data["seconds"])}


def _local_sgd(text: str) -> tuple[int, int]:
    """``K:H`` -> (K, H), K >= 0 and H >= 1."""
    try:
        k, h = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K:H (two integers), got {text!r}") from None
    if k < 0 or h < 1:
        raise argparse.ArgumentTypeError(f"K must be >= 0 and H >= 1, got {text!r}")
    return k, h


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``rank`` (one rank; it ends the process) or ``launch`` (all ranks on loopback)."""
    parser = argparse.ArgumentParser(
        prog="python -m mlfabric.examples.ddp_digits", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rank", help="train one rank")
    r.add_argument("--rank", type=int, required=True)
    r.add_argument(
        "--init-method", required=True, help="torch.distributed init method (file://... or tcp://...)"
    )
    r.add_argument("--out", type=Path, required=True, help="where to save the final parameters (.npz)")
    r.add_argument("--daemon", default=None, help="the daemon's socket (default $MLFABRIC_DAEMON)")
    r.add_argument("--job", default="ddp-digits")
    for p in (r, sub.add_parser("launch", help="run all ranks with a scheduler and daemons on loopback")):
        p.add_argument("--world-size", type=int, default=2)
        p.add_argument("--comm", choices=COMMS, default="mlfabric")
        p.add_argument("--steps", type=int, default=200)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(
            "--local-sgd",
            metavar="K:H",
            type=_local_sgd,
            default=None,
            help="post-local SGD: all-reduce every step for K steps, then average the model every H",
        )
        p.add_argument(
            "--compress",
            choices=COMPRESS,
            default=None,
            help="all-reduce the buckets as fp16 (torch's fp16_compress_wrapper around the hook)",
        )
    args = parser.parse_args(argv)
    if args.command == "launch":
        results = launch(args.world_size, args.comm, args.steps, args.seed, args.local_sgd, args.compress)
        print(
            f"{args.comm}: {args.world_size} ranks, {args.steps} steps, test accuracy "
            f"{results[0]['accuracy']:.3f}, {results[0]['seconds']:.2f} s"
        )
        return 0
    result = train_rank(
        rank=args.rank,
        world_size=args.world_size,
        init_method=args.init_method,
        comm=args.comm,
        steps=args.steps,
        seed=args.seed,
        job=args.job,
        daemon=args.daemon,
        local_sgd=args.local_sgd,
        compress=args.compress,
    )
    write_result(args.out, result)
    print(f"rank {args.rank}: accuracy {result['accuracy']:.3f} in {result['seconds']:.2f} s", flush=True)
    from mlfabric.torch import exit_rank

    exit_rank(0)  # gloo's threads outlive the group: no interpreter teardown (see exit_rank)


if __name__ == "__main__":
    raise SystemExit(main())
