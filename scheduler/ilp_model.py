"""Model building for the offline ILP (paper appendix 10.1, DESIGN §4): back ends, variables,
constraints, objective and warm start. :mod:`mlfabric.scheduler.ilp` documents the model and
solves it; this module only writes it, once, for every engine. Internal: no public API.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ortools.linear_solver.python import model_builder as mb
from ortools.sat.python import cp_model

from mlfabric.scheduler.graph import path_links
from mlfabric.scheduler.instance import Instance
from mlfabric.scheduler.schedule import Link, Schedule, Transfer

__all__: list[str] = []

Hop = tuple[str, int]  # (aggregator host, group index there)
Route = Hop | None  # None: direct

# ---------------------------------------------------------------------------------------------
# Solver back ends: one small adapter per engine so that the model is written once.


class Backend:
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


class CpSat(Backend):
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


class Mip(Backend):
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


def quantum(instance: Instance, links: set[Link]) -> float:
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


def slot_bytes(transfer: Transfer, slot: float, horizon: int) -> list[float]:
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


@dataclass(frozen=True)
class Layout:
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


def layout(instance: Instance, T: int, groups: int) -> Layout:
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
    q = quantum(instance, links)
    cap = {e: math.floor(instance.capacity(e) * instance.slot_seconds / q + 1e-9) for e in links}
    size = {u.update_id: math.ceil(u.bytes / q - 1e-9) for u in instance.updates}
    return Layout(T, instance.slot_seconds, routes, hops, leg, agg_leg, q, cap, size)


@dataclass
class Vars:
    """The model's variables (see the module docstring) and what the builders share."""

    integer: bool
    y: dict[tuple[str, Route], Any] = field(default_factory=dict)
    x: dict[tuple[str, Route, int], Any] = field(default_factory=dict)
    z: dict[tuple[str, Route, int], Any] = field(default_factory=dict)
    d: dict[tuple[str, int], Any] = field(default_factory=dict)
    w: dict[tuple[str, Hop, int], Any] = field(default_factory=dict)
    agg_done: dict[tuple[Hop, int], Any] = field(default_factory=dict)
    xa: dict[tuple[Hop, int], Any] = field(default_factory=dict)
    e: dict[tuple[str, Hop, int], Any] = field(default_factory=dict)
    members: dict[Hop, list[str]] = field(default_factory=dict)
    twins: list[list[str]] = field(default_factory=list)
    on_link: dict[tuple[Link, int], list[Any]] = field(default_factory=dict)


def add_first_legs(m: CpSat | Mip, instance: Instance, lay: Layout, v: Vars) -> None:
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


def add_aggregates(m: CpSat | Mip, lay: Layout, v: Vars) -> None:
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


def add_store_and_forward(m: CpSat | Mip, lay: Layout, v: Vars) -> None:
    """Per-member shares ``e`` of the aggregate: bytes sent after the member arrived.

    ``e[u,h,t] <= xa[h,t]``, ``e[u,h,t] <= cap · z[u,h,t-1]`` and
    ``Σ_{k<=t} e[u,h,k] >= bytes(u) · w[u,h,t]``: ``u`` counts as delivered through the
    aggregate only once a whole update's worth of the aggregate left *after* ``u`` arrived.
    Every integer plan satisfies it (``e = xa`` for members), but in the LP relaxation it
    stops a fractional route from reaching the server one slot after its first leg: the
    store-and-forward delay of the aggregate is paid in full.
    """
    for hop in lay.hops:
        ub = min(lay.cap[link] for link in lay.agg_leg[hop])
        for uid in v.members[hop]:
            shares: list[Any] = []
            for t in range(lay.T):
                arrived = v.z.get((uid, hop, t - 1))
                if arrived is None:
                    continue
                v.e[uid, hop, t] = e = m.var(0, ub, f"e[{uid},{hop},{t}]", v.integer)
                m.add(e <= v.xa[hop, t])
                m.add(e <= ub * arrived)
                shares.append(e)
                if (uid, hop, t) in v.w:
                    m.add(m.total(shares) >= lay.size[uid] * v.w[uid, hop, t])


def add_symmetry(m: CpSat | Mip, lay: Layout, v: Vars) -> None:
    """Interchangeable updates complete in id order: ``d[u,t] >= d[u',t]`` for twins ``u < u'``.

    Twins have the same size and first slot and, route by route, the same links once the
    links no other payload can use (a worker's own NIC) are left out; swapping two twins maps
    every plan to one of equal objective, so the order is free. Fills ``v.twins``.
    """
    users: dict[Link, set[str]] = {}
    for (uid, _r), links in lay.leg.items():
        for link in links:
            users.setdefault(link, set()).add(uid)
    for links in lay.agg_leg.values():
        for link in links:
            users.setdefault(link, set()).add("")
    classes: dict[Any, list[str]] = {}
    for uid, routes in lay.routes.items():
        first = min((t for (u_, r, t) in v.x if u_ == uid and r is None), default=0)
        shared = tuple((r, tuple(link for link in lay.leg[uid, r] if users[link] != {uid})) for r in routes)
        classes.setdefault((lay.size[uid], first, shared), []).append(uid)
    v.twins = [ids for ids in classes.values() if len(ids) > 1]
    for ids in v.twins:
        for before, after in itertools.pairwise(ids):
            for t in range(lay.T):
                if (before, t) in v.d and (after, t) in v.d:
                    m.add(v.d[before, t] >= v.d[after, t])


def add_arrivals(m: CpSat | Mip, lay: Layout, v: Vars) -> None:
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


def set_objective(m: CpSat | Mip, instance: Instance, lay: Layout, v: Vars) -> float:
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


def add_hint(m: CpSat | Mip, instance: Instance, hint: Schedule, q: float, T: int, v: Vars) -> None:
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

    def finish(uid: str) -> int:
        payload = agg_of[parent[uid]] if uid in parent else uid
        return done_slot.get(payload, T)

    alias: dict[
        str, str
    ] = {}  # model update -> the hint's update whose plan it takes (twins finish in id order)
    for ids in v.twins:
        alias |= dict(zip(ids, sorted(ids, key=lambda uid: (finish(uid), ids.index(uid))), strict=True))
    for u in instance.updates:
        uid = u.update_id
        src = alias.get(uid, uid)
        route = parent.get(src)
        delivery = hint.delivery(src)
        if (uid, route) not in v.y or delivery is None:
            return  # not a plan of this model (an aggregator or a group too many): no hint
        choices = [r for (u_, r) in v.y if u_ == uid]
        for r in choices:
            m.hint(v.y[uid, r], int(r == route))
        for t, amount in enumerate(slot_bytes(delivery, slot, T)):
            for r in choices:
                if (uid, r, t) in v.x:
                    m.hint(v.x[uid, r, t], round(amount / q) if r == route else 0)
        arrived = done_slot[src]
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
        for t, amount in enumerate(slot_bytes(delivery, slot, T)):
            if (hop, t) in v.xa:
                m.hint(v.xa[hop, t], round(amount / q))
            for uid in v.members[hop]:
                if (uid, hop, t) in v.e:
                    m.hint(
                        v.e[uid, hop, t], round(amount / q) if parent.get(alias.get(uid, uid)) == hop else 0
                    )
            if (hop, t) in v.agg_done:
                m.hint(v.agg_done[hop, t], int(t >= done_slot[aid]))
