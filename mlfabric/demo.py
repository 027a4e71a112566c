"""Train on an emulated cluster on this machine, once per policy, and compare.

Starts, on loopback and in a temporary directory (no root, no set-up), a scheduler, one
daemon per emulated host, a parameter server and several workers running asynchronous
SGD on the digits MLP (:mod:`mlfabric.examples.digits`); trains to a target accuracy with
each policy (``fair``, ``stf`` and ``stf+agg`` by default; ``--runs N`` repeats each, the
policies interleaved); says what it is doing while it runs (starting the cluster, the
server and the workers, with how many are ready; training progress; the policy's number
and, from the second on, an estimate of the time left) and then a table per policy: wall
time to the target, worker updates applied (and the payloads that carried them: an
aggregate carries several), pushes dropped (every push whose verdict was DROPPED: mostly
the scheduler's tau_max drops, before the bottleneck) and the server's own drops (payloads
the server refused: what the progress lines count), the bytes that crossed the server's ingress per
applied worker update, mean and max delay, the accuracy of the evaluation that reached the
target ("at target") and the final accuracy (the model after the last update, which
asynchronous SGD can move either way). With several runs, a summary gives each policy's
median time to the target, its spread and its speed-up over ``fair``. ``--sync`` trains
synchronously (one step per round of every worker's update).

The emulated cluster is a star whose server ingress is the bottleneck and whose workers
have unequal uplinks. The daemons enforce these NIC rates themselves (a token bucket per
direction shared by all of a daemon's connections), so loopback has a real bottleneck;
what it does not emulate is switch queues, propagation delay and the kernel's own
congestion control between hosts — ``mlfabric testbed`` runs on network namespaces for
that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PolicyResult", "configure", "run", "run_policy", "write_topology"]

#: The demo's star: server ingress is the bottleneck; unequal worker uplinks (Mbit/s).
SERVER_INGRESS_MBPS = 20
SERVER_EGRESS_MBPS = 1000
WORKER_UPLINKS_MBPS = (160, 100, 60, 30, 20, 15, 10, 8)


def write_topology(path: Path, workers: int) -> list[str]:
    """Write the demo topology (TOML) for ``workers`` workers; return the worker host names."""
    names = [f"w{i}" for i in range(workers)]
    lines = [
        "# mlfabric demo: the server's ingress is the bottleneck; workers' uplinks differ.",
        f"hosts = {json.dumps(['ps', *names])}",
        'switches = ["sw"]',
        "",
        "[[links]]",
        'a = "ps"',
        'b = "sw"',
        f"mbps = {SERVER_EGRESS_MBPS}      # ps -> switch",
        f"mbps_ba = {SERVER_INGRESS_MBPS}    # switch -> ps: the server's ingress",
    ]
    for i, name in enumerate(names):
        rate = WORKER_UPLINKS_MBPS[i % len(WORKER_UPLINKS_MBPS)]
        lines += [
            "",
            "[[links]]",
            f'a = "{name}"',
            'b = "sw"',
            f"mbps = {rate}",
            f"mbps_ba = {SERVER_EGRESS_MBPS}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return names


@dataclass(frozen=True)
class PolicyResult:
    """One policy's run of the demo."""

    policy: str
    wall_time: float | None
    applied: int
    dropped: int
    mean_delay: float
    max_delay: int
    accuracy: float
    accuracy_at_target: float | None
    pushes: int
    unresolved: int
    #: worker updates in the payloads applied (an aggregate or a round carries several)
    worker_updates: int | None = None
    #: bytes into the server's host per applied worker update
    ingress_per_update: float | None = None
    #: payloads the server refused (delay > tau_max at the server): the progress lines' count
    server_dropped: int | None = None

    def row(self) -> list[str]:
        """The table row."""
        wall = f"{self.wall_time:.1f}" if self.wall_time is not None else "not reached"
        updates = self.worker_updates if self.worker_updates is not None else self.applied
        per_update = f"{self.ingress_per_update / 1e3:.0f}" if self.ingress_per_update is not None else "-"
        return [
            self.policy,
            wall,
            f"{updates} ({self.applied})",
            str(self.dropped),
            str(self.server_dropped) if self.server_dropped is not None else "-",
            per_update,
            f"{self.mean_delay:.2f}",
            str(self.max_delay),
            f"{self.accuracy_at_target:.3f}" if self.accuracy_at_target is not None else "-",
            f"{self.accuracy:.3f}",
        ]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def _progress(policy: str, status: dict[str, Any], started: float, target: float) -> str:
    """A progress line while training.

    Examples
    --------
    >>> status = {"version": 12, "applied": 12, "dropped": 1, "accuracy": 0.5}
    >>> _progress("stf", status, time.monotonic(), 0.95)
    '  [stf]   0.0s  version   12  applied   12  dropped by the server   1  accuracy 0.500 (target 0.95)'
    """
    return (
        f"  [{policy}] {time.monotonic() - started:5.1f}s  version {status['version']:4d}  "
        f"applied {status['applied']:4d}  dropped by the server {status['dropped']:3d}  "
        f"accuracy {status['accuracy']:.3f} (target {target})"
    )


def _say(policy: str, text: str) -> None:
    print(f"  [{policy}] {text}", flush=True)


def run_policy(policy: str, args: argparse.Namespace, workdir: Path) -> PolicyResult:
    """Run the whole training once with ``policy`` in ``workdir``; every process is reaped."""
    from mlfabric.cluster import ClusterError, LocalCluster, ingress_bytes, python_module, read_reports

    workdir.mkdir(parents=True, exist_ok=True)
    topology = workdir / "topology.toml"
    worker_hosts = write_topology(topology, args.workers)
    status_path, stop_file = workdir / "server-status.json", workdir / "stop"
    example = [
        *python_module("mlfabric.examples.digits"),
        "--hidden",
        str(args.hidden),
        "--job",
        "demo",
        "--progress",
        "0",  # the demo says what they do
    ]
    tty = sys.stdout.isatty()
    sync = ["--aggregate-plan", "sync"] if args.sync else []
    cluster = LocalCluster(
        topology,
        policy=policy,
        workdir=workdir,
        enforce_nic_rates=True,
        report_files=True,
        extra_scheduler_args=sync if policy == "stf+agg" else [],
    )
    began = time.monotonic()
    with cluster:
        _say(policy, f"scheduler and {len(cluster.hosts)} daemons ready in {time.monotonic() - began:.1f} s")
        server_argv = [*example, "server", "--status-file", str(status_path)]
        server_argv += ["--target-accuracy", str(args.target_accuracy)]
        if args.sync:
            server_argv += ["--sync-workers", str(args.workers)]
        if args.tau_max is not None:
            server_argv += ["--tau-max", str(args.tau_max)]
        server = cluster.spawn("ps", server_argv, name="server")
        step = time.monotonic()
        deadline = step + 60
        while _read_json(status_path) is None:
            if server.popen.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"the server did not start; its log:\n{server.log_tail()}")
            time.sleep(0.05)
        _say(
            policy,
            f"parameter server ready in {time.monotonic() - step:.1f} s; starting {len(worker_hosts)} "
            "workers (each imports torch, registers and fetches the model)",
        )
        step = time.monotonic()
        go_file = workdir / "go"
        workers = [
            cluster.spawn(
                host,
                [
                    *example,
                    "worker",
                    "--rank",
                    str(rank),
                    "--world",
                    str(args.workers),
                    "--lr",
                    str(args.lr),
                    "--compute-delay",
                    str(args.compute_seconds),
                    "--stop-file",
                    str(stop_file),
                    "--stats-file",
                    str(workdir / f"worker{rank}.json"),
                    "--ready-file",
                    str(workdir / f"worker{rank}.ready"),
                    "--go-file",
                    str(go_file),
                ],
                name=f"worker{rank}",
            )
            for rank, host in enumerate(worker_hosts)
        ]
        deadline = time.monotonic() + 120
        said = -1.0
        ready_files = [workdir / f"worker{rank}.ready" for rank in range(len(workers))]
        while (ready := sum(f.exists() for f in ready_files)) < len(workers):
            if time.monotonic() - said >= 5.0:
                _say(policy, f"workers ready: {ready}/{len(workers)} ({time.monotonic() - step:.0f} s)")
                said = time.monotonic()
            cluster.check_alive()
            for w in workers:
                if w.popen.poll() is not None:
                    raise ClusterError(f"{w.name} exited during start-up; its log:\n{w.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError("workers did not register within 120 s")
            time.sleep(0.05)
        _say(
            policy,
            f"{len(workers)} workers ready in {time.monotonic() - step:.1f} s; training to accuracy "
            f"{args.target_accuracy} (at most {args.time_limit:g} s)",
        )
        started_unix, started = time.time(), time.monotonic()
        go_file.touch()
        status: dict[str, Any] = {}
        last_print = 0.0
        while time.monotonic() - started < args.time_limit:
            cluster.check_alive()
            status = _read_json(status_path) or status
            if status and time.monotonic() - last_print >= (0.5 if tty else 2.0):
                line = _progress(policy, status, started, args.target_accuracy)
                print("\r" + line if tty else line, end="" if tty else "\n", flush=True)
                last_print = time.monotonic()
            if status.get("reached_at") is not None or all(w.popen.poll() is not None for w in workers):
                break
            time.sleep(0.1)
        if tty:
            print()
        if status.get("reached_at") is not None:
            ended = f"target reached at {status['reached_at'] - started_unix:.1f} s"
        elif time.monotonic() - started >= args.time_limit:
            ended = f"time limit of {args.time_limit:g} s reached"
        else:
            ended = "every worker exited"
        _say(
            policy,
            f"{ended}; stopping: the workers wait for their last pushes' verdicts, then the cluster stops",
        )
        step = time.monotonic()
        stop_file.touch()
        for w in workers:
            try:
                w.popen.wait(timeout=args.push_timeout + 30)
            except subprocess.TimeoutExpired:  # cluster.stop() below terminates and reaps it
                print(f"  [{policy}] {w.name} did not stop in time; terminating it", file=sys.stderr)
        server.popen.terminate()
        server.popen.wait(timeout=30)
    _say(
        policy,
        f"stopped in {time.monotonic() - step:.1f} s; {time.monotonic() - began:.0f} s for this policy",
    )
    final = _read_json(status_path) or status
    pushes = [
        p
        for rank in range(args.workers)
        for p in (_read_json(workdir / f"worker{rank}.json") or {}).get("pushes", [])
    ]
    unresolved = sum(1 for p in pushes if p["status"] not in ("APPLIED", "DROPPED"))
    reached, at_target = final.get("reached_at"), final.get("accuracy_at_target")
    updates = final.get("worker_updates")
    into_server = ingress_bytes(read_reports(workdir / "reports"), "ps")
    return PolicyResult(
        policy=policy,
        wall_time=(reached - started_unix) if reached is not None else None,
        applied=int(final.get("applied", 0)),
        dropped=sum(1 for p in pushes if p["status"] == "DROPPED"),
        mean_delay=float(final.get("mean_delay", 0.0)),
        max_delay=int(final.get("max_delay", 0)),
        accuracy=float(final.get("accuracy", 0.0)),
        accuracy_at_target=float(at_target) if at_target is not None else None,
        pushes=len(pushes),
        unresolved=unresolved,
        worker_updates=int(updates) if updates is not None else None,
        ingress_per_update=into_server / updates if updates else None,
        server_dropped=int(final["dropped"]) if "dropped" in final else None,
    )


def format_table(results: list[PolicyResult]) -> str:
    """A plain-text table of the results."""
    header = ["policy", "wall time (s)", "applied (payloads)", "pushes dropped", "server drops"]
    header += ["server in kB/update"]
    header += ["mean delay", "max delay"]
    header += ["at target", "final accuracy"]
    rows = [header, *(r.row() for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: what the table's drop columns count
TABLE_NOTE = (
    "pushes dropped: worker pushes whose verdict was DROPPED, by the scheduler (delay would exceed "
    "tau_max: dropped before the bottleneck) or by the server; server drops: payloads the server "
    "itself refused, the count of the progress lines"
)


def format_summary(results: list[PolicyResult]) -> str:
    """Per policy: median time to the target, min-max, speed-up over ``fair``'s median.

    Examples
    --------
    >>> rs = [PolicyResult(p, t, 1, 0, 0.0, 0, 0.9, 0.95, 1, 0) for p, t in
    ...       [("fair", 9.0), ("fair", 10.0), ("fair", 12.0), ("stf+agg", 5.0), ("stf+agg", None)]]
    >>> print(format_summary(rs))
     policy  runs  reached  median (s)  min-max (s)  vs fair
    -------  ----  -------  ----------  -----------  -------
       fair     3        3        10.0     9.0-12.0    1.00x
    stf+agg     2        1         5.0      5.0-5.0    2.00x
    """
    by_policy: dict[str, list[PolicyResult]] = {}
    for r in results:
        by_policy.setdefault(r.policy, []).append(r)
    medians = {
        p: float(statistics.median(t))
        if (t := [r.wall_time for r in rs if r.wall_time is not None])
        else None
        for p, rs in by_policy.items()
    }
    base = medians.get("fair")
    rows = [["policy", "runs", "reached", "median (s)", "min-max (s)", "vs fair"]]
    for p, rs in by_policy.items():
        times = [r.wall_time for r in rs if r.wall_time is not None]
        m = medians[p]
        rows.append(
            [
                p,
                str(len(rs)),
                str(len(times)),
                f"{m:.1f}" if m is not None else "-",
                f"{min(times):.1f}-{max(times):.1f}" if times else "-",
                f"{base / m:.2f}x" if base is not None and m else "-",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``mlfabric demo``."""
    parser.add_argument("--policies", default="fair,stf,stf+agg", help="comma-separated policies to compare")
    parser.add_argument("--runs", type=int, default=1, help="runs per policy (medians and spread)")
    parser.add_argument(
        "--sync", action="store_true", help="synchronous SGD: one step per round of every worker's update"
    )
    parser.add_argument("--workers", type=int, default=8, help="number of workers (one host each)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden units of the MLP (update size)")
    parser.add_argument(
        "--target-accuracy", type=float, default=0.95, help="stop when the test accuracy reaches it"
    )
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    parser.add_argument(
        "--compute-seconds",
        type=float,
        default=0.1,
        help="extra compute time per step, as a GPU's forward/backward would take (default 0.1)",
    )
    parser.add_argument(
        "--tau-max", type=int, default=8, help="delay bound tau_max (default 8; -1: unbounded)"
    )
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per policy at most")
    parser.add_argument("--push-timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--workdir", type=Path, help="keep sockets, logs and results here (default: a temp dir)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit code 0 when every policy ran and every push resolved."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    print(
        f"mlfabric demo: {args.workers} workers, MLP with {args.hidden} hidden units, "
        f"server ingress {SERVER_INGRESS_MBPS} Mbit/s, target accuracy {args.target_accuracy}"
    )
    results = []
    total = args.runs * len(policies)
    spent: list[float] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-demo-") as tmp:
        root = args.workdir or Path(tmp)
        for run_index in range(args.runs):
            for policy in policies:
                where = root / policy if args.runs == 1 else root / f"{policy}-{run_index}"
                left = total - len(spent)
                eta = f"; about {statistics.mean(spent) * left:.0f} s left" if spent else ""
                print(
                    f"policy {policy} ({len(spent) + 1} of {total}{eta}): starting the scheduler and "
                    f"{args.workers + 1} daemons",
                    flush=True,
                )
                began = time.monotonic()
                results.append(run_policy(policy, args, where))
                spent.append(time.monotonic() - began)
    print()
    print(format_table(results))
    print(TABLE_NOTE)
    if args.runs > 1:
        print()
        print(format_summary(results))
    problems = [r for r in results if r.unresolved]
    for r in problems:
        print(f"error: {r.unresolved} of {r.pushes} pushes under {r.policy} did not resolve", file=sys.stderr)
    return 1 if problems else 0
