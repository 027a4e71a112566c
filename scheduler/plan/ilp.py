"""The offline ILP: optimal joint ordering and aggregation routing (paper appendix 10.1, DESIGN §4).

Workers W, one server S, aggregators A on a bandwidth graph G. Time is split into slots of
``Δ = instance.slot_seconds``; the horizon (``T`` slots) comes from a heuristic plan's
length. Bytes are counted in integer *quanta* (below). Every update ``u`` either goes
straight to S or joins one *aggregate* at an aggregator ``a``; an aggregate is a column
``(a, s, c)``: made at ``a``, needing ``s`` slots to S at the full rate ``ρ_a`` of its path
(its *size class*: the size of its largest member is ``k ∈ [k_lo(s), k_hi(s)]``, the
smallest and largest update sizes of that class; one size when sizes are whole slots), at S
by the end of slot ``c``. Indexing aggregates by their completion slot makes each member's
completion a constant of the column, so the objective is linear and tight, and an
aggregator may make any number of aggregates (``groups`` caps it; 1 is the paper's one
aggregate per aggregator). Classes by slots rather than exact sizes keep the model smaller
when sizes are off the slot grid; there, pick a coarser ``slot_seconds`` for many slots.

Variables (all 0/1 except the byte counts):

* ``y[u,r]``: ``u`` takes route ``r`` (``None`` direct, or ``a``); exactly one per update.
* ``x[u,r,t]`` (integer quanta): bytes of ``u`` moved on the first leg of ``r`` (worker ->
  S, or worker -> ``a``) in slot ``t``; zero before ``u`` is ready; ``Σ_t x = size(u)·y``.
* ``z[u,a,t]``: ``u``'s first leg to ``a`` is complete by the end of slot ``t``.
* ``D[u,c]``: ``u`` goes direct and is complete at the end of slot ``c``.
* ``G[a,s,c]``: column ``(a,s,c)`` is used; ``xa[a,s,c,t]`` its bytes to S in slot ``t``
  (``k_lo·G <= Σ_t xa <= k_hi·G`` and ``Σ_t xa >= size(u)·m`` for every member ``u``),
  ``S[a,s,c,t]`` it has started by slot ``t``; ``m[u,a,s,c]``: ``u`` is one of its members
  (only for ``size(u) <= k_hi`` and ``c`` late enough for ``u`` to arrive and the aggregate
  to be forwarded).

Rows: ``Σ_c D[u,c] = y[u,None]``; ``Σ_(s,c) m[u,a,s,c] = y[u,a]``; ``m <= G``; a used
column has a member of its class; store and forward: ``S[a,s,c,t] <= G - m[u,a,s,c] +
z[u,a,t-1]`` (the aggregate moves only once every member has arrived) and ``xa <=
rate·S``; on every directed link and slot, the bytes of all first legs and aggregates whose
path crosses it are at most ``capacity·Δ`` (the fluid, time-shared model of §3.1.1: a
payload may use any rate up to its residual on every link of its path). Objective:
``Σ_u C_u`` with ``C_u = Δ·(c + 1)`` of its ``D`` or ``m`` (mean completion, asynchronous
SGD), or ``max_u C_u`` (makespan, synchronous).

Valid rows that tighten the LP relaxation (every integer plan satisfies them):

* Windows (:func:`~mlfabric.scheduler.plan.ilp_model.add_direct` and friends): a payload that
  must be complete by slot ``c`` at rate ``ρ`` has moved at least ``size - ρ·(c - t)`` by slot
  ``t``, at most ``size - 1`` quanta (``k_hi - 1`` for an aggregate) before ``c`` when ``c``
  is its true completion, and nothing after ``c``: the LP finishes payloads at the end of
  their windows instead of spreading completion over them (with these the LP is exact on
  the no-aggregator instances of the benchmark, where STF is optimal).
* Energy per column: the members of ``(a,s,c)`` cross ``a``'s ingress between their ready
  slots and ``c - s``: ``Σ_(u ready >= r) size(u)·m[u,a,s,c] <= ingress(a)·(c - s - r + 1)·
  G[a,s,c]`` for every ready slot ``r``, and the Chvátal-Gomory rounding of that row
  by every update size (at most two updates of 2 slots in 5 slots, not two and a half). It
  scales with ``G``, not with the members: a fraction of a column can no longer serve whole
  updates while paying a fraction of the ingress (the weakness of a route-per-hop model,
  whose bound stayed 34 % below the plans on 16 x 4).
* Twins (:func:`~mlfabric.scheduler.plan.ilp_model.add_symmetry`): updates with the same size,
  ready slot and shared links on every route complete in instance order; the warm start is
  remapped to respect it.

Solver: CP-SAT on the integer-scaled model (default, 8 search workers even on 2 cores),
or the model with continuous bytes under OR-Tools' model_builder SCIP or HiGHS. CP-SAT takes
the warm start as a hint (HiGHS runs without: it crashes on hints in 9.15), reports progress
through solution and bound callbacks, and polls ``stop``. Should the solver stop before its
first solution, or with a worse one than the hint, the hint is returned. Why CP-SAT, and the
measured bounds and gaps: ``experiments/results/bench_ilp.md``.

Warm start and local search: the hint is the better heuristic plan (STF or aggregation
groups), improved for ``search_seconds`` (default a sixth of the limit, at most 10 s) by
simulated annealing over aggregation groups (:mod:`mlfabric.scheduler.plan.grouping`, ~1 ms a
plan at 16 x 4); CP-SAT takes the rest of the limit.

Completions are counted at slot ends, so objective and bound are those of the slot model.
On slot-aligned instances (every update a whole number of slots at full rate on every
link, ready at slot boundaries; :func:`~mlfabric.scheduler.plan.instance.two_tier_instance`
makes such) the optimum matched the fluid brute force on every tested instance; otherwise
pick ``slot_seconds`` small against the transfer times.

Bytes are scaled to an integer quantum: the greatest common divisor of the update sizes and
per-slot link capacities when that is fine enough, otherwise ~1/200 of the largest update;
capacities round down and sizes up, so a plan is always feasible in real bytes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlfabric.scheduler.core.schedule import Aggregate, Link, Reservation, Schedule, Transfer, aggregate_id
from mlfabric.scheduler.plan.grouping import groups_of, improve_groups, plan_groups
from mlfabric.scheduler.plan.ilp_model import (
    Column,
    CpSat,
    Layout,
    Mip,
    Vars,
    add_capacity,
    add_columns,
    add_direct,
    add_first_legs,
    add_hint,
    add_symmetry,
    layout,
    set_objective,
)
from mlfabric.scheduler.plan.ilp_relays import add_relay_column, add_relays, finish_relays, relay_payloads
from mlfabric.scheduler.plan.instance import Instance, objective_of

__all__ = ["ENGINES", "IlpResult", "Progress", "solve_ilp"]

#: Solver engines: CP-SAT (default) and MathOpt/model_builder MIP back ends.
ENGINES = ("cp-sat", "highs", "scip")

#: Most seconds of local search over aggregation groups before the solver (``search_seconds``).
SEARCH_SECONDS = 10.0


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
        ``OPTIMAL``, ``FEASIBLE``, ``INFEASIBLE``, ``UNKNOWN`` or ``INTERRUPTED``.
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


def _sequential_horizon(instance: Instance) -> float:
    latest = max(u.ready_at for u in instance.updates)
    return latest + sum(
        u.bytes / instance.path_rate(instance.direct_path(u.update_id)) for u in instance.updates
    )


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
    workers: int = 8,
    engine: str = "cp-sat",
    groups: int | None = None,
    search_seconds: float | None = None,
    progress: Callable[[Progress], None] | None = None,
    stop: threading.Event | None = None,
    levels: int = 1,
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
    groups : int, optional
        Most aggregates each aggregator may make (the aggregation groups of Fig. 6 reuse a
        hop); default no limit; 1 is the paper's one aggregate per aggregator.
    search_seconds : float, optional
        Seconds of local search over aggregation groups
        (:func:`~mlfabric.scheduler.plan.grouping.improve_groups`) from the hint before the
        solver starts; its best plan becomes the hint. Part of ``time_limit``; default a
        sixth of it, at most 10 s (0 with no hint).
    progress : callable, optional
        Called with a :class:`Progress` on every new solution and bound (CP-SAT only).
    stop : threading.Event, optional
        Polled by the local search (between rounds) and by CP-SAT (its callback): once set,
        the solve ends with its best plan so far (status ``INTERRUPTED`` when set during the
        local search). ``mlfabric plan`` sets it on Ctrl-C. HiGHS and SCIP do not poll it.
    levels : int
        1: every update goes direct or through one aggregator; 2: also through an
        aggregator whose aggregate is summed at another aggregator
        (:mod:`~mlfabric.scheduler.plan.ilp_relays`; the tree planner's plan space).

    Returns
    -------
    IlpResult
        Plan, objective, bound, gap, status and wall time.

    Examples
    --------
    >>> from mlfabric.scheduler.plan.instance import parse_instance
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
    if levels not in (1, 2):
        raise ValueError(f"levels must be 1 or 2, got {levels!r}")
    started = time.monotonic()
    stop = stop if stop is not None else threading.Event()
    if hint is not None:
        seconds = min(time_limit / 6, SEARCH_SECONDS) if search_seconds is None else search_seconds
        hint, horizon_slots = _search(instance, hint, horizon_slots, groups, seconds, seed, stop)
        if progress is not None and seconds > 0:
            progress(Progress(time.monotonic() - started, objective_of(instance, hint), 0.0))
    if horizon_slots is None:
        length = hint.makespan() if hint is not None else _sequential_horizon(instance)
        horizon_slots = _slots(instance, length)
    if stop.is_set() and hint is not None:  # Ctrl-C during the search: its best plan
        objective = objective_of(instance, hint)
        hosts = _hosts(hint, [u.update_id for u in instance.updates])
        wall = time.monotonic() - started
        return IlpResult(
            schedule=hint,
            objective=objective,
            bound=0.0,
            gap=1.0,
            status="INTERRUPTED",
            wall_seconds=wall,
            routes=hosts,
            engine=engine,
            horizon_slots=horizon_slots,
        )
    lay = layout(instance, horizon_slots, groups)
    T = lay.T
    m: CpSat | Mip = CpSat() if engine == "cp-sat" else Mip(engine)
    v = Vars(integer=engine == "cp-sat")
    add_first_legs(m, lay, v)
    add_direct(m, lay, v)
    if levels == 2:
        add_relays(m, instance, lay, v)
        v.relay_column = add_relay_column
    add_columns(m, lay, v)
    finish_relays(m, v)
    add_capacity(m, lay, v)
    add_symmetry(m, lay, v)
    to_seconds = set_objective(m, instance, lay, v)
    if hint is not None and engine != "highs":  # model_builder's HiGHS crashes on hints (9.15)
        add_hint(m, instance, hint, lay, v)

    def report(objective: float, bound: float) -> None:
        if progress is not None:
            obj = None if math.isnan(objective) else objective * to_seconds
            progress(Progress(time.monotonic() - started, obj, bound * to_seconds))

    status = m.solve(max(0.01, time_limit - (time.monotonic() - started)), seed, workers, report, stop)
    wall = time.monotonic() - started
    bound = m.bound() * to_seconds if status != "INFEASIBLE" else math.inf
    bound = bound if math.isfinite(bound) and status != "INFEASIBLE" else 0.0
    routes = lay.routes
    if status in ("OPTIMAL", "FEASIBLE"):
        hosts = {uid: next(r for r in routes[uid] if m.value(v.y[uid, r]) > 0.5) for uid in routes}
        schedule = _to_schedule(instance, m, lay, v, hosts)
    elif hint is not None:  # stopped before the first solution: the warm start is the best plan
        schedule, status, hosts = hint, "FEASIBLE", _hosts(hint, routes)
    else:
        return IlpResult(
            schedule=None,
            objective=None,
            bound=bound,
            gap=math.inf,
            status=status,
            wall_seconds=wall,
            routes={},
            engine=engine,
            horizon_slots=T,
        )
    objective = objective_of(instance, schedule)
    if hint is not None and objective_of(instance, hint) < objective:  # stopped before using the hint
        schedule, objective, hosts = hint, objective_of(instance, hint), _hosts(hint, routes)
    bound = min(bound, objective)
    gap = (objective - bound) / objective if objective > 0 else 0.0
    if gap <= 1e-9:
        status = "OPTIMAL"
    return IlpResult(
        schedule=schedule,
        objective=objective,
        bound=bound,
        gap=gap,
        status=status,
        wall_seconds=wall,
        routes=hosts,
        engine=engine,
        horizon_slots=T,
    )


def _search(
    instance: Instance,
    hint: Schedule,
    horizon_slots: int | None,
    groups: int | None,
    seconds: float,
    seed: int,
    stop: threading.Event,
) -> tuple[Schedule, int | None]:
    """The hint improved by local search over aggregation groups, and the horizon to hold it.

    The better plan replaces the hint only if it fits a given horizon; without one the
    horizon becomes the longer of the two plans, so the model holds both.
    """
    if seconds <= 0:
        return hint, horizon_slots
    found, cost = improve_groups(
        instance, groups_of(instance, hint), seconds=seconds, seed=seed, groups=groups, stop=stop.is_set
    )
    if cost >= objective_of(instance, hint):
        return hint, horizon_slots
    better = plan_groups(instance, found)
    slots = _slots(instance, max(hint.makespan(), better.makespan()))
    if horizon_slots is not None and slots > horizon_slots:
        return hint, horizon_slots
    return better, horizon_slots or slots


def _slots(instance: Instance, seconds: float) -> int:
    """Slots (at least one) that hold ``seconds`` of the instance's time."""
    return max(1, math.ceil(seconds / instance.slot_seconds - 1e-9))


def _hosts(schedule: Schedule, updates: Iterable[str]) -> dict[str, str | None]:
    """Update id -> the aggregator it goes through in ``schedule``, or ``None``."""
    parent = {mem: a.aggregator for a in schedule.aggregates for mem in a.members}
    return {uid: parent.get(uid) for uid in updates}


def _to_schedule(
    instance: Instance, m: CpSat | Mip, lay: Layout, v: Vars, hosts: dict[str, str | None]
) -> Schedule:
    """The solver's values as a :class:`Schedule` (one reservation per run of equal slots)."""
    slot, T = lay.slot, lay.T
    transfers: list[Transfer] = []
    for u in instance.updates:
        uid, r = u.update_id, hosts[u.update_id]
        moved = {t: m.value(v.x[uid, r, t]) for t in range(T) if (uid, r, t) in v.x}
        res, start, end = _reservations(lay.leg[uid, r], moved, slot, u.bytes)
        path = instance.path(u.src, r or instance.server)
        transfers.append(Transfer(uid, path[0], path[-1], path, start, end, u.bytes, res))
    members: dict[Column, list[str]] = {}
    for (uid, col), var in v.m.items():
        if m.value(var) > 0.5:
            members.setdefault(col, []).append(uid)
    relays, aggregates, into = relay_payloads(instance, m, lay, v, _reservations)
    transfers += relays
    leaves = {a.aggregate_id: a.members for a in aggregates}
    for col, ids in into.items():
        members.setdefault(col, []).extend(ids)
    made: dict[str, int] = {}  # aggregator -> aggregates so far
    for col in sorted(members, key=lambda col: (col[0], col[2], col[1])):
        a = col[0]
        aid, made[a] = aggregate_id(a, made.get(a, 0)), made.get(a, 0) + 1
        size = max(instance.update(u).bytes for uid in members[col] for u in leaves.get(uid, (uid,)))
        amounts = {t: m.value(v.xa[col, t]) for t in range(T) if (col, t) in v.xa}
        res, start, end = _reservations(lay.agg_leg[a], amounts, slot, size)
        path = instance.path(a, instance.server)
        transfers.append(Transfer(aid, a, instance.server, path, start, end, size, res))
        aggregates.append(Aggregate(aid, a, tuple(members[col]), size, instance.server))
    return Schedule(transfers=tuple(transfers), aggregates=tuple(aggregates))
