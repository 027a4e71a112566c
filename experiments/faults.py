"""Fault-injection harness: nothing lost, nothing applied twice, nothing reported falsely (DESIGN §3, §5).

A job of several workers pushes continuously on loopback (a :class:`~mlfabric.cluster.LocalCluster`:
scheduler, a daemon per host, the server ``ps0`` on host ``ps``, workers on hosts ``a`` and
``b``, aggregator hop ``x`` under ``stf+agg``) while faults are injected at seeded random
times: SIGKILL / SIGTERM of a worker's daemon, the server's daemon, the server process, the
aggregator's daemon and the scheduler (restarted on the same address), and SIGSTOP/SIGCONT of
a daemon (a stalled peer); on the namespace testbed (``--testbed``, root) also a host's link
taken down and up, and its rate cut 1000-fold for a while. Killed processes are started again
with the same arguments.

Each push of worker ``r`` with index ``i`` adds 1 at cell ``[r, i]`` of the float64 model
(:mod:`faults_roles`), so the final model, fetched with ``get()``, says exactly which pushes
were applied. Per fault kind (a push is counted under the last fault injected before it
resolved) the report gives: pushes lost (APPLIED, in no model), applied twice, applied but
reported otherwise (DROPPED or an error, yet in the model), UNKNOWN that was applied
(allowed: the status says so) and not applied, unresolved past the deadline, and the time
to recover (fault to the first APPLIED verdict of a push submitted after it).

Workers push until ``--tail`` seconds after the last fault (or their last index), then stop;
every push still in flight resolves or counts as unresolved. Run (bounded in time and in
count, stops by itself)::

    python experiments/faults.py --seed 1     # 4 workers, up to 5000 pushes each, 110 faults
    python experiments/faults.py --seed 1 --quick     # ~1 minute, a few faults of each kind
    sudo python experiments/faults.py --seed 1 --quick --testbed   # namespaces: + link faults

It prints the table and writes ``experiments/results/faults.md`` and ``faults.csv``
(``--out`` elsewhere). Exit status 1 when any of lost / twice / false / unresolved is non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from faults_cluster import FaultCluster, TestbedFaultCluster  # noqa: E402
from faults_report import Fault, analyse, write_results  # noqa: E402

import mlfabric  # noqa: E402

ROLES = HERE / "faults_roles.py"

TOPOLOGY = """
hosts = ["ps", "a", "b", "x"]
switches = ["sw"]
[[links]]
a = "ps"
b = "sw"
mbps = {ps_mbps}
[[links]]
a = "a"
b = "sw"
mbps = 1000
[[links]]
a = "b"
b = "sw"
mbps = 1000
[[links]]
a = "x"
b = "sw"
mbps = 1000
"""

LOOPBACK_KINDS = (
    "kill-worker-daemon",
    "term-worker-daemon",
    "kill-server-daemon",
    "term-server-daemon",
    "kill-server",
    "term-server",
    "kill-aggregator-daemon",
    "term-aggregator-daemon",
    "kill-scheduler",
    "term-scheduler",
    "stall-peer",
)


#: Faults only the namespace testbed can inject (``--testbed``, root): a host's link down
#: (its switch port, so the host keeps its addresses and routes) and its rate cut 1000-fold.
TESTBED_KINDS = ("link-down", "rate-collapse")
#: seconds the workers have, together, to stop once told (a push resolves within about 60 s)
STOP_WAIT = 100.0
HOST_LINKS = (("a", "sw"), ("b", "sw"), ("ps", "sw"), ("x", "sw"))


@dataclass
class Config:
    """One run's settings (see ``--help``)."""

    seed: int = 1
    workers: int = 4
    pushes: int = 250
    window: int = 8
    pace_ms: int = 0
    faults: int = 22
    policy: str = "stf+agg"
    kinds: tuple[str, ...] = LOOPBACK_KINDS
    gap: tuple[float, float] = (0.3, 1.5)
    down: tuple[float, float] = (0.0, 0.5)
    duration: float = 600.0
    tail: float = 10.0
    tau_max: int = -1
    workdir: Path | None = None
    log_level: str = "INFO"
    testbed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _wait_file(path: Path, proc: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited before {path.name}:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} did not appear in {timeout:.0f} s:\n{proc.log_tail()}")
        time.sleep(0.05)


def _inject(cluster: FaultCluster, kind: str, rng: random.Random, cfg: Config) -> Fault:
    """Inject one fault and undo it (restart / SIGCONT); return what was done and when."""
    down = rng.uniform(*cfg.down)
    if kind == "stall-peer":
        target = f"daemon-{rng.choice(['ps', 'a', 'b', 'x'] if 'agg' in cfg.policy else ['ps', 'a', 'b'])}"
        t0 = time.time()
        cluster.signal(target, signal.SIGSTOP)
        time.sleep(max(down, 0.2) * 4)  # a stall long enough for transfers to notice
        cluster.signal(target, signal.SIGCONT)
        return Fault(kind, target, t0, time.time())
    if kind in TESTBED_KINDS:
        return _link_fault(cluster, kind, rng.choice(HOST_LINKS), max(down, 0.2) * 4)
    how, _, what = kind.partition("-")
    sig = signal.SIGKILL if how == "kill" else signal.SIGTERM
    target = {
        "worker-daemon": f"daemon-{rng.choice(['a', 'b'])}",
        "server-daemon": "daemon-ps",
        "aggregator-daemon": "daemon-x",
        "server": "server",
        "scheduler": "scheduler",
    }[what]
    t0 = time.time()
    note = cluster.restart(target, sig, down)
    return Fault(kind, target, t0, time.time(), note)


def _link_fault(cluster: Any, kind: str, link: tuple[str, str], duration: float) -> Fault:
    """Take ``link`` down (its switch-side end) or cut its rate 1000-fold for ``duration`` s."""
    tb = cluster.testbed
    host, switch = link
    t0 = time.time()
    if kind == "link-down":
        end = tb.layout.link_ends[(switch, host)]
        subprocess.run(["ip", "-n", end.namespace, "link", "set", "dev", end.ifname, "down"], check=True)
        time.sleep(duration)
        subprocess.run(["ip", "-n", end.namespace, "link", "set", "dev", end.ifname, "up"], check=True)
    else:
        rates = {d: tb.rate(d) for d in (link, (switch, host))}
        for d, rate in rates.items():
            tb.set_rate(d, rate / 1000)
        time.sleep(duration)
        for d, rate in rates.items():
            tb.set_rate(d, rate)
    return Fault(kind, f"link {host}-{switch}", t0, time.time())


def run(cfg: Config) -> dict[str, Any]:
    """Run the harness once; return the analysis (see :func:`faults_report.analyse`)."""
    kinds = [k for k in cfg.kinds if "agg" in cfg.policy or "aggregator" not in k]
    rng = random.Random(cfg.seed)
    work = cfg.workdir or Path(tempfile.mkdtemp(prefix="mlfabric-faults-"))
    out = work / "out"
    if (work / "run").exists() or out.exists():  # stale ready files would name dead processes
        raise FileExistsError(f"{work} holds an earlier run: give a new --workdir")
    out.mkdir(parents=True)
    topology = work / "topology.toml"
    topology.write_text(TOPOLOGY.format(ps_mbps=100 if "agg" in cfg.policy else 1000))
    options: dict[str, Any] = {
        "policy": cfg.policy,
        "workdir": work / "run",
        "extra_scheduler_args": ["--aggregate-timeout", "5"] if "agg" in cfg.policy else [],
        "aggregator_host": "x",
        "log_level": cfg.log_level,
        # a daemon restarted while the scheduler is down too is ready only once it is welcomed
        "ready_timeout": 120.0,
    }
    with contextlib.ExitStack() as stack:
        if cfg.testbed:
            from mlfabric.scheduler.core.graph import load_topology
            from mlfabric.testbed.cluster import Testbed
            from mlfabric.testbed.netns import new_prefix

            tb = stack.enter_context(Testbed(load_topology(topology), prefix=new_prefix(rng)))
            cluster: FaultCluster | TestbedFaultCluster = TestbedFaultCluster(tb, topology, **options)
        else:
            kinds = [k for k in kinds if k not in TESTBED_KINDS]
            cluster = FaultCluster(topology, **options)
        return _run(cfg, cluster, kinds, rng, out)


def _run(cfg: Config, cluster: Any, kinds: list[str], rng: random.Random, out: Path) -> dict[str, Any]:
    faults: list[Fault] = []
    started = time.time()
    deadline = time.monotonic() + cfg.duration
    final: dict[str, Any] = {}
    try:
        cluster.start()
        sizes = [str(cfg.workers), str(cfg.pushes)]
        cluster.spawn_role(
            "server", "ps", [sys.executable, str(ROLES), "server", str(out), str(cfg.tau_max), *sizes]
        )
        _wait_file(out / "server.ready", cluster.current("server"), 60)
        workers = [
            cluster.spawn(
                "ab"[rank % 2],
                [
                    sys.executable,
                    str(ROLES),
                    "worker",
                    str(out),
                    str(rank),
                    *sizes,
                    str(cfg.window),
                    str(cfg.pace_ms),
                ],
                name=f"worker{rank}",
            )
            for rank in range(cfg.workers)
        ]
        order: list[str] = []
        while len(faults) < cfg.faults and time.monotonic() < deadline:
            time.sleep(rng.uniform(*cfg.gap))
            if all(w.popen.poll() is not None for w in workers):
                break
            if not order:
                order = list(kinds)
                rng.shuffle(order)
            faults.append(_inject(cluster, order.pop(), rng, cfg))
            print(
                f"[{time.time() - started:6.1f}s] {faults[-1].kind} {faults[-1].target} {faults[-1].note}",
                flush=True,
            )
        tail_end = min(deadline, time.monotonic() + cfg.tail)  # pushes after the last fault
        for w in workers:
            try:
                w.popen.wait(timeout=max(0.1, tail_end - time.monotonic()))
            except subprocess.TimeoutExpired:  # time to stop them
                break
        (out / "stop").touch()
        stop_by = time.monotonic() + STOP_WAIT  # all of them together: the test's own timeout
        for w in workers:
            try:
                w.popen.wait(timeout=max(0.1, stop_by - time.monotonic()))
            except subprocess.TimeoutExpired:  # where it hangs (faulthandler), then stop() kills it
                w.popen.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                print(f"{w.name} did not stop in {STOP_WAIT:g} s:\n{w.log_tail(120)}", flush=True)
        final = _fetch_model(cluster)
        final["survivors"] = cluster.dead()
    finally:
        cluster.stop()
    return analyse(out, cfg.workers, cfg.pushes, faults, final, started)


def _fetch_model(cluster: FaultCluster) -> dict[str, Any]:
    """The server's final model by ``get()`` from a worker on the server's host."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with mlfabric.register_as_worker(
                "faults", name="auditor", daemon=cluster.socket("ps"), wait=10
            ) as w:
                version, model = w.get("ps0", timeout=30)
            return {"version": version, "model": {k: v.copy() for k, v in model.items()}}
        except mlfabric.MlfabricError as exc:
            if time.monotonic() > deadline:
                raise
            print(f"get: {exc.code}: {exc}", flush=True)
            time.sleep(0.5)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(f"terminated by signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--pushes", type=int, default=5000, help="pushes per worker (at most)")
    p.add_argument("--window", type=int, default=8, help="pushes in flight per worker")
    p.add_argument(
        "--pace-ms", type=int, default=30, help="ms between a worker's pushes (0: as fast as it can)"
    )
    p.add_argument("--faults", type=int, default=110, help="faults to inject (at most)")
    p.add_argument("--policy", default="stf+agg", choices=["fair", "stf", "stf+agg"])
    p.add_argument("--kinds", help="comma-separated fault kinds (default: every kind of the cluster)")
    p.add_argument(
        "--testbed",
        action="store_true",
        help="run on the namespace testbed (root) and add link-down and rate-collapse faults",
    )
    p.add_argument("--gap", type=float, nargs=2, default=(0.5, 1.5), help="seconds between faults (min max)")
    p.add_argument("--duration", type=float, default=1200.0, help="time budget, seconds")
    p.add_argument("--tail", type=float, default=10.0, help="seconds of pushes after the last fault")
    p.add_argument("--tau-max", type=int, default=-1, help="the server's tau_max (-1: unbounded)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run: 3 workers x up to 2000 pushes, 2 faults of each kind, 0.1-0.5 s apart",
    )
    p.add_argument(
        "--workdir", type=Path, help="keep the run's logs here (default: a new temporary directory)"
    )
    p.add_argument("--log-level", default="INFO", help="of the scheduler and the daemons")
    p.add_argument("--out", type=Path, default=HERE / "results" / "faults")
    a = p.parse_args(argv)
    known = LOOPBACK_KINDS + TESTBED_KINDS
    kinds = tuple(k for k in (a.kinds or ",".join(known if a.testbed else LOOPBACK_KINDS)).split(",") if k)
    unknown = set(kinds) - set(known)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(known)}")
    if a.testbed and os.geteuid() != 0:
        p.error("--testbed builds network namespaces: run as root")
    cfg = Config(
        seed=a.seed,
        workers=a.workers,
        pushes=a.pushes,
        window=a.window,
        pace_ms=a.pace_ms,
        faults=a.faults,
        policy=a.policy,
        kinds=kinds,
        gap=(a.gap[0], a.gap[1]),
        duration=a.duration,
        tail=a.tail,
        tau_max=a.tau_max,
        workdir=a.workdir,
        log_level=a.log_level,
        testbed=a.testbed,
    )
    if a.quick:  # ~1 minute
        cfg.workers, cfg.pushes, cfg.pace_ms, cfg.faults = 3, 2000, 5, 2 * len(kinds)
        cfg.duration, cfg.gap = 150.0, (0.1, 0.5)
    signal.signal(signal.SIGTERM, _terminated)  # stop the cluster's processes on the way out
    command = "python experiments/faults.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = analyse_and_print = run(cfg)
    write_results(a.out, result, cfg, command)
    return 0 if analyse_and_print["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
