"""Failover of a replicated parameter server on loopback (docs/replication.md, issue #14).

Per trial: a scheduler and four daemons (hosts ps, rep, a, b) on loopback, a server on ps
with ``Params(div_max=K x the norm of one update)``, its replica on rep, two workers pushing
float64 updates back to back. After ``--warmup`` seconds the server's process (or,
separately, its daemon) gets SIGKILL. Measured:

* **failover time**: from the kill until the promoted replica applies its first worker update;
* **norm lost**: the norms of the updates in the server's *shadow log* (every update it
  applied, appended and flushed as it applied it) that the replica never applied — to be
  compared with ``div_max``.

Usage::

    python experiments/failover.py --trials 10 --out experiments/results/failover.json

(``python experiments/failover.py role ...`` is how the script runs its own training roles.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

JOB, SERVER = "failover", "ps0"
SHAPE = (256, 256)
TOPOLOGY = """
hosts = ["ps", "rep", "a", "b"]
switches = ["sw"]
""" + "".join(f'[[links]]\na = "{h}"\nb = "sw"\nmbps = 10000\n' for h in ("ps", "rep", "a", "b"))


def _update(rank: int, i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([rank, i])
    return {"w": rng.integers(-3, 4, size=SHAPE).astype(np.float64)}


def _norm(u: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float((v**2).sum()) for v in u.values())))


# ---------------------------------------------------------------- roles (child processes)


def role_server(out: Path, div_max: float) -> None:
    import mlfabric

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    model = {"w": np.zeros(SHAPE)}
    srv = mlfabric.register_as_server(JOB, SERVER, model, mlfabric.Params(div_max=div_max))
    shadow = open(out / "shadow.jsonl", "a", buffering=1)  # noqa: SIM115 - line-buffered, lives with the process

    @srv.on_update
    def apply(update: dict[str, Any], meta: Any) -> None:
        srv.model["w"] -= update["w"]
        shadow.write(json.dumps({"id": meta.update_id, "norm": meta.norm}) + "\n")

    (out / "server.ready").touch()
    srv.serve(until=stop)


def role_replica(out: Path) -> None:
    import mlfabric

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rep = mlfabric.register_as_replica(JOB, SERVER)
    applied: list[str] = []
    after: list[float] = []

    @rep.on_update
    def apply(update: dict[str, Any], meta: Any) -> None:
        rep.model["w"] -= update["w"]
        applied.append(meta.update_id)
        if rep.promoted.is_set() and not after:
            after.append(time.time())
            (out / "replica.first.tmp").write_text(str(after[0]))
            os.replace(out / "replica.first.tmp", out / "replica.first")  # whole or absent

    (out / "replica.ready").touch()
    rep.serve(until=stop)
    (out / "replica.json").write_text(json.dumps({"applied": applied, "first_after_promotion": after}))


def role_worker(out: Path, rank: int) -> None:
    import mlfabric

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    w = mlfabric.register_as_worker(JOB, name=f"w{rank}", wait=60.0)
    i = 0
    while not stop.is_set():
        try:
            w.push(SERVER, _update(rank, i)).wait(timeout=30.0)
        except mlfabric.MlfabricError:
            time.sleep(0.05)  # the server is failing over
        i += 1


# ---------------------------------------------------------------- driver


def trial(victim: str, div_max: float, warmup: float, workdir: Path) -> dict[str, Any]:
    """One kill; returns the failover time and the norm lost."""
    from mlfabric.cluster import LocalCluster

    topology = workdir / "topology.toml"
    topology.write_text(TOPOLOGY)
    out = workdir / "out"
    out.mkdir()
    me = [sys.executable, str(Path(__file__).resolve()), "role"]
    cluster = LocalCluster(
        topology, policy="stf", workdir=workdir / "run", log_level="WARNING", ready_timeout=120
    ).start()
    try:
        server = cluster.spawn("ps", [*me, "server", str(out), str(div_max)], name="server")
        _wait(out / "server.ready", server)
        replica = cluster.spawn("rep", [*me, "replica", str(out)], name="replica")
        _wait(out / "replica.ready", replica)
        workers = [
            cluster.spawn(h, [*me, "worker", str(out), str(r)], name=f"w{r}") for r, h in enumerate("ab")
        ]
        time.sleep(warmup)
        deadline = time.monotonic() + 60
        while _lines(out / "shadow.jsonl") < 20:  # the workers are pushing
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not push within 60 s; log:\n{workers[0].log_tail()}")
            time.sleep(0.05)
        target = (
            server if victim == "process" else next(p for p in cluster.processes() if p.name == "daemon-ps")
        )
        killed_at = time.time()
        os.kill(target.popen.pid, signal.SIGKILL)
        first = out / "replica.first"
        deadline = time.monotonic() + 20
        while not first.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        failover = float(first.read_text()) - killed_at if first.exists() else float("nan")
        for p in workers:
            p.popen.terminate()
            p.popen.wait(timeout=30)
        replica.popen.terminate()
        replica.popen.wait(timeout=30)
    finally:
        cluster.stop()
    shadow = [json.loads(line) for line in (out / "shadow.jsonl").read_text().splitlines() if line.strip()]
    have = set(json.loads((out / "replica.json").read_text())["applied"])
    lost = [s for s in shadow if s["id"] not in have]
    return {
        "victim": victim,
        "failover_seconds": failover,
        "applied_at_server": len(shadow),
        "lost_updates": len(lost),
        "lost_norm": sum(s["norm"] for s in lost),
        "div_max": div_max,
    }


def overhead_trial(mode: str, div_max: float, seconds: float, workdir: Path) -> dict[str, Any]:
    """Updates the server applies in ``seconds`` of back-to-back pushes: no replica, bounded, chain."""
    from mlfabric.cluster import LocalCluster

    topology = workdir / "topology.toml"
    topology.write_text(TOPOLOGY)
    out = workdir / "out"
    out.mkdir()
    me = [sys.executable, str(Path(__file__).resolve()), "role"]
    bound = {"none": div_max, "div_max": div_max, "chain": 0.0}[mode]
    cluster = LocalCluster(
        topology, policy="stf", workdir=workdir / "run", log_level="WARNING", ready_timeout=120
    ).start()
    try:
        server = cluster.spawn("ps", [*me, "server", str(out), str(bound)], name="server")
        _wait(out / "server.ready", server)
        if mode != "none":
            replica = cluster.spawn("rep", [*me, "replica", str(out)], name="replica")
            _wait(out / "replica.ready", replica)
        workers = [
            cluster.spawn(h, [*me, "worker", str(out), str(r)], name=f"w{r}") for r, h in enumerate("ab")
        ]
        time.sleep(2.0)  # registration and warm-up
        start = _lines(out / "shadow.jsonl")
        time.sleep(seconds)
        applied = _lines(out / "shadow.jsonl") - start
        for p in workers:
            p.popen.terminate()
            p.popen.wait(timeout=30)
    finally:
        cluster.stop()
    return {"mode": mode, "seconds": seconds, "applied": applied, "updates_per_s": applied / seconds}


def _lines(path: Path) -> int:
    return sum(1 for _ in path.open()) if path.exists() else 0


def _wait(path: Path, proc: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} did not appear; log:\n{proc.log_tail()}")
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    """Run the trials and print/write the table."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "role":
        role, out = argv[1], Path(argv[2])
        {"server": lambda: role_server(out, float(argv[3])), "replica": lambda: role_replica(out)}.get(
            role, lambda: role_worker(out, int(argv[3]))
        )()
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10, help="kills per victim (default 10)")
    ap.add_argument("--updates", type=float, default=4.0, help="div_max in update norms (default 4)")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds of pushing before the kill")
    ap.add_argument("--victims", default="process,daemon")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument(
        "--overhead",
        type=float,
        metavar="SECONDS",
        help="instead: throughput with no replica / div_max / chain",
    )
    args = ap.parse_args(argv)
    div_max = args.updates * _norm(_update(0, 0))
    if args.overhead:
        runs = []
        for _ in range(args.trials):
            for mode in ("none", "div_max", "chain"):
                with tempfile.TemporaryDirectory(prefix="mlfabric-overhead-") as d:
                    runs.append(overhead_trial(mode, div_max, args.overhead, Path(d)))
                print(json.dumps(runs[-1]), flush=True)
        table = {
            m: statistics.median(r["updates_per_s"] for r in runs if r["mode"] == m)
            for m in ("none", "div_max", "chain")
        }
        print(json.dumps({"median_updates_per_s": table, "div_max": div_max}, indent=2))
        if args.out:
            args.out.write_text(json.dumps({"runs": runs, "median_updates_per_s": table}, indent=2))
        return 0
    rows = []
    for victim in args.victims.split(","):
        for _ in range(args.trials):
            with tempfile.TemporaryDirectory(prefix="mlfabric-failover-") as d:
                row = trial(victim, div_max, args.warmup, Path(d))
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for victim in args.victims.split(","):
        mine = [r for r in rows if r["victim"] == victim]
        times = [r["failover_seconds"] for r in mine]
        summary[victim] = {
            "trials": len(mine),
            "failover_median_s": statistics.median(times),
            "failover_max_s": max(times),
            "lost_norm_max": max(r["lost_norm"] for r in mine),
            "lost_updates_max": max(r["lost_updates"] for r in mine),
            "within_div_max": all(r["lost_norm"] <= r["div_max"] + 1e-9 for r in mine),
            "div_max": div_max,
        }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
