"""A character-level transformer language model on the Python standard library's own source.

The second learning task (issue 25; the first is :mod:`mlfabric.examples.digits`). Its data
is on every machine that runs Python, nothing is downloaded:

- **Corpus** (:func:`load_corpus`): the top-level ``*.py`` files of the running
  interpreter's standard library (``sysconfig.get_paths()["stdlib"]``), in sorted file-name
  order, whole files concatenated (each followed by ``b"\\n"``) while the total stays within
  ``budget`` bytes (default 1,000,000). The selection rule is fixed; the text is whatever that
  Python build ships, so runs on one interpreter are comparable and :func:`corpus_digest`
  names the exact text (CPython 3.11.7: 39 files, ``__future__.py`` .. ``compileall.py``, 979,411 bytes).
- **Split**: the first 90 % of the bytes train, the rest validates.
- **Vocabulary**: bytes (256 symbols), so there is no tokenizer state.
- **Model** (:class:`Config`, :func:`init_model`): a pre-norm causal transformer (token and
  position embeddings, ``layers`` blocks of multi-head self-attention and a 4x GELU MLP, a
  final norm and a linear head), held as a dict of float32 tensors like the digits MLP so
  that ``push``/``get`` carry it unchanged. The default (2 layers, d 64, 4 heads, context 64;
  137,216 parameters, 549 kB an update) takes a few tens of ms a step of 16 sequences on one
  CPU thread.

The update rule is the digits example's: a worker pushes ``lr`` times its clipped gradient
(:func:`gradient_step`), the server subtracts what it receives (an aggregate or a synchronous
round is the sum of its members' updates). :func:`train_local` runs the same rule in one
process — the baseline the distributed runs are compared with, sample for sample.
:func:`evaluate` gives the validation loss (nats per byte) and perplexity.

Run a server and N workers next to their hosts' daemons (``MLFABRIC_DAEMON`` or ``--daemon``)::

    python -m mlfabric.examples.charlm server --name ps0 --model-file /tmp/model.npz
    python -m mlfabric.examples.charlm worker --rank 0 --world 4 --steps 250 --codec int8+ef

``experiments/train_charlm.py`` runs them on a local cluster, asynchronously and
synchronously, with the fair and stf+agg policies, next to the single-process baseline.
torch is an optional extra (``pip install 'mlfabric[torch]'``): corpus functions work
without it; the model functions raise ``ImportError`` naming the extra.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.examples.digits import (
    _say,
    _stop_on_signals,
    _write_json,
    add_launch_options,
    add_push_options,
    local_sgd,
    push_record,
    run_role,
    sgd_steps,
    start_together,
)

__all__ = [
    "Config",
    "batches",
    "corpus_digest",
    "corpus_files",
    "evaluate",
    "from_vector",
    "gradient_step",
    "init_model",
    "load_corpus",
    "load_data",
    "main",
    "to_vector",
    "train_local",
]

#: Default corpus size in bytes.
BUDGET = 1_000_000
#: Fraction of the corpus that trains (the rest validates).
TRAIN_FRACTION = 0.9
#: Bytes per block when the training text is dealt to the workers (block i goes to worker i mod N).
SHARD_BLOCK = 4096


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(
            "mlfabric.examples.charlm's model needs PyTorch: pip install 'mlfabric[torch]'"
        ) from exc
    return torch


# ---------------------------------------------------------------------------- corpus


def corpus_files(stdlib: str | Path | None = None, budget: int = BUDGET) -> list[Path]:
    """The standard-library files of the corpus: top-level ``*.py``, sorted by name, within ``budget``.

    Files are taken whole, in order, while the running total (each file plus one newline)
    stays within ``budget``; the first file that would exceed it ends the selection.

    Examples
    --------
    >>> files = corpus_files(budget=200_000)
    >>> [f.name for f in files][:2]
    ['__future__.py', '__hello__.py']
    >>> sum(f.stat().st_size + 1 for f in files) <= 200_000
    True
    """
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    chosen: list[Path] = []
    total = 0
    for path in sorted(root.glob("*.py"), key=lambda p: p.name):
        size = path.stat().st_size + 1
        if total + size > budget:
            break
        chosen.append(path)
        total += size
    if not chosen:
        raise ValueError(f"no standard-library source within {budget} bytes under {root}")
    return chosen


def load_corpus(stdlib: str | Path | None = None, budget: int = BUDGET) -> bytes:
    """The corpus text: :func:`corpus_files` concatenated, each followed by a newline.

    Examples
    --------
    >>> text = load_corpus(budget=200_000)
    >>> text == load_corpus(budget=200_000), len(text) <= 200_000
    (True, True)
    """
    return b"".join(path.read_bytes() + b"\n" for path in corpus_files(stdlib, budget))


def corpus_digest(text: bytes) -> str:
    """The first 12 hex digits of the corpus's SHA-256: which Python build's text a result used.

    Examples
    --------
    >>> corpus_digest(b"import this\\n")
    '56fbe8052c13'
    """
    return hashlib.sha256(text).hexdigest()[:12]


def load_data(budget: int = BUDGET, stdlib: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The corpus as ``uint8`` arrays: the training bytes and the validation bytes.

    Examples
    --------
    >>> train, val = load_data(budget=200_000)
    >>> train.dtype, len(train) > 8 * len(val) > 0
    (dtype('uint8'), True)
    """
    text = np.frombuffer(load_corpus(stdlib, budget), dtype=np.uint8)
    cut = int(len(text) * TRAIN_FRACTION)
    return text[:cut].copy(), text[cut:].copy()


def shard(train: np.ndarray, rank: int, world: int, block: int = SHARD_BLOCK) -> np.ndarray:
    """Worker ``rank``'s part of ``train``: blocks ``rank, rank + world, ...`` of ``block`` bytes.

    Examples
    --------
    >>> shard(np.arange(10, dtype=np.uint8), 1, 2, block=2).tolist()
    [2, 3, 6, 7]
    """
    starts = range(rank * block, len(train), world * block)
    return np.concatenate([train[s : s + block] for s in starts])


def batches(text: np.ndarray, context: int, size: int, rng: np.random.Generator) -> tuple[Any, Any]:
    """``size`` random windows of ``text``: inputs and next-byte targets, ``(size, context)`` int64.

    Examples
    --------
    >>> x, y = batches(np.arange(100, dtype=np.uint8), 8, 2, np.random.default_rng(0))
    >>> tuple(x.shape), bool((x[:, 1:] == y[:, :-1]).all())
    ((2, 8), True)
    """
    torch = _torch()
    starts = rng.integers(0, len(text) - context - 1, size=size)
    windows = np.stack([text[s : s + context + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Config:
    """The transformer's shape (defaults: 137,216 parameters)."""

    layers: int = 2
    d_model: int = 64
    heads: int = 4
    context: int = 64
    vocab: int = 256


@functools.lru_cache(maxsize=4)
def _skeleton(config: Config) -> Any:
    """A module of ``config``'s shape whose parameters :func:`_forward` replaces (built once)."""
    torch = _torch()
    nn = torch.nn
    fn = torch.nn.functional

    class Block(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            d = config.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, config.heads, d // config.heads).transpose(1, 2) for z in (q, k, v))
            att = fn.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.down(fn.gelu(self.up(self.ln2(x))))

    class Model(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(config.vocab, config.d_model)
            self.pos = nn.Embedding(config.context, config.d_model)
            self.blocks = nn.ModuleList([Block() for _ in range(config.layers)])
            self.ln = nn.LayerNorm(config.d_model)
            self.head = nn.Linear(config.d_model, config.vocab)

        def forward(self, idx: Any) -> Any:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return Model()


def init_model(config: Config = Config(), seed: int = 0) -> dict[str, Any]:
    """A freshly initialised model: tensor name -> float32 torch tensor (GPT-2 style init).

    Examples
    --------
    >>> model = init_model(Config(), seed=0)
    >>> sum(v.numel() for v in model.values())
    137216
    """
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in _skeleton(config).named_parameters():
        if name.endswith("bias"):
            value = torch.zeros(p.shape)
        elif ".ln" in name or name.startswith("ln."):
            value = torch.ones(p.shape)
        else:
            std = (
                0.02 / math.sqrt(2 * config.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
            )
            value = torch.randn(p.shape, generator=gen) * std
        out[name] = value
    return out


def _forward(model: dict[str, Any], config: Config, x: Any) -> Any:
    torch = _torch()
    params = {k: torch.as_tensor(v) for k, v in model.items()}
    return torch.func.functional_call(_skeleton(config), params, (x,))


def _loss(model: dict[str, Any], config: Config, x: Any, y: Any) -> Any:
    logits = _forward(model, config, x)
    return _torch().nn.functional.cross_entropy(logits.reshape(-1, config.vocab), y.reshape(-1))


def gradient_step(
    model: dict[str, Any], config: Config, x: Any, y: Any, lr: float, clip: float = 1.0
) -> tuple[dict[str, Any], float]:
    """``lr`` times the gradient of the loss on ``(x, y)``, its norm clipped to ``clip``; and the loss.

    Examples
    --------
    >>> cfg = Config(layers=1, d_model=16, heads=2, context=8)
    >>> x, y = batches(np.arange(64, dtype=np.uint8), 8, 2, np.random.default_rng(0))
    >>> update, loss = gradient_step(init_model(cfg), cfg, x, y, lr=0.1)
    >>> sorted(update) == sorted(init_model(cfg)), 5.0 < loss < 6.0
    (True, True)
    """
    torch = _torch()
    params = {k: torch.as_tensor(v).detach().clone().requires_grad_(True) for k, v in model.items()}
    loss = _loss(params, config, x, y)
    loss.backward()
    grads = {k: p.grad for k, p in params.items()}
    norm = float(torch.sqrt(sum((g * g).sum() for g in grads.values())))
    scale = lr * min(1.0, clip / (norm + 1e-12))
    return {k: (scale * g).detach() for k, g in grads.items()}, float(loss.detach())


def evaluate(
    model: dict[str, Any], config: Config, text: np.ndarray, max_windows: int = 1024
) -> tuple[float, float]:
    """Mean loss (nats per byte) over consecutive windows of ``text``, and the perplexity ``exp(loss)``.

    The windows are the first ``max_windows`` non-overlapping ``context + 1`` byte slices:
    the same bytes for every model, so losses compare.

    Examples
    --------
    >>> cfg = Config(layers=1, d_model=16, heads=2, context=8)
    >>> loss, ppl = evaluate(init_model(cfg), cfg, np.arange(200, dtype=np.uint8))
    >>> abs(loss - math.log(256)) < 0.1, abs(ppl - math.exp(loss)) < 1e-9
    (True, True)
    """
    torch = _torch()
    span = config.context + 1
    count = min(max_windows, len(text) // span)
    windows = torch.from_numpy(text[: count * span].astype(np.int64).reshape(count, span))
    total = 0.0
    with torch.no_grad():
        for chunk in windows.split(256):
            total += float(_loss(model, config, chunk[:, :-1], chunk[:, 1:])) * len(chunk)
    loss = total / count
    return loss, math.exp(loss)


def to_vector(model: dict[str, Any]) -> np.ndarray:
    """The model's tensors flattened into one float32 vector, in the dict's order.

    Examples
    --------
    >>> to_vector({"a": np.ones((2, 2)), "b": np.zeros(1)}).tolist()
    [1.0, 1.0, 1.0, 1.0, 0.0]
    """
    return np.concatenate([np.asarray(v, dtype=np.float32).reshape(-1) for v in model.values()])


def from_vector(vector: np.ndarray, like: dict[str, Any]) -> dict[str, np.ndarray]:
    """The inverse of :func:`to_vector`: ``vector`` cut into ``like``'s names and shapes.

    Examples
    --------
    >>> from_vector(np.arange(5.0), {"a": np.ones((2, 2)), "b": np.zeros(1)})["b"].tolist()
    [4.0]
    """
    out, at = {}, 0
    for name, value in like.items():
        shape = tuple(np.shape(value))
        size = int(np.prod(shape))
        if at + size > len(vector):
            raise ValueError(f"vector of {len(vector)} values is too short for tensor '{name}'")
        out[name] = np.asarray(vector[at : at + size], dtype=np.float32).reshape(shape)
        at += size
    if at != len(vector):
        raise ValueError(f"vector has {len(vector)} values, the model {at}")
    return out


def train_local(
    config: Config,
    steps: int,
    *,
    per_step: int = 1,
    batch: int = 16,
    lr: float = 0.3,
    clip: float = 1.0,
    seed: int = 0,
    budget: int = BUDGET,
    delay: int = 0,
) -> dict[str, Any]:
    """The single-process baseline: ``steps`` steps, each the sum of ``per_step`` updates.

    ``per_step=1`` is asynchronous SGD without delays; ``per_step=N`` is a synchronous round
    of N workers (N clipped updates of ``batch`` sequences from one model, summed). With
    ``delay=d`` every update is computed from the model as it was ``d`` steps before (the
    steady state of asynchronous SGD with ``d + 1`` workers taking turns: each update's
    delay is ``d``). The model starts from ``init_model(config, seed)``; batches are drawn
    from the whole training text. Returns the model (numpy) and its validation loss and
    perplexity.

    Examples
    --------
    >>> cfg = Config(layers=1, d_model=16, heads=2, context=16)
    >>> out = train_local(cfg, 3, batch=4, budget=100_000)
    >>> sorted(out)
    ['loss', 'model', 'perplexity', 'samples']
    """
    train, val = load_data(budget)
    rng = np.random.default_rng(seed)

    def update(base: dict[str, Any]) -> dict[str, Any]:
        return gradient_step(base, config, *batches(train, config.context, batch, rng), lr, clip)[0]

    start = {k: v.numpy() for k, v in init_model(config, seed).items()}
    model = sgd_steps(start, steps, update, per_step=per_step, delay=delay)
    loss, ppl = evaluate(model, config, val)
    return {"model": model, "loss": loss, "perplexity": ppl, "samples": steps * per_step * batch}


# ----------------------------------------------------------------------------- roles


def _config(args: argparse.Namespace) -> Config:
    return Config(layers=args.layers, d_model=args.d_model, heads=args.heads, context=args.context)


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; then write the model to ``--model-file``, counts to ``--status-file``."""
    import mlfabric

    _torch().set_num_threads(1)  # several training processes share this machine's cores
    stop = _stop_on_signals()
    model = {k: v.numpy() for k, v in init_model(_config(args), args.seed).items()}
    if args.optimizer:
        from mlfabric.examples.charlm_optimizer import serve_groups

        def write(counts: dict[str, Any], final: bool) -> None:
            if args.status_file:
                _write_json(Path(args.status_file), {**counts, "final": final})

        final = serve_groups(args, model, stop, write)
        if args.model_file:
            np.savez(args.model_file, **final)
        return 0
    server = mlfabric.register_as_server(
        args.job,
        args.name,
        model,
        mlfabric.Params(tau_max=args.tau_max, sync_workers=args.sync_workers),
        daemon=args.daemon,
    )
    counts = {"payloads": 0, "worker_updates": 0, "aggregated": 0, "partial_rounds": 0}
    delays: list[int] = []

    @server.on_update
    def apply(update: dict[str, Any], meta: Any) -> None:
        for key, value in update.items():
            server.model[key] -= value
        counts["payloads"] += 1
        counts["worker_updates"] += meta.num_updates
        counts["aggregated"] += meta.num_updates if meta.num_updates > 1 else 0
        counts["partial_rounds"] += int(meta.partial_round)
        delays.extend(meta.member_delays or (meta.delay,))

    def status(final: bool) -> dict[str, Any]:
        return {
            **counts,
            "version": server.version,
            "dropped": server.dropped,
            "mean_delay": float(np.mean(delays)) if delays else 0.0,
            "max_delay": max(delays, default=0),
            "final": final,
        }

    with server:
        if args.status_file:
            _write_json(Path(args.status_file), status(final=False))
        if args.progress > 0:
            _say(f"server {args.name} of job {args.job}: serving; Ctrl-C stops")
        said = time.monotonic()
        while not stop.is_set():
            server.serve(timeout=0.25)
            if args.progress > 0 and time.monotonic() - said >= args.progress:
                _say(f"server {args.name}: {status(final=False)}")
                said = time.monotonic()
        if args.model_file:
            np.savez(args.model_file, **server.model)
        if args.status_file:
            _write_json(Path(args.status_file), status(final=True))
    return 0


def run_worker(args: argparse.Namespace) -> int:
    """Get, compute, push, wait — ``--steps`` times (``mlfabric.LocalSGD``: every ``--local-period``).

    Each push is followed by a get of at least the version it was applied in (synchronous:
    the round's model)."""
    import mlfabric

    torch = _torch()
    torch.set_num_threads(1)
    stop = _stop_on_signals()
    if args.optimizer:
        from mlfabric.examples.charlm_optimizer import train_with_optimizer

        records = train_with_optimizer(args, stop)
        if args.stats_file:
            _write_json(Path(args.stats_file), {"rank": args.rank, "pushes": records})
        return 0
    config = _config(args)
    train, _ = load_data(args.budget)
    mine = shard(train, args.rank, args.world)
    rng = np.random.default_rng(1000 * args.seed + args.rank)
    me = f"worker{args.rank}"
    worker = mlfabric.register_as_worker(args.job, name=me, daemon=args.daemon, wait=60.0)
    local = local_sgd(worker, args)
    results: list[dict[str, Any]] = []
    with worker:
        worker.get(args.server)  # warm up (imports, connections) before the clock starts
        start_together(args, stop)
        local.fetch()
        while not stop.is_set() and local.steps < args.steps:
            version = local.version
            x, y = batches(mine, config.context, args.batch, rng)
            update, loss = gradient_step(local.model, config, x, y, args.lr)
            result = local.step(update)
            if result is None and local.steps == args.steps:
                result = local.flush()  # the steps since the last push
            if result is not None:
                results.append({**push_record(result, version), "loss": loss, "steps": local.steps})
            if args.progress > 0 and local.steps % 50 == 0:
                _say(f"{me}: {local.steps} steps, {local.pushes} pushes, training loss {loss:.3f}")
    if args.stats_file:
        _write_json(Path(args.stats_file), {"rank": args.rank, "pushes": results})
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The example's command line (``server`` and ``worker`` subcommands)."""
    parser = argparse.ArgumentParser(
        prog="python -m mlfabric.examples.charlm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--daemon", help="the daemon's Unix socket (default: $MLFABRIC_DAEMON)")
    parser.add_argument("--job", default="charlm")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation (server), batches (worker)")
    parser.add_argument("--layers", type=int, default=Config.layers)
    parser.add_argument("--d-model", type=int, default=Config.d_model)
    parser.add_argument("--heads", type=int, default=Config.heads)
    parser.add_argument("--context", type=int, default=Config.context)
    parser.add_argument(
        "--progress", type=float, default=0.0, metavar="S", help="say what it does (0: quiet)"
    )
    sub = parser.add_subparsers(dest="role", required=True)
    server = sub.add_parser("server", help="serve the model")
    server.add_argument("--name", default="ps0")
    server.add_argument("--tau-max", type=int, default=None, help="delay bound (default: unbounded)")
    server.add_argument("--sync-workers", type=int, default=0, help="synchronous: N workers a round")
    server.add_argument("--status-file", help="JSON counts (payloads, worker updates, delays)")
    server.add_argument("--model-file", help="write the final model here (.npz) when stopped")
    server.add_argument(
        "--optimizer",
        action="store_true",
        help="serve it as mlfabric.torch.GroupServers, one server per group '<name>.<i>' "
        "(for workers with --optimizer)",
    )
    server.set_defaults(run=run_server)
    worker = sub.add_parser("worker", help="compute and push updates")
    worker.add_argument("--server", default="ps0")
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--world", type=int, required=True, help="number of workers (for sharding)")
    worker.add_argument("--budget", type=int, default=BUDGET, help="corpus bytes")
    worker.add_argument("--lr", type=float, default=0.3)
    worker.add_argument("--batch", type=int, default=16, help="sequences per update")
    worker.add_argument(
        "--steps",
        "--max-pushes",
        dest="steps",
        type=int,
        required=True,
        help="gradient steps (pushes without local SGD)",
    )
    add_push_options(worker)
    add_launch_options(worker)
    worker.add_argument(
        "--optimizer",
        action="store_true",
        help="train through mlfabric.torch.DistributedOptimizer (servers '<server>.<i>'; "
        "mlfabric.examples.charlm_optimizer)",
    )
    worker.add_argument("--sync", action="store_true", help="with --optimizer: synchronous rounds")
    worker.set_defaults(run=run_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m mlfabric.examples.charlm server|worker ...``."""
    return run_role(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
