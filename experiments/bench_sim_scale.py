"""The simulator at cluster scale: CPU, wall and RSS per policy at 1,024 and 10,240 workers (issue 24).

Runs ``mlfabric simulate`` in the issue's two-tier setting (16 hosts per rack, 4:1
oversubscribed uplinks, a quarter of the NICs 4x slower, a tenth of the workers 3x slower
to compute, asynchronous SGD, 10 MB updates, 2 pushes per worker) once per (size, policy,
seed), each run in its own child process so that its CPU time and peak RSS are its own
(``os.wait4``'s resource usage of the child). Prints and writes
``experiments/results/bench_sim_scale.md`` (+ ``.json``) and a plot of mean completion time
and makespan relative to ``fair`` at each size (``.png``).

Columns: ``cpu`` is the child's user + system CPU seconds, interpreter start and imports
included (~1 s; ``> x``: the run was stopped unfinished after ``x``); ``sim cpu`` the CPU
seconds of the simulation alone (``time.process_time`` around it in the child); ``x fair``
is ``sim cpu`` over fair's at the same size and seed; ``wall`` the child's wall seconds;
``rss`` its peak resident set. ``makespan`` is the simulated time at which the last update
was applied (asynchronous SGD has no iterations). The figures are deterministic given the
seed (the simulation has no other randomness); the machine is shared, so wall times are
noisy and CPU time is the measure.

Targets (issue 24): ``stf`` at <= 3x fair's CPU at both sizes, ``stf+agg`` and ``stf+tree``
at <= 5x; each 10,240-worker run finishes in <= 10 minutes on 2 cores.

Run::

    python experiments/bench_sim_scale.py                          # 1,024 and 10,240, all policies
    python experiments/bench_sim_scale.py --sizes 1024 --seeds 0 1 2
    python experiments/bench_sim_scale.py --src /path/to/old/checkout   # the old code, same runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
POLICIES = ("fair", "stf", "stf+agg", "stf+tree")
SETTING = [
    "--preset", "two-tier", "--hosts-per-rack", "16", "--oversubscription", "4",
    "--slow-nics", "0.25:4", "--straggler", "0.1:3", "--iterations", "2",
]  # fmt: skip
TARGET = {"fair": 1.0, "stf": 3.0, "stf+agg": 5.0, "stf+tree": 5.0}


def child(argv: list[str], out: Path) -> int:
    """In the child: run the simulation in-process, timing its CPU, and write the JSON."""
    from mlfabric.scheduler.sim import cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args([*argv, "--json", str(out)])
    t0 = time.process_time()
    rc = cli.run(args)
    cpu = time.process_time() - t0
    rows = json.loads(out.read_text())
    for r in rows:
        r["sim_cpu_s"] = cpu
    out.write_text(json.dumps(rows, allow_nan=False))
    return rc


def run_one(src: Path, workers: int, policy: str, seed: int, timeout: float, label: str) -> dict[str, Any]:
    """One simulation in a child process; its stats plus cpu, wall and peak RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stats.json"
        argv = [*SETTING, "--workers", str(workers), "--policy", policy, "--seed", str(seed), "--quiet"]
        env = dict(os.environ, PYTHONPATH=str(src))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out), "--", *argv]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.DEVNULL)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                timed_out = True
                proc.send_signal(signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        row: dict[str, Any] = {"code": label, "workers": workers, "policy": policy, "seed": seed}
        row.update(
            cpu_s=usage.ru_utime + usage.ru_stime,
            wall_s=wall,
            rss_mb=usage.ru_maxrss / 1024,
            finished=not timed_out and proc.returncode == 0,
        )
        if row["finished"]:
            (stats,) = json.loads(out.read_text())
            row.update(
                sim_cpu_s=stats["sim_cpu_s"],
                completion_mean=stats["completion_mean"],
                makespan=stats["sim_time"],
                applied=stats["applied"],
                pushed=stats["pushed"],
                events=stats["events"],
                decisions=stats["decisions"],
                decide_share=_ratio(stats.get("decide_s"), stats.get("wall_s")),
            )
        return row


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's CPU, completion and makespan over fair's at the same size and seed."""
    fair = {(r["code"], r["workers"], r["seed"]): r for r in rows if r["policy"] == "fair" and r["finished"]}
    for r in rows:
        base = fair.get((r["code"], r["workers"], r["seed"]))
        for key in ("sim_cpu_s", "completion_mean", "makespan"):
            r[f"{key}_x_fair"] = _ratio(r.get(key), base.get(key) if base else None)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (code, size, policy): medians over the seeds, and the min-max of the CPU ratio."""
    out = []
    codes = list(dict.fromkeys(r["code"] for r in rows))
    keys = sorted(
        {(r["code"], r["workers"], r["policy"]) for r in rows},
        key=lambda k: (k[1], codes.index(k[0]), POLICIES.index(k[2])),
    )
    for code, workers, policy in keys:
        runs = [r for r in rows if (r["code"], r["workers"], r["policy"]) == (code, workers, policy)]
        done = [r for r in runs if r["finished"]]

        def med(key: str, done: list[dict[str, Any]] = done) -> float | None:
            vals = [r[key] for r in done if r.get(key) is not None]
            return statistics.median(vals) if vals else None

        ratios = [r["sim_cpu_s_x_fair"] for r in done if r.get("sim_cpu_s_x_fair") is not None]
        out.append(
            {
                "code": code,
                "workers": workers,
                "policy": policy,
                "seeds": len(runs),
                "finished": len(done),
                "cpu_s": med("cpu_s") if done else max((r.get("cpu_s") or 0.0 for r in runs), default=None),
                "sim_cpu_s": med("sim_cpu_s"),
                "cpu_x_fair": med("sim_cpu_s_x_fair"),
                "cpu_x_fair_min": min(ratios, default=None),
                "cpu_x_fair_max": max(ratios, default=None),
                "wall_s": med("wall_s") if done else max(r["wall_s"] for r in runs),
                "rss_mb": med("rss_mb") if done else max(r["rss_mb"] for r in runs),
                "completion_x_fair": med("completion_mean_x_fair"),
                "makespan_x_fair": med("makespan_x_fair"),
                "completion_mean": med("completion_mean"),
                "makespan": med("makespan"),
                "decide_share": med("decide_share"),
                "target": TARGET[policy],
            }
        )
    return out


def table(summ: list[dict[str, Any]]) -> str:
    """The summary as a markdown table."""
    lines = [
        "| workers | code | policy | seeds done | cpu (s) | sim cpu (s) | x fair [min-max] | target "
        "| deciding | wall (s) | rss (MB) | completion mean (s) | x fair | makespan (s) | x fair |",
        "|" + " --- |" * 15,
    ]
    for s in summ:
        span = (
            f" [{_fmt(s['cpu_x_fair_min'], '.2f')}-{_fmt(s['cpu_x_fair_max'], '.2f')}]"
            if s["cpu_x_fair_min"] is not None and s["finished"] > 1
            else ""
        )
        met = "" if s["cpu_x_fair"] is None else (" met" if s["cpu_x_fair"] <= s["target"] else " missed")
        lines.append(
            f"| {s['workers']:,} | {s['code']} | {s['policy']} | {s['finished']}/{s['seeds']} "
            f"| {'' if s['finished'] else '> '}{_fmt(s['cpu_s'], '.1f')} | {_fmt(s['sim_cpu_s'], '.1f')} "
            f"| {_fmt(s['cpu_x_fair'], '.2f')}{span} "
            f"| <= {s['target']:g}x{met} | {_fmt(s['decide_share'], '.0%')} | {_fmt(s['wall_s'], '.1f')} "
            f"| {_fmt(s['rss_mb'], '.0f')} "
            f"| {_fmt(s['completion_mean'], '.3f')} | {_fmt(s['completion_x_fair'], '.2f')} "
            f"| {_fmt(s['makespan'], '.2f')} | {_fmt(s['makespan_x_fair'], '.2f')} |"
        )
    return "\n".join(lines)


def plot(summ: list[dict[str, Any]], path: Path) -> None:
    """Mean completion and makespan over fair's, per policy, at each size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    code = summ[0]["code"] if summ else ""
    summ = [s for s in summ if s["code"] == code]
    sizes = sorted({s["workers"] for s in summ})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    width = 0.8 / len(POLICIES)
    for ax, key, title in (
        (axes[0], "completion_x_fair", "mean completion time / fair"),
        (axes[1], "makespan_x_fair", "makespan / fair"),
    ):
        for i, policy in enumerate(POLICIES):
            vals = []
            for n in sizes:
                s = next((s for s in summ if s["workers"] == n and s["policy"] == policy), None)
                v = s[key] if s is not None else None
                vals.append(math.nan if v is None else v)
            xs = [j + (i - (len(POLICIES) - 1) / 2) * width for j in range(len(sizes))]
            ax.bar(xs, vals, width, label=policy)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(sizes)), [f"{n:,} workers" for n in sizes])
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("mlfabric simulate, two-tier 4:1, 25% NICs 4x slower, 10% stragglers 3x (async)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    """Run the grid, print and write the results."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 10240])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds of wall per run (default 600)")
    ap.add_argument("--src", type=Path, default=ROOT, help="checkout whose mlfabric runs (default: this one)")
    ap.add_argument("--label", default="new", help="the code's name in the table (default: new)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_sim_scale")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="LABEL=FILE",
        help="run nothing: tabulate the runs of earlier result files (.json) together, each under "
        "LABEL (the plot shows the first label)",
    )
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for item in args.merge or ():
        label, _, path = item.partition("=")
        rows += [{**r, "code": label} for r in json.loads(Path(path).read_text())["runs"]]
    for n in args.sizes if not args.merge else ():
        for seed in args.seeds:
            for policy in args.policies:
                row = run_one(args.src.resolve(), n, policy, seed, args.timeout, args.label)
                rows.append(row)
                print(
                    f"# {n} workers, {policy}, seed {seed}: cpu {row['cpu_s']:.1f} s "
                    f"(sim {_fmt(row.get('sim_cpu_s'), '.1f')}), wall {row['wall_s']:.1f} s, "
                    f"rss {row['rss_mb']:.0f} MB" + ("" if row["finished"] else ", DID NOT FINISH"),
                    file=sys.stderr,
                    flush=True,
                )
    add_ratios(rows)
    summ = summary(rows)
    text = table(summ)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python experiments/bench_sim_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    head = (
        f"# bench_sim_scale\n\n`{cmd.strip()}` (source: {args.src}), setting: "
        f"`mlfabric simulate {' '.join(SETTING)}`, seeds {args.seeds}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f} at the end.\n\n"
    )
    args.out.with_suffix(".md").write_text(head + text + "\n")
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": cmd, "runs": rows, "summary": summ}, indent=1, allow_nan=False)
    )
    plot(summ, args.out.with_suffix(".png"))
    print(f"# wrote {args.out}.md, .json, .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[4:] if sys.argv[3] == "--" else sys.argv[3:], Path(sys.argv[2])))
    sys.exit(main())
