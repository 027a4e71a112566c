"""Asynchronous SGD with a parameter server: an MLP on scikit-learn's bundled digits.

Uses only the public API (:func:`mlfabric.register_as_server`,
:func:`mlfabric.register_as_worker`) and PyTorch. The data set ships inside
scikit-learn (``load_digits``); nothing is downloaded.

Run a server and N workers, each next to its host's daemon (``MLFABRIC_DAEMON`` or
``--daemon`` names the daemon's socket)::

    python -m mlfabric.examples.digits server --job digits --name ps0 --status-file /tmp/ps.json
    python -m mlfabric.examples.digits worker --rank 0 --world 4 --stop-file /tmp/stop
    ...

Both say on stderr what they do: the server once it serves, then every ``--progress``
seconds (default 5; 0: quiet) its version, updates applied and dropped and the test
accuracy; a worker once registered, then its pushes so far (applied, dropped, the last
delay), and a summary when it stops.

The server applies each update (the worker already scaled its gradient by the learning
rate; an aggregate or a synchronous round is the sum of its members' updates), refuses any
whose delay exceeds ``--tau-max``, evaluates test accuracy every few
updates and writes its progress to ``--status-file``. A worker loops *get the model,
compute a gradient on a mini-batch of its shard, push it, wait for the verdict* until
``--stop-file`` exists or ``--max-pushes`` is reached, then writes its push results to
``--stats-file``. With ``server --sync-workers N`` training is synchronous: the server's
daemon sums N workers' updates into one step per round, and a worker's push returns when
its round is applied. ``mlfabric demo`` runs exactly this on an emulated cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "accuracy",
    "add_launch_options",
    "add_push_options",
    "init_model",
    "load_data",
    "local_sgd",
    "main",
    "push_record",
    "run_role",
    "run_server",
    "run_worker",
    "sgd_steps",
    "split_codec",
    "train_local",
]

#: Tensor names of the MLP, in order: 64 -> hidden -> 10.
NAMES = ("w1", "b1", "w2", "b2")


def load_data(seed: int = 0, test_size: int = 360) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits (8x8 images scaled to [0, 1]) split into train and test, deterministically.

    Examples
    --------
    >>> x_train, y_train, x_test, y_test = load_data()
    >>> x_train.shape[1], len(x_test)
    (64, 360)
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[:test_size], order[test_size:]
    return x[train], y[train], x[test], y[test]


def _one_thread() -> None:
    """Use one intra-op thread: several training processes share this machine's cores."""
    import torch

    torch.set_num_threads(1)


def init_model(hidden: int, seed: int = 0) -> dict[str, Any]:
    """A freshly initialised MLP as a dict of float32 torch tensors (He initialisation)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(hidden, 64, generator=gen) * (2.0 / 64) ** 0.5,
        "b1": torch.zeros(hidden),
        "w2": torch.randn(10, hidden, generator=gen) * (1.0 / hidden) ** 0.5,
        "b2": torch.zeros(10),
    }


def _logits(model: dict[str, Any], x: Any) -> Any:
    import torch

    return torch.relu(x @ model["w1"].T + model["b1"]) @ model["w2"].T + model["b2"]


def accuracy(model: dict[str, Any], x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of ``x`` classified as ``y`` by ``model``."""
    import torch

    with torch.no_grad():
        predicted = _logits(model, torch.from_numpy(x)).argmax(dim=1).numpy()
    return float((predicted == y).mean())


def gradient_step(model: dict[str, Any], x: np.ndarray, y: np.ndarray, lr: float) -> dict[str, Any]:
    """``lr`` times the cross-entropy gradient of ``model`` on the batch ``(x, y)``."""
    import torch

    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.items()}
    loss = torch.nn.functional.cross_entropy(_logits(params, torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    return {k: (lr * p.grad).detach() for k, p in params.items()}


def sgd_steps(
    model: dict[str, np.ndarray],
    steps: int,
    update: Any,
    *,
    per_step: int = 1,
    delay: int = 0,
) -> dict[str, np.ndarray]:
    """The examples' rule in one process: ``steps`` times ``model -=`` the sum of ``per_step`` updates.

    ``update(model)`` gives one update (name -> numpy array or torch tensor, ``lr`` x a
    gradient) computed from ``model``. ``per_step=N`` is a synchronous round of N workers;
    ``delay=d`` computes every update from the model as it was ``d`` steps before (the steady
    state of asynchronous SGD with ``d + 1`` workers taking turns). Returns the new model
    (``model`` itself is not changed).

    Examples
    --------
    >>> out = sgd_steps({"w": np.zeros(2)}, 3, lambda m: {"w": m["w"] * 0 + 1.0}, per_step=2)
    >>> out["w"].tolist()
    [-6.0, -6.0]
    """
    model = {k: np.array(v) for k, v in model.items()}
    past = [{k: v.copy() for k, v in model.items()}]  # the models of the last ``delay`` steps and now
    for _ in range(steps):
        total: dict[str, Any] = {}
        for _ in range(per_step):
            for k, v in update(past[0]).items():
                total[k] = total.get(k, 0) + np.asarray(v)
        for k, v in total.items():
            model[k] -= v
        past = [*past, {k: v.copy() for k, v in model.items()}][-(delay + 1) :]
    return model


def train_local(
    hidden: int, steps: int, *, per_step: int = 1, batch: int = 32, lr: float = 0.05, seed: int = 0
) -> dict[str, Any]:
    """The single-process baseline (:func:`sgd_steps`) from ``init_model(hidden, seed)``; test accuracy.

    Batches are drawn from the whole training set (``default_rng(seed)``).

    Examples
    --------
    >>> out = train_local(32, 20, batch=16, lr=0.1)
    >>> sorted(out), out["accuracy"] > 0.3
    (['accuracy', 'model'], True)
    """
    import torch

    x_train, y_train, x_test, y_test = load_data(seed)
    rng = np.random.default_rng(seed)

    def update(model: dict[str, np.ndarray]) -> dict[str, Any]:
        pick = rng.integers(0, len(x_train), size=batch)
        tensors = {k: torch.from_numpy(v) for k, v in model.items()}
        return gradient_step(tensors, x_train[pick], y_train[pick], lr)

    start = {k: v.numpy() for k, v in init_model(hidden, seed).items()}
    model = sgd_steps(start, steps, update, per_step=per_step)
    return {
        "model": model,
        "accuracy": accuracy({k: torch.from_numpy(v) for k, v in model.items()}, x_test, y_test),
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_server(args: argparse.Namespace) -> int:
    """Serve the model until SIGTERM/SIGINT, recording progress in ``--status-file``."""
    import mlfabric

    stop = _stop_on_signals()
    _one_thread()
    _, _, x_test, y_test = load_data(args.seed)
    server = mlfabric.register_as_server(
        args.job,
        args.name,
        init_model(args.hidden, args.seed),
        mlfabric.Params(
            tau_max=args.tau_max if args.tau_max is not None and args.tau_max >= 0 else None,
            sync_workers=args.sync_workers,
        ),
        daemon=args.daemon,
    )
    status_path = Path(args.status_file) if args.status_file else None
    started = time.monotonic()
    delays: list[int] = []
    counts = {"updates": 0, "aggregated": 0}  # worker updates applied, those applied in a sum
    state: dict[str, Any] = {
        "accuracy": accuracy(server.model, x_test, y_test),
        "reached_at": None,
        "accuracy_at_target": None,
    }

    @server.on_update
    def apply(update: dict[str, Any], meta: Any) -> None:
        for key, value in update.items():
            server.model[key] -= value
        delays.append(meta.delay)
        counts["updates"] += meta.num_updates
        counts["aggregated"] += meta.num_updates if meta.num_updates > 1 else 0
        if len(delays) % args.eval_every == 0:
            state["accuracy"] = accuracy(server.model, x_test, y_test)
            if state["reached_at"] is None and state["accuracy"] >= args.target_accuracy:
                state["reached_at"] = time.time()
                state["accuracy_at_target"] = state["accuracy"]

    def write_status(final: bool) -> None:
        if status_path is None:
            return
        _write_json(
            status_path,
            {
                "version": server.version,
                "applied": server.applied,
                "worker_updates": counts["updates"],  # worker updates in the payloads applied
                "aggregated_updates": counts["aggregated"],
                "dropped": server.dropped,
                "accuracy": state["accuracy"],
                "reached_at": state["reached_at"],  # unix time the target was reached
                "accuracy_at_target": state["accuracy_at_target"],  # the evaluation that reached it
                "elapsed": time.monotonic() - started,
                "mean_delay": float(np.mean(delays)) if delays else 0.0,
                "max_delay": max(delays, default=0),
                "final": final,
            },
        )

    def progress() -> str:
        return (
            f"server {args.name}: version {server.version}, applied {server.applied} ({counts['updates']} "
            f"worker updates), dropped {server.dropped}, accuracy {state['accuracy']:.3f}"
        )

    with server:
        write_status(final=False)
        if args.progress > 0:
            bound = (
                f"tau_max {args.tau_max}" if args.tau_max is not None and args.tau_max >= 0 else "no tau_max"
            )
            _say(
                f"server {args.name} of job {args.job}: serving ({bound}); accuracy {state['accuracy']:.3f}; "
                "Ctrl-C stops"
            )
        said = time.monotonic()
        while not stop.is_set():
            server.serve(timeout=0.25)
            write_status(final=False)
            if args.progress > 0 and time.monotonic() - said >= args.progress:
                _say(progress())
                said = time.monotonic()
        state["accuracy"] = accuracy(server.model, x_test, y_test)
        write_status(final=True)
        if args.progress > 0:
            _say(f"{progress()}; stopped")
    return 0


def run_worker(args: argparse.Namespace) -> int:
    """Get, compute, push, wait — until the stop file appears or ``--steps`` are done.

    With ``--local-period H`` the steps are local (:class:`mlfabric.LocalSGD`): one push of
    their sum every H steps (every step for the first ``--local-warmup``)."""
    import torch

    import mlfabric

    stop = _stop_on_signals()
    _one_thread()
    x_train, y_train, _, _ = load_data(args.seed)
    shard = np.arange(len(x_train))[args.rank :: args.world]
    rng = np.random.default_rng(1000 + args.rank)
    worker = mlfabric.register_as_worker(args.job, name=f"worker{args.rank}", daemon=args.daemon, wait=60.0)
    stop_file = Path(args.stop_file) if args.stop_file else None
    results: list[dict[str, Any]] = []
    me = f"worker{args.rank}"

    def progress() -> str:
        applied = sum(r["status"] == mlfabric.APPLIED for r in results)
        dropped = sum(r["status"] == mlfabric.DROPPED for r in results)
        last = f", last delay {results[-1]['delay']}" if results and results[-1]["delay"] is not None else ""
        return f"{me}: {len(results)} pushes to {args.server}: {applied} applied, {dropped} dropped{last}"

    if args.progress > 0:
        _say(f"{me}: registered with job {args.job} (servers: {', '.join(sorted(worker.servers))})")
    said = time.monotonic()
    local = local_sgd(worker, args)
    with worker:
        worker.get(args.server)  # warm up (imports, connections) before the clock starts
        start_together(args, stop)
        local.fetch()
        while not stop.is_set() and (stop_file is None or not stop_file.exists()):
            if args.steps is not None and local.steps >= args.steps:
                break
            version = local.version
            model = {k: torch.from_numpy(v) for k, v in local.model.items()}
            batch = rng.choice(shard, size=args.batch_size)
            update = gradient_step(model, x_train[batch], y_train[batch], args.lr)
            if args.compute_delay > 0:
                time.sleep(args.compute_delay)
            began = time.monotonic()
            result = local.step(update)
            if result is None and local.steps == args.steps:
                result = local.flush()  # the steps since the last push
            if result is not None:  # seconds: the push, its verdict and the get of the model
                seconds = time.monotonic() - began
                results.append({**push_record(result, version), "seconds": seconds, "steps": local.steps})
            if args.progress > 0 and time.monotonic() - said >= args.progress:
                _say(progress())
                said = time.monotonic()
    if args.progress > 0:
        _say(f"{progress()}; done")
    if args.stats_file:
        _write_json(Path(args.stats_file), {"rank": args.rank, "pushes": results})
    return 0


def push_record(result: Any, base_version: int) -> dict[str, Any]:
    """What a worker's ``--stats-file`` keeps of one push: its verdict and the version it came from."""
    return {
        "status": result.status,
        "delay": result.delay,
        "version": result.version,
        "reason": result.reason,
        "base_version": base_version,
    }


def split_codec(spec: str | None) -> tuple[str | None, bool]:
    """A codec option (``int8+ef``) as push's ``codec`` and ``error_feedback``.

    Examples
    --------
    >>> split_codec("int8+ef"), split_codec("fp16"), split_codec(None)
    (('int8', True), ('fp16', False), (None, False))
    """
    if not spec:
        return None, False
    return spec.removesuffix("+ef"), spec.endswith("+ef")


def add_push_options(worker: argparse.ArgumentParser) -> None:
    """A worker's options for how it pushes: the codec and local SGD (:func:`local_sgd`)."""
    worker.add_argument(
        "--codec",
        help="push codec (docs/compression.md: fp16, bf16, int8, int8:bound=6, ...); +ef: error feedback",
    )
    worker.add_argument(
        "--local-period", type=int, default=1, help="local SGD: local steps per push (default 1: every step)"
    )
    worker.add_argument(
        "--local-warmup", type=int, default=0, help="post-local SGD: push every step for the first K steps"
    )


def local_sgd(worker: Any, args: argparse.Namespace) -> Any:
    """The worker's :class:`mlfabric.LocalSGD` from :func:`add_push_options`' options (seeded rounding)."""
    import mlfabric

    codec, feedback = split_codec(args.codec)
    worker.rng = np.random.default_rng([args.seed, 7919, args.rank])  # stochastic int8 rounding
    return mlfabric.LocalSGD(
        worker,
        args.server,
        period=args.local_period,
        warmup=args.local_warmup,
        codec=codec,
        error_feedback=feedback,
        timeout=args.push_timeout,
    )


def add_launch_options(worker: argparse.ArgumentParser) -> None:
    """A worker's options for the launcher: start together, bound the wait, report the pushes."""
    worker.add_argument("--push-timeout", type=float, default=120.0)
    worker.add_argument("--ready-file", help="create this file once registered and warmed up")
    worker.add_argument("--go-file", help="start pushing only once this file exists")
    worker.add_argument("--stats-file", help="write the push results here as JSON")


def start_together(args: argparse.Namespace, stop: threading.Event) -> None:
    """Touch ``--ready-file``, then wait for ``--go-file`` or ``stop`` (:func:`add_launch_options`)."""
    if args.ready_file:
        Path(args.ready_file).touch()
    while args.go_file and not Path(args.go_file).exists() and not stop.is_set():
        time.sleep(0.01)


def build_parser() -> argparse.ArgumentParser:
    """The example's command line (``server`` and ``worker`` subcommands)."""
    parser = argparse.ArgumentParser(
        prog="python -m mlfabric.examples.digits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the usage examples' lines
    )
    parser.add_argument("--daemon", help="the daemon's Unix socket (default: $MLFABRIC_DAEMON)")
    parser.add_argument("--job", default="digits")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden units of the MLP")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--progress",
        type=float,
        default=5.0,
        metavar="S",
        help="say on stderr what it does every S seconds (default 5; 0: quiet)",
    )
    sub = parser.add_subparsers(dest="role", required=True)
    server = sub.add_parser("server", help="serve the model")
    server.add_argument("--name", default="ps0")
    server.add_argument("--tau-max", type=int, default=None, help="delay bound (default or < 0: unbounded)")
    server.add_argument("--target-accuracy", type=float, default=0.95)
    server.add_argument("--eval-every", type=int, default=5, help="evaluate every N applied updates")
    server.add_argument(
        "--sync-workers",
        type=int,
        default=0,
        help="synchronous SGD: one step per round of N workers' updates (default 0: asynchronous)",
    )
    server.add_argument("--status-file", help="JSON progress file, rewritten as training goes")
    server.set_defaults(run=run_server)
    worker = sub.add_parser("worker", help="compute and push updates")
    worker.add_argument("--server", default="ps0")
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--world", type=int, required=True, help="number of workers (for sharding)")
    worker.add_argument("--lr", type=float, default=0.05)
    worker.add_argument("--batch-size", type=int, default=32)
    worker.add_argument("--compute-delay", type=float, default=0.0, help="extra seconds per step (straggler)")
    worker.add_argument(
        "--steps",
        "--max-pushes",
        dest="steps",
        type=int,
        default=None,
        help="gradient steps (default: no limit)",
    )
    worker.add_argument("--stop-file", help="stop once this file exists")
    add_push_options(worker)
    add_launch_options(worker)
    worker.set_defaults(run=run_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m mlfabric.examples.digits server|worker ...``."""
    return run_role(build_parser(), argv)


def run_role(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run the role it names (``args.run``); an mlfabric error: say it, exit 1."""
    from mlfabric.localclient import MlfabricError

    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except MlfabricError as exc:  # e.g. no daemon at the socket, or the daemon went away
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
