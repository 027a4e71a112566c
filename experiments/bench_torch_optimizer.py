"""The digits MLP: a hand-written push/get loop vs ``mlfabric.torch.DistributedOptimizer`` (wait-free).

One local cluster (scheduler + daemons as real processes on loopback, the daemons enforcing
the topology's NIC rates: ``--mbps`` per host, a star), the server on h0 and ``--workers``
workers on h1.. . Per seed, both systems run side by side on the same cluster (in turn,
order alternating with the seed), each training the same ``torch.nn`` MLP (64 -> ``--hidden``
-> 10, plain SGD, lr 0.05, batch 32) for ``--epochs`` epochs of each worker's shard:

- ``hand``: the loop of ``mlfabric.examples.digits``: ``get`` the whole model from one server,
  load it, forward/backward, ``push`` ``lr * grad`` (the server subtracts it), wait for the
  verdict;
- ``serial``: the same model and data wrapped by ``DistributedOptimizer(pipeline=False)``
  (wait-free, one server per tensor: each tensor's update pushed from its gradient hook;
  ``step()`` waits for every verdict, then fetches the servers' models one after another);
- ``optimizer``: the same with the default ``pipeline=True``: each tensor's model fetched as
  soon as its own verdict is in, while the other tensors' pushes are under way.

A worker times each epoch (wall clock, from its first step); the table gives per system the
median epoch time over workers, epochs and seeds, its min-max over the seeds' medians, and
per seed the ratios ``hand / X`` and ``serial / optimizer`` (> 1: the latter faster). Every
run checks that the servers applied exactly the updates the workers pushed.

    python experiments/bench_torch_optimizer.py --seeds 0,1,2 --mbps 100 \\
        --out experiments/results/bench_torch_optimizer.md
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

import numpy as np

#: the systems, in the order of the tables
SYSTEMS = ("hand", "serial", "optimizer")


def _model(hidden: int, seed: int) -> Any:
    from mlfabric.examples.torchrun_digits import build_model

    return build_model(hidden, seed)


def serve(args: argparse.Namespace) -> None:
    """A server process: the whole model on one server (hand) or one server per tensor (optimizer)."""
    import torch

    import mlfabric
    from mlfabric.torch import GroupServers

    torch.set_num_threads(1)
    model = _model(args.hidden, args.seed)
    stop = Path(args.stop_file)
    if args.system == "hand":
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        with mlfabric.register_as_server(args.job, "ps", init) as server:
            Path(args.ready_file).touch()
            while not stop.exists():
                server.serve(timeout=0.1)
            applied, updates = server.applied, server.applied
    else:
        with GroupServers(args.job, model.named_parameters(), group_bytes=0) as servers:
            Path(args.ready_file).touch()
            while not stop.exists():
                servers.check()
                time.sleep(0.05)
            applied, updates = servers.applied, len(set(servers.update_ids))
    Path(args.result).write_text(json.dumps({"applied": applied, "unique_updates": updates}))


def work(args: argparse.Namespace) -> None:
    """A worker process: ``--epochs`` epochs of its shard, each timed."""
    import torch

    import mlfabric
    from mlfabric.examples.digits import load_data
    from mlfabric.torch import DistributedOptimizer

    torch.set_num_threads(1)
    model = _model(args.hidden, args.seed)
    x, y, _, _ = load_data(args.seed)
    shard = np.arange(len(x))[args.rank :: args.workers]
    rng = np.random.default_rng(1000 * args.seed + args.rank)
    steps = len(shard) // 32
    worker = mlfabric.register_as_worker(args.job, name=f"w{args.rank}", wait=60)
    opt = None
    if args.system != "hand":
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = DistributedOptimizer(
            sgd,
            model.named_parameters(),
            worker,
            group_bytes=0,
            on_drop="count",
            pipeline=args.system == "optimizer",
        )
        opt.pull()
    params = dict(model.named_parameters())
    epochs: list[float] = []
    pushes = applied = 0
    hidden = comm = 0.0
    for _ in range(args.epochs):
        started = time.monotonic()
        for _ in range(steps):
            batch = rng.choice(shard, size=32)
            xb, yb = torch.from_numpy(x[batch]), torch.from_numpy(y[batch])
            if opt is not None:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
                continue
            _, served = worker.get("ps", as_torch=True)
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(served[n])
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            update = {n: (0.05 * p.grad).detach() for n, p in params.items()}
            result = worker.push("ps", update).wait(timeout=120)
            pushes += 1
            applied += result.status == mlfabric.APPLIED
        epochs.append(time.monotonic() - started)
    if opt is not None:
        pushes, applied = opt.pushed, opt.applied
        hidden, comm = opt.hidden_seconds, opt.comm_seconds
        opt.close()
    worker.close()
    Path(args.result).write_text(
        json.dumps({"epochs": epochs, "pushes": pushes, "applied": applied, "hidden": hidden, "comm": comm})
    )


def run_system(cluster: Any, system: str, seed: int, args: argparse.Namespace, work_dir: Path) -> dict:
    """One run of ``system``: its epoch times and the exactly-once check."""
    job = f"{system}-{seed}"
    base = [sys.executable, str(Path(__file__).resolve())]
    common = ["--system", system, "--job", job, "--seed", str(seed), "--hidden", str(args.hidden)]
    stop, ready = work_dir / f"{job}.stop", work_dir / f"{job}.ready"
    server = cluster.spawn(
        "h0",
        [*base, "serve", *common, "--stop-file", str(stop), "--ready-file", str(ready),
         "--result", str(work_dir / f"{job}-server.json")],
        name=f"{job}-server",
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not ready.exists():
        cluster.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"server of {job} not ready")
        time.sleep(0.05)
    workers = [
        cluster.spawn(
            f"h{1 + r}",
            [
                *base,
                "work",
                *common,
                "--rank",
                str(r),
                "--workers",
                str(args.workers),
                "--epochs",
                str(args.epochs),
                "--result",
                str(work_dir / f"{job}-w{r}.json"),
            ],
            name=f"{job}-w{r}",
        )
        for r in range(args.workers)
    ]
    for w in workers:
        cluster.wait(w, timeout=600)
    stop.touch()
    cluster.wait(server, timeout=60)
    served = json.loads((work_dir / f"{job}-server.json").read_text())
    results = [json.loads((work_dir / f"{job}-w{r}.json").read_text()) for r in range(args.workers)]
    pushed = sum(r["pushes"] for r in results)
    assert served["unique_updates"] == served["applied"] == pushed == sum(r["applied"] for r in results), (
        job,
        served,
        pushed,
    )
    comm = sum(r["comm"] for r in results)
    return {
        "epochs": [e for r in results for e in r["epochs"][1:] or r["epochs"]],
        "pushes": pushed,
        "hidden": sum(r["hidden"] for r in results) / comm if comm else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="role")
    for role in ("serve", "work"):
        p = sub.add_parser(role)
        p.add_argument("--system", choices=SYSTEMS, required=True)
        p.add_argument("--job", required=True)
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--hidden", type=int, required=True)
        p.add_argument("--result", required=True)
        p.add_argument("--stop-file")
        p.add_argument("--ready-file")
        p.add_argument("--rank", type=int)
        p.add_argument("--workers", type=int)
        p.add_argument("--epochs", type=int)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="per worker; the first is a warm-up")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--mbps", type=int, default=100)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.role == "serve":
        serve(args)
        return 0
    if args.role == "work":
        work(args)
        return 0
    from mlfabric.cluster import LocalCluster

    seeds = [int(s) for s in args.seeds.split(",")]
    hosts = [f"h{i}" for i in range(args.workers + 1)]
    work_dir = Path(tempfile.mkdtemp(prefix="mlfbo-"))
    lines = ["hosts = [" + ", ".join(f'"{h}"' for h in hosts) + "]", 'switches = ["sw"]']
    for h in hosts:
        lines += ["[[links]]", f'a = "{h}"', 'b = "sw"', f"mbps = {args.mbps}"]
    (work_dir / "topology.toml").write_text("\n".join(lines) + "\n")
    per_seed: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    rows = []
    load_before = os.getloadavg()[0]
    with LocalCluster(
        work_dir / "topology.toml", policy="stf", workdir=work_dir / "run", enforce_nic_rates=True
    ) as cluster:
        for seed in seeds:
            order = list(SYSTEMS[seed % len(SYSTEMS) :] + SYSTEMS[: seed % len(SYSTEMS)])  # rotated
            got = {name: run_system(cluster, name, seed, args, work_dir) for name in order}
            t = {name: statistics.median(got[name]["epochs"]) for name in SYSTEMS}
            for name in SYSTEMS:
                per_seed[name].append(t[name])
            rows.append(
                f"| {seed} | {t['hand']:.3f} | {t['serial']:.3f} | {t['optimizer']:.3f} | "
                f"{t['hand'] / t['optimizer']:.2f} | {t['serial'] / t['optimizer']:.2f} | "
                f"{got['hand']['pushes']} | {got['optimizer']['pushes']} | "
                f"{got['serial']['hidden']:.3f} / {got['optimizer']['hidden']:.3f} |"
            )
            print(rows[-1], flush=True)
    load_after = os.getloadavg()[0]

    def ratio(a: str, b: str) -> str:
        r = [x / y for x, y in zip(per_seed[a], per_seed[b], strict=True)]
        return f"median {statistics.median(r):.2f}, min-max {min(r):.2f}-{max(r):.2f}"

    out = [
        f"# Digits MLP 64-{args.hidden}-10, {args.workers} workers, {args.mbps} Mbit/s NICs (enforced), "
        f"{args.epochs} epochs (first a warm-up), seeds {args.seeds}; load average {load_before:.1f} "
        f"before, {load_after:.1f} after, {os.cpu_count()} cores",
        "",
        "Systems: `hand` (get, forward/backward, push, wait), `serial` (`DistributedOptimizer(pipeline="
        "False)`: the models fetched one after another once every verdict is in), `optimizer` (the "
        "default, `pipeline=True`: each model fetched as soon as its verdict is in). Communication "
        "hidden behind backward: over the optimizer's steps, the time from a step's first push to its "
        "last verdict that passed before `step()` was called, as a fraction of that span "
        "(`DistributedOptimizer.hidden_seconds / comm_seconds`).",
        "",
        f"`python experiments/bench_torch_optimizer.py --seeds {args.seeds} --mbps {args.mbps} "
        f"--hidden {args.hidden} --workers {args.workers} --epochs {args.epochs}`",
        "",
        "| seed | hand: s/epoch | serial: s/epoch | optimizer: s/epoch | hand / optimizer "
        "| serial / optimizer | pushes hand | pushes optimizer "
        "| hidden behind backward (serial / optimizer) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "| system | median s/epoch over seeds | min-max |",
        "| --- | --- | --- |",
        *[f"| {s} | {statistics.median(v):.3f} | {min(v):.3f}-{max(v):.3f} |" for s, v in per_seed.items()],
        "",
        f"hand / optimizer: {ratio('hand', 'optimizer')}; "
        f"serial / optimizer: {ratio('serial', 'optimizer')}; hand / serial: {ratio('hand', 'serial')}",
    ]
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
