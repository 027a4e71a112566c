"""Plan one instance offline: the ILP optimum, STF, aggregation and fair, and their gaps.

    mlfabric plan INSTANCE.json [--solver ilp|stf|tree|fair|all] [--time-limit S] [--levels 1|2]
                  [--out plan.json] [--trace plan.trace.json] [--plot plan.png]

The instance format is described in mlfabric.scheduler.plan.instance (and the README).
Prints, per plan, each update's route (hosts), start and finish, then the objective,
status, bound and gap. --solver all runs ilp, stf, aggregation (groups over the STF order,
when the instance has aggregators), tree (``stf+tree``'s multi-level aggregation trees) and
fair, and prints each one's gap to the bound, gap = (objective - bound) / objective. With
the makespan objective the bound is the larger of the ILP's and plan/bounds.py's (printed
with its parts: each update's own path time, the server's ingress with the best
aggregation, the rack uplink cuts); --levels 2 lets the ILP sum an aggregate into another
aggregator's (two-level routes, plan/ilp_relays.py). The ILP starts from the better of stf and
aggregation. --out writes the same as JSON (objective, bound, gap, status, solver,
updates: [{id, route, start, finish}]; with --solver all, a "plans" list of those).
--trace writes a Chrome trace (one track per link, one process per plan); --plot a Gantt
chart by link (needs matplotlib: the [plot] extra). Long ILP solves print progress to stderr; Ctrl-C stops
the solver and keeps its best plan.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SOLVERS = ("ilp", "stf", "tree", "fair", "all")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` subcommand's arguments."""
    parser.add_argument("instance", type=Path, help="instance JSON file")
    parser.add_argument("--solver", choices=SOLVERS, default="ilp", help="planner (default: ilp)")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="ILP time limit (s)")
    parser.add_argument("--seed", type=int, default=0, help="ILP random seed (default 0)")
    parser.add_argument(
        "--workers", type=int, default=8, help="CP-SAT search workers (portfolio size; default 8)"
    )
    parser.add_argument(
        "--engine", choices=("cp-sat", "highs", "scip"), default="cp-sat", help="ILP solver engine"
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=None,
        help="most aggregates each aggregator may make (default: no limit; 1 is the paper's model)",
    )
    parser.add_argument(
        "--search-seconds",
        type=float,
        default=None,
        metavar="S",
        help="local search over aggregation groups before the ILP, part of --time-limit "
        "(default: a sixth of it, at most 10 s; 0 turns it off)",
    )
    parser.add_argument(
        "--levels",
        type=int,
        choices=(1, 2),
        default=1,
        help="ILP routes: 1 = direct or one aggregator; 2 = also an aggregate into another aggregator",
    )
    parser.add_argument("--out", type=Path, metavar="PLAN.json", help="write the plan(s) as JSON")
    parser.add_argument("--trace", type=Path, metavar="TRACE.json", help="write a Chrome trace by link")
    parser.add_argument("--plot", type=Path, metavar="PLAN.png", help="draw a Gantt chart by link")
    parser.add_argument(
        "--progress-every", type=float, default=2.0, metavar="S", help="ILP progress period on stderr"
    )


def _plan_record(instance: Any, name: str, schedule: Any, **fields: Any) -> dict[str, Any]:
    """The JSON record of one plan: per update its route (hosts), start and finish."""
    parent = {m: a for a in schedule.aggregates for m in a.members}
    done = schedule.update_completion_times(list(instance.updates))
    rows = []
    for u in instance.updates:
        route = [u.src]
        agg = parent.get(u.update_id)
        while agg is not None:  # every aggregator on the way (a deeper tree: several)
            route.append(agg.aggregator)
            agg = parent.get(agg.aggregate_id)
        route.append(instance.server)
        first = schedule.delivery(u.update_id)
        rows.append({"id": u.update_id, "route": route, "start": first.start, "finish": done[u.update_id]})
    return {"solver": name, **fields, "updates": rows}


def _fmt(value: float | None, digits: int = 6) -> str:
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return "-"
    return f"{value:.{digits}g}"


def _percent(gap: float | None) -> float | None:
    return None if gap is None else 100 * gap


def summary_table(records: list[dict[str, Any]]) -> str:
    """The table of ``--solver all``: each solver's objective and its gap to the ILP's bound,
    in aligned columns.

    Examples
    --------
    >>> print(summary_table([{"solver": "ilp", "objective": 0.0516667, "gap": 0.0},
    ...                      {"solver": "aggregation", "objective": 0.055, "gap": 0.06061}]))
    solver       objective (s)  gap to ILP bound
    ilp              0.0516667                0%
    aggregation          0.055            6.061%
    """
    rows = [("solver", "objective (s)", "gap to ILP bound")]
    for r in records:
        gap = _fmt(_percent(r["gap"]), 4)
        rows.append((r["solver"], _fmt(r["objective"]), gap if gap == "-" else f"{gap}%"))
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{width[0]}}  {b:>{width[1]}}  {c:>{width[2]}}" for a, b, c in rows)


def _print_plan(record: dict[str, Any]) -> None:
    print(f"== {record['solver']} ==")
    width = max(len(" > ".join(r["route"])) for r in record["updates"])
    print(f"{'update':<10} {'route':<{width}} {'start (s)':>12} {'finish (s)':>12}")
    for r in sorted(record["updates"], key=lambda r: (r["finish"], r["id"])):
        print(f"{r['id']:<10} {' > '.join(r['route']):<{width}} {r['start']:>12.6g} {r['finish']:>12.6g}")
    print(
        f"objective {_fmt(record['objective'])} s  status {record['status']}  "
        f"bound {_fmt(record['bound'])} s  gap {_fmt(_percent(record['gap']), 4)} %"
    )
    print()


def _progress_printer(every: float) -> Any:
    last = [-math.inf]

    def show(p: Any) -> None:
        if p.wall_seconds - last[0] >= every:
            last[0] = p.wall_seconds
            obj = "-" if p.objective is None else f"{p.objective:.6g}"
            print(f"[ilp {p.wall_seconds:6.1f}s] best {obj} s, bound {p.bound:.6g} s", file=sys.stderr)

    return show


def _plot(path: Path, instance: Any, plans: list[tuple[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r.link for _, s in plans for t in s.transfers for r in t.reservations})
    payloads = sorted({t.payload_id for _, s in plans for t in s.transfers})
    colors = {p: plt.get_cmap("tab20")(i % 20) for i, p in enumerate(payloads)}
    fig, axes = plt.subplots(len(plans), 1, figsize=(10, 1 + 0.45 * len(links) * len(plans)), squeeze=False)
    for ax, (name, schedule) in zip(axes[:, 0], plans, strict=True):
        stack: dict[tuple[Any, float], float] = {}
        for t in schedule.transfers:
            for r in t.reservations:
                row = links.index(r.link)
                share = r.rate / instance.capacity(r.link)
                base = stack.get((r.link, r.start), 0.0)
                stack[r.link, r.start] = base + share
                ax.broken_barh(
                    [(r.start, r.end - r.start)],
                    (row - 0.4 + 0.8 * base, 0.8 * share),
                    color=colors[t.payload_id],
                )
        ax.set_yticks(range(len(links)), [f"{a}->{b}" for a, b in links], fontsize=7)
        ax.set_title(name)
        ax.set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@contextlib.contextmanager
def _ctrl_c_sets() -> Iterator[threading.Event]:
    """SIGINT sets the yielded event while the block runs (instead of KeyboardInterrupt).

    ``solve_ilp`` polls the event and returns its best plan: no KeyboardInterrupt that
    could escape between the local search and the solver, or leave CP-SAT's search thread
    running behind an exiting interpreter.
    """
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def run(args: argparse.Namespace) -> int:
    """Plan the instance with the chosen solver(s); print, and write the requested files."""
    from mlfabric.scheduler.core.checker import check_schedule
    from mlfabric.scheduler.core.trace import trace_events, write_trace
    from mlfabric.scheduler.plan.heuristics import fair_schedule, heuristic_plans, warm_start
    from mlfabric.scheduler.plan.ilp import solve_ilp
    from mlfabric.scheduler.plan.instance import InstanceError, load_instance, objective_of

    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib: pip install 'mlfabric[plot]'", file=sys.stderr)
            return 2
    try:
        instance = load_instance(args.instance)
    except InstanceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    updates = list(instance.updates)
    wanted = ("ilp", "stf", "aggregation", "tree", "fair") if args.solver == "all" else (args.solver,)
    heuristics = heuristic_plans(instance)
    hint = warm_start(instance, heuristics.values())
    heuristics["fair"] = fair_schedule(instance)
    if "tree" in wanted:
        from mlfabric.scheduler.policies.trees import plan_tree

        aggs = list(instance.aggregators)
        heuristics["tree"] = plan_tree(instance.graph, updates, aggregators=aggs)
    plans: list[tuple[str, Any]] = []
    records: list[dict[str, Any]] = []
    bound: float | None = None
    gap: float | None  # of each plan to the bound (None: no bound)
    if instance.objective == "makespan":  # a real lower bound (plan/bounds.py), so the gap means something
        from mlfabric.scheduler.plan.bounds import makespan_bound

        parts = makespan_bound(instance.graph, updates, instance.server, aggregators=instance.aggregators)
        bound = parts.value
        print(
            f"lower bound {parts.value:.6g} s ({parts.where}): own path {parts.path:.6g} s, "
            f"server ingress {parts.ingress:.6g} s, largest cut {parts.cut:.6g} s"
        )
    if "ilp" in wanted:
        with _ctrl_c_sets() as stop:
            result = solve_ilp(
                instance,
                hint=hint,
                time_limit=args.time_limit,
                seed=args.seed,
                workers=args.workers,
                engine=args.engine,
                groups=args.groups,
                search_seconds=args.search_seconds,
                progress=_progress_printer(args.progress_every),
                stop=stop,
                levels=args.levels,
            )
        if result.schedule is None or result.objective is None:
            print(f"error: the ILP found no plan ({result.status}) in {args.time_limit:g} s", file=sys.stderr)
            return 1
        bound = max(result.bound, bound or 0.0)
        gap = (result.objective - bound) / result.objective if result.objective > 0 else result.gap
        plans.append(("ilp", result.schedule))
        records.append(
            _plan_record(
                instance,
                "ilp",
                result.schedule,
                objective=result.objective,
                bound=bound,
                gap=gap,
                status=result.status,
                wall_seconds=result.wall_seconds,
                engine=result.engine,
                horizon_slots=result.horizon_slots,
            )
        )
    for name in wanted:
        if name not in heuristics:
            continue
        schedule = heuristics[name]
        objective = objective_of(instance, schedule)
        gap = (objective - bound) / objective if bound is not None and objective > 0 else None
        plans.append((name, schedule))
        records.append(
            _plan_record(
                instance, name, schedule, objective=objective, bound=bound, gap=gap, status="HEURISTIC"
            )
        )
    for _, schedule in plans:
        check_schedule(instance.graph, schedule, updates=updates)
    for record in records:
        _print_plan(record)
    if len(records) > 1:
        print(summary_table(records))
    if args.out is not None:
        doc = records[0] if len(records) == 1 else {"plans": records}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    if args.trace is not None:
        caps = {e: instance.capacity(e) for e in instance.graph.edges}
        events = [
            ev
            for pid, (name, schedule) in enumerate(plans, start=1)
            for ev in trace_events(schedule, capacities=caps, process=name, pid=pid)
        ]
        write_trace(args.trace, events)
    if args.plot is not None:
        _plot(args.plot, instance, plans)
    return 0
