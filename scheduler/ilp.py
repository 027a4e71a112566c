"""The offline ILP: optimal joint ordering and aggregation routing (paper appendix 10.1, DESIGN §4).

Workers W, one server S, aggregators A on a bandwidth graph G. Time is split into slots of
``Δ = instance.slot_seconds``; the horizon (``T`` slots) comes from a heuristic plan's
length. Variables, per update ``u``, route ``r`` (direct, or via aggregator ``a``) and slot
``t``:

* ``y[u,r]`` (binary): ``u`` takes route ``r``; exactly one per update. An aggregator
  route is a *hop* ``(a, g)``: the ``g``-th of the ``groups`` aggregates ``a`` may make
  (groups at one aggregator fill up and finish in order, which breaks their symmetry).
* ``x[u,r,t]`` (integer, bytes in units of a quantum): bytes of ``u`` moved on the first leg
  of ``r`` (worker -> server, or worker -> ``a``) during slot ``t``; zero before ``u`` is
  ready; ``Σ_t x[u,r,t] = bytes(u) · y[u,r]``.
* ``z[u,h,t]`` (binary, aggregator routes): the first leg of ``u`` to hop ``h`` is complete
  by the end of slot ``t`` (``Σ_{k<=t} x[u,h,k] >= bytes(u)·z``, ``z <= y``).
* ``xa[h,t]``: bytes of hop ``h``'s aggregate moved in slot ``t`` to S; it moves in slot
  ``t`` only if every member's first leg was complete by the end of slot ``t-1`` (store and
  forward: ``xa[h,t] <= cap·(1 - y[u,h] + z[u,h,t-1])``).
* ``A[h,t]`` (binary): the aggregate is at S by the end of slot ``t``: it has carried one
  update's size, that of its largest member (``Σ_{k<=t} xa[h,k] >= bytes(v)·(A + y[v,h] - 1)``).
* ``w[u,h,t]`` (0/1): ``u``'s content reached S inside hop ``h``'s aggregate by slot ``t``
  (``w <= A``, ``w <= z[u,h,t-1]``, ``Σ_{k<=t} xa[h,k] >= bytes(u)·w``): the disaggregated
  form, much tighter in the LP relaxation than a big-M on the route.
* ``d[u,t]`` (binary): ``u``'s content is at S by the end of slot ``t``:
  ``bytes(u)·d <= Σ_{k<=t} x[u,direct,k] + bytes(u)·Σ_h w[u,h,t]``; ``d`` is monotone and
  fixed to 0 before the earliest possible arrival; completion ``C_u = Δ·(T + 1 - Σ_t d[u,t])``.

Capacity: on every directed link and slot, the bytes of all first legs and aggregates whose
path crosses the link are at most ``capacity · Δ`` (the fluid, time-shared model of §3.1.1:
a payload may use any rate up to its residual on every link of its path). Objective:
``Σ_u C_u`` (mean completion, asynchronous SGD) or ``max_u C_u`` (makespan, synchronous).

Solver choice (measured on this 2-core machine, 2 threads, see
``experiments/results/bench_ilp.md``): CP-SAT on the integer-scaled model against the same
model with continuous bytes under MathOpt's HiGHS and SCIP backends (``engine=``). On
8 workers x 2 aggregators (T=34) CP-SAT proved optimality in ~1 s; HiGHS and SCIP needed
10-40 s and more, and at 16 x 4 the MIP solvers ended the 60 s limit with large gaps while
CP-SAT closed to < 1 %. CP-SAT's core-guided and LP-based bound workers together suit this
model (many binaries with big-M links, few continuous quantities), it takes a warm start as
a hint, reports progress through callbacks, and stops cleanly on Ctrl-C with its best
solution. It is the default; ``"highs"`` and ``"scip"`` stay selectable for comparison.

Bytes are scaled to an integer quantum: the greatest common divisor of the update sizes and
per-slot link capacities when that is fine enough, otherwise ~1/200 of the largest update;
capacities round down and sizes up, so a plan is always feasible in real bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ortools.linear_solver.python import model_builder as mb
from ortools.sat.python import cp_model

from mlfabric.scheduler.aggregation import plan_aggregation, plan_aggregation_sync
from mlfabric.scheduler.graph import path_links
from mlfabric.scheduler.instance import Instance
from mlfabric.scheduler.schedule import Aggregate, Link, Reservation, Schedule, Transfer
from mlfabric.scheduler.stf import plan_stf

__all__ = [
    "ENGINES",
    "IlpResult",
    "Progress",
    "aggregate_id",
    "heuristic_plans",
    "objective_of",
    "solve_ilp",
    "warm_start",
]

#: Solver engines: CP-SAT (default) and MathOpt/model_builder MIP back ends.
ENGINES = ("cp-sat", "highs", "scip")

Hop = tuple[str, int]  # (aggregator host, group index there)
Route = Hop | None  # None: direct


def aggregate_id(aggregator: str, group: int = 0) -> str:
    """Payload id of the ``group``-th aggregate an aggregator makes.

    Examples
    --------
    >>> aggregate_id("a1"), aggregate_id("a1", 1)
    ('agg@a1', 'agg@a1#1')
    """
    return f"agg@{aggregator}" + (f"#{group}" if group else "")


@dataclass(frozen=True)
class Progress:
    """A progress report during a solve: best objective (s) and best bound (s) so far."""

    wall_seconds: float
    objective: float | None
    bound: float


@dataclass(frozen=True)
class IlpResult:
    """The outcome of :func:`solve_ilp`.

    Attributes
    ----------
    schedule : Schedule or None
        Best plan found (passes ``check_schedule``); ``None`` if none was found.
    objective : float or None
        Its objective in seconds (mean completion or makespan).
    bound : float
        Best proven lower bound on the objective (s).
    gap : float
        ``(objective - bound) / objective`` (``inf`` without a plan).
    status : str
        ``OPTIMAL``, ``FEASIBLE``, ``INFEASIBLE`` or ``UNKNOWN``.
    wall_seconds : float
        Solve time.
    routes : dict
        Update id -> aggregator host or ``None`` (direct).
    engine : str
        Which solver ran.
    horizon_slots : int
        ``T``.
    """

    schedule: Schedule | None
    objective: float | None
    bound: float
    gap: float
    status: str
    wall_seconds: float
    routes: dict[str, str | None]
    engine: str
    horizon_slots: int


def objective_of(instance: Instance, schedule: Schedule) -> float:
    """The instance's objective (seconds) for a plan: mean update completion or makespan.

    Examples
    --------
    >>> from mlfabric.scheduler.instance import parse_instance
    >>> inst = parse_instance({"topology": {"hosts": ["s", "w"], "links": [{"a": "w", "b": "s", "mbps": 8}]},
    ...                        "server": "s", "updates": [{"id": "u", "worker": "w", "bytes": 10}]})
    >>> plan = Schedule(transfers=(Transfer.at_rate("u", ("w", "s"), start=0, bytes=10, rate=5),))
    >>> objective_of(inst, plan)
    2.0
    """
    done = schedule.update_completion_times(list(instance.updates))
    times = [done[u.update_id] for u in instance.updates]
    return max(times) if instance.objective == "makespan" else sum(times) / len(times)


# ---------------------------------------------------------------------------------------------
# Solver back ends: one small adapter per engine so that the model is written once.


class _CpSat:
    def __init__(self) -> None:
        self.model = cp_model.CpModel()
        self.solver = cp_model.CpSolver()

    def var(self, lb: int, ub: int, name: str, integer: bool = True) -> Any:
        return self.model.new_int_var(lb, ub, name)

    def bool(self, name: str) -> Any:
        return self.model.new_bool_var(name)

    def add(self, constraint: Any) -> None:
        self.model.add(constraint)

    def total(self, terms: list[Any]) -> Any:
        return cp_model.LinearExpr.sum(terms)

    def minimize(self, expr: Any) -> None:
        self.model.minimize(expr)

    def hint(self, var: Any, value: int) -> None:
        self.model.add_hint(var, value)

    def solve(
        self, time_limit: float, seed: int, workers: int, report: Callable[[float, float], None]
    ) -> str:
        p = self.solver.parameters
        p.max_time_in_seconds = time_limit
        p.random_seed = seed
        p.num_workers = workers
        p.catch_sigint_signal = True

        class _OnSolution(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(inner) -> None:
                report(inner.objective_value, inner.best_objective_bound)

        self.solver.best_bound_callback = lambda bound: report(math.nan, bound)
        status = self.solver.solve(self.model, _OnSolution())
        return str(self.solver.status_name(status))

    def value(self, var: Any) -> float:
        return float(self.solver.value(var))

    def bound(self) -> float:
        return float(self.solver.best_objective_bound)


class _Mip:
    def __init__(self, engine: str) -> None:
        self.model = mb.Model()
        self.solver = mb.Solver(engine)
        self._status = ""

    def var(self, lb: int, ub: int, name: str, integer: bool = True) -> Any:
        return (self.model.new_int_var if integer else self.model.new_num_var)(lb, ub, name)

    def bool(self, name: str) -> Any:
        return self.model.new_bool_var(name)

    def add(self, constraint: Any) -> None:
        self.model.add(constraint)

    def total(self, terms: list[Any]) -> Any:
        return mb.LinearExpr.sum(terms)

    def minimize(self, expr: Any) -> None:
        self.model.minimize(expr)

    def hint(self, var: Any, value: int) -> None:
        self.model.add_hint(var, value)

    def solve(
        self, time_limit: float, seed: int, workers: int, report: Callable[[float, float], None]
    ) -> str:
        self.solver.set_time_limit_in_seconds(time_limit)
        status = self.solver.solve(self.model)
        names = {
            mb.SolveStatus.OPTIMAL: "OPTIMAL",
            mb.SolveStatus.FEASIBLE: "FEASIBLE",
            mb.SolveStatus.INFEASIBLE: "INFEASIBLE",
        }
        return names.get(status, "UNKNOWN")

    def value(self, var: Any) -> float:
        return float(self.solver.value(var))

    def bound(self) -> float:
        return float(self.solver.best_objective_bound)


# ---------------------------------------------------------------------------------------------


def _quantum(instance: Instance, links: set[Link]) -> float:
    slot = instance.slot_seconds
    values = [u.bytes for u in instance.updates] + [instance.capacity(e) * slot for e in links]
    biggest = max(u.bytes for u in instance.updates)
    if all(abs(v - round(v)) <= 1e-9 * v and round(v) > 0 for v in values):
        g = 0
        for v in values:
            g = math.gcd(g, round(v))
        if biggest / g <= 1000 and max(values) / g <= 20000:
            return float(g)
    smallest_slot = min(instance.capacity(e) * slot for e in links)
    return min(biggest / 200, smallest_slot / 20)


def _sequential_horizon(instance: Instance) -> float:
    latest = max(u.ready_at for u in instance.updates)
    return latest + sum(
        u.bytes / instance.path_rate(instance.direct_path(u.update_id)) for u in instance.updates
    )


def _slot_bytes(transfer: Transfer, slot: float, horizon: int) -> list[float]:
    """Bytes of ``transfer`` moved in each slot, measured on the first link of its path."""
    first = transfer.links[0]
    out = [0.0] * horizon
    for r in transfer.reservations:
        if r.link != first or r.rate <= 0:
            continue
        t = int(r.start // slot)
        while t < horizon and t * slot < r.end:
            lo, hi = max(r.start, t * slot), min(r.end, (t + 1) * slot)
            out[t] += max(0.0, hi - lo) * r.rate
            t += 1
    return out


def _reservations(
    links: list[Link], amounts: dict[int, float], slot: float, nbytes: float
) -> tuple[tuple[Reservation, ...], float, float]:
    """Per-slot amounts (quanta) -> reservations carrying ``nbytes`` on every link, start, end.

    Solver noise below 1e-7 of the payload is dropped; the rest is scaled to ``nbytes`` (a
    factor <= 1 when sizes were rounded up to the quantum), so capacities still hold.
    """
    total = sum(amounts.values())
    slots = sorted(t for t, v in amounts.items() if v > 1e-7 * total)
    scale = nbytes / sum(amounts[t] for t in slots)
    runs: list[tuple[int, int, float]] = []
    for t in slots:
        rate = amounts[t] * scale / slot
        if runs and runs[-1][1] == t and abs(runs[-1][2] - rate) <= 1e-12 * rate:
            runs[-1] = (runs[-1][0], t + 1, rate)
        else:
            runs.append((t, t + 1, rate))
    res = tuple(Reservation(link, a * slot, b * slot, rate) for a, b, rate in runs for link in links)
    return res, slots[0] * slot, (slots[-1] + 1) * slot


def solve_ilp(
    instance: Instance,
    *,
    hint: Schedule | None = None,
    horizon_slots: int | None = None,
    time_limit: float = 60.0,
    seed: int = 0,
    workers: int = 2,
    engine: str = "cp-sat",
    groups: int = 2,
    progress: Callable[[Progress], None] | None = None,
) -> IlpResult:
    """Solve the time-indexed ILP of appendix 10.1 for ``instance`` (see the module docstring).

    Parameters
    ----------
    instance : Instance
        Updates, server, aggregators, slot length and objective.
    hint : Schedule, optional
        A heuristic plan (STF, aggregation groups): the warm start, and the horizon
        (its makespan) when ``horizon_slots`` is not given.
    horizon_slots : int, optional
        ``T``; default: the hint's makespan, else every update sent one after another.
    time_limit : float
        Seconds; the best plan found by then is returned.
    seed : int
        Solver random seed (reproducible runs with ``workers=1``).
    workers : int
        Solver threads.
    engine : str
        ``"cp-sat"`` (default), ``"highs"`` or ``"scip"``.
    groups : int
        Aggregates each aggregator may make (one after another: the aggregation groups of
        Fig. 6 reuse a hop); 1 is the paper's one aggregate per aggregator.
    progress : callable, optional
        Called with a :class:`Progress` on every new solution and bound (CP-SAT only).

    Returns
    -------
    IlpResult
        Plan, objective, bound, gap, status and wall time.

    Examples
    --------
    >>> from mlfabric.scheduler.instance import parse_instance
    >>> inst = parse_instance({
    ...     "topology": {"hosts": ["s", "w1", "w2"], "switches": ["sw"],
    ...                  "links": [{"a": h, "b": "sw", "mbps": 8} for h in ("s", "w1", "w2")]},
    ...     "server": "s", "slot_seconds": 1.0,
    ...     "updates": [{"id": "a", "worker": "w1", "bytes": 1000000},
    ...                 {"id": "b", "worker": "w2", "bytes": 2000000}]})
    >>> r = solve_ilp(inst, time_limit=10)
    >>> r.status, r.objective, r.routes
    ('OPTIMAL', 2.0, {'a': None, 'b': None})
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    started = time.monotonic()
    slot = instance.slot_seconds
    n = len(instance.updates)
    if horizon_slots is None:
        length = hint.makespan() if hint is not None else _sequential_horizon(instance)
        horizon_slots = max(1, math.ceil(length / slot - 1e-9))
    T = horizon_slots
    server = instance.server
    routes: dict[str, list[Route]] = {
        u.update_id: [None, *((a, g) for a in instance.routes(u.update_id)[1:] for g in range(groups))]
        for u in instance.updates
    }
    used_aggs = sorted({r for rs in routes.values() for r in rs if r is not None})
    leg: dict[tuple[str, Route], list[Link]] = {}
    for u in instance.updates:
        for r in routes[u.update_id]:
            leg[u.update_id, r] = path_links(list(instance.path(u.src, r[0] if r else server)))
    agg_leg = {hop: path_links(list(instance.path(hop[0], server))) for hop in used_aggs}
    all_links = {e for ls in leg.values() for e in ls} | {e for ls in agg_leg.values() for e in ls}
    q = _quantum(instance, all_links)
    cap = {e: math.floor(instance.capacity(e) * slot / q + 1e-9) for e in all_links}
    size = {u.update_id: math.ceil(u.bytes / q - 1e-9) for u in instance.updates}
    integer = engine == "cp-sat"
    m: _CpSat | _Mip = _CpSat() if engine == "cp-sat" else _Mip(engine)

    y: dict[tuple[str, Route], Any] = {}
    x: dict[tuple[str, Route, int], Any] = {}
    z: dict[tuple[str, Route, int], Any] = {}  # first leg to the aggregator done by slot t
    d: dict[tuple[str, int], Any] = {}
    on_link: dict[tuple[Link, int], list[Any]] = {}
    agg_rate = {a: min(cap[e] for e in agg_leg[a]) for a in used_aggs}
    members: dict[Hop, list[str]] = {a: [] for a in used_aggs}
    for u in instance.updates:
        uid = u.update_id
        first = math.ceil(u.ready_at / slot - 1e-9)
        earliest = T - 1
        for r in routes[uid]:
            y[uid, r] = m.bool(f"y[{uid},{r}]")
            ub = min(cap[e] for e in leg[uid, r])
            done_leg = first + math.ceil(size[uid] / ub) - 1
            earliest = min(earliest, done_leg + (0 if r is None else math.ceil(size[uid] / agg_rate[r])))
            moved: list[Any] = []
            for t in range(first, T if r is None else T - 1):
                x[uid, r, t] = v = m.var(0, ub, f"x[{uid},{r},{t}]", integer)
                m.add(v <= ub * y[uid, r])
                moved.append(v)
                for e in leg[uid, r]:
                    on_link.setdefault((e, t), []).append(v)
                if r is not None and t >= done_leg:
                    z[uid, r, t] = m.bool(f"z[{uid},{r},{t}]")
                    m.add(m.total(moved) >= size[uid] * z[uid, r, t])
                    m.add(z[uid, r, t] <= y[uid, r])
                    if (uid, r, t - 1) in z:
                        m.add(z[uid, r, t - 1] <= z[uid, r, t])
            m.add(m.total(moved) == size[uid] * y[uid, r])
            if r is not None:
                members[r].append(uid)
        m.add(m.total([y[uid, r] for r in routes[uid]]) == 1)
        for t in range(min(max(0, earliest), T - 1), T):
            d[uid, t] = m.bool(f"d[{uid},{t}]")
            if (uid, t - 1) in d:
                m.add(d[uid, t - 1] <= d[uid, t])
    # w[u,a,t]: u's aggregate at a is at the server by slot t (the disaggregated form of
    # "d <= aggregate done", much tighter in the LP relaxation than a big-M on the route).
    w: dict[tuple[str, Hop, int], Any] = {}
    xa: dict[tuple[Hop, int], Any] = {}
    agg_done: dict[tuple[Hop, int], Any] = {}
    for a in used_aggs:
        ub = agg_rate[a]
        sent: list[Any] = []
        for t in range(T):
            xa[a, t] = v = m.var(0, ub, f"xa[{a},{t}]", integer)
            sent.append(v)
            for e in agg_leg[a]:
                on_link.setdefault((e, t), []).append(v)
            done = None
            for uid in members[a]:
                arrived = z.get((uid, a, t - 1), 0)
                m.add(v <= ub * (1 - y[uid, a] + arrived))
                if (uid, t) not in d or isinstance(arrived, int):
                    continue
                if done is None:  # the aggregate (one update's size: its largest member) is in
                    done = agg_done[a, t] = m.bool(f"A[{a},{t}]")
                    for other in members[a]:
                        m.add(m.total(sent) >= size[other] * (done + y[other, a] - 1))
                w[uid, a, t] = f = m.var(0, 1, f"w[{uid},{a},{t}]", integer)
                m.add(f <= arrived)
                m.add(f <= done)
                m.add(m.total(sent) >= size[uid] * f)
    for hop in used_aggs:  # symmetry: groups at one aggregator fill up and finish in order
        if hop[1]:
            earlier = (hop[0], hop[1] - 1)
            for uid in members[hop]:
                m.add(y[uid, hop] <= m.total([y[other, earlier] for other in members[earlier]]))
            for t in range(T):
                if (hop, t) in agg_done and (earlier, t) in agg_done:
                    m.add(agg_done[hop, t] <= agg_done[earlier, t])
    for u in instance.updates:
        uid = u.update_id
        for t in range(T):
            if (uid, t) in d:
                via = [w[uid, r, t] for r in routes[uid] if r is not None and (uid, r, t) in w]
                reached = m.total([x[uid, None, k] for k in range(t + 1) if (uid, None, k) in x])
                m.add(size[uid] * d[uid, t] <= reached + size[uid] * m.total(via))
    for (e, _t), vs in on_link.items():
        if len(vs) > 1:
            m.add(m.total(vs) <= cap[e])
    # u completes at the end of the first slot t with d[u,t] = 1: C_u / Δ = T + 1 - Σ_t d[u,t]
    slots_of = {uid: T + 1 - m.total([d[uid, t] for t in range(T) if (uid, t) in d]) for uid in routes}
    for uid in routes:
        m.add(d[uid, T - 1] == 1)
    if instance.objective == "makespan":
        span = m.var(0, T + 1, "makespan", True)
        for uid in routes:
            m.add(span >= slots_of[uid])
        m.minimize(span)
        to_seconds = slot
    else:
        m.minimize(m.total(list(slots_of.values())))
        to_seconds = slot / n
    if hint is not None:
        _add_hint(m, instance, hint, q, T, _Vars(y, x, z, d, w, agg_done, xa))

    def report(objective: float, bound: float) -> None:
        if progress is not None:
            obj = None if math.isnan(objective) else objective * to_seconds
            progress(Progress(time.monotonic() - started, obj, bound * to_seconds))

    status = m.solve(max(0.01, time_limit - (time.monotonic() - started)), seed, workers, report)
    wall = time.monotonic() - started
    bound = m.bound() * to_seconds if status != "INFEASIBLE" else math.inf
    bound = bound if math.isfinite(bound) and status != "INFEASIBLE" else 0.0
    if status in ("OPTIMAL", "FEASIBLE"):
        chosen = {uid: next(r for r in routes[uid] if m.value(y[uid, r]) > 0.5) for uid in routes}
        schedule = _to_schedule(instance, m, chosen, leg, agg_leg, x, xa, size, T)
        hosts = {uid: r[0] if r else None for uid, r in chosen.items()}
    elif hint is not None:  # stopped before the first solution: the warm start is the best plan
        schedule, status, hosts = hint, "FEASIBLE", _hosts(hint, routes)
    else:
        return IlpResult(None, None, bound, math.inf, status, wall, {}, engine, T)
    objective = objective_of(instance, schedule)
    if hint is not None and objective_of(instance, hint) < objective:  # stopped before using the hint
        schedule, objective, hosts = hint, objective_of(instance, hint), _hosts(hint, routes)
    bound = min(bound, objective)
    gap = (objective - bound) / objective if objective > 0 else 0.0
    if gap <= 1e-9:
        status = "OPTIMAL"
    return IlpResult(schedule, objective, bound, gap, status, wall, hosts, engine, T)


def _hosts(schedule: Schedule, updates: Iterable[str]) -> dict[str, str | None]:
    """Update id -> the aggregator it goes through in ``schedule``, or ``None``."""
    parent = {mem: a.aggregator for a in schedule.aggregates for mem in a.members}
    return {uid: parent.get(uid) for uid in updates}


def heuristic_plans(instance: Instance) -> dict[str, Schedule]:
    """The heuristics the ILP is the yardstick for: ``stf`` (Fig. 4) and, with aggregators,
    ``aggregation`` (groups over the STF order, Fig. 6; for the makespan objective chosen
    for one synchronous iteration by
    :func:`~mlfabric.scheduler.aggregation.plan_aggregation_sync`).

    Examples
    --------
    >>> import random
    >>> from mlfabric.scheduler.instance import parse_instance, two_tier_instance
    >>> sorted(heuristic_plans(parse_instance(two_tier_instance(random.Random(0), 4, 1))))
    ['aggregation', 'stf']
    """
    updates = list(instance.updates)
    plans = {"stf": plan_stf(instance.graph, updates)}
    if instance.aggregators:
        group = plan_aggregation_sync if instance.objective == "makespan" else plan_aggregation
        plans["aggregation"] = group(instance.graph, updates, aggregators=list(instance.aggregators))
    return plans


def warm_start(instance: Instance, plans: Iterable[Schedule] | None = None) -> Schedule:
    """The best of the heuristic plans (default :func:`heuristic_plans`): the ILP's hint.

    Examples
    --------
    >>> import random
    >>> from mlfabric.scheduler.instance import parse_instance, two_tier_instance
    >>> inst = parse_instance(two_tier_instance(random.Random(0), 8, 2))
    >>> plan = warm_start(inst)
    >>> objective_of(inst, plan) <= objective_of(inst, plan_stf(inst.graph, list(inst.updates)))
    True
    """
    candidates = list(plans) if plans is not None else list(heuristic_plans(instance).values())
    return min(candidates, key=lambda plan: objective_of(instance, plan))


@dataclass(frozen=True)
class _Vars:
    y: dict[tuple[str, Route], Any]
    x: dict[tuple[str, Route, int], Any]
    z: dict[tuple[str, Route, int], Any]
    d: dict[tuple[str, int], Any]
    w: dict[tuple[str, Hop, int], Any]
    agg_done: dict[tuple[Hop, int], Any]
    xa: dict[tuple[Hop, int], Any]


def _add_hint(m: _CpSat | _Mip, instance: Instance, hint: Schedule, q: float, T: int, v: _Vars) -> None:
    """Warm start: every variable's value in the hint plan (bytes rounded to quanta)."""
    slot = instance.slot_seconds
    done_slot: dict[str, int] = {}  # payload -> slot in which it is complete
    for t_ in hint.transfers:
        if not t_.replica:
            done_slot[t_.payload_id] = max(0, math.ceil(t_.end / slot - 1e-9) - 1)
    hop_of: dict[str, Hop] = {}  # the hint's aggregates at each aggregator, in finishing order
    for agg in sorted(hint.aggregates, key=lambda a: (done_slot.get(a.aggregate_id, 0), a.aggregate_id)):
        hop_of[agg.aggregate_id] = (agg.aggregator, sum(h[0] == agg.aggregator for h in hop_of.values()))
    parent = {mem: hop_of[a.aggregate_id] for a in hint.aggregates for mem in a.members}
    agg_of = {hop: aid for aid, hop in hop_of.items()}
    for u in instance.updates:
        uid = u.update_id
        route = parent.get(uid)
        delivery = hint.delivery(uid)
        if (uid, route) not in v.y or delivery is None:
            return  # not a plan of this model (an aggregator or a group too many): no hint
        choices = [r for (u_, r) in v.y if u_ == uid]
        for r in choices:
            m.hint(v.y[uid, r], int(r == route))
        for t, amount in enumerate(_slot_bytes(delivery, slot, T)):
            for r in choices:
                if (uid, r, t) in v.x:
                    m.hint(v.x[uid, r, t], round(amount / q) if r == route else 0)
        arrived = done_slot[uid]
        complete = done_slot[agg_of[route]] if route is not None else arrived
        for t in range(T):
            for r in choices:
                if r is None:
                    continue
                if (uid, r, t) in v.z:
                    m.hint(v.z[uid, r, t], int(r == route and t >= arrived))
                if (uid, r, t) in v.w:
                    m.hint(v.w[uid, r, t], int(r == route and t >= complete))
            if (uid, t) in v.d:
                m.hint(v.d[uid, t], int(t >= complete))
    for hop, aid in agg_of.items():
        delivery = hint.delivery(aid)
        if delivery is None:
            continue
        for t, amount in enumerate(_slot_bytes(delivery, slot, T)):
            if (hop, t) in v.xa:
                m.hint(v.xa[hop, t], round(amount / q))
            if (hop, t) in v.agg_done:
                m.hint(v.agg_done[hop, t], int(t >= done_slot[aid]))


def _to_schedule(
    instance: Instance,
    m: _CpSat | _Mip,
    chosen: dict[str, Route],
    leg: dict[tuple[str, Route], list[Link]],
    agg_leg: dict[Hop, list[Link]],
    x: dict[tuple[str, Route, int], Any],
    xa: dict[tuple[Hop, int], Any],
    size_q: dict[str, int],
    T: int,
) -> Schedule:
    slot = instance.slot_seconds
    transfers: list[Transfer] = []
    members: dict[Hop, list[str]] = {}
    for u in instance.updates:
        uid, r = u.update_id, chosen[u.update_id]
        moved = {t: m.value(x[uid, r, t]) for t in range(T) if (uid, r, t) in x}
        res, start, end = _reservations(leg[uid, r], moved, slot, u.bytes)
        path = instance.path(u.src, r[0] if r else instance.server)
        transfers.append(Transfer(uid, path[0], path[-1], path, start, end, u.bytes, res))
        if r is not None:
            members.setdefault(r, []).append(uid)
    aggregates = []
    for a, mem in sorted(members.items()):
        size = max(instance.update(uid).bytes for uid in mem)
        amounts: dict[int, float] = {}
        need, sent = max(size_q[uid] for uid in mem), 0.0
        for t in range(T):  # anything the solver sends beyond the aggregate's size is waste
            amounts[t] = min(m.value(xa[a, t]), max(0.0, need - sent))
            sent += amounts[t]
        res, start, end = _reservations(agg_leg[a], amounts, slot, size)
        path = instance.path(a[0], instance.server)
        aid = aggregate_id(*a)
        transfers.append(Transfer(aid, a[0], instance.server, path, start, end, size, res))
        aggregates.append(Aggregate(aid, a[0], tuple(mem), size, instance.server))
    return Schedule(transfers=tuple(transfers), aggregates=tuple(aggregates))
