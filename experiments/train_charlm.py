"""Learning quality on the second task: the stdlib character LM through mlfabric vs one process.

The model, data and update rule are :mod:`mlfabric.examples.charlm` (a 2-layer causal
transformer on the Python standard library's source; workers push ``lr`` x their clipped
gradient, the server subtracts). Per seed, on loopback with real processes
(:class:`mlfabric.cluster.LocalCluster`: a scheduler and one daemon per host, the daemons
enforcing the topology's NIC rates so that the server's ingress is a bottleneck and the
policies have something to schedule), N workers push P updates each of B sequences, for

- ``async`` and ``sync`` training (sync: one step per round of N updates, their sum);
- the ``fair`` and ``stf+agg`` policies (stf+agg sums aggregation groups at worker hosts
  before the server; asynchronously that changes which updates are applied together).

Every run trains on the same number of samples, N x P x B sequences of the context length.
Its final model is evaluated on the validation text (loss in nats per byte, perplexity).
The **baseline** trains the same update rule in one process from the same initial model for
the same samples: for ``async`` N x P steps of one update (SGD without delays), for ``sync``
P steps of the sum of N updates (a round without a network). The summary gives per mode and
system the median over the seeds, the min-max spread, and the difference to the baseline's
median; also the worker updates applied, pushes dropped or unresolved, the mean delay and
the wall time (the machine is shared: times are noisy, and speed is not what this measures).

    python experiments/train_charlm.py                  # 4 workers x 150 pushes, seeds 0,1,2
    python experiments/train_charlm.py --quick          # 2 workers x 40 pushes, one seed

Writes experiments/results/train_charlm[_quick].{csv,md}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from systems import split_systems

from mlfabric.cluster import ClusterError, LocalCluster, python_module, wait_for_ready_file
from mlfabric.examples import charlm

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("fair", "stf+agg")
#: the single-process baseline with every update N - 1 steps stale (asynchronous SGD's delay
#: when N workers take turns), run with ``--systems delayed`` (or added to the list)
DELAYED = "delayed"


def topology(workers: int, server_mbps: float) -> str:
    """A star: the server's ingress (``server_mbps``) is the bottleneck; 1 Gbit/s elsewhere.

    Examples
    --------
    >>> print(topology(1, 100).splitlines()[0])
    hosts = ["ps", "w0"]
    """
    hosts = ["ps", *(f"w{i}" for i in range(workers))]
    links = [f'[[links]]\na = "ps"\nb = "sw"\nmbps = 1000\nmbps_ba = {server_mbps:g}\n']
    links += [f'[[links]]\na = "{h}"\nb = "sw"\nmbps = 1000\nmbps_ba = 1000\n' for h in hosts[1:]]
    return f'hosts = {json.dumps(hosts)}\nswitches = ["sw"]\n' + "".join(links)


def model_args(args: argparse.Namespace) -> list[str]:
    """The example's model options (shared by the server and the workers)."""
    return ["--layers", str(args.layers), "--d-model", str(args.d_model), "--context", str(args.context)]


def parse_system(system: str) -> tuple[str, list[str]]:
    """``POLICY[@CODEC[+ef]][@hH[kK]][@opt]`` as the policy and the workers' push options.

    ``CODEC`` is passed to ``push(codec=...)`` as written (any spec it accepts: ``fp16``,
    ``int8:bound=6``, ...); ``+ef`` adds error feedback; ``hH`` is local SGD with H local
    steps a push, ``kK`` post-local SGD's K steps pushed one by one first; ``opt``: the
    workers train through ``mlfabric.torch.DistributedOptimizer`` and the server serves
    ``GroupServers`` (``--optimizer``, :mod:`mlfabric.examples.charlm_optimizer`).

    Examples
    --------
    >>> parse_system("stf+agg@int8+ef@h4k10")
    ('stf+agg', ['--codec', 'int8+ef', '--local-period', '4', '--local-warmup', '10'])
    >>> parse_system("fair")
    ('fair', [])
    >>> parse_system("stf+agg@opt")
    ('stf+agg', ['--optimizer'])
    """
    policy, *parts = system.split("@")
    argv: list[str] = []
    for part in parts:
        local = re.fullmatch(r"h(\d+)(?:k(\d+))?", part)
        if part == "opt":
            argv.append("--optimizer")
        elif local:
            argv += ["--local-period", local[1]] + (["--local-warmup", local[2]] if local[2] else [])
        elif part:
            argv += ["--codec", part]
    return policy, argv


def run_cluster(
    system: str,
    sync: bool,
    args: argparse.Namespace,
    workdir: Path,
    example: list[str],
    server_argv: list[str],
    worker_argv: list[str],
) -> dict[str, Any]:
    """One distributed run of an example (server, then ``args.workers`` workers, ``args.pushes`` steps each).

    ``example``: the example's command up to its role; ``server_argv``/``worker_argv``: the
    task's own options of each role. Returns the server's final status, the workers' push
    records and the times (training, and from the cluster's start to the server's stop)."""
    workdir.mkdir(parents=True)
    (workdir / "topology.toml").write_text(topology(args.workers, args.server_mbps))
    policy, push_argv = parse_system(system)
    extra = ["--aggregate-plan", "sync"] if sync and policy == "stf+agg" else []
    status_file = workdir / "server.json"
    cluster = LocalCluster(
        workdir / "topology.toml",
        policy=policy,
        workdir=workdir / "run",
        enforce_nic_rates=True,
        extra_scheduler_args=extra,
        ready_timeout=120.0,
    )
    began = time.monotonic()
    optimizer = "--optimizer" in push_argv  # both roles: the optimizer's servers are its groups
    if optimizer:
        push_argv = [a for a in push_argv if a != "--optimizer"]
        server_argv = [*server_argv, "--optimizer"]
        worker_argv = [*worker_argv, "--optimizer", *(["--sync"] if sync else [])]
    with cluster:
        sargv = [*example, "server", "--status-file", str(status_file), *server_argv]
        sargv += ["--sync-workers", str(args.workers if sync else 0)]
        if args.tau_max is not None:
            sargv += ["--tau-max", str(args.tau_max)]
        server = cluster.spawn("ps", sargv, name="server")
        wait_for_ready_file(status_file, server, 120.0)
        go = workdir / "go"
        workers = []
        for rank in range(args.workers):
            wargv = [*example, "worker", "--rank", str(rank), "--world", str(args.workers)]
            wargv += ["--steps", str(args.pushes), "--lr", str(args.lr), *worker_argv, *push_argv]
            wargv += ["--go-file", str(go), "--ready-file", str(workdir / f"worker{rank}.ready")]
            wargv += ["--stats-file", str(workdir / f"worker{rank}.json")]
            workers.append(cluster.spawn(f"w{rank}", wargv, name=f"worker{rank}"))
        deadline = time.monotonic() + 180.0
        while not all((workdir / f"worker{r}.ready").exists() for r in range(args.workers)):
            cluster.check_alive()
            for w in workers:
                if w.popen.poll() is not None:
                    raise ClusterError(f"{w.name} exited during start-up:\n{w.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError("the workers did not get ready within 180 s")
            time.sleep(0.05)
        started = time.monotonic()
        go.touch()
        for w in workers:
            cluster.wait(w, timeout=args.time_limit)
        seconds = time.monotonic() - started
        server.popen.terminate()
        cluster.wait(server, timeout=60)
    pushes = [
        p
        for r in range(args.workers)
        for p in json.loads((workdir / f"worker{r}.json").read_text())["pushes"]
    ]
    return {
        "status": json.loads(status_file.read_text()),
        "pushes": pushes,
        "seconds": seconds,
        "wall": time.monotonic() - began,
    }


def push_counts(pushes: list[dict[str, Any]]) -> dict[str, int]:
    """The workers' pushes: how many, and how many APPLIED, DROPPED or neither."""
    return {
        "pushes": len(pushes),
        "applied": sum(p["status"] == "APPLIED" for p in pushes),
        "dropped": sum(p["status"] == "DROPPED" for p in pushes),
        "unresolved": sum(p["status"] not in ("APPLIED", "DROPPED") for p in pushes),
    }


def run_one(system: str, sync: bool, seed: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One distributed run; its final validation loss, perplexity and push accounting."""
    example = [*python_module("mlfabric.examples.charlm"), "--seed", str(seed), *model_args(args)]
    model_file = workdir / "model.npz"
    worker_argv = ["--batch", str(args.batch), "--budget", str(args.budget)]
    run = run_cluster(system, sync, args, workdir, example, ["--model-file", str(model_file)], worker_argv)
    status = run["status"]
    with np.load(model_file) as saved:
        model = {k: saved[k] for k in saved.files}
    loss, ppl = charlm.evaluate(model, config(args), load_val(args))
    return {
        "loss": loss,
        "perplexity": ppl,
        **push_counts(run["pushes"]),
        "worker_updates": status["worker_updates"],
        "payloads": status["payloads"],
        "aggregated": status["aggregated"],
        "partial_rounds": status["partial_rounds"],
        "mean_delay": status["mean_delay"],
        "seconds": run["seconds"],
        "wall": run["wall"],
    }


def config(args: argparse.Namespace) -> charlm.Config:
    return charlm.Config(layers=args.layers, d_model=args.d_model, context=args.context)


def load_val(args: argparse.Namespace) -> np.ndarray:
    return charlm.load_data(args.budget)[1]


def run_baseline(sync: bool, seed: int, args: argparse.Namespace, delay: int = 0) -> dict[str, Any]:
    """The same samples and update rule in this process (async: one update a step; sync: N summed).

    ``delay``: every update computed from the model ``delay`` steps old (asynchronous only)."""
    started = time.monotonic()
    steps, per_step = (args.pushes, args.workers) if sync else (args.pushes * args.workers, 1)
    out = charlm.train_local(
        config(args),
        steps,
        per_step=per_step,
        batch=args.batch,
        lr=args.lr,
        seed=seed,
        budget=args.budget,
        delay=delay,
    )
    samples = steps * per_step
    return {
        "loss": out["loss"],
        "perplexity": out["perplexity"],
        "pushes": samples,
        "applied": samples,
        "dropped": 0,
        "unresolved": 0,
        "worker_updates": samples,
        "payloads": steps,
        "aggregated": samples if per_step > 1 else 0,
        "partial_rounds": 0,
        "mean_delay": float(delay),
        "seconds": time.monotonic() - started,
        "wall": time.monotonic() - started,
    }


def _spread(xs: list[float], fmt: str) -> str:
    return f"{format(min(xs), fmt)}-{format(max(xs), fmt)}"


def run_notes(failed: list[str], loads: list[float]) -> list[str]:
    """The lines after a results table: the failed runs (if any), the load average's range.

    Examples
    --------
    >>> run_notes(["fair seed 1"], [2.0, 3.5])[1:3]
    ['Failed runs: fair seed 1.', '']
    """
    lines = ["", f"Failed runs: {', '.join(failed)}."] if failed else []
    return [
        *lines,
        "",
        f"Load average (1 min) at the end of each run: {min(loads):g} to {max(loads):g} (2 cores, shared).",
    ]


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` as CSV, the columns every key of any row in order of appearance."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def summary(rows: list[dict[str, Any]], args: argparse.Namespace, digest: str) -> str:
    """Per mode and system: median validation loss and perplexity over seeds, spread, vs baseline."""
    samples = args.workers * args.pushes * args.batch
    lines = [
        f"# Character LM on the standard library: learning quality ({'quick' if args.quick else 'full'})",
        "",
        f"{config(args)}; corpus {args.budget} bytes of this Python's stdlib source (sha256 "
        f"{digest}, Python {sys.version.split()[0]}); {args.workers} workers x {args.pushes} pushes x "
        f"{args.batch} sequences of {args.context} bytes = {samples} sequences "
        f"({samples * args.context / 1e6:.2f} M predicted bytes) per run; lr {args.lr}, clip 1.0; "
        f"tau_max {args.tau_max}; server ingress {args.server_mbps:g} Mbit/s (the daemons enforce it). "
        f"Seeds {args.seeds}. Command: `python experiments/train_charlm.py"
        f"{' --quick' if args.quick else ''} --seeds {args.seeds} --modes {args.modes} "
        f"--systems {args.systems}"
        f"{f' --tag {args.tag}' if args.tag else ''}`.",
        "",
        "| mode | system | runs | val loss (nats/byte), median | min-max | perplexity, median "
        "| min-max | loss - baseline | worker updates applied (payloads) | dropped / unresolved "
        "| mean delay | wall s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        of_mode = [r for r in rows if r["mode"] == mode]
        base = [r["loss"] for r in of_mode if r["system"] == "baseline"]
        base_med = statistics.median(base) if base else None
        for system in dict.fromkeys(r["system"] for r in of_mode):
            rs = [r for r in of_mode if r["system"] == system and r["loss"] is not None]
            if not rs:
                lines.append(f"| {mode} | {system} | 0 | - | - | - | - | - | - | - | - | - |")
                continue
            losses, ppls = [r["loss"] for r in rs], [r["perplexity"] for r in rs]
            med = statistics.median(losses)
            diff = f"{med - base_med:+.3f}" if base_med is not None and system != "baseline" else "-"
            lines.append(
                f"| {mode} | {system} | {len(rs)} | {med:.3f} | {_spread(losses, '.3f')} | "
                f"{statistics.median(ppls):.2f} | {_spread(ppls, '.2f')} | {diff} | "
                f"{statistics.median(r['worker_updates'] for r in rs):g} "
                f"({statistics.median(r['payloads'] for r in rs):g}) | "
                f"{sum(r['dropped'] for r in rs)} / {sum(r['unresolved'] for r in rs)} | "
                f"{statistics.median(r['mean_delay'] for r in rs):.2f} | "
                f"{statistics.median(r['wall'] for r in rs):.0f} |"
            )
    failed = [f"{r['mode']} {r['system']} seed {r['seed']}" for r in rows if r["loss"] is None]
    lines += run_notes(failed, [r["load1"] for r in rows])
    lines += [
        "",
        "The baseline trains the same update rule in one process for the same samples from the same",
        "initial model (async: one update a step; sync: the sum of N updates a step); `delayed` is",
        "the async baseline with every update computed from the model N - 1 steps old (the delay of",
        "N workers taking turns). Untrained, the",
        f"loss is ln 256 = {np.log(256):.3f}. wall s: from the cluster's start to the server's stop.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 workers x 40 pushes, seed 0")
    parser.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; quick: 0)")
    parser.add_argument("--modes", default="async,sync")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--workers", type=int, default=None, help="default 4 (quick: 2)")
    parser.add_argument("--pushes", type=int, default=None, help="pushes per worker (default 150; quick: 40)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--tau-max", type=int, default=16)
    parser.add_argument("--budget", type=int, default=charlm.BUDGET, help="corpus bytes")
    parser.add_argument("--layers", type=int, default=charlm.Config.layers)
    parser.add_argument("--d-model", type=int, default=charlm.Config.d_model)
    parser.add_argument("--context", type=int, default=charlm.Config.context)
    parser.add_argument("--server-mbps", type=float, default=100.0, help="the server's ingress, Mbit/s")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds a worker may take")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="results file name suffix (train_charlm[_quick][_TAG])")
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temporary directory)")
    args = parser.parse_args()
    args.seeds = args.seeds or ("0" if args.quick else "0,1,2")
    args.workers = args.workers or (2 if args.quick else 4)
    args.pushes = args.pushes or (40 if args.quick else 150)
    import torch

    torch.set_num_threads(1)  # the cluster's processes share the machine's cores
    digest = charlm.corpus_digest(charlm.load_corpus(budget=args.budget))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-charlm-") as tmp:
        root = args.workdir or Path(tmp)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for mode in args.modes.split(","):
                for system in ["baseline", *split_systems(args.systems)]:
                    if system == DELAYED and mode == "sync":
                        continue  # a synchronous round has no delays
                    try:
                        if system in ("baseline", DELAYED):
                            delay = args.workers - 1 if system == DELAYED else 0
                            res: dict[str, Any] = run_baseline(mode == "sync", seed, args, delay)
                        else:
                            res = run_one(
                                system, mode == "sync", seed, args, root / f"{mode}-{system}-{seed}"
                            )
                    except (ClusterError, OSError, ValueError) as exc:
                        print(f"{mode} {system} seed {seed} failed: {exc}", file=sys.stderr, flush=True)
                        res = {"loss": None, "error": str(exc)[:500]}
                    row = {"seed": seed, "mode": mode, "system": system, **res}
                    row["load1"] = round(os.getloadavg()[0], 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    text = summary(rows, args, digest)
    name = "train_charlm" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{name}.csv", rows)
    (args.out / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
