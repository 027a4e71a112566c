"""Scenarios: a cluster, a workload and an iteration model, run under each policy.

A :class:`Scenario` is everything but the policy; :func:`run_scenario` simulates it under
one policy and summarizes the run. :func:`cluster` builds the preset clusters the CLI and
the benchmark use: a star (one switch; the server's NIC is the bottleneck), an
oversubscribed two-tier (rack uplinks are the bottleneck, paper §7 NS1-NS3) or a k-ary
fat-tree, with optionally heterogeneous NICs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from mlfabric.scheduler.core import graph as bg
from mlfabric.scheduler.policies.base import Policy
from mlfabric.scheduler.policies.dispatch import DEFAULT_MAX_WAIT, DEFAULT_WINDOW, ReplanTrigger
from mlfabric.scheduler.sim.engine import Simulator
from mlfabric.scheduler.sim.iteration import AsyncSGD, SyncSGD
from mlfabric.scheduler.sim.report import PolicyStats, summarize
from mlfabric.scheduler.sim.workload import BandwidthChange, ComputeModel

__all__ = ["Cluster", "Scenario", "cluster", "nic_rates", "run_scenario"]


@dataclass(frozen=True)
class Cluster:
    """A bandwidth graph with the server's host and the workers' hosts."""

    graph: nx.DiGraph
    server_host: str
    workers: tuple[str, ...]


def nic_rates(
    hosts: Sequence[str], nic_bps: float, slow_fraction: float, slow_factor: float, rng: np.random.Generator
) -> dict[str, float]:
    """NIC rates with a random ``slow_fraction`` of ``hosts`` ``slow_factor`` times slower.

    Parameters
    ----------
    hosts : sequence of str
        Hosts that may be slow (leave the server out to keep its NIC nominal).
    nic_bps : float
        Nominal NIC rate (bits/s).
    slow_fraction : float
        Share of slow NICs in [0, 1].
    slow_factor : float
        A slow NIC runs at ``nic_bps / slow_factor``.
    rng : numpy.random.Generator
        Seeded generator choosing the slow hosts.

    Returns
    -------
    dict
        Host -> NIC rate (bits/s).

    Examples
    --------
    >>> r = nic_rates(["a", "b", "c", "d"], 8e9, 0.5, 4.0, np.random.default_rng(0))
    >>> sorted(r.values())
    [2000000000.0, 2000000000.0, 8000000000.0, 8000000000.0]
    """
    if not 0.0 <= slow_fraction <= 1.0:
        raise ValueError(f"slow NIC fraction must be in [0, 1], got {slow_fraction}")
    if slow_factor <= 0:
        raise ValueError(f"slow NIC factor must be > 0, got {slow_factor}")
    k = round(slow_fraction * len(hosts))
    slow = set(rng.choice(len(hosts), size=k, replace=False).tolist()) if k else set()
    return {h: nic_bps / slow_factor if i in slow else nic_bps for i, h in enumerate(hosts)}


def cluster(
    preset: str,
    workers: int,
    *,
    nic_bps: float = 10e9,
    server_bps: float | None = None,
    slow_fraction: float = 0.0,
    slow_factor: float = 1.0,
    hosts_per_rack: int = 16,
    oversubscription: float = 4.0,
    rng: np.random.Generator | None = None,
) -> Cluster:
    """A preset cluster of one server and ``workers`` workers.

    Parameters
    ----------
    preset : {"star", "two-tier", "fat-tree"}
        ``star``: server ``ps`` and workers ``w0..`` on one switch. ``two-tier``: racks of
        ``hosts_per_rack`` hosts, uplinks ``oversubscription`` times oversubscribed; the
        server is ``h0`` (rack 0), the workers the next hosts. ``fat-tree``: the smallest
        k-ary fat-tree with enough hosts, every link at ``nic_bps``.
    workers : int
        Number of workers (>= 1).
    nic_bps : float
        Nominal NIC rate (bits/s).
    server_bps : float, optional
        The server's NIC rate (default ``nic_bps``); star and two-tier only.
    slow_fraction, slow_factor : float
        Heterogeneous NICs (see :func:`nic_rates`); the server's NIC stays nominal. Not
        for ``fat-tree``, whose links all run at one rate.
    hosts_per_rack, oversubscription : int, float
        Two-tier shape.
    rng : numpy.random.Generator, optional
        Chooses the slow NICs (required when ``slow_fraction > 0``).

    Returns
    -------
    Cluster

    Examples
    --------
    >>> c = cluster("two-tier", 20, hosts_per_rack=8)
    >>> c.server_host, len(c.workers), c.workers[-1]
    ('h0', 20, 'h20')
    """
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    if slow_fraction > 0 and rng is None:
        raise ValueError("heterogeneous NICs need a seeded rng")
    gen = rng if rng is not None else np.random.default_rng(0)
    if preset == "star":
        names = [f"w{i}" for i in range(workers)]
        rates = nic_rates(names, nic_bps, slow_fraction, slow_factor, gen)
        rates["ps"] = server_bps or nic_bps
        return Cluster(bg.star(["ps", *names], rates), "ps", tuple(names))
    if preset == "two-tier":
        racks = math.ceil((workers + 1) / hosts_per_rack)
        names = [f"h{i}" for i in range(racks * hosts_per_rack)]
        rates = nic_rates(names[1:], nic_bps, slow_fraction, slow_factor, gen)
        rates["h0"] = server_bps or nic_bps
        g = bg.two_tier(racks, hosts_per_rack, rates, oversubscription=oversubscription)
        return Cluster(g, "h0", tuple(names[1 : workers + 1]))
    if preset == "fat-tree":
        if slow_fraction > 0:
            raise ValueError("the fat-tree preset has one link rate; use a topology file for mixed NICs")
        k = 2
        while k**3 // 4 < workers + 1:
            k += 2
        g = bg.fat_tree(k, nic_bps)
        return Cluster(g, "h0", tuple(f"h{i}" for i in range(1, workers + 1)))
    raise ValueError(f"unknown preset '{preset}' (star, two-tier, fat-tree)")


@dataclass(frozen=True)
class Scenario:
    """Everything a simulated comparison fixes except the policy.

    Parameters
    ----------
    cluster : Cluster
        Graph, server and workers.
    compute : ComputeModel
        Compute time of each worker's iterations (stragglers, jitter, seed).
    mode : {"async", "sync"}
        Iteration model (:class:`AsyncSGD` or :class:`SyncSGD`).
    update_bytes : float
        Size of an update.
    iterations : int, optional
        Pushes per worker (async) or iterations (sync).
    duration : float
        Simulated seconds to stop at (``inf``: until ``iterations`` are done).
    model_bytes : float
        Size of the model sent back after each push (0: not simulated).
    model_broadcast : {"direct", "tree"}
        Synchronous rounds: the model to the workers as one copy each, or down a relay tree
        (:class:`Simulator`).
    tau_max : int
        Delay bound (< 0: none). Synchronous SGD has no staleness and ignores it.
    wait : bool
        Asynchronous workers wait for their push to resolve before computing again.
    batch_window, batch_max_wait, dispatch_margin : float
        Batching and dispatch parameters (see :class:`Simulator`); batching defaults to
        the service's adaptive batching (300 µs quiet, at most 5 ms).
    changes : tuple of BandwidthChange
        Link capacity changes.
    """

    cluster: Cluster
    compute: ComputeModel
    mode: str = "async"
    update_bytes: float = 10e6
    iterations: int | None = None
    duration: float = math.inf
    model_bytes: float = 0.0
    model_broadcast: str = "direct"
    tau_max: int = -1
    wait: bool = True
    batch_window: float = DEFAULT_WINDOW
    batch_max_wait: float = DEFAULT_MAX_WAIT
    dispatch_margin: float = 0.0
    changes: tuple[BandwidthChange, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {self.mode!r}")
        if self.model_broadcast not in ("direct", "tree"):
            raise ValueError(f"model_broadcast must be 'direct' or 'tree', got {self.model_broadcast!r}")
        if self.iterations is None and math.isinf(self.duration):
            raise ValueError("give iterations or a finite duration")


def run_scenario(
    scenario: Scenario,
    policy: Policy,
    *,
    replan: ReplanTrigger | None = None,
    clock: Callable[[], float] | None = None,
    progress: Callable[[float, int], None] | None = None,
    record_flows: bool = False,
) -> tuple[PolicyStats, Simulator]:
    """Simulate ``scenario`` under ``policy`` and summarize it.

    Parameters
    ----------
    scenario : Scenario
        The comparison's fixed part.
    policy : Policy
        A fresh policy object.
    replan : ReplanTrigger, optional
        Its re-plan trigger (``make_policy(name)`` gives both; default: low-water 0).
    clock : callable, optional
        Clock (e.g. ``time.perf_counter``) to time the run and its decisions; none: ``wall_s``
        and ``decide_s`` are NaN.
    progress : callable, optional
        ``progress(sim_time, events)``, called every few dozen events.
    record_flows : bool
        Keep every transfer's rate history (for ``--trace`` and schedule checks).

    Returns
    -------
    (PolicyStats, Simulator)
        The summary and the simulator (records, flows, counters).

    Examples
    --------
    >>> from mlfabric.scheduler.policies.fair import FairPolicy
    >>> c = cluster("star", 2, nic_bps=8e6)
    >>> compute = ComputeModel(dict.fromkeys(c.workers, 0.0))
    >>> sc = Scenario(c, compute, update_bytes=1e6, iterations=1, batch_window=0.0, batch_max_wait=0.0)
    >>> stats, _ = run_scenario(sc, FairPolicy())
    >>> stats.applied, stats.completion_mean
    (2, 2.0)
    """
    c = scenario.cluster
    iteration: AsyncSGD | SyncSGD
    if scenario.mode == "async":
        iteration = AsyncSGD(scenario.compute, scenario.iterations, wait=scenario.wait)
    else:
        iteration = SyncSGD(scenario.compute, scenario.iterations)
    sim = Simulator(
        c.graph,
        policy,
        iteration,
        server_host=c.server_host,
        workers=c.workers,
        update_bytes=scenario.update_bytes,
        model_bytes=scenario.model_bytes,
        model_broadcast=scenario.model_broadcast,
        tau_max=scenario.tau_max if scenario.mode == "async" else -1,
        batch_window=scenario.batch_window,
        batch_max_wait=scenario.batch_max_wait,
        dispatch_margin=scenario.dispatch_margin,
        replan=replan,
        changes=scenario.changes,
        until=scenario.duration,
        record_flows=record_flows,
        progress=progress,
        clock=clock,
    )
    t0 = clock() if clock is not None else math.nan
    records = sim.run()
    wall = clock() - t0 if clock is not None else math.nan
    stats = summarize(
        policy.name,
        records,
        sim_time=sim.now,
        makespans=iteration.makespans if isinstance(iteration, SyncSGD) else (),
        decisions=sim.decisions,
        events=sim.events,
        wall_s=wall,
        decide_s=sim.decide_s,
    )
    return stats, sim
