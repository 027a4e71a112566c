"""Local search over aggregation groups: a better warm start for the ILP (DESIGN §4).

A plan is described by an ordered list of *groups*: a direct update, or an aggregate (an
aggregator and its members). :func:`plan_groups` turns such a list into a
:class:`~mlfabric.scheduler.core.schedule.Schedule` on link timelines — group by group in list
order, each payload taking the residual bandwidth of its path from its ready time (members
first, then their aggregate once the last member is in), the way STF reserves (Fig. 4).
:func:`improve_groups` searches that space by simulated annealing: move an update to
another group (or alone, direct or at an aggregator), move a group in the order, change a
group's aggregator, merge two groups. The ILP (:mod:`mlfabric.scheduler.plan.ilp`) uses the
result as its hint; both heuristics of the paper (STF, aggregation) are points of the space
and the search starts from the better of them.

Evaluating a list takes about a millisecond at 16 workers x 4 aggregators, so a few
seconds try thousands of groupings: the CP-SAT search, left to itself, varied by 3-4 % in
the plan it found in 60 s on 16 x 4 (``experiments/results/bench_ilp.md``).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlfabric.scheduler.core.schedule import Aggregate, Schedule, Transfer
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.plan.instance import Instance, objective_of
from mlfabric.scheduler.policies.aggregation import send_aggregate

__all__ = ["PATIENCE", "STALE_ROUNDS", "Group", "groups_of", "improve_groups", "plan_groups"]

#: Moves per update in one annealing round of :func:`improve_groups`.
PATIENCE = 200

#: Rounds in a row without a better plan after which :func:`improve_groups` stops.
STALE_ROUNDS = 2


@dataclass(frozen=True)
class Group:
    """One payload to the server: ``members`` sent directly (``aggregator`` None, one member)
    or summed at ``aggregator`` first.

    Examples
    --------
    >>> Group(None, ("u1",)), Group("a0", ("u2", "u3")).aggregator
    (Group(aggregator=None, members=('u1',)), 'a0')
    """

    aggregator: str | None
    members: tuple[str, ...]


def plan_groups(instance: Instance, groups: Sequence[Group]) -> Schedule:
    """The plan of an ordered group list: every payload reserved in list order (see module).

    Parameters
    ----------
    instance : Instance
        Graph, server, updates.
    groups : sequence of Group
        Every update in exactly one group; an aggregate's members may all use its aggregator.

    Returns
    -------
    Schedule
        Direct transfers, member transfers and aggregates; passes the invariant checker.

    Examples
    --------
    >>> import random
    >>> from mlfabric.scheduler.plan.instance import parse_instance, two_tier_instance
    >>> inst = parse_instance(two_tier_instance(random.Random(1), 4, 1))
    >>> plan = plan_groups(inst, [Group(None, ("u0",)), Group("a0", ("u1", "u2", "u3"))])
    >>> [(a.aggregator, a.members) for a in plan.aggregates]
    [('a0', ('u1', 'u2', 'u3'))]
    """
    tls = Timelines(instance.graph)
    transfers: list[Transfer] = []
    aggregates: list[Aggregate] = []
    update = {u.update_id: u for u in instance.updates}

    def send(pid: str, src: str, dst: str, nbytes: float, ready: float) -> Transfer:
        transfers.append(tls.transfer(pid, instance.path(src, dst), nbytes, ready))
        return transfers[-1]

    for g in groups:
        if g.aggregator is None:
            (uid,) = g.members
            u = update[uid]
            send(uid, u.src, instance.server, u.bytes, u.ready_at)
            continue
        ins = [send(m, update[m].src, g.aggregator, update[m].bytes, update[m].ready_at) for m in g.members]
        out, made = send_aggregate(tls, instance.path(g.aggregator, instance.server), ins, len(aggregates))
        transfers.append(out)
        aggregates.append(made)
    return Schedule.aggregated(transfers, aggregates)


def groups_of(instance: Instance, plan: Schedule) -> list[Group]:
    """The group list of a plan: its payloads to the server in the order they arrive.

    Examples
    --------
    >>> import random
    >>> from mlfabric.scheduler.plan.instance import parse_instance, two_tier_instance
    >>> inst = parse_instance(two_tier_instance(random.Random(1), 4, 1))
    >>> gs = [Group(None, ("u0",)), Group(None, ("u1",)), Group("a0", ("u2", "u3"))]
    >>> groups_of(inst, plan_groups(inst, gs)) == gs
    True
    """
    made = {a.aggregate_id: a for a in plan.aggregates}
    summed = {m for a in plan.aggregates for m in a.members}
    to_server = [t for t in plan.transfers if t.dst == instance.server and not t.replica]
    out = []
    for t in sorted(to_server, key=lambda t: (t.end, t.start)):
        if t.payload_id in made:
            out.append(Group(made[t.payload_id].aggregator, made[t.payload_id].members))
        elif t.payload_id not in summed:
            out.append(Group(None, (t.payload_id,)))
    return out


def _neighbour(rng: random.Random, groups: list[Group], choices: dict[str, tuple[str, ...]]) -> list[Group]:
    """A random move: an update to another group, a group elsewhere, another aggregator, a merge."""
    gs = list(groups)
    move = rng.randrange(4)
    if move == 0 and len(gs) > 1:  # a group to another place in the order
        g = gs.pop(rng.randrange(len(gs)))
        gs.insert(rng.randrange(len(gs) + 1), g)
        return gs
    if move == 1:  # another aggregator for an aggregate
        agg = [i for i, g in enumerate(gs) if g.aggregator is not None]
        if agg:
            i = rng.choice(agg)
            usable = set.intersection(*(set(choices[m]) for m in gs[i].members))
            if usable:
                gs[i] = Group(rng.choice(sorted(usable)), gs[i].members)
                return gs
    if move == 2 and len(gs) > 1:  # merge two groups into one aggregate
        i, j = sorted(rng.sample(range(len(gs)), 2))
        members = gs[i].members + gs[j].members
        usable = set.intersection(*(set(choices[m]) for m in members))
        if usable:
            a = gs[i].aggregator if gs[i].aggregator in usable else rng.choice(sorted(usable))
            gs[i] = Group(a, members)
            del gs[j]
            return gs
    # an update out of its group: into another aggregate, or alone (direct or via a hop)
    i = rng.randrange(len(gs))
    rest = list(gs[i].members)
    uid = rest.pop(rng.randrange(len(rest)))
    if rest:
        gs[i] = Group(gs[i].aggregator, tuple(rest))
    else:
        del gs[i]
    targets = [k for k, g in enumerate(gs) if g.aggregator in choices[uid]]
    if targets and rng.random() < 0.5:
        k = rng.choice(targets)
        gs[k] = Group(gs[k].aggregator, (*gs[k].members, uid))
    else:
        hop = rng.choice((None, *choices[uid])) if rng.random() < 0.5 else None
        gs.insert(rng.randrange(len(gs) + 1), Group(hop, (uid,)))
    return gs


def _most_per_aggregator(groups: Sequence[Group]) -> int:
    made = Counter(g.aggregator for g in groups if g.aggregator is not None)
    return max(made.values(), default=0)


def improve_groups(
    instance: Instance,
    start: Sequence[Group],
    *,
    seconds: float = 5.0,
    seed: int = 0,
    groups: int | None = None,
    patience: int | None = None,
    stop: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[Group], float]:
    """Simulated annealing over group lists from ``start``; the best list and its objective.

    Parameters
    ----------
    instance : Instance
        The instance; its objective (mean completion or makespan) is the cost.
    start : sequence of Group
        A valid group list (e.g. :func:`groups_of` a heuristic plan).
    seconds : float
        Search time.
    seed : int
        Random seed (the moves are reproducible; how many fit in ``seconds`` is not).
    groups : int, optional
        Most aggregates per aggregator (as in :func:`~mlfabric.scheduler.plan.ilp.solve_ilp`).
    patience : int, optional
        Moves per annealing round (default ``PATIENCE`` per update); each round starts from
        the best list, and the search stops after ``STALE_ROUNDS`` rounds in a row without
        a better one, so small instances end long before ``seconds``.
    stop : callable
        Polled between moves; the search ends early when it returns true (Ctrl-C).
    clock : callable
        Time source (tests pass their own).

    Returns
    -------
    (list of Group, float)
        The best group list found (``start`` if nothing better) and its objective.

    Examples
    --------
    >>> import random
    >>> from mlfabric.scheduler.plan.instance import parse_instance, two_tier_instance
    >>> inst = parse_instance(two_tier_instance(random.Random(1), 4, 1))
    >>> start = [Group(None, (u.update_id,)) for u in inst.updates]
    >>> best, cost = improve_groups(inst, start, seconds=0.2)
    >>> cost <= objective_of(inst, plan_groups(inst, start))
    True
    """
    rng = random.Random(seed)
    choices = {u.update_id: tuple(a for a in instance.routes(u.update_id) if a) for u in instance.updates}

    def cost(gs: Sequence[Group]) -> float:
        return objective_of(instance, plan_groups(instance, gs))

    best, best_cost = list(start), cost(start)
    length = PATIENCE * len(instance.updates) if patience is None else patience
    began, stale = clock(), 0
    while stale < STALE_ROUNDS and clock() - began < seconds and not stop():
        # one round: annealing from the best list, cooling to zero over ``length`` moves
        current, now_cost, improved = best, best_cost, False
        temperature0 = 0.01 * best_cost
        for k in range(length):
            if k % 64 == 0 and (clock() - began >= seconds or stop()):
                break
            candidate = _neighbour(rng, current, choices)
            if groups is not None and _most_per_aggregator(candidate) > groups:
                continue
            c = cost(candidate)
            temperature = temperature0 * (1 - k / length)
            if c <= now_cost or (temperature > 0 and rng.random() < math.exp((now_cost - c) / temperature)):
                current, now_cost = candidate, c
                if c < best_cost - 1e-12:
                    best, best_cost, improved = candidate, c, True
        stale = 0 if improved else stale + 1
    return best, best_cost
