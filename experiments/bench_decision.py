"""Decision latency of the ``stf`` policy (DESIGN §5, "scheduler").

Times :meth:`STFPolicy.decide` for batches of 100, 1,000 and 10,000 ready updates on a
1,024-host two-tier graph (32 racks x 32 hosts, 4:1 oversubscribed uplinks), with a few
transfers in flight. Targets (issue 24, default horizon 256): <= 5 ms at 1,000 ready and
<= 50 ms at 10,000, uniform and mixed NICs.

Scenarios
---------
``homogeneous``
    10 Gb/s NICs, 4 servers (shards), every update the same size per shard.
``heterogeneous``
    NICs drawn from {1, 10, 25} Gb/s, 4 servers, sizes varying +-10 %.

Before issue 24 (2-core machine shared with other jobs; CPU time, one policy, the same inputs
decided again: ``--table``)
-----------------------------------------------------------------------------------------
==============  =======  =========  ==========  ===========
scenario        horizon  100 ready  1,000 ready 10,000 ready
==============  =======  =========  ==========  ===========
homogeneous     all      4.4 ms     49 ms       0.94 s
heterogeneous   all      5.8 ms     205 ms      17 s
homogeneous     256      4.5 ms     16 ms       63 ms
heterogeneous   256      5.8 ms     26 ms       69 ms
==============  =======  =========  ==========  ===========

Issue 24: the plan from scratch, the incremental book, and the book with the STF loop in C
---------------------------------------------------------------------------------------------
The default run replays decision sequences (after each decision its first 16 sends leave
into flight, 16 updates arrive, the clock moves 1 ms) through three contestants taking turns
(which goes first rotates): ``STFPolicy(incremental=False)`` with the Python loop (a plan
from scratch per decision, as before issue 24), ``STFPolicy()`` with the Python loop (the
book, DESIGN §8) and ``STFPolicy()`` with the loop in C (``_plan_native.stf_run``, the
default where built), and checks that every decision is the same. CPU ms per decision,
horizon 256, 10 decisions x seeds 1, 2, 3, median [min-max of the seeds' medians], load
1.6-2; "alone" is ``--alone``, the C loop on the same sequences without the others:

==============  ======  ====================  ====================  ================  =====  ================
NICs            ready   plan from scratch     book, Python loop     book, C loop      C/Py   C loop alone
==============  ======  ====================  ====================  ================  =====  ================
10 Gb/s         1,000   27.9 [27.2-29.5]      22.7 [21.0-23.1]      7.2 [6.6-7.7]     3.1x   4.6 [4.0-5.0]
10 Gb/s         10,000  167.7 [146.4-179.2]   50.5 [47.0-58.8]      23.7 [23.1-24.8]  2.1x   17.8 [17.2-19.4]
1/10/25 Gb/s    1,000   91.6 [28.0-133.5]     81.4 [24.0-119.1]     9.5 [7.3-11.1]    8.6x   5.0 [4.4-5.7]
1/10/25 Gb/s    10,000  178.3 [152.6-183.3]   47.1 [46.2-49.4]      25.5 [22.0-31.9]  1.8x   20.3 [18.6-22.3]
==============  ======  ====================  ====================  ================  =====  ================

The book removed the O(n) set-up of a plan from scratch (an ``Update`` per pending update,
its path, rank and class); the C loop removes the Python of the greedy over the 256 planned
sends. What is left at 1,000 ready is Python around the loop (the book's sync, the adapter to
a ``Decision``, the garbage collector) and work that grows with the transfers in flight (the
sequences reach ~150 of them).

Run::

    python experiments/bench_decision.py            # the three, 1,000 and 10,000 ready
    python experiments/bench_decision.py --alone    # the C loop alone, the same sequences
    python experiments/bench_decision.py --sizes 1000 --seeds 1 2 3 4 5 --decisions 20
    python experiments/bench_decision.py --table --sizes 100 1000 10000 --horizon 0 256
    python experiments/bench_decision.py --profile --sizes 10000   # cProfile of one decision
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from mlfabric.scheduler.core.graph import hosts, two_tier
from mlfabric.scheduler.policies import stf_planner
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, Snapshot
from mlfabric.scheduler.policies.stf import STFPolicy

RACKS, PER_RACK, OVERSUB = 32, 32, 4.0
SERVERS = ("h0", "h33", "h66", "h99")
SHARD_BYTES = 25e6


def scenario(name: str, n: int, seed: int) -> tuple[Snapshot, list[PendingUpdate]]:
    """A snapshot with 8 transfers in flight and ``n`` pending updates."""
    rng = random.Random(seed)
    names = [f"h{i}" for i in range(RACKS * PER_RACK)]
    if name == "homogeneous":
        nic: float | dict[str, float] = 10e9
    else:
        nic = {h: rng.choice((1e9, 10e9, 25e9)) for h in names}
    graph = two_tier(RACKS, PER_RACK, nic, oversubscription=OVERSUB)
    workers = [h for h in hosts(graph) if h not in SERVERS]
    pending = []
    for i in range(n):
        k = i % len(SERVERS)
        size = SHARD_BYTES if name == "homogeneous" else SHARD_BYTES * rng.uniform(0.9, 1.1)
        w = rng.choice(workers)
        pending.append(
            PendingUpdate(f"u{i}", "job", f"s{k}", w, w, SERVERS[k], int(size), 1.0, rng.randint(0, 5), 0.0)
        )
    in_flight = tuple(
        InFlight(f"f{j}", "job", f"s{j % 4}", (f"h{500 + j}", f"tor{(500 + j) // PER_RACK}", "core",
                 f"tor{int(SERVERS[j % 4][1:]) // PER_RACK}", SERVERS[j % 4]),
                 int(SHARD_BYTES), 0.0, 0.05 + 0.01 * j)
        for j in range(8)
    )  # fmt: skip
    snap = Snapshot(
        now=0.01,
        graph=graph,
        in_flight=in_flight,
        server_versions={("job", f"s{k}"): 5 for k in range(len(SERVERS))},
        tau_max={"job": -1},
    )
    return snap, pending


def measure(name: str, n: int, repeat: int, horizon: int | None = None) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU seconds of ``repeat`` decisions (after one warm-up filling the path cache).

    CPU time (``time.thread_time``) is what the decision costs; wall time also counts the
    time other processes on a shared machine hold the core.
    """
    snap, pending = scenario(name, n, seed=n)
    policy = STFPolicy(horizon=horizon)
    policy.decide(snap, pending)
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.thread_time()
        policy.decide(snap, pending)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return wall, cpu


#: the contestants of the comparison: (label, incremental book, the STF loop in C)
CONTESTANTS = (
    ("full re-plan, Python", False, False),
    ("book, Python loop", True, False),
    ("book, C loop", True, True),
)


@contextmanager
def stf_loop(native: bool) -> Iterator[None]:
    """Run the STF planner's loop in C (``native``) or in Python (as before the C loop)."""
    saved = stf_planner._plan_native
    if not native:
        stf_planner._plan_native = None  # type: ignore[assignment]
    try:
        yield
    finally:
        stf_planner._plan_native = saved


def sequence(
    name: str,
    n: int,
    seed: int,
    decisions: int,
    horizon: int | None,
    churn: int = 16,
    contestants: Sequence[tuple[str, bool, bool]] = CONTESTANTS,
) -> tuple[list[list[float]], bool]:
    """CPU seconds per decision of each of ``contestants`` (:data:`CONTESTANTS`), taking turns.

    A decision sequence at about ``n`` ready: after each decision the first ``churn`` sends
    leave (in flight until their expected end), ``churn`` updates arrive, and the clock moves
    on 1 ms. Every contestant decides every step (which goes first rotates between steps);
    the decisions are compared.

    Returns
    -------
    tuple
        CPU seconds of each contestant's decisions, and whether every decision was the same.
    """
    snap, pending = scenario(name, n, seed=seed)
    rng = random.Random(seed)
    workers = [h for h in hosts(snap.graph) if h not in SERVERS]
    runs: list[tuple[STFPolicy, bool, list[float]]] = [
        (STFPolicy(horizon, incremental=book), native, []) for _, book, native in contestants
    ]
    for policy, native, _ in runs:  # warm-up: caches, the book
        with stf_loop(native):
            policy.decide(snap, pending)
    flying = {f.update_id: f for f in snap.in_flight}
    cpu: list[list[float]] = [times for _, _, times in runs]
    same = True
    serial = n
    for step in range(decisions):
        decided = []
        k = step % len(runs)
        for policy, native, times in runs[k:] + runs[:k]:
            with stf_loop(native):
                c0 = time.process_time()
                decided.append(policy.decide(snap, pending))
                times.append(time.process_time() - c0)
        same = same and all(d == decided[0] for d in decided)
        now = snap.now + 1e-3
        left = {s.update_id: s for s in decided[0].sends[:churn]}
        for p in pending:
            if p.update_id in left:
                s = left[p.update_id]
                flying[p.update_id] = InFlight(
                    p.update_id, p.job, p.server, s.path, p.bytes, snap.now, s.expected_end
                )
        gone = left.keys() | {d.update_id for d in decided[0].drops}
        pending = [p for p in pending if p.update_id not in gone]
        for _ in range(churn):
            k = serial % len(SERVERS)
            w = rng.choice(workers)
            size = SHARD_BYTES if name == "homogeneous" else SHARD_BYTES * rng.uniform(0.9, 1.1)
            pending.append(
                PendingUpdate(f"u{serial}", "job", f"s{k}", w, w, SERVERS[k], int(size), 1.0, 5, now)
            )
            serial += 1
        flying = {u: f for u, f in flying.items() if f.expected_end > now}
        snap = replace(snap, now=now, in_flight=tuple(flying.values()))
    return cpu, same


def p99(xs: Sequence[float]) -> float:
    """Nearest-rank 99th percentile."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.99 * len(s) + 0.5) - 1))]


def compare(
    args: argparse.Namespace, names: Sequence[str], contestants: Sequence[tuple[str, bool, bool]]
) -> None:
    """Print each contestant's CPU median [spread of the per-seed medians] and the C loop's speed-up."""
    print(
        f"STFPolicy.decide on two_tier({RACKS}x{PER_RACK}, oversubscription {OVERSUB:g}), "
        f"{len(SERVERS)} servers; {args.decisions} decisions per seed, seeds {args.seeds}; "
        "CPU ms per decision, median [min-max of the seeds' medians]"
    )
    head = f"{'scenario':<14} {'horizon':>7} {'ready':>7} " + " ".join(f"{c[0]:>24}" for c in contestants)
    print(f"{head} {'C vs Python loop' if len(contestants) > 1 else '':>16} same")
    for name, horizon, n in itertools.product(names, args.horizon, args.sizes):
        every: list[list[float]] = [[] for _ in contestants]
        per_seed: list[list[float]] = [[] for _ in contestants]
        same = True
        for seed in args.seeds:
            cpu, ok = sequence(name, n, seed, args.decisions, horizon or None, contestants=contestants)
            for k, times in enumerate(cpu):
                every[k].extend(times)
                per_seed[k].append(statistics.median(times))
            same = same and ok
        meds = [statistics.median(times) for times in every]
        cells = " ".join(
            f"{f'{m * 1e3:.2f} [{min(ps) * 1e3:.2f}-{max(ps) * 1e3:.2f}]':>24}"
            for m, ps in zip(meds, per_seed, strict=True)
        )
        ratio = f"{meds[-2] / meds[-1]:>15.1f}x" if len(meds) > 1 else " " * 16
        print(f"{name:<14} {horizon or 'all':>7} {n:>7} {cells} {ratio} {'yes' if same else 'NO'}")


def main(argv: Sequence[str] | None = None) -> None:
    """Print the comparison (default), the one-policy table (``--table``) or a profile."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--decisions", type=int, default=10, help="timed decisions per seed (comparison)")
    ap.add_argument(
        "--table", action="store_true", help="the incremental policy alone, the same inputs repeated"
    )
    ap.add_argument(
        "--repeat", type=int, default=0, help="decisions per size with --table (default: 30/20/5)"
    )
    ap.add_argument("--scenario", choices=["homogeneous", "heterogeneous", "both"], default="both")
    ap.add_argument("--profile", action="store_true", help="cProfile one incremental decision")
    ap.add_argument(
        "--alone",
        action="store_true",
        help="only the book with the C loop (the others' work, in turns, heats the collector and caches)",
    )
    ap.add_argument(
        "--horizon",
        type=int,
        nargs="+",
        default=[256],
        help="STFPolicy horizons (0: plan everything); default 256, the service's",
    )
    args = ap.parse_args(argv)
    names = ["homogeneous", "heterogeneous"] if args.scenario == "both" else [args.scenario]
    if args.profile:
        n = args.sizes[0]
        snap, pending = scenario(names[-1], n, seed=n)
        policy = STFPolicy(horizon=args.horizon[0] or None)
        policy.decide(snap, pending)
        prof = cProfile.Profile()
        prof.runcall(policy.decide, snap, pending)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        return
    if not args.table:
        compare(args, names, CONTESTANTS[-1:] if args.alone else CONTESTANTS)
        return
    print(
        f"STFPolicy.decide on two_tier({RACKS}x{PER_RACK}, oversubscription {OVERSUB:g}), "
        f"{len(SERVERS)} servers"
    )
    print(
        f"{'scenario':<14} {'horizon':>7} {'ready':>7} {'runs':>5} {'cpu median ms':>14} {'cpu p99 ms':>11} "
        f"{'wall median ms':>15} {'wall p99 ms':>12} {'cpu us/update':>14}"
    )
    for name, horizon, n in itertools.product(names, args.horizon, args.sizes):
        repeat = args.repeat or (30 if n <= 100 else 20 if n <= 1000 else 5)
        wall, cpu = measure(name, n, repeat, horizon or None)
        med = statistics.median(cpu)
        print(
            f"{name:<14} {horizon or 'all':>7} {n:>7} {repeat:>5} {med * 1e3:>14.2f} {p99(cpu) * 1e3:>11.2f} "
            f"{statistics.median(wall) * 1e3:>15.2f} {p99(wall) * 1e3:>12.2f} {med / n * 1e6:>14.1f}"
        )


if __name__ == "__main__":
    main()
