"""Two-level routes for the offline ILP: an aggregate summed into another aggregate (DESIGN §4).

With ``levels=2`` (:func:`~mlfabric.scheduler.plan.ilp.solve_ilp`) an update may also go
worker -> ``a`` -> ``b`` -> server: it joins the *relay* ``R = (a, b)``, one aggregate made at
aggregator ``a`` and sent to aggregator ``b``, where it is a member of one of ``b``'s columns
(the aggregates to the server, :mod:`~mlfabric.scheduler.plan.ilp`). That is the in-rack sum
forwarded to a cross-rack aggregator of :mod:`~mlfabric.scheduler.policies.trees`, so the
tree planner's plans are in the model's plan space (every aggregator host is its own host;
the tree's zero-hop sums at a worker's host are not, as before). At most one relay per
ordered pair of aggregators.

Variables per relay ``R``: ``rg[R]`` used; ``rsize[R]`` its size in quanta (at least every
member's, at most the largest update's when used); ``rm[u, R]`` update ``u`` is a member
(``u``'s first leg is its route ``a``, so ``y[u, a] = Σ columns m + Σ_R rm``); ``rx[R, t]``
bytes on the path ``a -> b`` in slot ``t`` (counted on every link of it); ``rs[R, t]`` it has
started (monotone, ``rx <= rate·rs``; store and forward: ``rs[R, t] <= 1 - rm[u, R] + z[u, a,
t-1]``); ``rz[R, t]`` it is complete at ``b`` by the end of ``t`` (monotone, ``Σ_(<=t) rx >=
rsize - M·(1 - rz)``); ``rcol[R, col]`` it joins column ``col`` at ``b`` (``Σ_col rcol =
rg``; the column carries at least ``rsize`` and waits for ``rz``); ``rw[u, R, col]`` = ``rm ∧
rcol``, the flag that ``u`` is at the server when ``col`` is (objective and symmetry rows).
The valid rows of the one-level model (windows, energy) are not extended to relays.
"""

from __future__ import annotations

import math
from typing import Any

from mlfabric.scheduler.core.graph import path_links
from mlfabric.scheduler.core.schedule import Aggregate, Transfer, aggregate_id
from mlfabric.scheduler.plan.ilp_model import Column, CpSat, Layout, Mip, Vars
from mlfabric.scheduler.plan.instance import Instance

__all__: list[str] = []

Relay = tuple[str, str]


def relay_legs(instance: Instance, lay: Layout) -> dict[Relay, tuple[list[Any], int]]:
    """Every ordered pair of aggregators: the links from ``a`` to ``b`` and their rate (quanta/slot)."""
    out = {}
    for a in lay.agg_rate:
        for b in lay.agg_rate:
            if a == b:
                continue
            links = path_links(list(instance.path(a, b)))
            cap = [
                lay.cap.get(e, math.floor(instance.capacity(e) * instance.slot_seconds / lay.q + 1e-9))
                for e in links
            ]
            out[a, b] = (links, min(cap))
    return out


def add_relays(m: CpSat | Mip, instance: Instance, lay: Layout, v: Vars) -> None:
    """The relays' variables and rows that need no column (before ``add_columns``)."""
    biggest = max(lay.sizes)
    for (a, b), (links, rate) in relay_legs(instance, lay).items():
        r = (a, b)
        members = [uid for uid, routes in lay.routes.items() if a in routes]
        if not members or rate <= 0:
            continue
        v.rg[r] = g = m.bool(f"rg[{a},{b}]")
        v.rsize[r] = size = m.var(0, biggest, f"rsize[{a},{b}]", True)
        m.add(size <= biggest * g)
        for uid in members:
            v.rm[uid, r] = rm = m.bool(f"rm[{uid},{a},{b}]")
            m.add(rm <= g)
            m.add(size >= lay.size[uid] * rm)
        m.add(m.total([v.rm[uid, r] for uid in members]) >= g)
        lo = min(lay.arrival(uid, a) for uid in members) + 1
        sent = []
        for t in range(lo, lay.T):
            v.rx[r, t] = x = m.var(0, rate, f"rx[{a},{b},{t}]", v.integer)
            v.rs[r, t] = s = m.bool(f"rs[{a},{b},{t}]")
            m.add(x <= rate * s)
            if (r, t - 1) in v.rs:
                m.add(v.rs[r, t - 1] <= s)
            for uid in members:  # store and forward: every member arrived at a by t - 1
                m.add(s <= 1 - v.rm[uid, r] + v.z.get((uid, a, t - 1), 0))
            for e in links:
                v.on_link.setdefault((e, t), []).append(x)
            sent.append(x)
            v.rz[r, t] = z = m.bool(f"rz[{a},{b},{t}]")
            if (r, t - 1) in v.rz:
                m.add(v.rz[r, t - 1] <= z)
            m.add(m.total(sent) >= size - biggest + biggest * z)
        m.add(m.total(sent) == size)
        v.relays_into.setdefault(b, []).append(r)


def add_relay_column(
    m: CpSat | Mip, lay: Layout, v: Vars, col: Column, sent: list[Any], lo: int
) -> list[Any]:
    """Relays into column ``col`` (at ``b``): membership, size and store and forward; their flags."""
    b, _, c = col
    g, largest = v.G[col], lay.spans(b)[col[1]][1]
    biggest = max(lay.sizes)
    flags = []
    for r in v.relays_into.get(b, []):
        v.rcol[r, col] = mr = m.bool(f"rcol[{r},{col}]")
        m.add(mr <= g)
        m.add(m.total(sent) >= v.rsize[r] - biggest + biggest * mr)  # the column carries the relay
        m.add(v.rsize[r] <= largest + biggest - biggest * mr)  # ... within the column's class
        for t in range(lo, c + 1):
            m.add(v.S[col, t] <= g - mr + v.rz.get((r, t - 1), 0))
        flags.append(mr)
    return flags


def finish_relays(m: CpSat | Mip, v: Vars) -> None:
    """Each used relay joins one column; members are done when that column is (after columns)."""
    cols: dict[Relay, list[tuple[Column, Any]]] = {}
    for (r, col), var in v.rcol.items():
        cols.setdefault(r, []).append((col, var))
    for r, g in v.rg.items():
        m.add(m.total([var for _, var in cols.get(r, [])]) == g)
    for (uid, r), rm in v.rm.items():
        for col, mr in cols.get(r, []):
            v.rw[uid, r, col] = w = m.bool(f"rw[{uid},{r},{col}]")
            m.add(w <= rm)
            m.add(w <= mr)
            m.add(w >= rm + mr - 1)
            v.done.setdefault((uid, col[2]), []).append(w)


def relay_payloads(
    instance: Instance, m: CpSat | Mip, lay: Layout, v: Vars, reservations: Any
) -> tuple[list[Transfer], list[Aggregate], dict[Column, list[str]]]:
    """The used relays as transfers and aggregates; column -> the relay ids it sums.

    ``reservations(links, amounts, slot, nbytes)``: per-slot amounts -> (reservations,
    start, end), as for the columns.
    """
    transfers, aggregates = [], []
    into: dict[Column, list[str]] = {}
    legs = relay_legs(instance, lay)
    for r, g in sorted(v.rg.items()):
        if m.value(g) < 0.5:
            continue
        a, b = r
        members = [uid for (uid, r2), var in v.rm.items() if r2 == r and m.value(var) > 0.5]
        if not members:
            continue
        rid = aggregate_id(f"{a}>{b}", 0)
        size = max(instance.update(uid).bytes for uid in members)
        amounts = {t: m.value(v.rx[r, t]) for t in range(lay.T) if (r, t) in v.rx}
        res, start, end = reservations(legs[r][0], amounts, lay.slot, size)
        path = instance.path(a, b)
        transfers.append(Transfer(rid, a, b, path, start, end, size, res))
        aggregates.append(Aggregate(rid, a, tuple(members), size, instance.server))
        col = next(col for (r2, col), var in v.rcol.items() if r2 == r and m.value(var) > 0.5)
        into.setdefault(col, []).append(rid)
    return transfers, aggregates, into
