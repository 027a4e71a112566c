"""End-to-end asynchronous SGD on the namespace testbed under changing bandwidth (DESIGN §5, §6).

The digits MLP widened to 64-1024-1024-10 (4.5 MB of float32 per update) trains with an
asynchronous parameter server until a target test accuracy, three ways, on the same
testbed, the same changing-bandwidth schedule (an NS setting: every ``--period`` s the
server's link takes 1, 1/2 or 1/4 of its rate and each worker uplink 1 or 1/2) and the same
compute delays (a CS setting: one straggler computes ``--slowdown`` times longer):

- ``stf``  — mlfabric, shortest transfer first with network time-sharing;
- ``fair`` — mlfabric, every ready update sent at once (TCP shares the bottleneck);
- ``gloo`` — a torch.distributed (gloo) parameter server written the straightforward way:
  rank 0 keeps one ``irecv`` posted per worker, so all workers' gradients flow to it
  concurrently; it applies whichever arrives and sends that worker the new model.

Each worker: get the model, compute a minibatch gradient, wait its compute delay, push
``lr * gradient``, wait. The server evaluates test accuracy as it goes; time to target is
the wall time from the first update until the accuracy first reaches the target.

    python experiments/testbed_e2e.py --quick     # 4 workers, target 0.90
    python experiments/testbed_e2e.py             # 8 workers, target 0.95
    python experiments/testbed_e2e.py --uniform-mbps 1000   # every link at 1 Gbit/s, no changes

A system may name the workers' codec (``stf@int8+ef``, ``stf@auto``: the scheduler's choice,
the job registered with ``Params(compression="auto")``; docs/compression.md) and the model's
(``stf@int8+ef@fp16``), and local SGD (``stf@h4``: 4 local steps a push; ``stf@int8+ef@h4k10``:
post-local SGD, every step for the first 10; ``stf@h4s0.25``: the delta pushed times 0.25, the mean
of the steps); ``experiments/testbed_codecs.py`` compares them
over seeds.

Writes experiments/results/testbed_e2e[_quick].{csv,png,md} and ..._transfers.csv (the mlfabric
daemons' transfer reports). Needs root, ip, tc, torch.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_task import (
    HIDDEN,
    AccuracyLog,
    accuracy,
    dataset,
    gradient,
    load_numpy,
    make_model,
    one_thread,
    reached,
)
from harness import wait_file
from systems import add_local_options, split_system, split_systems, worker_argv
from testbed_gloo import gloo_role, run_gloo

from mlfabric.examples.digits import split_codec
from mlfabric.readyfile import write_ready_file

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("stf", "fair", "gloo")


# --------------------------------------------------------------------- mlfabric roles


def mlf_server(args: argparse.Namespace) -> int:
    one_thread()
    import mlfabric

    _, _, xte, yte = dataset()
    model = make_model()
    tensors = {k: p.detach().numpy().copy() for k, p in model.named_parameters()}
    params = job_params(args)
    server = mlfabric.register_as_server("e2e", "ps", tensors, params)
    log = AccuracyLog(Path(args.out), args.target)
    write_ready_file(args.ready_file, {})
    deadline = time.monotonic() + args.time_limit
    delays: list[int] = []

    applied_at = [0.0]

    @server.on_update
    def apply(update: dict[str, np.ndarray], meta: Any) -> None:
        delays.append(meta.delay)
        for k, v in update.items():
            server.model[k] -= v
        applied_at[0] = time.time()  # the row's time: the apply, not the evaluation after serve()

    log.start = None
    last_eval = -1
    with server:
        while time.monotonic() < deadline and log.reached is None:
            server.serve(timeout=0.25)
            if server.version != last_eval and server.version > 0:
                last_eval = server.version
                load_numpy(model, server.model)
                log.record(server.version, accuracy(model, xte, yte), at=applied_at[0])
        log.save({"applied": server.applied, "dropped": server.dropped, "delays": delays})
    return 0


def job_params(args: argparse.Namespace, **params: Any) -> Any:
    """The job's params: ``tau_max``, the model's codec, ``auto`` compression if the codec is,
    and ``params`` (``sync_workers``, ``div_max``: the aggregation testbed's).

    Examples
    --------
    >>> ns = argparse.Namespace(tau_max=32, model_codec=None, codec="auto+ef")
    >>> job_params(ns).compression
    'auto'
    >>> job_params(argparse.Namespace(tau_max=32, model_codec=None, codec="int8")).compression is None
    True
    """
    import mlfabric

    codec = split_codec(args.codec)[0]  # "auto": the job's, so the scheduler advises its workers
    compression = codec if codec and codec.startswith("auto") else None
    return mlfabric.Params(
        tau_max=args.tau_max, compression=compression, model_compression=args.model_codec, **params
    )


def mlf_worker(args: argparse.Namespace, job: str = "e2e") -> int:
    """A worker of ``job``: get, compute, push (with ``--codec``), wait (a round, when synchronous).

    With ``--local-period H`` (``--local-warmup K``) the steps are local SGD's
    (:class:`mlfabric.LocalSGD`): the gradient of the local copy applied to it, one push of the
    steps' sum every H steps (every step for the first K), then the server's model again.
    """
    one_thread()
    import mlfabric

    xtr, ytr, _, _ = dataset()
    model = make_model()
    rng = np.random.default_rng(args.seed)
    codec, feedback = split_codec(args.codec)
    sync = getattr(args, "sync_workers", 0) > 0
    schedule = (getattr(args, "local_period", 1), getattr(args, "local_warmup", 0))
    worker = mlfabric.register_as_worker(job, name=args.name, wait=60)
    worker.rng = np.random.default_rng(args.seed + 1000)  # int8's stochastic rounding, seeded
    if schedule != (1, 0):
        return _local_sgd_worker(args, worker, model, (xtr, ytr, rng), codec, feedback, schedule)
    floor = None  # synchronous: the version its last update was applied in
    steps = StepsLog(getattr(args, "steps_log", None))
    with worker, steps:
        while True:
            try:
                version, tensors = worker.get("ps", min_version=floor)
            except mlfabric.MlfabricError:
                return 0  # the server is gone: training is over
            got = time.time()
            load_numpy(model, tensors)
            update = gradient(model, xtr, ytr, args.batch, rng, args.lr)
            time.sleep(args.compute_delay)
            handle = worker.push("ps", update, codec=codec, error_feedback=feedback)
            steps.record(version=version, got=got, handed=time.time())
            result = handle.wait(timeout=300)
            if not result.applied and "unregistered" in result.reason:
                return 0
            # synchronous: the next model is the round's (version at least the one it was applied
            # in), which the host's daemon or its rack's relay may serve (docs/model-relays.md);
            # asynchronous: the server's current model, from the server's daemon
            floor = result.version if result.applied and sync else None


class StepsLog:
    """A worker's steps as JSON lines (Unix seconds): the model's version, when it was in hand
    (``got``) and when the update computed from it was handed to the daemon (``handed``).

    The round split of ``testbed_racks.py`` reads them (the model's way down, the compute). A
    line is written per step, so a worker terminated at the run's end leaves its steps. No
    path: nothing is written.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._file: Any = None

    def __enter__(self) -> StepsLog:
        if self.path:
            self._file = open(self.path, "a", buffering=1)  # closed by __exit__
        return self

    def record(self, **fields: float) -> None:
        if self._file is not None:
            self._file.write(json.dumps(fields) + "\n")

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()


def _local_sgd_worker(
    args: argparse.Namespace,
    worker: Any,
    model: Any,
    data: tuple[Any, Any, np.random.Generator],
    codec: str | None,
    feedback: bool,
    schedule: tuple[int, int],
) -> int:
    """:func:`mlf_worker`'s loop with local steps: a push of their sum (times ``--local-scale``)
    every ``schedule[0]``."""
    import mlfabric

    xtr, ytr, rng = data
    period, warmup = schedule
    local = mlfabric.LocalSGD(
        worker,
        "ps",
        period=period,
        warmup=warmup,
        codec=codec,
        error_feedback=feedback,
        scale=args.local_scale,
        timeout=300,
    )
    with worker:
        try:
            local.fetch()
            while True:
                load_numpy(model, local.model)
                update = gradient(model, xtr, ytr, args.batch, rng, args.lr)
                time.sleep(args.compute_delay)
                result = local.step(update)  # a push (then the model again) every H-th step
                if result is not None and not result.applied and "unregistered" in result.reason:
                    return 0
        except mlfabric.MlfabricError:
            return 0  # the server is gone: training is over


def run_system(
    system: str,
    testbed: Any,
    topo: Path,
    workers: list[str],
    args: argparse.Namespace,
    delays: dict[str, float],
    changes: list,
    workdir: Path,
) -> dict[str, Any]:
    from mlfabric.testbed.launch import TestbedCluster
    from mlfabric.testbed.schedule import ScheduleRunner

    workdir.mkdir(parents=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--lr", str(args.lr), "--batch", str(args.batch), "--target", str(args.target)]
    common += ["--time-limit", str(args.time_limit)]
    out, ready = workdir / "server.json", workdir / "server.ready"
    for link in {c.link for c in changes}:  # every system starts from the configured rates
        testbed.set_rate(link, testbed.graph.edges[link]["capacity"], "both")
    rates = ScheduleRunner(lambda c: testbed.set_rate(c.link, c.rate, c.direction), changes)
    if system == "gloo":
        return run_gloo(testbed, workers, args, delays, rates, workdir, me, common)
    policy, codec, model_codec = split_system(system)
    with TestbedCluster(testbed, topo, policy=policy, workdir=workdir / "run") as cluster:
        sargv = [*me, "--role", "mlf-server", *common, "--out", str(out), "--ready-file", str(ready)]
        sargv += ["--model-codec", model_codec] if model_codec else []
        sargv += ["--codec", codec] if codec and codec.startswith("auto") else []  # the job's auto
        server = cluster.spawn("ps", [*sargv, "--tau-max", str(args.tau_max)])
        wait_file(ready, server.popen, 120)
        rates.start()
        procs = []
        for i, w in enumerate(workers):
            argv = [*me, "--role", "mlf-worker", *common, "--name", w, "--seed", str(i), *worker_argv(system)]
            procs.append(cluster.spawn(w, [*argv, "--compute-delay", str(delays[w])]))
        cluster.wait(server, timeout=args.time_limit + 120)
        rates.stop()
        for p in procs:
            p.popen.terminate()
    transfers = [dict(r, system=system) for r in cluster.transfer_reports()]  # the daemons' reports
    return {**json.loads(out.read_text()), "transfers": transfers}


def ns_setting(graph: Any, workers: list[str], args: argparse.Namespace) -> list:
    """The changing-bandwidth schedule: the server link and every worker uplink change each period.

    None with ``--uniform-mbps`` (every link stays at that rate).
    """
    from mlfabric.testbed.schedule import ns_schedule

    if args.uniform_mbps:
        return []

    rng = random.Random(args.seed)
    server = ns_schedule(
        graph,
        [("ps", "tor")],
        levels=(1.0, 0.5, 0.25),
        period=args.period,
        duration=args.time_limit + 60,
        rng=rng,
    )
    uplinks = ns_schedule(
        graph,
        [(w, "tor") for w in workers],
        levels=(1.0, 0.5),
        period=args.period,
        duration=args.time_limit + 60,
        rng=rng,
    )
    return sorted(server + uplinks, key=lambda c: c.at)


def plot(results: dict[str, dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for system, res in results.items():
        rows = res["rows"]
        ax.plot([r["t"] for r in rows], [r["accuracy"] for r in rows], label=system)
    ax.axhline(target, color="gray", linestyle="--", label=f"target {target}")
    ax.set_xlabel("seconds since the first update")
    ax.set_ylabel("test accuracy")
    ax.set_title("async SGD, digits MLP (4.5 MB updates), changing bandwidth")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def worker_uplinks(quick: bool, uniform: float | None = None) -> list[float]:
    """The workers' uplinks in Mbit/s: 4 workers with ``--quick``, else 8; all ``uniform`` if given.

    Examples
    --------
    >>> worker_uplinks(True), worker_uplinks(True, 1000.0)
    ([100, 100, 50, 50], [1000.0, 1000.0, 1000.0, 1000.0])
    """
    uplinks: list[float] = [100, 100, 50, 50] if quick else [200, 200, 100, 100, 50, 50, 25, 25]
    return [float(uniform)] * len(uplinks) if uniform else uplinks


def layout(args: argparse.Namespace) -> tuple[list[float], list[str], dict[str, float]]:
    """The workers' uplinks (Mbit/s), names and compute delays (seeded by ``--seed``)."""
    from mlfabric.testbed.schedule import compute_delays

    uplinks = worker_uplinks(args.quick, args.uniform_mbps)
    workers = [f"w{i}" for i in range(len(uplinks))]
    delays = compute_delays(
        workers, base=args.compute, stragglers=1, slowdown=args.slowdown, rng=random.Random(args.seed)
    )
    return uplinks, workers, delays


def write_topology(path: Path, args: argparse.Namespace, uplinks: list[float], workers: list[str]) -> Path:
    """The bottleneck star (the server's link ``--server-mbps``) as a topology file at ``path``."""
    from mlfabric.testbed.topologies import bottleneck_star, to_toml

    star = bottleneck_star("ps", args.server_mbps, dict(zip(workers, uplinks, strict=True)))
    path.write_text(to_toml(star))
    return path


def driver(args: argparse.Namespace) -> int:
    from mlfabric.scheduler.core.graph import load_topology
    from mlfabric.testbed.cluster import Testbed
    from mlfabric.testbed.launch import write_transfer_csv
    from mlfabric.testbed.netns import SubprocessRunner, missing_prerequisites, new_prefix, sweep_stale

    missing = missing_prerequisites()
    if missing:
        print("testbed unavailable: " + "; ".join(missing), file=sys.stderr)
        return 2
    uplinks, workers, delays = layout(args)
    name = "testbed_e2e" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resummarize:  # the results of an earlier run kept with --workdir
        done = {s: args.resummarize / s / "server.json" for s in split_systems(args.systems)}
        results = {s: json.loads(p.read_text()) for s, p in done.items() if p.exists()}
        report(
            results,
            args,
            uplinks,
            delays,
            [f"summarized from the kept run files of {args.resummarize}"],
            name,
        )
        return 0
    sweep_stale(SubprocessRunner())
    results = {}
    transfers: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-e2e-") as tmp_dir:
        tmp = args.workdir or Path(tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        topo = write_topology(tmp / "topology.toml", args, uplinks, workers)
        graph = load_topology(topo)
        changes = ns_setting(graph, workers, args)
        with Testbed(graph, new_prefix(random.Random())) as testbed:
            for system in split_systems(args.systems):
                res = run_system(system, testbed, topo, workers, args, delays, changes, tmp / system)
                transfers += res.pop("transfers", [])
                results[system] = res
                print(
                    f"{system}: time to {args.target}: {res['time_to_target']}, applied {res['applied']}, "
                    f"dropped {res['dropped']}",
                    flush=True,
                )
            notes = list(testbed.notes)
    write_transfer_csv(args.out / f"{name}_transfers.csv", transfers, leading=["system"])
    report(results, args, uplinks, delays, notes, name)
    return 0


def report(
    results: dict[str, dict],
    args: argparse.Namespace,
    uplinks: list[float],
    delays: dict[str, float],
    notes: list[str],
    name: str,
) -> None:
    """Write the CSV, the plot and the summary; time to target is recomputed from the rows."""
    for res in results.values():
        res["time_to_target"] = next(
            (r["t"] for r in res["rows"] if reached(r["accuracy"], args.target)), None
        )
    rows = [dict(system=s, **r) for s, res in results.items() for r in res["rows"]]
    with open(args.out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["system", "t", "version", "accuracy"])
        writer.writeheader()
        writer.writerows(rows)
    plot(results, args.target, args.out / f"{name}.png")
    summary(results, args, uplinks, delays, notes, args.out / f"{name}.md")
    print((args.out / f"{name}.md").read_text())


def longest_gap(rows: list[dict]) -> float:
    """Longest time between two successive model versions seen by the server (a stall)."""
    times = [r["t"] for r in rows]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def summary(
    results: dict[str, dict],
    args: argparse.Namespace,
    uplinks: list[float],
    delays: dict[str, float],
    notes: list[str],
    path: Path,
) -> None:
    def fmt(x: float | None) -> str:
        return "not reached" if x is None else f"{x:.1f}"

    lines = [
        f"# Testbed end-to-end async SGD ({'quick' if args.quick else 'full'})",
        "",
        f"Digits MLP 64-{HIDDEN}-{HIDDEN}-10 (4.5 MB float32 updates), lr {args.lr}, batch {args.batch};",
        f"{len(uplinks)} workers, uplinks {uplinks} Mbit/s; server link {args.server_mbps:g} Mbit/s.",
        f"NS setting: every {args.period:g} s the server link takes 1, 1/2 or 1/4 of its rate and",
        "each uplink 1 or 1/2 (the same seeded schedule for every system, applied with `tc qdisc change`).",
        f"CS setting: compute delay per iteration {sorted(set(delays.values()))} s (one straggler).",
        f"Target test accuracy {args.target}; limit {args.time_limit:g} s per system; "
        f"tau_max {args.tau_max}.",
        "",
        "| system | time to target (s) | applied | dropped | mean delay | p99 delay | final accuracy "
        "| longest gap between updates (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for system, res in results.items():
        d = res.get("delays") or [0]
        final = res["rows"][-1]["accuracy"] if res["rows"] else float("nan")
        lines.append(
            f"| {system} | {fmt(res['time_to_target'])} | {res['applied']} | {res['dropped']} | "
            f"{np.mean(d):.2f} | {np.percentile(d, 99):.0f} | {final:.3f} | {longest_gap(res['rows']):.1f} |"
        )
    base = results.get("gloo", {}).get("time_to_target")
    for system in ("stf", "fair"):
        t = results.get(system, {}).get("time_to_target")
        if base and t:
            lines.append(f"\n{system} vs gloo: {base / t:.2f}x faster to target.")
    t_stf, t_fair = (results.get(s, {}).get("time_to_target") for s in ("stf", "fair"))
    if t_stf and t_fair:
        lines.append(f"\nstf vs fair: {t_fair / t_stf:.2f}x faster to target.")
    lines += [
        "",
        "One run per system: the test accuracy of asynchronous SGD fluctuates by several points",
        "between evaluations, so a time to target from one run is noisy; compare updates applied",
        "per second and the delays too, and repeat with other --seed values before concluding.",
        "",
        *(f"Note: {n}" for n in notes),
    ]
    path.write_text("\n".join(lines) + "\n")


def build_parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The options of the driver and of the roles it starts (``--role``)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: 4 workers, target 0.90")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated: stf, fair, gloo, or POLICY@CODEC[@MODEL_CODEC] (stf@int8+ef@fp16: "
        "the workers' codec, the model's; stf+agg@topk:ratio=0.01+ef; "
        "stf@randk:ratio=0.01,rescale=0+ef)",
    )
    parser.add_argument("--target", type=float)
    parser.add_argument("--time-limit", type=float, help="seconds per system (150 quick, 400 full)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--server-mbps", type=float, default=100.0)
    parser.add_argument("--period", type=float, default=5.0, help="seconds between bandwidth changes")
    parser.add_argument(
        "--uniform-mbps",
        type=float,
        help="a uniform graph instead: every worker uplink and the server link at this rate (Mbit/s), "
        "no bandwidth changes",
    )
    parser.add_argument("--compute", type=float, default=0.02, help="extra compute delay per iteration, s")
    parser.add_argument("--slowdown", type=float, default=4.0, help="the straggler's compute delay factor")
    parser.add_argument("--tau-max", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, help="keep logs and per-run files here (default: a temp dir)")
    parser.add_argument(
        "--resummarize", type=Path, metavar="WORKDIR", help="only rewrite the outputs of a kept run"
    )
    # the roles this script runs as inside the namespaces
    parser.add_argument("--role", choices=["mlf-server", "mlf-worker", "gloo"], help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    parser.add_argument("--compute-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--steps-log", help=argparse.SUPPRESS)  # a worker's StepsLog
    parser.add_argument("--codec", help=argparse.SUPPRESS)  # a worker's: int8, fp16, int8+ef, ...
    add_local_options(parser)
    parser.add_argument("--model-codec", help=argparse.SUPPRESS)  # the server's: fp16, bf16
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options, with the target and time limit defaulted by ``--quick``."""
    args, _ = parser.parse_known_args()
    args.target = args.target or (0.90 if args.quick else 0.95)
    args.time_limit = args.time_limit or (150.0 if args.quick else 400.0)
    if args.uniform_mbps:
        args.server_mbps = args.uniform_mbps
    return args


def main() -> int:
    args = parse(build_parser())
    if args.role == "mlf-server":
        return mlf_server(args)
    if args.role == "mlf-worker":
        return mlf_worker(args)
    if args.role == "gloo":
        return gloo_role(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
