"""Failover *during training*: SIGKILL the parameter server (or its daemon) while a job trains.

Issue #14's failover measurement with training (``failover.py`` measures back-to-back pushes
of a synthetic model). Per trial, on loopback with real processes
(:class:`mlfabric.cluster.LocalCluster`): a scheduler and one daemon per host (``ps``,
``rep``, ``w0`` .. ``w{N-1}``), asynchronous SGD on the digits MLP of
:mod:`mlfabric.examples.digits` (its model, data, gradient and accuracy; the server applies
``model -= update``), the server on ``ps`` with ``Params(div_max=D, tau_max=T)``, its replica
on ``rep`` running the same ``on_update``, N workers looping *get, gradient, push, wait*.
Once the server has applied ``K`` updates (the **kill point**, spread over
``--kill-after LO:HI`` across the trials) the server's process — or, in the other half of the
trials, its daemon — gets SIGKILL; the promoted replica trains on until its test accuracy
reaches ``--target`` (or ``--time-limit`` s from the start). Per trial:

* time from the kill to the replica's promotion and to its first applied update;
* the norm lost: worker updates in the server's shadow log (flushed as applied) that the
  replica never applied, against ``div_max``;
* pushes APPLIED / DROPPED (those naming the failed server) / UNKNOWN / unresolved (no
  verdict within ``--push-timeout``) / duplicated (applied twice by the surviving model),
  and every exactly-once violation (:mod:`failover_accounting`);
* whether and when (s from the first push) the promoted server reached the target.

``D`` is ``--div-updates`` x the median L2 norm of ``lr * gradient`` over local SGD from the
same initial model (computed first). Writes ``experiments/results/failover_training.{csv,md}``.

    python experiments/failover_training.py --trials 10      # 10 kills of each victim

(``python experiments/failover_training.py role ...`` is how it runs its own processes.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import failover_accounting as acc  # the experiments directory is not a package
import failover_report

JOB, SERVER = "ftrain", "ps0"
RESULTS = Path(__file__).resolve().parent / "results"


def topology(workers: int, replica_mbps: float = 10000.0) -> str:
    """A star of 10 Gbit/s links (CPU is the limit): ``ps``, ``rep`` (``replica_mbps``), the workers."""
    hosts = ["ps", "rep", *(f"w{i}" for i in range(workers))]
    rate = {"rep": replica_mbps}
    links = "".join(f'[[links]]\na = "{h}"\nb = "sw"\nmbps = {rate.get(h, 10000):g}\n' for h in hosts)
    return f'hosts = {json.dumps(hosts)}\nswitches = ["sw"]\n{links}'


def kill_points(lo: int, hi: int, trials: int) -> list[int]:
    """``trials`` kill points (updates applied at the server) spread evenly over ``[lo, hi]``.

    Examples
    --------
    >>> kill_points(20, 80, 4)
    [20, 40, 60, 80]
    >>> kill_points(30, 90, 1)
    [60]
    """
    if trials == 1:
        return [(lo + hi) // 2]
    return [round(lo + (hi - lo) * i / (trials - 1)) for i in range(trials)]


# ---------------------------------------------------------------- roles (child processes)


def _stop_event() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def _applier(srv: Any, log_path: Path, a: argparse.Namespace, promoted: threading.Event | None) -> Any:
    """The ``on_update`` of server and replica (the same code): apply, log, evaluate."""
    from mlfabric.examples.digits import accuracy, load_data

    _, _, x_test, y_test = load_data(a.seed)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - line-buffered, lives with the process
    count = [0]

    def apply(update: dict[str, Any], meta: Any) -> None:
        for k, v in update.items():
            srv.model[k] -= v
        count[0] += 1
        line: dict[str, Any] = {
            "id": meta.update_id,
            "members": list(meta.member_ids),
            "norm": meta.norm,
            "t": time.time(),
            "promoted": promoted is not None and promoted.is_set(),
        }
        if count[0] % a.eval_every == 0:
            line["accuracy"] = accuracy(srv.model, x_test, y_test)
        log.write(json.dumps(line) + "\n")

    return apply


def role_server(out: Path, a: argparse.Namespace) -> None:
    """The parameter server: the digits MLP, ``Params(div_max, tau_max)``, the shadow log."""
    import mlfabric
    from mlfabric.examples.digits import _one_thread, init_model

    stop = _stop_event()
    _one_thread()
    params = mlfabric.Params(div_max=a.div_max, tau_max=a.tau_max if a.tau_max >= 0 else None)
    srv = mlfabric.register_as_server(JOB, SERVER, init_model(a.hidden, a.seed), params)
    srv.on_update(_applier(srv, out / "shadow.jsonl", a, None))
    (out / "server.ready").touch()
    srv.serve(until=stop)


def role_replica(out: Path, a: argparse.Namespace) -> None:
    """The replica on another host: the same ``on_update``; records its promotion."""
    import mlfabric
    from mlfabric.examples.digits import _one_thread

    stop = _stop_event()
    _one_thread()
    rep = mlfabric.register_as_replica(JOB, SERVER, as_torch=True, timeout=120.0)

    def watch() -> None:
        rep.promoted.wait()
        (out / "promoted.tmp").write_text(json.dumps({"t": time.time(), "reason": rep.promotion_reason}))
        os.replace(out / "promoted.tmp", out / "promoted.json")

    threading.Thread(target=watch, daemon=True).start()
    rep.on_update(_applier(rep, out / "replica.jsonl", a, rep.promoted))
    (out / "replica.ready").touch()
    try:  # its daemon may stop first at the end: serve raises; the log is written all along
        rep.serve(until=stop)
    finally:
        rep.close()


def role_worker(out: Path, rank: int, a: argparse.Namespace) -> None:
    """Get, gradient, push, wait until ``out/stop``; every push and its verdict to a log."""
    import mlfabric
    from mlfabric import tensors as tcodec
    from mlfabric.examples.digits import _one_thread, gradient_step, load_data

    stop = _stop_event()
    _one_thread()
    x_train, y_train, _, _ = load_data(a.seed)
    shard = np.arange(len(x_train))[rank :: a.workers]
    rng = np.random.default_rng(1000 + rank)
    w = mlfabric.register_as_worker(JOB, name=f"w{rank}", wait=120.0)
    log = open(out / f"worker{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the process
    w.get(SERVER, timeout=60)  # warm up before the clock starts
    (out / f"worker{rank}.ready").touch()
    while not (out / "go").exists() and not stop.is_set():
        time.sleep(0.01)
    get_failures = 0
    while not stop.is_set() and not (out / "stop").exists():
        try:
            _, model = w.get(SERVER, as_torch=True, timeout=10)
        except (mlfabric.MlfabricError, TimeoutError):  # failing over: the next get goes to the new server
            get_failures += 1
            time.sleep(0.05)
            continue
        batch = rng.choice(shard, size=a.batch)
        update = gradient_step(model, x_train[batch], y_train[batch], a.lr)
        rec: dict[str, Any] = {"norm": tcodec.l2_norm(update), "t": time.time()}
        handle = None
        try:
            handle = w.push(SERVER, update)
            r = handle.wait(timeout=a.push_timeout)
            rec.update(id=r.update_id, status=r.status, reason=r.reason, version=r.version)
        except TimeoutError as exc:
            rec.update(id=handle.update_id if handle else "", status="UNRESOLVED", reason=str(exc))
        except mlfabric.MlfabricError as exc:
            rec.update(id=handle.update_id if handle else "", status="ERROR", reason=f"{exc.code}: {exc}")
        rec["resolved_s"] = time.time() - rec["t"]
        log.write(json.dumps(rec) + "\n")
        if rec["status"] == "ERROR":
            time.sleep(0.05)
    log.write(json.dumps({"get_failures": get_failures}) + "\n")
    w.close()


# ---------------------------------------------------------------- driver


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the SIGKILL (the shadow log's last)
                continue
    return rows


def _lines(path: Path) -> int:
    return sum(1 for _ in path.open()) if path.exists() else 0


def _wait_file(path: Path, proc: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} did not appear within {timeout:.0f} s; log:\n{proc.log_tail()}")
        time.sleep(0.02)


def _reached(log: list[dict[str, Any]], target: float, after: float) -> float | None:
    """Unix time of the first evaluation at or above ``target`` after time ``after``."""
    return next((e["t"] for e in log if e.get("accuracy", -1) >= target and e["t"] >= after), None)


def trial(victim: str, kill_after: int, a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One training run with one kill; returns its row (see :func:`acc.summarize`)."""
    from mlfabric.cluster import LocalCluster

    (workdir / "topology.toml").write_text(topology(a.workers, a.replica_mbps or 10000.0))
    out = workdir / "out"
    out.mkdir()
    me = [sys.executable, str(Path(__file__).resolve()), "role"]
    common = [*("--hidden", str(a.hidden), "--seed", str(a.seed), "--eval-every", str(a.eval_every))]
    common += [*("--div-max", repr(a.div_max), "--tau-max", str(a.tau_max), "--lr", str(a.lr))]
    common += [*("--batch", str(a.batch), "--workers", str(a.workers), "--push-timeout", str(a.push_timeout))]
    load1 = os.getloadavg()[0]
    cluster = LocalCluster(
        workdir / "topology.toml", policy=a.policy, workdir=workdir / "run", log_level="WARNING",
        ready_timeout=120, enforce_nic_rates=a.replica_mbps is not None,
    ).start()  # fmt: skip
    killed_at = t0 = float("nan")
    server_acc = None
    try:
        server = cluster.spawn("ps", [*me, "server", str(out), *common], name="server")
        _wait_file(out / "server.ready", server, 120)
        replica = cluster.spawn("rep", [*me, "replica", str(out), *common], name="replica")
        _wait_file(out / "replica.ready", replica, 120)
        workers = [
            cluster.spawn(f"w{r}", [*me, "worker", str(out), *common, "--rank", str(r)], name=f"worker{r}")
            for r in range(a.workers)
        ]
        for r, p in enumerate(workers):
            _wait_file(out / f"worker{r}.ready", p, 180)
        t0 = time.time()
        (out / "go").touch()
        deadline = time.monotonic() + a.time_limit
        while _lines(out / "shadow.jsonl") < kill_after:
            if time.monotonic() > deadline or server.popen.poll() is not None:
                raise RuntimeError(
                    f"the server applied {_lines(out / 'shadow.jsonl')} < {kill_after} updates; "
                    f"log:\n{server.log_tail()}\n{workers[0].log_tail()}"
                )
            time.sleep(0.005)
        name = "server" if victim == "process" else "daemon-ps"
        target = next(p for p in cluster.processes() if p.name == name)
        killed_at = time.time()
        os.kill(target.popen.pid, signal.SIGKILL)
        while time.monotonic() < deadline:
            if _reached(_read_jsonl(out / "replica.jsonl"), a.target, killed_at) is not None:
                break
            time.sleep(0.2)
        (out / "stop").touch()
        for p in workers:
            try:
                p.popen.wait(timeout=a.push_timeout + 30)
            except subprocess.TimeoutExpired:  # cluster.stop() terminates it; its pushes count as they are
                print(f"  {p.name} did not stop in time", file=sys.stderr, flush=True)
        replica.popen.terminate()
        replica.popen.wait(timeout=30)
    finally:
        cluster.stop()
    shadow = _read_jsonl(out / "shadow.jsonl")
    rep_log = _read_jsonl(out / "replica.jsonl")
    pushes = [p for r in range(a.workers) for p in _read_jsonl(out / f"worker{r}.jsonl") if "status" in p]
    promoted = json.loads((out / "promoted.json").read_text()) if (out / "promoted.json").exists() else None
    after = [e for e in rep_log if e["promoted"]]
    server_evals = [e for e in shadow if "accuracy" in e and e["t"] <= killed_at]
    server_acc = server_evals[-1]["accuracy"] if server_evals else None
    reached_at = _reached(rep_log, a.target, killed_at)
    row = {
        "victim": victim,
        "kill_point": len(shadow),
        "kill_after_s": round(killed_at - t0, 3),
        "server_accuracy_at_kill": server_acc,
        "server_reached_before_kill": _reached(shadow, a.target, 0.0) is not None,
        "promotion_s": round(promoted["t"] - killed_at, 4) if promoted else None,
        "first_update_s": round(after[0]["t"] - killed_at, 4) if after else None,
        "replica_updates_after": sum(len(e["members"] or [e["id"]]) for e in after),
        "div_max": a.div_max,
        **acc.account(shadow, rep_log, pushes, a.div_max),
        "reached": reached_at is not None,
        "time_to_target": round(reached_at - t0, 2) if reached_at is not None else None,
        "final_accuracy": next((e["accuracy"] for e in reversed(rep_log) if "accuracy" in e), None),
        "load1": round(load1, 2),
    }
    row["lost_norm_over_div_max"] = round(row["lost_norm"] / a.div_max, 4) if a.div_max > 0 else None
    return row


def reference_norm(a: argparse.Namespace, steps: int = 150) -> float:
    """Median L2 norm of ``lr * gradient`` over local SGD from the initial model."""
    from mlfabric import tensors as tcodec
    from mlfabric.examples.digits import _one_thread, gradient_step, init_model, load_data

    _one_thread()
    x_train, y_train, _, _ = load_data(a.seed)
    model, rng, norms = init_model(a.hidden, a.seed), np.random.default_rng(0), []
    for _ in range(steps):
        batch = rng.choice(len(x_train), size=a.batch)
        update = gradient_step(model, x_train[batch], y_train[batch], a.lr)
        norms.append(tcodec.l2_norm(update))
        for k, v in update.items():
            model[k] -= v
    return float(statistics.median(norms))


def _setting_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hidden", type=int, default=256, help="hidden units of the digits MLP (default 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=5, help="evaluate every N applied payloads")
    ap.add_argument("--tau-max", type=int, default=8, help="delay bound (-1: none)")
    ap.add_argument("--push-timeout", type=float, default=30.0, help="seconds before a push is unresolved")
    ap.add_argument("--div-max", type=float, default=0.0, help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    """Run the trials, print each, write the CSV and the Markdown report."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "role":
        ap = argparse.ArgumentParser()
        ap.add_argument("role", choices=["server", "replica", "worker"])
        ap.add_argument("out", type=Path)
        ap.add_argument("--rank", type=int, default=0)
        _setting_args(ap)
        a = ap.parse_args(argv[1:])
        if a.role == "server":
            role_server(a.out, a)
        elif a.role == "replica":
            role_replica(a.out, a)
        else:
            role_worker(a.out, a.rank, a)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10, help="kills per victim (default 10)")
    ap.add_argument("--victims", default="process,daemon")
    ap.add_argument("--div-updates", type=float, default=4.0, help="div_max in reference update norms")
    ap.add_argument("--kill-after", default="20:90", help="LO:HI updates applied at the server (spread)")
    ap.add_argument("--target", type=float, default=0.93, help="test accuracy to reach")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per trial from the first push")
    ap.add_argument("--policy", default="stf")
    ap.add_argument(
        "--replica-mbps",
        type=float,
        help="the replica host's link in Mbit/s, enforced by the daemons (default: 10 Gbit/s, not enforced)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for failover_training.{csv,md}")
    ap.add_argument("--name", default="failover_training")
    _setting_args(ap)
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.kill_after.split(":"))
    a.reference_norm = reference_norm(a)
    a.div_max = a.div_updates * a.reference_norm
    print(f"reference update norm {a.reference_norm:.5f}, div_max {a.div_max:.5f}", flush=True)
    load_before, wall, a.commit = os.getloadavg(), time.time(), failover_report.commit()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows: list[dict[str, Any]] = []
    points = kill_points(lo, hi, a.trials)
    for i in range(a.trials):
        for victim in a.victims.split(","):  # interleaved: both see the same load
            with tempfile.TemporaryDirectory(prefix="mlfabric-ftrain-") as d:
                row = trial(victim, points[i], a, Path(d))
            rows.append(row)
            print(failover_report.trial_line(row), flush=True)
            failover_report.write_csv(a.out / f"{a.name}.csv", rows)
    a.wall_minutes = (time.time() - wall) / 60
    text = failover_report.markdown(rows, a, load_before, os.getloadavg(), started, " ".join(argv))
    (a.out / f"{a.name}.md").write_text(text)
    print(text)
    return 0 if all(r["exactly_once"] and r["within_div_max"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
