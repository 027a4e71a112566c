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

Solver choice, by measurement on this 2-core machine (``experiments/bench_ilp.py`` part 1,
``experiments/results/bench_ilp.md``; same model, hint and limit): CP-SAT on the
integer-scaled model against the model with continuous bytes under OR-Tools'
model_builder SCIP and HiGHS. 6 workers x 2 aggregators, 30 s: CP-SAT proved the optimum
in 20 s (2 or 8 search workers); SCIP ended at a 26 % gap, HiGHS with no solution or
bound (it also crashes when given hints, so it runs without one). 8 x 2: CP-SAT with 8
workers 12 %, SCIP 25 %, CP-SAT with 2 workers 49 %, HiGHS nothing. SCIP's LP bound is
strong on pure ordering (no aggregators: optimal in 0.5 s), but the aggregation routing
(binaries with big-M gating) is where CP-SAT's portfolio (LP, core-guided and
local-search workers sharing bounds and solutions) pulls ahead. CP-SAT also takes the
warm start as a hint, reports progress through solution and bound callbacks, and stops
cleanly on Ctrl-C with its best solution. It is the default, with 8 search workers even
on 2 cores (the portfolio matters more than the threads); ``"scip"`` and ``"highs"`` stay
selectable. Should the solver stop before its first solution, or with a worse one than
the hint, the hint is returned.

Completions are counted at slot ends, so objective and bound are those of the slot model.
On slot-aligned instances (every update a whole number of slots at full rate on every
link, ready at slot boundaries; :func:`~mlfabric.scheduler.instance.two_tier_instance`
makes such) the optimum matched the fluid brute force on every tested instance; otherwise
pick ``slot_seconds`` small against the transfer times.

Bytes are scaled to an integer quantum: the greatest common divisor of the update sizes and
per-slot link capacities when that is fine enough, otherwise ~1/200 of the largest update;
capacities round down and sizes up, so a plan is always feasible in real bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ortools.linear_solver.python import model_builder as mb
from ortools.sat.python import cp_model

from mlfabric.scheduler.graph import path_links
from mlfabric.scheduler.instance import Instance, objective_of
from mlfabric.scheduler.schedule import Aggregate, Link, Reservation, Schedule, Transfer

__all__ = ["ENGINES", "IlpResult", "Progress", "aggregate_id", "solve_ilp"]

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


# ---------------------------------------------------------------------------------------------
# Solver back ends: one small adapter per engine so that the model is written once.


class _Backend:
    """What the model builders need from a solver; ``model`` is a CP-SAT or model_builder model."""

    model: Any
    solver: Any

    def bool(self, name: str) -> Any:
        return self.model.new_bool_var(name)

    def add(self, constraint: Any) -> None:
        self.model.add(constraint)

    def minimize(self, expr: Any) -> None:
        self.model.minimize(expr)

    def hint(self, var: Any, value: int) -> None:
        self.model.add_hint(var, value)

    def value(self, var: Any) -> float:
        return float(self.solver.value(var))


class _CpSat(_Backend):
    def __init__(self) -> None:
        self.model = cp_model.CpModel()
        self.solver = cp_model.CpSolver()

    def var(self, lb: int, ub: int, name: str, integer: bool = True) -> Any:
        return self.model.new_int_var(lb, ub, name)

    def total(self, terms: list[Any]) -> Any:
        return cp_model.LinearExpr.sum(terms)

    def solve(
        self, time_limit: float, seed: int, workers: int, report: Callable[[float, float], None]
    ) -> str:
        p = self.solver.parameters
        p.max_time_in_seconds = time_limit
        p.random_seed = seed
        p.num_workers = workers
        p.catch_sigint_signal = True  # Ctrl-C ends the search with the best solution so far

        class _OnSolution(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(inner) -> None:
                report(inner.objective_value, inner.best_objective_bound)

        self.solver.best_bound_callback = lambda bound: report(math.nan, bound)
        status = self.solver.solve(self.model, _OnSolution())
        return str(self.solver.status_name(status))

    def bound(self) -> float:
        return float(self.solver.best_objective_bound)


class _Mip(_Backend):
    def __init__(self, engine: str) -> None:
        self.model = mb.Model()
        self.solver = mb.Solver(engine)

    def var(self, lb: int, ub: int, name: str, integer: bool = True) -> Any:
        return (self.model.new_int_var if integer else self.model.new_num_var)(lb, ub, name)

    def total(self, terms: list[Any]) -> Any:
        return mb.LinearExpr.sum(terms)

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

    def bound(self) -> float:
        value = self.solver.best_objective_bound  # pandas NA when the solver has none
        return float(value) if isinstance(value, int | float) else -math.inf


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


@dataclass(frozen=True)
class _Layout:
    """The instance in the model's units: slots, routes, paths, quanta per slot and per update."""

    T: int
    slot: float
    routes: dict[str, list[Route]]
    hops: list[Hop]
    leg: dict[tuple[str, Route], list[Link]]
    agg_leg: dict[Hop, list[Link]]
    q: float
    cap: dict[Link, int]
    size: dict[str, int]


def _layout(instance: Instance, T: int, groups: int) -> _Layout:
    server = instance.server
    routes: dict[str, list[Route]] = {
        u.update_id: [None, *((a, g) for a in instance.routes(u.update_id)[1:] for g in range(groups))]
        for u in instance.updates
    }
    hops = sorted({r for rs in routes.values() for r in rs if r is not None})
    leg = {
        (u.update_id, r): path_links(list(instance.path(u.src, r[0] if r else server)))
        for u in instance.updates
        for r in routes[u.update_id]
    }
    agg_leg = {hop: path_links(list(instance.path(hop[0], server))) for hop in hops}
    links = {e for ls in leg.values() for e in ls} | {e for ls in agg_leg.values() for e in ls}
    q = _quantum(instance, links)
    cap = {e: math.floor(instance.capacity(e) * instance.slot_seconds / q + 1e-9) for e in links}
    size = {u.update_id: math.ceil(u.bytes / q - 1e-9) for u in instance.updates}
    return _Layout(T, instance.slot_seconds, routes, hops, leg, agg_leg, q, cap, size)


@dataclass
class _Vars:
    """The model's variables (see the module docstring) and what the builders share."""

    integer: bool
    y: dict[tuple[str, Route], Any] = field(default_factory=dict)
    x: dict[tuple[str, Route, int], Any] = field(default_factory=dict)
    z: dict[tuple[str, Route, int], Any] = field(default_factory=dict)
    d: dict[tuple[str, int], Any] = field(default_factory=dict)
    w: dict[tuple[str, Hop, int], Any] = field(default_factory=dict)
    agg_done: dict[tuple[Hop, int], Any] = field(default_factory=dict)
    xa: dict[tuple[Hop, int], Any] = field(default_factory=dict)
    members: dict[Hop, list[str]] = field(default_factory=dict)
    on_link: dict[tuple[Link, int], list[Any]] = field(default_factory=dict)


def _add_first_legs(m: _CpSat | _Mip, instance: Instance, lay: _Layout, v: _Vars) -> None:
    """Routes ``y``, first-leg bytes ``x``, arrivals at the aggregator ``z``, and ``d``."""
    T, size, cap = lay.T, lay.size, lay.cap
    agg_rate = {hop: min(cap[e] for e in lay.agg_leg[hop]) for hop in lay.hops}
    v.members = {hop: [] for hop in lay.hops}
    for u in instance.updates:
        uid = u.update_id
        first = math.ceil(u.ready_at / lay.slot - 1e-9)
        earliest = T - 1
        for r in lay.routes[uid]:
            v.y[uid, r] = m.bool(f"y[{uid},{r}]")
            ub = min(cap[e] for e in lay.leg[uid, r])
            done_leg = first + math.ceil(size[uid] / ub) - 1
            earliest = min(earliest, done_leg + (0 if r is None else math.ceil(size[uid] / agg_rate[r])))
            moved: list[Any] = []
            for t in range(first, T if r is None else T - 1):
                v.x[uid, r, t] = x = m.var(0, ub, f"x[{uid},{r},{t}]", v.integer)
                m.add(x <= ub * v.y[uid, r])
                moved.append(x)
                for e in lay.leg[uid, r]:
                    v.on_link.setdefault((e, t), []).append(x)
                if r is not None and t >= done_leg:
                    v.z[uid, r, t] = z = m.bool(f"z[{uid},{r},{t}]")
                    m.add(m.total(moved) >= size[uid] * z)
                    m.add(z <= v.y[uid, r])
                    if (uid, r, t - 1) in v.z:
                        m.add(v.z[uid, r, t - 1] <= z)
            m.add(m.total(moved) == size[uid] * v.y[uid, r])
            if r is not None:
                v.members[r].append(uid)
        m.add(m.total([v.y[uid, r] for r in lay.routes[uid]]) == 1)
        for t in range(min(max(0, earliest), T - 1), T):
            v.d[uid, t] = m.bool(f"d[{uid},{t}]")
            if (uid, t - 1) in v.d:
                m.add(v.d[uid, t - 1] <= v.d[uid, t])


def _add_aggregates(m: _CpSat | _Mip, lay: _Layout, v: _Vars) -> None:
    """Aggregate bytes ``xa`` (store and forward), completion ``A`` and ``w``; symmetry."""
    size = lay.size
    for hop in lay.hops:
        ub = min(lay.cap[e] for e in lay.agg_leg[hop])
        sent: list[Any] = []
        for t in range(lay.T):
            v.xa[hop, t] = xa = m.var(0, ub, f"xa[{hop},{t}]", v.integer)
            sent.append(xa)
            for e in lay.agg_leg[hop]:
                v.on_link.setdefault((e, t), []).append(xa)
            done = None
            for uid in v.members[hop]:
                arrived = v.z.get((uid, hop, t - 1), 0)
                m.add(xa <= ub * (1 - v.y[uid, hop] + arrived))
                if (uid, t) not in v.d or isinstance(arrived, int):
                    continue
                if done is None:  # the aggregate (one update's size: its largest member) is in
                    done = v.agg_done[hop, t] = m.bool(f"A[{hop},{t}]")
                    for other in v.members[hop]:
                        m.add(m.total(sent) >= size[other] * (done + v.y[other, hop] - 1))
                v.w[uid, hop, t] = f = m.var(0, 1, f"w[{uid},{hop},{t}]", v.integer)
                m.add(f <= arrived)
                m.add(f <= done)
                m.add(m.total(sent) >= size[uid] * f)
    for hop in lay.hops:  # symmetry: groups at one aggregator fill up and finish in order
        if hop[1]:
            earlier = (hop[0], hop[1] - 1)
            for uid in v.members[hop]:
                m.add(v.y[uid, hop] <= m.total([v.y[other, earlier] for other in v.members[earlier]]))
            for t in range(lay.T):
                if (hop, t) in v.agg_done and (earlier, t) in v.agg_done:
                    m.add(v.agg_done[hop, t] <= v.agg_done[earlier, t])


def _add_arrivals(m: _CpSat | _Mip, lay: _Layout, v: _Vars) -> None:
    """``d`` from the direct bytes or the aggregates; link capacity per slot."""
    for uid, routes in lay.routes.items():
        size = lay.size[uid]
        for t in range(lay.T):
            if (uid, t) in v.d:
                via = [v.w[uid, r, t] for r in routes if r is not None and (uid, r, t) in v.w]
                reached = m.total([v.x[uid, None, k] for k in range(t + 1) if (uid, None, k) in v.x])
                m.add(size * v.d[uid, t] <= reached + size * m.total(via))
        m.add(v.d[uid, lay.T - 1] == 1)
    for (e, _t), flows in v.on_link.items():
        if len(flows) > 1:
            m.add(m.total(flows) <= lay.cap[e])


def _set_objective(m: _CpSat | _Mip, instance: Instance, lay: _Layout, v: _Vars) -> float:
    """Minimise the sum (or max) of completion slots; return the factor to seconds (mean)."""
    T = lay.T
    # u completes at the end of the first slot t with d[u,t] = 1: C_u / Δ = T + 1 - Σ_t d[u,t]
    slots_of = [T + 1 - m.total([v.d[uid, t] for t in range(T) if (uid, t) in v.d]) for uid in lay.routes]
    if instance.objective == "makespan":
        span = m.var(0, T + 1, "makespan", True)
        for slots in slots_of:
            m.add(span >= slots)
        m.minimize(span)
        return lay.slot
    m.minimize(m.total(slots_of))
    return lay.slot / len(slots_of)


def solve_ilp(
    instance: Instance,
    *,
    hint: Schedule | None = None,
    horizon_slots: int | None = None,
    time_limit: float = 60.0,
    seed: int = 0,
    workers: int = 8,
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
        CP-SAT search workers (its portfolio; 8 by default even on fewer cores).
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
    if horizon_slots is None:
        length = hint.makespan() if hint is not None else _sequential_horizon(instance)
        horizon_slots = max(1, math.ceil(length / instance.slot_seconds - 1e-9))
    lay = _layout(instance, horizon_slots, groups)
    T = lay.T
    m: _CpSat | _Mip = _CpSat() if engine == "cp-sat" else _Mip(engine)
    v = _Vars(integer=engine == "cp-sat")
    _add_first_legs(m, instance, lay, v)
    _add_aggregates(m, lay, v)
    _add_arrivals(m, lay, v)
    to_seconds = _set_objective(m, instance, lay, v)
    if hint is not None and engine != "highs":  # model_builder's HiGHS crashes on hints (9.15)
        _add_hint(m, instance, hint, lay.q, T, v)

    def report(objective: float, bound: float) -> None:
        if progress is not None:
            obj = None if math.isnan(objective) else objective * to_seconds
            progress(Progress(time.monotonic() - started, obj, bound * to_seconds))

    status = m.solve(max(0.01, time_limit - (time.monotonic() - started)), seed, workers, report)
    wall = time.monotonic() - started
    bound = m.bound() * to_seconds if status != "INFEASIBLE" else math.inf
    bound = bound if math.isfinite(bound) and status != "INFEASIBLE" else 0.0
    routes = lay.routes
    if status in ("OPTIMAL", "FEASIBLE"):
        chosen = {uid: next(r for r in routes[uid] if m.value(v.y[uid, r]) > 0.5) for uid in routes}
        schedule = _to_schedule(instance, m, lay, v, chosen)
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
    instance: Instance, m: _CpSat | _Mip, lay: _Layout, v: _Vars, chosen: dict[str, Route]
) -> Schedule:
    """The solver's values as a :class:`Schedule` (one reservation per run of equal slots)."""
    slot, T = lay.slot, lay.T
    transfers: list[Transfer] = []
    members: dict[Hop, list[str]] = {}
    for u in instance.updates:
        uid, r = u.update_id, chosen[u.update_id]
        moved = {t: m.value(v.x[uid, r, t]) for t in range(T) if (uid, r, t) in v.x}
        res, start, end = _reservations(lay.leg[uid, r], moved, slot, u.bytes)
        path = instance.path(u.src, r[0] if r else instance.server)
        transfers.append(Transfer(uid, path[0], path[-1], path, start, end, u.bytes, res))
        if r is not None:
            members.setdefault(r, []).append(uid)
    aggregates = []
    for a, mem in sorted(members.items()):
        size = max(instance.update(uid).bytes for uid in mem)
        amounts: dict[int, float] = {}
        need, sent = max(lay.size[uid] for uid in mem), 0.0
        for t in range(T):  # anything the solver sends beyond the aggregate's size is waste
            amounts[t] = min(m.value(v.xa[a, t]), max(0.0, need - sent))
            sent += amounts[t]
        res, start, end = _reservations(lay.agg_leg[a], amounts, slot, size)
        path = instance.path(a[0], instance.server)
        aid = aggregate_id(*a)
        transfers.append(Transfer(aid, a[0], instance.server, path, start, end, size, res))
        aggregates.append(Aggregate(aid, a[0], tuple(mem), size, instance.server))
    return Schedule(transfers=tuple(transfers), aggregates=tuple(aggregates))
