"""Aggregation on the namespace testbed: stf+agg vs fair vs gloo PS vs torch DDP (DESIGN §5, §6).

The paper's setting (§6): a bottlenecked server link, heterogeneous worker uplinks, changing
bandwidth (NS: every ``--period`` s the server link takes 1, 1/2 or 1/4 of its rate and each
uplink 1 or 1/2) and a compute straggler (CS). The digits MLP 64-1024-1024-10 (4.5 MB of
float32 per update, as in ``testbed_e2e.py``) trains to a target test accuracy, asynchronously
and synchronously, with

- ``fair``    — mlfabric, every ready update sent at once (TCP shares the server's ingress);
- ``stf+agg`` — mlfabric, shortest transfer first with aggregation groups summed at worker
  hosts (their downlinks are idle in a parameter-server job) before the server (Fig. 6);
- ``gloo``    — a torch.distributed (gloo) parameter server: asynchronous as in
  ``testbed_e2e.py``; synchronous: rank 0 receives every worker's update, applies the sum,
  sends the model back;
- ``ddp``     — torch DistributedDataParallel over gloo (ring all-reduce between the workers,
  no server; synchronous only);
- ``POLICY@CODEC[@MODEL_CODEC]`` — an mlfabric policy whose workers push with a codec
  (``stf+agg@fp16``, ``stf+agg@int8+ef``: ``+ef`` adds error feedback at the sender) and whose
  server publishes its model with the model codec (docs/compression.md), as in
  ``testbed_codecs.py``; ``@hH`` adds local SGD (H local steps a push, ``@hHkK``: every
  step for the first K, ``@hHsS``: the delta pushed times S; ``stf+agg@h4s0.25``). The summary adds
  the ratio to the same policy without a codec (every step pushed).

Every (seed, mode, system) runs in turn on the same testbed, seeds and modes interleaved.
For each run: time to target (from the first update), worker updates applied and the bytes
that crossed the server's ingress per applied worker update (mlfabric: the daemons' transfer
reports; gloo PS: one update's size; ddp: no server). The summary gives per mode and system
the median time over the seeds, the min-max spread and the ratios against ``fair`` and
against the faster gloo baseline.

    python experiments/testbed_aggregation.py --quick     # 8 workers, target 0.85, 3 seeds
    python experiments/testbed_aggregation.py             # 8 workers, target 0.95, 3 seeds
    python experiments/testbed_aggregation.py --modes sync --systems stf+agg,stf+agg@fp16

Writes experiments/results/testbed_aggregation[_quick].{csv,md}. Needs root, ip, tc, torch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed_e2e as e2e  # the model, data, accuracy log, gloo PS and NS schedule
from harness import init_gloo, save_results, stop_all
from systems import pipelined
from testbed_codecs import ratios
from testbed_gloo import gloo_role, unflatten

from mlfabric.readyfile import write_ready_file

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("fair", "stf+agg", "gloo", "ddp")
UPLINKS = [200, 200, 100, 100, 50, 50, 25, 25]
#: seconds an mlfabric run may take to its first update (the time limit counts from then)
STARTUP_ALLOWANCE = 180.0
#: tries per run: a run that fails (e.g. a daemon not up in time on a loaded machine) is run again
START_ATTEMPTS = 2


# --------------------------------------------------------------------- mlfabric roles


def mlf_server(args: argparse.Namespace) -> int:
    e2e.one_thread()
    import mlfabric

    _, _, xte, yte = e2e.dataset()
    model = e2e.make_model()
    tensors = {k: p.detach().numpy().copy() for k, p in model.named_parameters()}
    # div_max: with a replica registered (testbed_replication.py); without one it has no effect
    params = e2e.job_params(args, sync_workers=args.sync_workers, div_max=args.div_max)
    server = mlfabric.register_as_server("agg", "ps", tensors, params)
    log = e2e.AccuracyLog(Path(args.out), args.target)
    write_ready_file(args.ready_file, {})
    # the time limit counts from the first update: on a loaded machine the workers' start-up
    # (torch, the data set) can take a large part of it, and the run would stop before training
    deadline = time.monotonic() + args.time_limit + STARTUP_ALLOWANCE
    started = False
    counts = {"updates": 0, "payloads": 0}
    norms: list[float] = []  # the declared norms (an aggregate: its members' sum)

    applied_at = [0.0]

    @server.on_update
    def apply(update: dict[str, np.ndarray], meta: Any) -> None:
        counts["updates"] += meta.num_updates
        counts["payloads"] += 1
        norms.append(meta.norm / meta.num_updates)
        for k, v in update.items():
            server.model[k] -= v
        applied_at[0] = time.time()  # the row's time: the apply, not the evaluation after serve()

    last_eval = -1
    with server:
        while time.monotonic() < deadline and log.reached is None:
            server.serve(timeout=0.25)
            if server.version != last_eval and server.version > 0:
                if not started:
                    started, deadline = True, time.monotonic() + args.time_limit
                last_eval = server.version
                e2e.load_numpy(model, server.model)
                log.record(server.version, e2e.accuracy(model, xte, yte), at=applied_at[0])
        norm = statistics.median(norms) if norms else None
        log.save({**counts, "dropped": server.dropped, "median_update_norm": norm, "version": server.version})
    return 0


# ------------------------------------------------------------------------ torch roles


def _init(args: argparse.Namespace, world: int) -> Any:
    return init_gloo(args.store, args.rank, world, args.ready_file)


def gloo_sync(args: argparse.Namespace) -> int:
    """Synchronous gloo PS: rank 0 gathers every worker's update, applies the sum, sends the model."""
    e2e.one_thread()
    import torch

    dist = _init(args, args.world)
    model = e2e.make_model()
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])
    if args.rank == 0:
        _, _, xte, yte = e2e.dataset()
        log = e2e.AccuracyLog(Path(args.out), args.target)
        deadline, version = time.monotonic() + args.time_limit, 0
        bufs = [torch.empty_like(flat) for _ in range(args.world - 1)]
        stop = torch.zeros(1)
        while True:
            for w in [dist.isend(torch.cat([flat, stop]), dst=r) for r in range(1, args.world)]:
                w.wait()
            if stop.item():
                break
            for w in [dist.irecv(b, src=r + 1) for r, b in enumerate(bufs)]:
                w.wait()
            flat.sub_(torch.stack(bufs).sum(0))
            version += 1
            e2e.load_numpy(model, unflatten(flat, names, shapes, sizes))
            log.record(version, e2e.accuracy(model, xte, yte))
            if log.reached is not None or time.monotonic() > deadline:
                stop[0] = 1
        log.save({"updates": version * (args.world - 1), "payloads": version, "dropped": 0})
        return 0
    xtr, ytr, _, _ = e2e.dataset()
    rng = np.random.default_rng(args.seed)
    buf = torch.empty(flat.numel() + 1)
    while True:
        dist.recv(buf, src=0)
        if buf[-1].item():
            return 0
        e2e.load_numpy(model, unflatten(buf[:-1], names, shapes, sizes))
        update = e2e.gradient(model, xtr, ytr, args.batch, rng, args.lr)
        time.sleep(args.compute_delay)
        dist.send(torch.cat([torch.as_tensor(update[k]).reshape(-1) for k in names]), dst=0)


def ddp(args: argparse.Namespace) -> int:
    """One rank of torch DDP (gloo all-reduce); each step applies the sum of the workers' lr * gradients."""
    e2e.one_thread()
    import torch

    dist = _init(args, args.world)
    model = e2e.make_model()
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr * args.world)  # DDP averages: lr * sum
    xtr, ytr, xte, yte = e2e.dataset()
    rng = np.random.default_rng(args.seed)
    log = e2e.AccuracyLog(Path(args.out), args.target) if args.rank == 0 else None
    deadline, step, stop = time.monotonic() + args.time_limit, 0, torch.zeros(1)
    while True:
        b = torch.as_tensor(rng.integers(0, len(xtr), size=args.batch))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xtr[b]), ytr[b]).backward()
        time.sleep(args.compute_delay)  # after backward: DDP has all-reduced the gradients
        opt.step()
        step += 1
        if log is not None:
            log.record(step, e2e.accuracy(model, xte, yte))
            stop[0] = float(log.reached is not None or time.monotonic() > deadline)
        dist.broadcast(stop, src=0)
        if stop.item():
            break
    if log is not None:
        log.save({"updates": step * args.world, "payloads": step, "dropped": 0})
    return 0


# ---------------------------------------------------------------------------- driver


def _torch_run(
    testbed: Any,
    role: str,
    hosts: list[str],
    args: argparse.Namespace,
    delays: dict[str, float],
    rates: Any,
    workdir: Path,
    me: list[str],
    common: list[str],
) -> dict[str, Any]:
    """Run ``role`` with rank i on ``hosts[i]`` (rank 0 records the accuracy)."""
    import subprocess

    out, ready = workdir / "server.json", workdir / "server.ready"
    env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    base = [*me, "--role", role, *common, "--world", str(len(hosts))]
    procs = []
    port = 0
    try:
        with open(workdir / "ranks.log", "wb") as log:
            for rank, host in enumerate(hosts):
                store = f"{testbed.address(hosts[0])}:{0 if rank == 0 else port}"
                argv = [*base, "--rank", str(rank), "--store", store, "--seed", str(rank)]
                argv += ["--compute-delay", str(delays.get(host, 0.0)), "--out", str(out)]
                argv += ["--ready-file", str(ready)]
                procs.append(testbed.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
                if rank == 0:
                    port = json.loads(e2e.wait_file(ready, procs[0], 60))["port"]
                    rates.start()
            procs[0].wait(timeout=args.time_limit + 180)
            rates.stop()
    finally:
        stop_all(procs)
    return dict(json.loads(out.read_text()))


def run_one(
    system: str,
    sync: bool,
    testbed: Any,
    topo: Path,
    workers: list[str],
    args: argparse.Namespace,
    seed: int,
    *,
    server_args: Sequence[str] = (),
    before_workers: Callable[[Any, Path], list[Any]] | None = None,
    changes: list[Any] | None = None,
) -> dict[str, Any]:
    """One run; ``server_args`` go to the mlfabric server's command line, ``before_workers(cluster,
    workdir)`` starts more processes once the server is up (they are terminated with the workers).

    ``changes``: the bandwidth schedule (default: :func:`ns_changes`; ``[]``: static rates).
    An mlfabric run's result has the daemons' transfer reports under ``transfers`` and its
    workers' steps (:class:`testbed_e2e.StepsLog`, all workers' lines) under ``steps``."""
    from mlfabric.cluster import ingress_bytes
    from mlfabric.scheduler.core.graph import load_topology
    from mlfabric.testbed.launch import TestbedCluster
    from mlfabric.testbed.schedule import ScheduleRunner, compute_delays

    workdir = args.tmp / f"{'sync' if sync else 'async'}-{system}-{seed}"
    for retry in itertools.count(1):  # a run tried again (it failed to start) gets its own directory
        if not workdir.exists():
            break
        workdir = args.tmp / f"{'sync' if sync else 'async'}-{system}-{seed}-retry{retry}"
    workdir.mkdir(parents=True)
    rng = random.Random(seed)
    delays = compute_delays(workers, base=args.compute, stragglers=1, slowdown=args.slowdown, rng=rng)
    args.seed = seed
    if changes is None:
        changes = ns_changes(load_topology(topo), workers, args)
    for link in {c.link for c in changes}:
        testbed.set_rate(link, testbed.graph.edges[link]["capacity"], "forward")
    rates = ScheduleRunner(lambda c: testbed.set_rate(c.link, c.rate, c.direction), changes)
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--lr", str(args.lr), "--batch", str(args.batch), "--target", str(args.target)]
    common += ["--time-limit", str(args.time_limit)]
    update_bytes = 4 * sum(p.numel() for p in e2e.make_model().parameters())
    if system == "ddp":
        res = _torch_run(testbed, "ddp", workers, args, delays, rates, workdir, me, common)
        return {**res, "ingress_per_update": None}
    if system == "gloo":
        role = "gloo-sync" if sync else "gloo"
        res = _torch_run(testbed, role, ["ps", *workers], args, delays, rates, workdir, me, common)
        res.setdefault("updates", res.get("applied", 0))
        return {**res, "ingress_per_update": float(update_bytes)}
    policy, codec, model_codec = e2e.split_system(system)
    extra = ["--aggregate-plan", args.aggregate_plan] if sync and policy == "stf+agg" else []
    extra += ["--pipelined-aggregates"] if pipelined(system) else []
    out, ready = workdir / "server.json", workdir / "server.ready"
    with TestbedCluster(
        testbed,
        topo,
        policy=policy,
        workdir=workdir / "run",
        extra_scheduler_args=extra,
        ready_timeout=STARTUP_ALLOWANCE,
        log_level=getattr(args, "log_level", "INFO"),
    ) as c:
        sargv = [*me, "--role", "mlf-server", *common, "--out", str(out), "--ready-file", str(ready)]
        sargv += ["--tau-max", str(args.tau_max), "--sync-workers", str(len(workers) if sync else 0)]
        sargv += list(server_args) + (["--model-codec", model_codec] if model_codec else [])
        sargv += ["--codec", codec] if codec and codec.startswith("auto") else []  # the job's auto
        server = c.spawn("ps", sargv)
        e2e.wait_file(ready, server.popen, STARTUP_ALLOWANCE)
        procs = before_workers(c, workdir) if before_workers is not None else []
        rates.start()
        for i, w in enumerate(workers):
            argv = [*me, "--role", "mlf-worker", *common, "--name", w, "--seed", str(100 * seed + i)]
            argv += ["--sync-workers", str(len(workers) if sync else 0), *e2e.worker_argv(system)]
            argv += ["--steps-log", str(workdir / f"steps-{w}.jsonl")]
            procs.append(c.spawn(w, [*argv, "--compute-delay", str(delays[w])]))
        c.wait(server, timeout=args.time_limit + STARTUP_ALLOWANCE + 180)
        rates.stop()
        for p in procs:
            p.popen.terminate()
        reports = c.transfer_reports()
    into = ingress_bytes(reports, "ps")
    res = dict(json.loads(out.read_text()))
    per_update = into / res["updates"] if res["updates"] else None
    steps = [
        json.loads(line)
        for path in sorted(workdir.glob("steps-*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    return {**res, "ingress_per_update": per_update, "transfers": reports, "steps": steps}


def ns_changes(graph: Any, workers: list[str], args: argparse.Namespace) -> list:
    """NS: the server's ingress (tor -> ps) takes 1, 1/2 or 1/4 of its rate, each uplink 1 or 1/2."""
    from mlfabric.testbed.schedule import ns_schedule

    rng, duration = random.Random(args.seed), args.time_limit + STARTUP_ALLOWANCE + 60
    kw: dict[str, Any] = {"period": args.period, "duration": duration, "rng": rng, "direction": "forward"}
    server = ns_schedule(graph, [("tor", "ps")], levels=(1.0, 0.5, 0.25), **kw)
    uplinks = ns_schedule(graph, [(w, "tor") for w in workers], levels=(1.0, 0.5), **kw)
    return sorted(server + uplinks, key=lambda c: c.at)


def topology(workers: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """A star whose server ingress is the bottleneck; heterogeneous uplinks, 1 Gbit/s downlinks.

    Every rate is multiplied by ``--scale`` (10: the paper's setting at a 1 Gbit/s server ingress).
    """
    k = args.scale
    links = [{"a": "ps", "b": "tor", "mbps": args.server_egress_mbps * k, "mbps_ba": args.server_mbps * k}]
    links += [
        {"a": w, "b": "tor", "mbps": up * k, "mbps_ba": 1000 * k}
        for w, up in zip(workers, UPLINKS, strict=True)
    ]
    return {"hosts": ["ps", *workers], "switches": ["tor"], "links": links}


def driver(args: argparse.Namespace) -> int:
    from mlfabric.scheduler.core.graph import load_topology
    from mlfabric.testbed.cluster import Testbed
    from mlfabric.testbed.netns import SubprocessRunner, missing_prerequisites, new_prefix, sweep_stale
    from mlfabric.testbed.topologies import to_toml

    missing = missing_prerequisites()
    if missing:
        print("testbed unavailable: " + "; ".join(missing), file=sys.stderr)
        return 2
    workers = [f"w{i}" for i in range(len(UPLINKS))]
    name = (
        "testbed_aggregation"
        + ("_quick" if args.quick else "")
        + (f"_x{args.scale:g}" if args.scale != 1 else "")
    )
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    systems = args.systems.split(",")
    sweep_stale(SubprocessRunner())
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-agg-") as tmp_dir:
        args.tmp = args.workdir or Path(tmp_dir)
        args.tmp.mkdir(parents=True, exist_ok=True)
        topo = args.tmp / "topology.toml"
        topo.write_text(to_toml(topology(workers, args)))
        with Testbed(load_topology(topo), new_prefix(random.Random())) as testbed:
            for seed in seeds:
                for mode in modes:
                    for system in systems:
                        if system == "ddp" and mode == "async":
                            continue  # DDP is synchronous
                        started = time.monotonic()
                        for attempt in range(1, START_ATTEMPTS + 1):
                            try:
                                res = run_one(system, mode == "sync", testbed, topo, workers, args, seed)
                                break
                            except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
                                print(
                                    f"{mode} {system} seed {seed} failed (attempt {attempt}): {exc!r}",
                                    file=sys.stderr,
                                    flush=True,
                                )
                                res = {"rows": [], "error": repr(exc)}
                        t = next(
                            (r["t"] for r in res["rows"] if e2e.reached(r["accuracy"], args.target)), None
                        )
                        row = {
                            "seed": seed,
                            "mode": mode,
                            "system": system,
                            "time_to_target": t,
                            "updates": res.get("updates"),
                            "payloads": res.get("payloads"),
                            "dropped": res.get("dropped", 0),
                            "ingress_per_update": res.get("ingress_per_update"),
                            "final_accuracy": res["rows"][-1]["accuracy"] if res["rows"] else None,
                            "updates_per_s": (res.get("updates") or 0) / res["rows"][-1]["t"]
                            if res["rows"] and res["rows"][-1]["t"] > 0
                            else None,
                            "load1": round(os.getloadavg()[0], 1),  # the shared machine's load at the end
                        }
                        rows.append(row)
                        print(json.dumps({**row, "wall": round(time.monotonic() - started, 1)}), flush=True)
    text = summary(rows, args)
    save_results(args.out, name, rows, text)
    print(text)
    return 0


def _median(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _systems_option(args: argparse.Namespace) -> str:
    """`` --systems ...`` when the run named other systems than the default ones, else ""."""
    systems = getattr(args, "systems", None)
    return f" --systems {systems}" if systems and systems != ",".join(SYSTEMS) else ""


def _per_seed(values: list[float]) -> str:
    """``a / b / c (median m)`` of per-seed ratios ("-" when none).

    Examples
    --------
    >>> _per_seed([1.5, 1.2, 2.0]), _per_seed([])
    ('1.50 / 1.20 / 2.00 (median 1.50)', '-')
    """
    if not values:
        return "-"
    return " / ".join(f"{v:.2f}" for v in values) + f" (median {statistics.median(values):.2f})"


def summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Per mode and system: median time to target over seeds, spread, ratios, ingress bytes."""
    lines = [
        f"# Aggregation on the testbed ({'quick' if args.quick else 'full'})",
        "",
        f"Digits MLP 64-1024-1024-10 (4.5 MB float32 updates), lr {args.lr}, batch {args.batch}; "
        f"{len(UPLINKS)} workers, uplinks {[u * args.scale for u in UPLINKS]} Mbit/s (downlinks "
        f"{1000 * args.scale:g}); server ingress {args.server_mbps * args.scale:g} Mbit/s (the "
        f"bottleneck), egress {args.server_egress_mbps * args.scale:g}. NS: the "
        f"server's ingress changes every {args.period:g} s "
        f"(1, 1/2, 1/4), uplinks (1, 1/2); CS: one straggler {args.slowdown:g}x slower "
        f"(compute {args.compute:g} s). Target {args.target}; tau_max {args.tau_max}; "
        f"seeds {args.seeds}. Command: `python experiments/testbed_aggregation.py"
        f"{' --quick' if args.quick else ''} --seeds {args.seeds} --modes {args.modes}"
        f"{f' --scale {args.scale:g}' if args.scale != 1 else ''}"
        f"{_systems_option(args)}`.",
        "",
        "| mode | system | runs | reached | median time to target (s) | min-max (s) | vs fair "
        "| vs faster gloo baseline | vs uncompressed, per seed | server ingress per applied update (MB) "
        "| vs fair | final accuracy | worker updates applied/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        of_mode = [r for r in rows if r["mode"] == mode]
        med: dict[str, float | None] = {}
        ingress: dict[str, float | None] = {}
        for system in dict.fromkeys(r["system"] for r in of_mode):
            rs = [r for r in of_mode if r["system"] == system]
            med[system] = _median([r["time_to_target"] for r in rs if r["time_to_target"] is not None])
            ingress[system] = _median([r["ingress_per_update"] for r in rs if r["ingress_per_update"]])
        baselines = [med[s] for s in ("gloo", "ddp") if med.get(s)]
        fastest = min(baselines) if baselines else None  # type: ignore[type-var]
        by_seed = {s: {r["seed"]: r["time_to_target"] for r in of_mode if r["system"] == s} for s in med}
        for system, m in med.items():
            rs = [r for r in of_mode if r["system"] == system]
            times = [r["time_to_target"] for r in rs if r["time_to_target"] is not None]
            fair, fair_in, mine_in = med.get("fair"), ingress.get("fair"), ingress[system]
            finals = [r["final_accuracy"] for r in rs if r["final_accuracy"] is not None]
            rates = [r["updates_per_s"] for r in rs if r.get("updates_per_s")]
            lines.append(
                f"| {mode} | {system} | {len(rs)} | {len(times)} | {m if m is None else f'{m:.1f}'} | "
                f"{f'{min(times):.1f}-{max(times):.1f}' if times else '-'} | "
                f"{f'{fair / m:.2f}x' if fair and m else '-'} | "
                f"{f'{fastest / m:.2f}x' if fastest and m else '-'} | "
                f"{_per_seed(ratios(by_seed, system)) if '@' in system else '-'} | "
                f"{f'{mine_in / 1e6:.2f}' if mine_in else '-'} | "
                f"{f'{mine_in / fair_in:.2f}x' if mine_in and fair_in else '-'} | "
                f"{f'{statistics.median(finals):.3f}' if finals else '-'} | "
                f"{f'{statistics.median(rates):.2f}' if rates else '-'} |"
            )
    loads = [r["load1"] for r in rows if r.get("load1") is not None]
    if loads:
        span = f"{min(loads):g} to {max(loads):g}"
        lines += ["", f"Load average (1 min) at the end of each run: {span} (2 cores)."]
    lines += [
        "",
        "Ratios: a time ratio > 1 means faster than the baseline; the ingress ratio is bytes per",
        "applied worker update relative to fair's (< 1: fewer bytes on the bottleneck). DDP has no",
        "server (ring all-reduce between the workers). Runs of one seed share the bandwidth",
        "schedule and the straggler; the machine is shared, so times are noisy.",
    ]
    return "\n".join(lines) + "\n"


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """The training and network setting's options (shared with ``testbed_replication.py``)."""
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--server-mbps", type=float, default=100.0, help="the server's ingress, Mbit/s")
    parser.add_argument("--server-egress-mbps", type=float, default=1000.0, help="the server's egress")
    parser.add_argument("--period", type=float, default=5.0, help="seconds between bandwidth changes")
    parser.add_argument("--compute", type=float, default=0.02, help="compute delay per iteration, s")
    parser.add_argument("--slowdown", type=float, default=4.0, help="the straggler's compute delay factor")
    parser.add_argument("--tau-max", type=int, default=32)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every link rate (10: a 1 Gbit/s server ingress)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The driver's options and the roles' (run inside the namespaces)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="target 0.85, 120 s limit per run")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--modes", default="async,sync")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--target", type=float)
    parser.add_argument("--time-limit", type=float, help="seconds per run (150 quick, 400 full)")
    add_setting_arguments(parser)
    parser.add_argument(
        "--aggregate-plan",
        choices=["async", "sync"],
        default="async",
        help="stf+agg's planner for synchronous training (the scheduler's --aggregate-plan; default "
        "async: the online planner, whose open aggregates gather a round's trickling updates)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, help="keep logs and per-run files here (default: a temp dir)")
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="of the scheduler and the daemons (DEBUG: each update's readiness, get and verdict)",
    )
    # the roles this script runs as inside the namespaces
    roles = ["mlf-server", "mlf-worker", "gloo", "gloo-sync", "ddp"]
    parser.add_argument("--role", choices=roles, help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    parser.add_argument("--compute-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--steps-log", help=argparse.SUPPRESS)  # a worker's (testbed_e2e.StepsLog)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sync-workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--div-max", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--codec", help=argparse.SUPPRESS)  # a worker's: fp16, int8+ef, ...
    e2e.add_local_options(parser)
    parser.add_argument("--model-codec", help=argparse.SUPPRESS)  # the server's: fp16, bf16
    return parser


def main() -> int:
    args, _ = build_parser().parse_known_args()
    args.target = args.target or (0.85 if args.quick else 0.95)
    args.time_limit = args.time_limit or (120.0 if args.quick else 400.0)
    if args.role is not None:
        args.out = str(args.out)
    if args.role == "mlf-server":
        return mlf_server(args)
    if args.role == "mlf-worker":
        return e2e.mlf_worker(args, job="agg")
    if args.role == "gloo":
        return gloo_role(args)
    if args.role == "gloo-sync":
        return gloo_sync(args)
    if args.role == "ddp":
        return ddp(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
