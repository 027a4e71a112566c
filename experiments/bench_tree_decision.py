"""The tree planner's decision at 1,024 workers, this code and a reference commit's side by side (issue 24).

The reference planner is the scheduler package (``scheduler/core``, ``policies``, ``plan``)
of ``--ref`` (default ``main``) read with ``git archive`` into a temporary directory as the
package ``mlfabric_ref`` (its imports rewritten), so both planners run in this one process
on the same graphs, alternately, each on inputs made of its own classes. The reference's C
extension (``_plan_native``, where its ``pyproject.toml`` declares one) is compiled there
with the flags it declares (``--no-build-ref``: its Python loops). Nothing of the old code
is kept in this repository.

Three decisions, on the graphs of ``experiments/bench_trees.py`` (32 racks x 32 hosts,
4:1, mixed NICs: 70 % 10 Gbit/s, 20 % 25 Gbit/s, 10 % 2.5 Gbit/s; server ``h0``, every
other host a worker with a 20 MB update):

* **cold** — ``TreePolicy().decide`` on 1,023 pending updates, a new policy object (no
  path or route kept: ``bench_trees.py``'s decision time);
* **warm** — the same policy deciding the same round again (paths and routes kept);
* **round first** — a synchronous round's first decision through the decision runner (1
  update there, 1,022 expected; ``bench_rounds.py``'s), a new runner and policy.

CPU time (``time.process_time``; the machine is shared) per decision, ``--repeat`` per seed
and planner, the two planners alternated. Each decision of the new code is checked to be
the reference's (the digest of the decisions' ``repr``).

Run::

    python experiments/bench_tree_decision.py --out experiments/results/bench_tree_decision.md
    python experiments/bench_tree_decision.py --seeds 0 --repeat 3      # quick
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import io
import os
import random
import re
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
from bench_trees import mixed_nics  # noqa: E402 - beside this script

MB = 1_000_000
KINDS = ("cold", "warm", "round first")
REF_PATHS = ("scheduler/__init__.py", "scheduler/core", "scheduler/policies", "scheduler/plan")


NATIVE = "mlfabric.scheduler.core._plan_native"


def build_native(commit: str, pkg: Path) -> bool:
    """Compile ``commit``'s ``_plan_native`` into ``pkg`` (the reference package); False: none declared."""
    toml = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:pyproject.toml"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    ext = next(
        (e for e in tomllib.loads(toml)["tool"]["setuptools"].get("ext-modules", []) if e["name"] == NATIVE),
        None,
    )
    if ext is None:
        return False
    blob = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, *ext["sources"], *ext.get("depends", [])],
        check=True,
        capture_output=True,
    ).stdout
    src = pkg / "_native_src"
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(src, filter="data")
    target = pkg / "scheduler" / "core" / f"_plan_native{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        [
            sysconfig.get_config_var("CC").split()[0],
            "-shared",
            "-fPIC",
            *ext.get("extra-compile-args", []),
            f"-I{sysconfig.get_paths()['include']}",
            *(str(src / f) for f in ext["sources"]),
            "-o",
            str(target),
            "-lm",
        ],
        check=True,
    )
    return True


def load_reference(ref: str, into: Path, build: bool = True) -> tuple[str, bool]:
    """Unpack ``ref``'s scheduler as the package ``mlfabric_ref`` under ``into``; its commit and
    whether its C extension was built."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    blob = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, *REF_PATHS],
        check=True,
        capture_output=True,
    ).stdout
    pkg = into / "mlfabric_ref"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        '"""A reference copy of mlfabric.scheduler (bench_tree_decision.py)."""\n'
    )
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(pkg, filter="data")
    for py in pkg.rglob("*.py"):
        text = py.read_text()
        py.write_text(re.sub(r"\bmlfabric\.scheduler\b", "mlfabric_ref.scheduler", text))
    native = build and build_native(commit, pkg)
    sys.path.insert(0, str(into))
    importlib.invalidate_caches()
    return commit, native


class Planner:
    """One package's classes: the tree policy, the runner and the inputs."""

    def __init__(self, prefix: str) -> None:
        base = importlib.import_module(f"{prefix}.scheduler.policies.base")
        self.PendingUpdate = base.PendingUpdate
        self.Snapshot = base.Snapshot
        self.RoundSpec = base.RoundSpec
        self.TreePolicy = importlib.import_module(f"{prefix}.scheduler.policies.tree_policy").TreePolicy
        self.DecisionRunner = importlib.import_module(f"{prefix}.scheduler.policies.runner").DecisionRunner
        self.trees: ModuleType = importlib.import_module(f"{prefix}.scheduler.policies.trees")

    def pending(self, names: list[str], at: float = 0.0) -> list[Any]:
        return [self.PendingUpdate(f"u{h}", "j", "s", h, h, "h0", 20 * MB, 1.0, 0, at) for h in names]

    def decisions(self, g: nx.DiGraph, names: list[str]) -> tuple[dict[str, float], str]:
        """CPU seconds of the cold, warm and round-first decisions, and a digest of the decisions."""
        pending = self.pending(names[1:])
        policy = self.TreePolicy()
        t0 = time.process_time()
        cold = policy.decide(self.Snapshot(0.0, g), pending)
        t1 = time.process_time()
        warm = policy.decide(self.Snapshot(0.0, g), list(pending))
        t2 = time.process_time()
        spec = self.RoundSpec({h: h for h in names[1:]})
        runner = self.DecisionRunner(self.TreePolicy())
        t3 = time.process_time()
        first = runner.decide(self.Snapshot(0.0, g, rounds={("j", "s"): spec}), self.pending(names[1:2]))
        t4 = time.process_time()
        digest = hashlib.sha256(repr((cold, warm, first)).encode()).hexdigest()[:16]
        return {"cold": t1 - t0, "warm": t2 - t1, "round first": t4 - t3}, digest


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def run(seeds: list[int], repeat: int, ref: str, build: bool = True) -> dict[str, Any]:
    from mlfabric.scheduler.core.graph import two_tier
    from mlfabric.scheduler.core.timeline import _plan_native

    loads = [os.getloadavg()[0]]
    tmp = tempfile.TemporaryDirectory(prefix="bench_tree_ref_")
    commit, built = load_reference(ref, Path(tmp.name), build)
    planners = {"old": Planner("mlfabric_ref"), "new": Planner("mlfabric")}
    old_timeline = importlib.import_module("mlfabric_ref.scheduler.core.timeline")
    old_native = getattr(old_timeline, "_plan_native", None) is not None  # None: before the C loops
    if built and not old_native:
        raise RuntimeError("the reference's C extension was built but does not load")
    rows: dict[int, dict[str, dict[str, list[float]]]] = {}
    same = True
    for seed in seeds:
        names = [f"h{k}" for k in range(32 * 32)]
        g = two_tier(32, 32, mixed_nics(names, random.Random(seed)), oversubscription=4)
        times: dict[str, dict[str, list[float]]] = {p: {k: [] for k in KINDS} for p in planners}
        for i in range(repeat):
            digests = {}
            for who in ("old", "new") if i % 2 == 0 else ("new", "old"):
                cpu, digests[who] = planners[who].decisions(g, names)
                for k in KINDS:
                    times[who][k].append(cpu[k])
            same = same and digests["old"] == digests["new"]
        rows[seed] = times
        ms = {who: {k: [x * 1e3 for x in times[who][k]] for k in KINDS} for who in times}
        cells = [f"{k} old {spread(ms['old'][k])} / new {spread(ms['new'][k])} ms" for k in KINDS]
        print(f"seed {seed}: " + ", ".join(cells), file=sys.stderr)
    tmp.cleanup()
    return {
        "rows": rows,
        "same": same,
        "commit": commit,
        "native": _plan_native is not None,
        "old_native": old_native,
        "load": [*loads, os.getloadavg()[0]],
    }


def report(doc: dict[str, Any], seeds: list[int], repeat: int, ref: str, took: float) -> str:
    rows = doc["rows"]
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        "# The tree planner's decision at 1,024 workers, against the reference code (issue 24)",
        "",
        f"Reproduce: `python experiments/bench_tree_decision.py --seeds {' '.join(map(str, seeds))} "
        f"--repeat {repeat} --ref {ref} --out experiments/results/bench_tree_decision.md` "
        f"({took:.0f} s, 1-minute load average {doc['load'][0]:.1f} at the start, "
        f"{doc['load'][1]:.1f} at the end, on the 2 shared cores).",
        "",
        f"Old: `{ref}` at {doc['commit']} (its scheduler package unpacked by `git archive` into a "
        "temporary package, run in this process, C loops of its `_plan_native` "
        f"{'compiled there' if doc['old_native'] else 'absent or not built: its Python loops'}); "
        f"new: this tree at {head} (C loops of "
        f"`_plan_native` {'built' if doc['native'] else 'NOT built: the Python loops'}). 32 x 32 hosts, "
        "4:1, mixed NICs, 1,023 updates of 20 MB to `h0`; the two planners alternated. CPU ms per "
        "decision, median [min-max] over the repeats; old / new: the median of the paired ratios.",
        "",
        f"Same decisions, old and new, every repeat: **{'yes' if doc['same'] else 'NO'}**.",
        "",
        "| seed | decision | old (ms) | new (ms) | old / new |",
        "|---|---|---|---|---|",
    ]
    overall: dict[str, dict[str, list[float]]] = {k: {"old": [], "new": [], "ratio": []} for k in KINDS}
    for seed in seeds:
        t = rows[seed]
        for k in KINDS:
            old = [x * 1e3 for x in t["old"][k]]
            new = [x * 1e3 for x in t["new"][k]]
            ratios = [a / b for a, b in zip(old, new, strict=True)]
            overall[k]["old"] += old
            overall[k]["new"] += new
            overall[k]["ratio"] += ratios
            lines.append(
                f"| {seed} | {k} | {spread(old)} | {spread(new)} | {statistics.median(ratios):.2f}x |"
            )
    lines += ["", "All seeds:", "", "| decision | old (ms) | new (ms) | old / new |", "|---|---|---|---|"]
    for k in KINDS:
        o = overall[k]
        lines.append(
            f"| {k} | {spread(o['old'])} | {spread(o['new'])} | {statistics.median(o['ratio']):.2f}x "
            f"[{min(o['ratio']):.2f}-{max(o['ratio']):.2f}] |"
        )
    cold = statistics.median(overall["cold"]["new"])
    lines += [
        "",
        f"Target (issue 24): the decision at 1,024 workers <= 25 ms CPU cold: median {cold:.1f} ms "
        f"({'met' if cold <= 25 else 'not met'} on this machine under this load).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeat", type=int, default=10, help="decisions per seed and planner")
    ap.add_argument("--ref", default="main", help="the reference commit (a git revision)")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument(
        "--no-build-ref",
        action="store_true",
        help="do not compile the reference's C extension (its Python loops)",
    )
    args = ap.parse_args(argv)
    started = time.monotonic()
    doc = run(args.seeds, args.repeat, args.ref, not args.no_build_ref)
    text = report(doc, args.seeds, args.repeat, args.ref, time.monotonic() - started)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0 if doc["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
