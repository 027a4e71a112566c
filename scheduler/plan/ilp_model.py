"""Model building for the offline ILP (paper appendix 10.1, DESIGN §4): back ends, variables,
constraints, objective and warm start. :mod:`mlfabric.scheduler.plan.ilp` documents the model and
solves it; this module only writes it, once, for every engine. Internal: no public API.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ortools.linear_solver.python import model_builder as mb
from ortools.sat.python import cp_model

from mlfabric.scheduler.core.graph import path_links
from mlfabric.scheduler.core.schedule import Link, Schedule, Transfer
from mlfabric.scheduler.plan.instance import Instance

__all__: list[str] = []

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
        self,
        time_limit: float,
        seed: int,
        workers: int,
        report: Callable[[float, float], None],
        stop: threading.Event | None = None,
    ) -> str:
        p = self.solver.parameters
        p.max_time_in_seconds = time_limit
        p.random_seed = seed
        p.num_workers = workers
        # Ctrl-C is the caller's (``stop``), not CP-SAT's own SIGINT handler
        # (catch_sigint_signal): a SIGINT that arrived while CP-SAT was loading the model after
        # the hint's solution hung the process (about 1 run in 6 on this machine). The search
        # runs in a thread; this one polls ``stop`` and asks the search to stop, which ends it
        # with the best solution so far.
        p.catch_sigint_signal = False

        class _OnSolution(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(inner) -> None:
                report(inner.objective_value, inner.best_objective_bound)

        self.solver.best_bound_callback = lambda bound: report(math.nan, bound)
        outcome: list[Any] = []
        done = threading.Event()

        def search() -> None:
            try:
                outcome.append(self.solver.solve(self.model, _OnSolution()))
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller's thread below
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=search, name="cp-sat", daemon=True).start()
        while not done.wait(0.1):
            if stop is not None and stop.is_set():
                self.solver.stop_search()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return str(self.solver.status_name(outcome[0]))

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
        self,
        time_limit: float,
        seed: int,
        workers: int,
        report: Callable[[float, float], None],
        stop: threading.Event | None = None,
    ) -> str:
        # ``stop`` is not polled: HiGHS and SCIP run to their time limit
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


Column = tuple[str, int, int]  # (aggregator, slots the aggregate needs to the server, completion slot)


@dataclass(frozen=True)
class Layout:
    """The instance in the model's units: slots, routes, paths, quanta per slot and per update.

    ``first[u]``: ``u``'s first slot; ``leg_rate[u, r]``: its quanta per slot on route ``r``'s
    first leg; ``agg_rate[a]``: an aggregate's quanta per slot from ``a`` to the server;
    ``ingress[a]``: quanta per slot into ``a``; ``sizes``: the distinct update sizes.
    """

    T: int
    slot: float
    routes: dict[str, tuple[str | None, ...]]
    leg: dict[tuple[str, str | None], list[Link]]
    agg_leg: dict[str, list[Link]]
    q: float
    cap: dict[Link, int]
    size: dict[str, int]
    first: dict[str, int]
    leg_rate: dict[tuple[str, str | None], int]
    agg_rate: dict[str, int]
    ingress: dict[str, int]
    sizes: tuple[int, ...]
    groups: int | None

    def arrival(self, uid: str, route: str | None) -> int:
        """The earliest slot by whose end ``uid``'s first leg on ``route`` can be complete."""
        return self.first[uid] + math.ceil(self.size[uid] / self.leg_rate[uid, route]) - 1

    def forward_slots(self, aggregator: str, k: int) -> int:
        """Slots an aggregate of ``k`` quanta needs from ``aggregator`` to the server."""
        return math.ceil(k / self.agg_rate[aggregator])

    def spans(self, aggregator: str) -> dict[int, tuple[int, int]]:
        """Aggregate size classes at ``aggregator``: forward slots -> (smallest, largest) size."""
        out: dict[int, tuple[int, int]] = {}
        for k in self.sizes:  # ascending: the first size of a class is its smallest
            span = self.forward_slots(aggregator, k)
            out[span] = (out.get(span, (k, k))[0], k)
        return out


def layout(instance: Instance, T: int, groups: int | None) -> Layout:
    server = instance.server
    routes = {u.update_id: instance.routes(u.update_id) for u in instance.updates}
    src = {u.update_id: u.src for u in instance.updates}
    leg = {
        (uid, r): path_links(list(instance.path(src[uid], r or server)))
        for uid, rs in routes.items()
        for r in rs
    }
    aggs = sorted({r for rs in routes.values() for r in rs if r is not None})
    agg_leg = {a: path_links(list(instance.path(a, server))) for a in aggs}
    links = {e for ls in leg.values() for e in ls} | {e for ls in agg_leg.values() for e in ls}
    q = quantum(instance, links)
    cap = {e: math.floor(instance.capacity(e) * instance.slot_seconds / q + 1e-9) for e in links}
    size = {u.update_id: math.ceil(u.bytes / q - 1e-9) for u in instance.updates}
    first = {u.update_id: math.ceil(u.ready_at / instance.slot_seconds - 1e-9) for u in instance.updates}
    leg_rate = {key: min(cap[e] for e in links_) for key, links_ in leg.items()}
    agg_rate = {a: min(cap[e] for e in agg_leg[a]) for a in aggs}
    ingress = {a: sum(cap[e] for e in links if e[1] == a) for a in aggs}
    sizes = tuple(sorted(set(size.values())))
    return Layout(
        T,
        instance.slot_seconds,
        routes,
        leg,
        agg_leg,
        q,
        cap,
        size,
        first,
        leg_rate,
        agg_rate,
        ingress,
        sizes,
        groups,
    )


@dataclass
class Vars:
    """The model's variables (see :mod:`mlfabric.scheduler.plan.ilp`) and what the builders share.

    ``done[u, c]`` lists the 0/1 variables whose value 1 means ``u`` is at the server by
    the end of slot ``c`` and not before: ``D[u, c]`` and ``m[u, (a, s, c)]``.
    """

    integer: bool
    y: dict[tuple[str, str | None], Any] = field(default_factory=dict)
    x: dict[tuple[str, str | None, int], Any] = field(default_factory=dict)
    z: dict[tuple[str, str, int], Any] = field(default_factory=dict)
    D: dict[tuple[str, int], Any] = field(default_factory=dict)
    G: dict[Column, Any] = field(default_factory=dict)
    xa: dict[tuple[Column, int], Any] = field(default_factory=dict)
    S: dict[tuple[Column, int], Any] = field(default_factory=dict)
    m: dict[tuple[str, Column], Any] = field(default_factory=dict)
    done: dict[tuple[str, int], list[Any]] = field(default_factory=dict)
    twins: list[list[str]] = field(default_factory=list)
    on_link: dict[tuple[Link, int], list[Any]] = field(default_factory=dict)
    # two-level routes (plan/ilp_relays.py; empty with one level)
    rg: dict[tuple[str, str], Any] = field(default_factory=dict)
    rsize: dict[tuple[str, str], Any] = field(default_factory=dict)
    rm: dict[tuple[str, tuple[str, str]], Any] = field(default_factory=dict)
    rx: dict[tuple[tuple[str, str], int], Any] = field(default_factory=dict)
    rs: dict[tuple[tuple[str, str], int], Any] = field(default_factory=dict)
    rz: dict[tuple[tuple[str, str], int], Any] = field(default_factory=dict)
    rcol: dict[tuple[tuple[str, str], Column], Any] = field(default_factory=dict)
    rw: dict[tuple[str, tuple[str, str], Column], Any] = field(default_factory=dict)
    relays_into: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    relay_column: Callable[..., list[Any]] | None = None  # ilp_relays.add_relay_column, when on


def _cumulative(m: CpSat | Mip, moved: list[Any]) -> list[Any]:
    """Running sums of ``moved`` as expressions."""
    return [m.total(moved[: i + 1]) for i in range(len(moved))]


def add_first_legs(m: CpSat | Mip, lay: Layout, v: Vars) -> None:
    """Routes ``y``, first-leg bytes ``x`` and arrivals at an aggregator ``z``."""
    for uid, routes in lay.routes.items():
        size, first = lay.size[uid], lay.first[uid]
        for r in routes:
            v.y[uid, r] = m.bool(f"y[{uid},{r}]")
            ub = lay.leg_rate[uid, r]
            moved = []
            for t in range(first, lay.T):
                v.x[uid, r, t] = x = m.var(0, ub, f"x[{uid},{r},{t}]", v.integer)
                m.add(x <= ub * v.y[uid, r])
                moved.append(x)
                for e in lay.leg[uid, r]:
                    v.on_link.setdefault((e, t), []).append(x)
            m.add(m.total(moved) == size * v.y[uid, r])
            if r is None:
                continue
            sums = _cumulative(m, moved)
            for t in range(lay.arrival(uid, r), lay.T):
                v.z[uid, r, t] = z = m.bool(f"z[{uid},{r},{t}]")
                m.add(sums[t - first] >= size * z)
                if (uid, r, t - 1) in v.z:
                    m.add(v.z[uid, r, t - 1] <= z)
        m.add(m.total([v.y[uid, r] for r in routes]) == 1)


def _window_rows(
    m: CpSat | Mip,
    sums: list[Any],
    lo: int,
    ends: list[tuple[int, Any]],
    size: int,
    rate: int,
    most: int | None = None,
) -> None:
    """Valid rows tying a payload's bytes to the slot it must be complete by.

    ``sums[i]``: bytes moved by the end of slot ``lo + i``; ``ends``: ``(slot, var)`` pairs,
    ``var = 1`` when the payload must be complete by that slot (at most one is 1). By slot
    ``t`` it has moved at least ``size - rate·(end - t)`` (else it cannot finish in time), and
    with ``most`` (integer quanta, ``end`` its true completion, ``most`` its largest size) at
    most ``most - 1`` while ``end > t``. These make the time-indexed LP finish a payload at
    the end of its window, not spread over it.
    """
    for i, total in enumerate(sums):
        t = lo + i
        need = [
            (size - rate * max(0, end - t), var) for end, var in ends if size - rate * max(0, end - t) > 0
        ]
        if need:
            m.add(total >= m.total([c * var for c, var in need]))
        if most is not None and any(end > t for end, _ in ends):
            m.add(total <= m.total([(most - 1 if end > t else most) * var for end, var in ends]))


def add_direct(m: CpSat | Mip, lay: Layout, v: Vars) -> None:
    """``D[u, c]``: ``u`` goes straight to the server and is complete at the end of slot ``c``."""
    for uid in lay.routes:
        first, size, ub = lay.first[uid], lay.size[uid], lay.leg_rate[uid, None]
        ends = []
        for c in range(lay.arrival(uid, None), lay.T):
            v.D[uid, c] = var = m.bool(f"D[{uid},{c}]")
            v.done.setdefault((uid, c), []).append(var)
            ends.append((c, var))
        m.add(m.total([var for _, var in ends]) == v.y[uid, None])
        moved = [v.x[uid, None, t] for t in range(first, lay.T)]
        _window_rows(m, _cumulative(m, moved), first, ends, size, ub, size if v.integer else None)
        for t, x in zip(range(first, lay.T), moved, strict=True):  # nothing moves once complete
            m.add(x <= ub * m.total([var for c, var in ends if c >= t]))


def add_columns(m: CpSat | Mip, lay: Layout, v: Vars) -> None:
    """Aggregate columns ``G[a, s, c]``, their bytes ``xa``, start ``S`` and members ``m``."""
    for a in lay.agg_rate:
        candidates = [uid for uid, rs in lay.routes.items() if a in rs]
        for span, sizes in lay.spans(a).items():
            for c in range(lay.T):
                feasible = [
                    u for u in candidates if lay.size[u] <= sizes[1] and lay.arrival(u, a) + span <= c
                ]
                if any(lay.forward_slots(a, lay.size[u]) == span for u in feasible):
                    _add_column(m, lay, v, (a, span, c), feasible, sizes)
        if lay.groups is not None:
            m.add(m.total([g for col, g in v.G.items() if col[0] == a]) <= lay.groups)
    for uid, routes in lay.routes.items():
        for hop in routes[1:]:
            if hop is not None:
                _add_membership(m, lay, v, uid, hop)


def _add_column(
    m: CpSat | Mip, lay: Layout, v: Vars, col: Column, feasible: list[str], sizes: tuple[int, int]
) -> None:
    """One column: an aggregate of ``sizes[0]..sizes[1]`` quanta (``span`` slots) done at ``c``."""
    a, span, c = col
    rate, (smallest, largest) = lay.agg_rate[a], sizes
    v.G[col] = g = m.bool(f"G[{col}]")
    lo = min(lay.arrival(u, a) for u in feasible) + 1
    sent = []
    for t in range(lo, c + 1):
        v.xa[col, t] = xa = m.var(0, rate, f"xa[{col},{t}]", v.integer)
        v.S[col, t] = s = m.bool(f"S[{col},{t}]")
        m.add(xa <= rate * s)
        if (col, t - 1) in v.S:
            m.add(v.S[col, t - 1] <= s)
        sent.append(xa)
        for e in lay.agg_leg[a]:
            v.on_link.setdefault((e, t), []).append(xa)
    m.add(s <= g)  # the last start flag; the earlier ones are below it
    if smallest == largest:
        m.add(m.total(sent) == largest * g)
    else:
        m.add(m.total(sent) >= smallest * g)
        m.add(m.total(sent) <= largest * g)
    sums = _cumulative(m, sent)
    _window_rows(m, sums[:-1], lo, [(c, g)], smallest, rate)
    if v.integer and len(sums) > 1:  # bytes by c - 1 bound those of every earlier slot
        m.add(sums[-2] <= (largest - 1) * g)
    started = c + 1 - math.ceil(smallest / rate)  # the aggregate has started by this slot
    members = {}
    for uid in feasible:
        v.m[uid, col] = members[uid] = mv = m.bool(f"m[{uid},{col}]")
        v.done.setdefault((uid, c), []).append(mv)
        m.add(mv <= g)
        if lay.size[uid] > smallest:  # the aggregate carries its largest member's size
            m.add(m.total(sent) >= lay.size[uid] * mv)
        _store_and_forward(m, v, col, uid, range(max(lo, lay.arrival(uid, a)), started + 1))
    relays = v.relay_column(m, lay, v, col, sent, lo) if v.relay_column is not None else []
    # the column's class is that of its largest member
    own = [mv for uid, mv in members.items() if lay.forward_slots(a, lay.size[uid]) == span]
    m.add(g <= m.total(own + relays))
    # energy: every member crosses a's ingress between its ready slot and c - span
    for since in sorted({lay.first[u] for u in feasible}):
        later = [(lay.size[u], members[u]) for u in feasible if lay.first[u] >= since]
        _knapsack_rows(m, later, lay.ingress[a] * (c - span - since + 1), g)


#: Longest run of slots with one store-and-forward row per slot (:func:`_store_and_forward`).
POINTWISE_SLOTS = 4


def _store_and_forward(m: CpSat | Mip, v: Vars, col: Column, uid: str, slots: range) -> None:
    """The aggregate ``col`` moves in slot ``t`` only once member ``uid`` arrived by ``t - 1``.

    ``S[col, t] <= G - m[uid, col] + z[uid, a, t - 1]``. ``S`` and ``z`` are monotone, so
    ``slots`` only runs from ``uid``'s earliest arrival (earlier rows follow from that one) to
    the slot by which the aggregate must have started (later rows follow from that one).
    Over longer runs (off the slot grid) the rows are summed into one, which is exact for 0/1
    monotone flags (a later start is a shorter run of ones) and much smaller.
    """
    a, g, mv = col[0], v.G[col], v.m[uid, col]
    arrived = [v.z.get((uid, a, t - 1), 0) for t in slots]
    if len(slots) <= POINTWISE_SLOTS:
        for t, z in zip(slots, arrived, strict=True):
            m.add(v.S[col, t] <= g - mv + z)
    elif slots:
        m.add(m.total([v.S[col, t] for t in slots]) <= m.total(arrived) + len(slots) * (g - mv))


def _knapsack_rows(m: CpSat | Mip, items: list[tuple[int, Any]], energy: int, scale: Any = 1) -> None:
    """``Σ size·var <= energy·scale`` and its roundings by every size ``σ`` (Chvátal-Gomory).

    ``Σ ⌊size/σ⌋·var <= ⌊energy/σ⌋·scale``: two updates of 2 slots fit in 5 slots, not two
    and a half. Valid for 0/1 ``var``; the LP relaxation of the plain row is much weaker.
    (Counting rows, at most ``n`` items of size >= ``σ`` with ``n`` the most that fit
    smallest first, were tried and did not move the LP on the benchmark's instances.)
    """
    if sum(size for size, _ in items) > energy:
        m.add(m.total([size * var for size, var in items]) <= energy * scale)
    for sigma in sorted({size for size, _ in items}):
        rounded = [(size // sigma, var) for size, var in items if size >= sigma]
        if sum(n for n, _ in rounded) > energy // sigma:
            m.add(m.total([n * var for n, var in rounded]) <= energy // sigma * scale)


def _add_membership(m: CpSat | Mip, lay: Layout, v: Vars, uid: str, a: str) -> None:
    """``u`` joins one aggregate at ``a`` iff routed there, and arrives before it must leave."""
    cols = [(col, var) for (u_, col), var in v.m.items() if u_ == uid and col[0] == a]
    relayed = [var for (u_, r), var in v.rm.items() if u_ == uid and r[0] == a]  # no deadline rows
    m.add(m.total([var for _, var in cols] + relayed) == v.y[uid, a])
    deadlines = [(c - span, var) for (_, span, c), var in cols]
    first, ub = lay.first[uid], lay.leg_rate[uid, a]
    moved = [v.x[uid, a, t] for t in range(first, lay.T)]
    _window_rows(m, _cumulative(m, moved), first, deadlines, lay.size[uid], ub)
    for t, x in zip(range(first, lay.T), moved, strict=True):  # nothing moves after the deadline
        m.add(x <= ub * m.total([var for end, var in deadlines if end >= t] + relayed))


def add_capacity(m: CpSat | Mip, lay: Layout, v: Vars) -> None:
    """Bytes per directed link and slot within its capacity."""
    for (e, _t), flows in v.on_link.items():
        if len(flows) > 1:
            m.add(m.total(flows) <= lay.cap[e])


def add_symmetry(m: CpSat | Mip, lay: Layout, v: Vars) -> None:
    """Interchangeable updates complete in id order (by every slot, ``u`` is done if ``u'`` is).

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
        shared = tuple((r, tuple(link for link in lay.leg[uid, r] if users[link] != {uid})) for r in routes)
        classes.setdefault((lay.size[uid], lay.first[uid], shared), []).append(uid)
    v.twins = [ids for ids in classes.values() if len(ids) > 1]
    for ids in v.twins:
        for before, after in itertools.pairwise(ids):
            by: list[Any] = []
            later: list[Any] = []
            for t in range(lay.T - 1):  # done by slot t: the flags of slots 0..t
                by += v.done.get((before, t), [])
                later += v.done.get((after, t), [])
                if later:
                    m.add(m.total(by) >= m.total(later))


def set_objective(m: CpSat | Mip, instance: Instance, lay: Layout, v: Vars) -> float:
    """Minimise the sum (or max) of completion slots; return the factor to seconds (mean)."""
    # u completes at the end of slot c, (c + 1) slots after time 0, when one of done[u, c] is 1
    slots_of: dict[str, list[Any]] = {uid: [] for uid in lay.routes}
    for (uid, c), vars_ in v.done.items():
        slots_of[uid] += [(c + 1) * var for var in vars_]
    if instance.objective == "makespan":
        span = m.var(0, lay.T + 1, "makespan", True)
        for terms in slots_of.values():
            m.add(span >= m.total(terms))
        m.minimize(span)
        return lay.slot
    m.minimize(m.total([term for terms in slots_of.values() for term in terms]))
    return lay.slot / len(slots_of)


def add_hint(m: CpSat | Mip, instance: Instance, hint: Schedule, lay: Layout, v: Vars) -> None:
    """Warm start: every variable's value in the hint plan (bytes rounded to quanta).

    Does nothing when the hint is no plan of this model (more aggregates at an aggregator
    than ``groups``, or two of one size class finishing in one slot there).
    """
    slot, T, q = lay.slot, lay.T, lay.q
    done_slot = {
        t.payload_id: max(0, math.ceil(t.end / slot - 1e-9) - 1) for t in hint.transfers if not t.replica
    }
    column_of: dict[str, Column] = {}
    if any(m_ not in lay.size for agg in hint.aggregates for m_ in agg.members):
        return  # an aggregate of aggregates: not hinted
    for agg in hint.aggregates:
        largest = max(lay.size[u] for u in agg.members)
        col = (agg.aggregator, lay.forward_slots(agg.aggregator, largest), done_slot[agg.aggregate_id])
        if col not in v.G or col in column_of.values():
            return
        column_of[agg.aggregate_id] = col
    if lay.groups is not None and any(
        sum(col[0] == a for col in column_of.values()) > lay.groups for a in lay.agg_rate
    ):
        return
    parent = {mem: column_of[a.aggregate_id] for a in hint.aggregates for mem in a.members}

    def finish(uid: str) -> int:
        return parent[uid][2] if uid in parent else done_slot.get(uid, T)

    alias: dict[str, str] = {}  # model update -> the hint's update whose plan it takes
    for ids in v.twins:  # twins finish in id order in the model
        alias |= dict(zip(ids, sorted(ids, key=lambda uid: (finish(uid), ids.index(uid))), strict=True))
    values: dict[tuple[str, Any], int] = {}
    for uid in lay.routes:
        src = alias.get(uid, uid)
        joined = parent.get(src)
        route = joined[0] if joined else None
        delivery = hint.delivery(src)
        if (uid, route) not in v.y or delivery is None:
            return
        values["y", (uid, route)] = 1
        for t, amount in enumerate(slot_bytes(delivery, slot, T)):
            values["x", (uid, route, t)] = round(amount / q)
        if joined is None:
            values["D", (uid, done_slot[src])] = 1
            continue
        values["m", (uid, joined)] = 1
        for t in range(done_slot[src], T):
            values["z", (uid, route, t)] = 1
    for aid, col in column_of.items():
        values["G", col] = 1
        delivery = hint.delivery(aid)
        started = False
        for t, amount in enumerate(slot_bytes(delivery, slot, T) if delivery else []):
            values["xa", (col, t)] = round(amount / q)
            started = started or amount > 0
            values["S", (col, t)] = int(started)
    for name in ("y", "x", "z", "D", "G", "xa", "S", "m"):
        for key, var in getattr(v, name).items():
            m.hint(var, values.get((name, key), 0))
