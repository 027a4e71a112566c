"""Simulate scheduling policies on a large cluster (fluid, discrete-event; DESIGN §6).

Runs the same policy code as the scheduler service (fair, stf, stf+agg: STF with
aggregation groups, and stf+tree: multi-level aggregation trees) on a simulated cluster:
concurrent transfers share links max-min fairly, the policy's sends are released when the
transfers they follow are done, links may change bandwidth over time, the server applies
updates in arrival order. Prints one row per policy (delay, completion time, applied/dropped,
sync makespan) and the ratios
to fair. Every policy sees the same cluster and the same compute times (--seed).

examples:
  mlfabric simulate --preset star --workers 64 --policy fair,stf --iterations 5
  mlfabric simulate --preset two-tier --workers 256 --oversubscription 4 \\
      --slow-nics 0.25:4 --straggler 0.1:3 --tau-max 64 --duration 10
  mlfabric simulate --preset star --workers 32 --server-gbps 2.5 --mode sync \\
      --aggregation --iterations 3 --trace sim.json      # open in ui.perfetto.dev
  mlfabric simulate --preset two-tier --workers 31 --hosts-per-rack 8 --mode sync \\
      --model-mb 20 --model-broadcast tree --policy stf+tree   # the model down a relay tree
  mlfabric simulate --preset two-tier --workers 7 --hosts-per-rack 4 --nic-gbps 0.1 \\
      --mode sync --update-mb 4.5 --policy fair,stf+tree --pipelined-aggregates

bandwidth schedule file (TOML), for --bandwidth-schedule:
  [[change]]
  at = 2.0          # seconds
  a = "w3"          # link ends (both directions unless direction = "ab")
  b = "sw"
  mbps = 100        # or gbps; 0 takes the link down
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from mlfabric.scheduler.policies.registry import DEFAULT_STF_HORIZON

__all__ = ["Progress", "configure", "run"]


def _pair(text: str) -> tuple[float, float]:
    """``FRACTION:FACTOR`` -> (fraction, factor)."""
    try:
        a, b = text.split(":")
        return float(a), float(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FRACTION:FACTOR, e.g. 0.1:4, got {text!r}") from None


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``simulate`` subcommand's arguments."""
    g = parser.add_argument_group("cluster")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--topology", type=Path, help="topology TOML file (see mlfabric.scheduler.core.graph)")
    where.add_argument(
        "--preset",
        choices=["star", "two-tier", "fat-tree"],
        default="star",
        help="built-in cluster (default: star): star = one switch (server NIC is the bottleneck); "
        "two-tier = racks with oversubscribed uplinks, server h0 in rack 0; fat-tree = smallest "
        "k-ary fat-tree with enough hosts",
    )
    g.add_argument("--workers", type=int, default=16, help="number of workers (default 16)")
    g.add_argument("--server", help="server host with --topology (default: the first host)")
    g.add_argument("--nic-gbps", type=float, default=10.0, help="NIC rate of presets (default 10)")
    g.add_argument(
        "--server-gbps", type=float, help="server NIC rate of the star preset (default: --nic-gbps)"
    )
    g.add_argument(
        "--slow-nics",
        type=_pair,
        metavar="FRACTION:FACTOR",
        help="heterogeneous NICs: a random FRACTION of workers get NIC rate / FACTOR",
    )
    g.add_argument("--hosts-per-rack", type=int, default=16, help="two-tier rack size (default 16)")
    g.add_argument(
        "--oversubscription", type=float, default=4.0, help="two-tier uplink oversubscription (default 4)"
    )
    g.add_argument("--bandwidth-schedule", type=Path, help="TOML file of link capacity changes over time")

    w = parser.add_argument_group("workload")
    w.add_argument(
        "--policy",
        default="fair,stf",
        help="comma-separated policies: fair, stf, stf+agg (aggregation groups, meant for sync "
        "SGD: it does not drop on tau_max), stf+tree (multi-level aggregation trees) (default fair,stf)",
    )
    w.add_argument("--mode", choices=["async", "sync"], default="async", help="SGD iteration model")
    w.add_argument(
        "--pipelined-aggregates",
        action="store_true",
        help="stf+tree plans each synchronous round as a pipelined (cut-through) aggregation tree "
        "(chains to stars, per-rack trees joined across racks, scored by the all-reduce planner's "
        "model: the most loaded link's time plus a chunk per hop) and the simulator forwards its "
        "aggregates chunk by chunk as their members arrive (docs/pipelined-aggregation.md); its "
        "rows are labelled stf+tree/pipelined (default: store-and-forward, an aggregate leaves "
        "once every member is in whole)",
    )
    w.add_argument("--aggregation", action="store_true", help="also run stf+agg (aggregation groups)")
    stop = w.add_mutually_exclusive_group()
    stop.add_argument("--iterations", type=int, help="pushes per worker (async) or iterations (sync)")
    stop.add_argument("--duration", type=float, help="simulated seconds to run")
    w.add_argument("--update-mb", type=float, default=10.0, help="update size in MB (default 10)")
    w.add_argument(
        "--model-mb",
        type=float,
        default=0.0,
        help="model size sent back after each push (default 0: instant)",
    )
    w.add_argument(
        "--model-broadcast",
        choices=["direct", "tree"],
        default="direct",
        help="sync rounds: how the server sends the model (--model-mb) to the workers: direct = one "
        "copy per worker through the server's link; tree = down a relay tree planned from the graph "
        "(one copy per rack across an oversubscribed uplink, fanned out inside, pipelined in chunks; "
        "docs/broadcast.md) (default direct)",
    )
    w.add_argument("--compute-ms", type=float, default=100.0, help="compute time per iteration (default 100)")
    w.add_argument(
        "--jitter", type=float, default=0.1, help="log-normal sigma of compute times (default 0.1)"
    )
    w.add_argument(
        "--straggler",
        type=_pair,
        metavar="FRACTION:FACTOR",
        help="compute stragglers: a random FRACTION of workers compute FACTOR times longer",
    )
    w.add_argument("--tau-max", type=int, default=-1, help="delay bound for async SGD (default: none)")
    w.add_argument(
        "--no-wait",
        action="store_true",
        help="async workers compute the next update right after pushing (default: wait for the model)",
    )
    w.add_argument(
        "--stf-horizon",
        type=int,
        default=DEFAULT_STF_HORIZON,
        metavar="N",
        help="stf: plan the first N sends per decision and decide again once N/4 remain planned, "
        f"as the scheduler service does; 0 plans every pending update (default {DEFAULT_STF_HORIZON})",
    )
    w.add_argument("--batch-window-us", type=float, default=300.0, help="adaptive batching quiet time")
    w.add_argument("--batch-max-wait-ms", type=float, default=5.0, help="adaptive batching maximum wait")
    w.add_argument(
        "--dispatch-margin-ms", type=float, default=0.0, help="release a send this early (default 0)"
    )
    w.add_argument("--seed", type=int, default=0, help="seed of stragglers, slow NICs and jitter")

    o = parser.add_argument_group("output")
    o.add_argument("--trace", type=Path, help="write a Chrome trace (one track per link; Perfetto)")
    o.add_argument(
        "--json",
        type=Path,
        help="write the results as JSON (a list, one object per policy; a missing value, e.g. no "
        "makespan in asynchronous runs, is null)",
    )
    o.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (default: a line with simulated time and events/s every 5 s of "
        "wall time on long runs, and one per policy when it is done)",
    )


class Progress:
    """Prints simulated time, events and events per wall second, at most every ``every`` wall seconds.

    The simulator calls it every few dozen events (``progress(sim_time, events)``); a line
    goes out once ``every`` seconds of ``clock`` passed since the last one, so short runs print
    nothing and long runs show that they advance.

    Parameters
    ----------
    label : str
        Printed first (the policy).
    every : float
        Wall seconds between lines (default 5).
    clock : callable
        Wall clock (default :func:`time.monotonic`).
    stream : file, optional
        Where the lines go (default ``sys.stderr``).

    Examples
    --------
    >>> import io
    >>> t = [0.0]
    >>> out = io.StringIO()
    >>> p = Progress("stf", every=5.0, clock=lambda: t[0], stream=out)
    >>> p(0.5, 100); out.getvalue()
    ''
    >>> t[0] = 6.0; p(1.25, 3000); print(out.getvalue().strip())
    [stf] 6 s wall: t=1.250 s simulated, 3000 events (500 events/s)
    """

    def __init__(
        self,
        label: str,
        every: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        stream: TextIO | None = None,
    ) -> None:
        self.label = label
        self.every = every
        self.clock = clock
        self.stream = stream
        self.started = self.last = clock()
        self.events = 0

    def __call__(self, sim_time: float, events: int) -> None:
        now = self.clock()
        if now - self.last >= self.every:
            rate = (events - self.events) / (now - self.last)
            self.last, self.events = now, events
            print(
                f"[{self.label}] {now - self.started:.0f} s wall: t={sim_time:.3f} s simulated, "
                f"{events} events ({rate:.0f} events/s)",
                file=self.stream if self.stream is not None else sys.stderr,
                flush=True,
            )


def _cluster(args: argparse.Namespace, rng: Any) -> Any:
    from mlfabric.scheduler.core.graph import hosts, load_topology
    from mlfabric.scheduler.sim.scenario import Cluster, cluster

    if args.topology is not None:
        g = load_topology(args.topology)
        names = hosts(g)
        server = args.server or names[0]
        if server not in names:
            raise ValueError(f"--server {server!r} is not a host of {args.topology}")
        others = [h for h in names if h != server]
        if args.workers > len(others):
            raise ValueError(f"{args.topology} has only {len(others)} hosts besides the server")
        return Cluster(g, server, tuple(others[: args.workers]))
    frac, factor = args.slow_nics or (0.0, 1.0)
    return cluster(
        args.preset,
        args.workers,
        nic_bps=args.nic_gbps * 1e9,
        server_bps=args.server_gbps * 1e9 if args.server_gbps is not None else None,
        slow_fraction=frac,
        slow_factor=factor,
        hosts_per_rack=args.hosts_per_rack,
        oversubscription=args.oversubscription,
        rng=rng,
    )


def _policies(args: argparse.Namespace) -> list[str]:
    from mlfabric.scheduler.policies.registry import POLICIES

    names = [p.strip() for p in args.policy.split(",") if p.strip()]
    if args.aggregation and "stf+agg" not in names:
        names.append("stf+agg")
    for n in names:
        if n not in POLICIES:
            raise ValueError(f"unknown policy {n!r} ({', '.join(POLICIES)})")
    if args.stf_horizon < 0:
        raise ValueError(f"--stf-horizon must be >= 0, got {args.stf_horizon}")
    return names


def _make_policy(name: str, args: argparse.Namespace) -> Any:
    from mlfabric.scheduler.policies.registry import make_policy

    return make_policy(
        name,
        horizon=args.stf_horizon,
        sync=args.mode == "sync",
        pipelined_aggregates=getattr(args, "pipelined_aggregates", False),
    )


def label(name: str, args: argparse.Namespace) -> str:
    """A policy's row label: ``stf+tree/pipelined`` under ``--pipelined-aggregates``.

    Examples
    --------
    >>> label("stf+tree", argparse.Namespace(pipelined_aggregates=True))
    'stf+tree/pipelined'
    >>> label("fair", argparse.Namespace(pipelined_aggregates=True))
    'fair'
    """
    return (
        f"{name}/pipelined" if name == "stf+tree" and getattr(args, "pipelined_aggregates", False) else name
    )


def run(args: argparse.Namespace) -> int:
    """Build the scenario, simulate every policy, print the table."""
    import numpy as np

    from mlfabric.scheduler.core.graph import TopologyError
    from mlfabric.scheduler.sim.report import format_table
    from mlfabric.scheduler.sim.scenario import Scenario, run_scenario
    from mlfabric.scheduler.sim.workload import ComputeModel, parse_bandwidth_schedule, pick_stragglers

    if args.iterations is None and args.duration is None:
        args.iterations = 5
    try:
        rng = np.random.default_rng(args.seed)
        cl = _cluster(args, rng)
        frac, factor = args.straggler or (0.0, 1.0)
        mean = pick_stragglers(cl.workers, frac, factor, args.compute_ms / 1e3, rng)
        changes: tuple[Any, ...] = ()
        if args.bandwidth_schedule is not None:
            data = tomllib.loads(args.bandwidth_schedule.read_text())
            changes = tuple(parse_bandwidth_schedule(data, cl.graph))
        scenario = Scenario(
            cl,
            ComputeModel(mean, jitter=args.jitter, seed=args.seed),
            mode=args.mode,
            update_bytes=args.update_mb * 1e6,
            iterations=args.iterations,
            duration=args.duration if args.duration is not None else math.inf,
            model_bytes=args.model_mb * 1e6,
            model_broadcast=args.model_broadcast,
            tau_max=args.tau_max,
            wait=not args.no_wait,
            batch_window=args.batch_window_us / 1e6,
            batch_max_wait=args.batch_max_wait_ms / 1e3,
            dispatch_margin=args.dispatch_margin_ms / 1e3,
            changes=changes,
        )
        names = _policies(args)
    except (ValueError, TopologyError, OSError, tomllib.TOMLDecodeError) as exc:
        print(f"mlfabric simulate: {exc}", file=sys.stderr)
        return 2
    print(
        f"# {len(cl.workers)} workers -> {cl.server_host}, {cl.graph.number_of_nodes()} nodes, "
        f"{args.mode} SGD, {args.update_mb:g} MB updates, seed {args.seed}",
        flush=True,
    )
    stats, events = [], []
    for i, name in enumerate(names):
        progress = None if args.quiet else Progress(name)
        setup = _make_policy(name, args)
        s, sim = run_scenario(
            scenario,
            setup.policy,
            replan=setup.trigger,
            clock=time.perf_counter,
            progress=progress,
            record_flows=args.trace is not None,
        )
        if not args.quiet:
            print(
                f"  [{name}] done: {s.events} events, {s.decisions} decisions, {s.wall_s:.1f} s "
                f"({s.decide_s:.1f} s deciding)",
                file=sys.stderr,
            )
        stats.append(dataclasses.replace(s, policy=label(name, args)))
        if args.trace is not None:
            events += _trace(sim, label(name, args), i + 1)
    print(format_table(stats))
    if args.trace is not None:
        from mlfabric.scheduler.core.trace import write_trace

        write_trace(args.trace, events)
        print(f"# trace: {args.trace} (open in ui.perfetto.dev)")
    if args.json is not None:
        args.json.write_text(json.dumps([s.as_json() for s in stats], indent=2, allow_nan=False))
    return 0


def _trace(sim: Any, name: str, pid: int) -> list[dict[str, Any]]:
    from mlfabric.scheduler.core.trace import trace_events
    from mlfabric.scheduler.sim.tracing import flows_to_schedule

    schedule = flows_to_schedule(sim.flows, include_models=True)
    capacities = {(u, v): c for u, v, c in sim.graph.edges(data="capacity")}
    return trace_events(schedule, capacities=capacities, process=name, pid=pid)
