"""Learning quality per codec and with local SGD, on both tasks, against uncompressed (issue 26).

Per task (``--task digits``: the MLP on scikit-learn's digits, :mod:`mlfabric.examples.digits`;
``--task charlm``: the character-level transformer on the stdlib source,
:mod:`mlfabric.examples.charlm`) and seed, the same training through a real local cluster
(``train_charlm.run_cluster``: scheduler, one daemon per host enforcing a server ingress of
``--server-mbps``, server and workers as processes on loopback), once per system:
``POLICY[@CODEC[+ef]][@hH[kK]]`` (``train_charlm.parse_system``): the workers push with
``push(codec=CODEC, error_feedback=...)`` — any codec spec push accepts, written as push takes
it — and with ``hH`` take H local steps a push (:class:`mlfabric.LocalSGD`; ``kK``: post-local
SGD's first K steps pushed one by one). Every run takes the same gradient steps (N workers x
``--pushes`` steps of one batch); the **baseline** trains the same rule in one process from
the same initial model on as many samples (async: one update a step).

The table gives per system the final metric (digits: test accuracy; charlm: validation loss
in nats per byte and perplexity), median and min-max over the seeds, the per-seed difference
to the uncompressed system of the same policy (median [min-max]) and the difference of the
medians to the baseline's; pushes per worker, updates applied, drops, the mean delay. The plot
shows every seed's value per system, the medians and the baseline's.

    python experiments/quality_codecs.py --task digits            # seeds 0,1,2
    python experiments/quality_codecs.py --task charlm
    python experiments/quality_codecs.py --task digits --quick    # one seed, tiny, a smoke

Writes experiments/results/quality_codecs_TASK[_quick].{csv,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_charlm as tc

from mlfabric.cluster import ClusterError, python_module
from mlfabric.examples import charlm, digits

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = "stf+agg,stf+agg@fp16,stf+agg@int8+ef,stf+agg@int8,stf+agg@h4,stf+agg@int8+ef@h4"
QUICK_SYSTEMS = "stf+agg,stf+agg@int8+ef,stf+agg@h2"
#: per task: the metric, whether higher is better, and the defaults (full; quick)
TASKS: dict[str, dict[str, Any]] = {
    "digits": {
        "metric": "accuracy",
        "higher": True,
        "full": {"workers": 4, "pushes": 50, "lr": 0.05, "batch": 32, "hidden": 1024},
        "quick": {"workers": 2, "pushes": 8, "lr": 0.5, "batch": 32, "hidden": 64},
    },
    "charlm": {
        "metric": "loss",
        "higher": False,
        "full": {"workers": 4, "pushes": 80, "lr": 0.3, "batch": 16, "budget": charlm.BUDGET},
        "quick": {
            "workers": 2,
            "pushes": 8,
            "lr": 0.3,
            "batch": 8,
            "budget": 200_000,
            "layers": 1,
            "d_model": 32,
            "context": 32,
        },
    },
}


def uncompressed(system: str) -> str:
    """The system without codec and local SGD: its policy alone.

    Examples
    --------
    >>> uncompressed("stf+agg@int8:bound=6@h4")
    'stf+agg'
    """
    return system.split("@")[0]


def run_digits(system: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One distributed digits run: the server's final test accuracy and the push accounting."""
    example = [*python_module("mlfabric.examples.digits"), "--seed", str(seed), "--hidden", str(args.hidden)]
    example += ["--progress", "0"]
    run = tc.run_cluster(system, False, args, workdir, example, [], ["--batch-size", str(args.batch)])
    status = run["status"]
    return {
        "accuracy": status["accuracy"],
        **tc.push_counts(run["pushes"]),
        "worker_updates": status["worker_updates"],
        "payloads": status["applied"],
        "mean_delay": status["mean_delay"],
        "wall": run["wall"],
    }


def run_charlm(system: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One distributed charlm run (``train_charlm.run_one``, asynchronous)."""
    return tc.run_one(system, False, seed, args, workdir)


def run_baseline(task: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """The single-process baseline of ``task``: workers x pushes steps of one update."""
    began = time.monotonic()
    steps = args.workers * args.pushes
    if task == "digits":
        out = digits.train_local(args.hidden, steps, batch=args.batch, lr=args.lr, seed=seed)
        res: dict[str, Any] = {"accuracy": out["accuracy"]}
    else:
        res = {k: v for k, v in tc.run_baseline(False, seed, args).items() if k in ("loss", "perplexity")}
    zero = {"dropped": 0, "unresolved": 0, "mean_delay": 0.0}
    return {**res, "pushes": steps, "applied": steps, "worker_updates": steps, "payloads": steps, **zero} | {
        "wall": time.monotonic() - began
    }


def _spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} [{format(min(xs), fmt)}-{format(max(xs), fmt)}]"


def versus_uncompressed(rows: list[dict[str, Any]], system: str, metric: str) -> list[float]:
    """Per seed, ``system``'s metric minus the uncompressed system's (the same policy).

    Examples
    --------
    >>> rows = [{"seed": 0, "system": "stf", "loss": 2.0}, {"seed": 0, "system": "stf@fp16", "loss": 2.1},
    ...         {"seed": 1, "system": "stf@fp16", "loss": 2.2}]
    >>> [round(d, 3) for d in versus_uncompressed(rows, "stf@fp16", "loss")]
    [0.1]
    """
    plain = uncompressed(system)
    base = {r["seed"]: r[metric] for r in rows if r["system"] == plain and r.get(metric) is not None}
    return [r[metric] - base[r["seed"]] for r in rows if r["system"] == system and r["seed"] in base]


def summary(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    """The Markdown table: per system the metric's median and spread, vs uncompressed and the baseline."""
    task = TASKS[args.task]
    metric = task["metric"]
    fmt = ".4f" if metric == "accuracy" else ".3f"
    model = f"MLP 64-{args.hidden}-10" if args.task == "digits" else str(tc.config(args))
    lines = [
        f"# Learning quality per codec and with local SGD: {args.task} ({'quick' if args.quick else 'full'})",
        "",
        f"{model}; {args.workers} workers x {args.pushes} gradient steps of {args.batch} samples each "
        f"per run (asynchronous; local SGD pushes their sum every H steps); lr {args.lr}; tau_max "
        f"{args.tau_max}; server ingress {args.server_mbps:g} Mbit/s (enforced by the daemons); seeds "
        f"{args.seeds}. Metric: {'test accuracy' if metric == 'accuracy' else 'validation loss, nats/byte'}"
        f" ({'higher' if task['higher'] else 'lower'} is better). Command: `{command}`.",
        "",
        f"| system | runs | {metric}, median [min-max] | "
        + ("perplexity | " if metric == "loss" else "")
        + "- uncompressed, per seed: median [min-max] | - baseline (medians) | pushes per worker "
        "| worker updates applied (payloads) | dropped / unresolved | mean delay | wall s |",
        "| --- | ---: | ---: | " + ("---: | " if metric == "loss" else "") + "---: | ---: | ---: | ---: | "
        "---: | ---: | ---: |",
    ]
    base = [r[metric] for r in rows if r["system"] == "baseline" and r.get(metric) is not None]
    for system in dict.fromkeys(r["system"] for r in rows):
        rs = [r for r in rows if r["system"] == system and r.get(metric) is not None]
        if not rs:
            lines.append(
                f"| {system} | 0 | - |"
                + (" - |" if metric == "loss" else "")
                + " - | - | - | - | - | - | - |"
            )
            continue
        values = [r[metric] for r in rs]
        diffs = versus_uncompressed(rows, system, metric) if system != uncompressed(system) else []
        to_base = (
            f"{statistics.median(values) - statistics.median(base):+{fmt}}"
            if base and system != "baseline"
            else "-"
        )
        per_worker = statistics.median(r["pushes"] for r in rs) / (
            1 if system == "baseline" else args.workers
        )
        ppl = f"{_spread([r['perplexity'] for r in rs], '.2f')} | " if metric == "loss" else ""
        lines.append(
            f"| {system} | {len(rs)} | {_spread(values, fmt)} | {ppl}"
            f"{_spread(diffs, '+' + fmt) if diffs else '-'} | {to_base} | "
            f"{per_worker:g} | "
            f"{statistics.median(r['worker_updates'] for r in rs):g} "
            f"({statistics.median(r['payloads'] for r in rs):g}) | "
            f"{sum(r['dropped'] for r in rs)} / {sum(r['unresolved'] for r in rs)} | "
            f"{statistics.median(r['mean_delay'] for r in rs):.2f} | "
            f"{statistics.median(r['wall'] for r in rs):.0f} |"
        )
    failed = [f"{r['system']} seed {r['seed']} ({r['error']})" for r in rows if r.get(metric) is None]
    lines += tc.run_notes(failed, [r["load1"] for r in rows])
    lines += [
        "The baseline's pushes per worker are its steps (one process). Worker updates applied count",
        "each push once (a local SGD push is one update, the sum of H steps).",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    """Every seed's metric per system (dots), the medians (bars) and the baseline's median (a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = TASKS[args.task]["metric"]
    systems = [s for s in dict.fromkeys(r["system"] for r in rows) if s != "baseline"]
    fig, ax = plt.subplots(figsize=(1.2 * len(systems) + 3, 4))
    for i, system in enumerate(systems):
        values = [r[metric] for r in rows if r["system"] == system and r.get(metric) is not None]
        if values:
            ax.scatter([i] * len(values), values, color="tab:blue", alpha=0.6, zorder=3)
            ax.hlines(statistics.median(values), i - 0.3, i + 0.3, color="tab:blue", lw=2)
    base = [r[metric] for r in rows if r["system"] == "baseline" and r.get(metric) is not None]
    if base:
        ax.axhline(statistics.median(base), color="gray", ls="--", label="one process (median)")
        ax.legend()
    ax.set_xticks(range(len(systems)), systems, rotation=25, ha="right")
    label = "test accuracy" if metric == "accuracy" else "validation loss (nats/byte)"
    ax.set_ylabel(label)
    ax.set_title(f"{args.task}: {label} per codec, {args.workers} workers, seeds {args.seeds}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--quick", action="store_true", help="one seed, 2 workers, a tiny model")
    parser.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; quick: 0)")
    parser.add_argument("--systems", default=None, help=f"default {SYSTEMS} (quick: {QUICK_SYSTEMS})")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--pushes", type=int, help="gradient steps per worker")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--hidden", type=int, help="digits: the MLP's hidden units")
    parser.add_argument("--budget", type=int, help="charlm: corpus bytes")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--context", type=int)
    parser.add_argument("--tau-max", type=int, default=16)
    parser.add_argument("--server-mbps", type=float, default=100.0, help="the server's ingress, Mbit/s")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds a worker may take")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temporary directory)")
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the task's defaults (full or quick) where not given."""
    args = build_parser().parse_args(argv)
    defaults = {
        "layers": charlm.Config.layers,
        "d_model": charlm.Config.d_model,
        "context": charlm.Config.context,
    }
    defaults |= {"hidden": 1024, "budget": charlm.BUDGET}
    defaults |= TASKS[args.task]["quick" if args.quick else "full"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seeds = args.seeds or ("0" if args.quick else "0,1,2")
    args.systems = args.systems or (QUICK_SYSTEMS if args.quick else SYSTEMS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    torch.set_num_threads(1)  # the cluster's processes share the machine's cores
    run = run_digits if args.task == "digits" else run_charlm
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-quality-") as tmp:
        root = args.workdir or Path(tmp)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for system in ["baseline", *tc.split_systems(args.systems)]:
                try:
                    if system == "baseline":
                        res = run_baseline(args.task, seed, args)
                    else:
                        res = run(system, seed, args, root / f"{system.replace(':', '_')}-{seed}")
                except (ClusterError, OSError, ValueError, KeyError) as exc:
                    print(f"{system} seed {seed} failed: {exc}", file=sys.stderr, flush=True)
                    res = {"error": str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}
                row = {"task": args.task, "seed": seed, "system": system, **res}
                row["load1"] = round(os.getloadavg()[0], 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    command = "python experiments/quality_codecs.py " + " ".join(argv if argv is not None else sys.argv[1:])
    name = f"quality_codecs_{args.task}" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    tc.write_csv(args.out / f"{name}.csv", rows)
    text = summary(rows, args, command.strip())
    (args.out / f"{name}.md").write_text(text)
    plot(rows, args, args.out / f"{name}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
