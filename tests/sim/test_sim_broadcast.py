"""The model down the trees in the simulator: ``Simulator.broadcast_model`` and sync rounds."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import networkx as nx
import pytest

from mlfabric.cli import main
from mlfabric.scheduler.core.graph import star, two_tier
from mlfabric.scheduler.policies.broadcast import broadcast_bound, check_broadcast, plan_broadcast
from mlfabric.scheduler.policies.fair import FairPolicy
from mlfabric.scheduler.sim.broadcast import BroadcastExecution
from mlfabric.scheduler.sim.engine import Simulator, UpdateRecord
from mlfabric.scheduler.sim.iteration import SyncSGD
from mlfabric.scheduler.sim.workload import ComputeModel

MB = 1_000_000


def two_racks() -> tuple[nx.DiGraph, list[str]]:
    """Two racks of six (10 Gbit/s NICs, 1 Gbit/s uplinks), the server ``ps`` on the core at 10 Gbit/s."""
    g = two_tier(2, 6, 10e9, oversubscription=60)
    g.add_node("ps", kind="host")
    for a, b in (("ps", "core"), ("core", "ps")):
        g.add_edge(a, b, capacity=10e9 / 8, latency=0.0)
    return g, [f"h{i}" for i in range(12)]


class Once:
    """Broadcasts the model once at the start (optionally stepping the version meanwhile)."""

    accumulates = True

    def __init__(self, step_at: float | None = None) -> None:
        self.got: dict[str, list[tuple[float, int]]] = {}
        self.step_at = step_at

    def start(self, sim: Simulator) -> None:
        sim.broadcast_model(sim.workers, lambda w, v: self.got.setdefault(w, []).append((sim.now, v)))
        if self.step_at is not None:
            sim.at(self.step_at, sim.step)

    def resolved(self, sim: Simulator, record: UpdateRecord) -> None:
        raise AssertionError("nothing is pushed")


def broadcast(
    g: nx.DiGraph, workers: list[str], mode: str, step_at: float | None = None
) -> tuple[Once, Simulator]:
    it = Once(step_at)
    sim = Simulator(
        g,
        FairPolicy(),
        it,
        server_host="ps",
        workers=workers,
        update_bytes=MB,
        model_bytes=20 * MB,
        model_broadcast=mode,
        record_flows=True,
    )
    sim.run()
    return it, sim


def test_two_racks_every_worker_once_one_copy_per_uplink_within_the_target() -> None:
    g, ws = two_racks()
    tree, sim = broadcast(g, ws, "tree")
    assert sorted(tree.got) == sorted(ws)
    assert all(len(v) == 1 and v[0][1] == 0 for v in tree.got.values())
    t_tree = max(v[0][0] for v in tree.got.values())
    # one copy's bytes down each rack's uplink, the model's chunks as flows
    for r in (0, 1):
        down = sum(f.bytes for f in sim.flows if ("core", f"tor{r}") in itertools.pairwise(f.path))
        assert down == pytest.approx(20 * MB)
    plan = plan_broadcast(g, "ps", ws, 20 * MB)
    check_broadcast(g, plan, "ps", ws)
    assert len(sim.flows) == plan.chunks * len(ws)
    assert t_tree == pytest.approx(plan.makespan)  # the estimate is the fluid time here
    bound = broadcast_bound(g, "ps", ws, 20 * MB, chunks=plan.chunks)
    assert t_tree <= 1.3 * bound.value
    direct, _ = broadcast(g, ws, "direct")
    t_direct = max(v[0][0] for v in direct.got.values())
    assert t_direct == pytest.approx(0.96)  # six copies through each 1 Gbit/s uplink
    assert t_direct / t_tree > 5


def test_the_version_is_the_one_at_the_broadcasts_start() -> None:
    g, ws = two_racks()
    it, sim = broadcast(g, ws, "tree", step_at=0.05)  # a step while the chunks move
    assert sim.version == 1
    assert {v for got in it.got.values() for _, v in got} == {0}


def test_sync_rounds_use_the_tree_and_push_from_the_rounds_model() -> None:
    g, ws = two_racks()
    makespans = {}
    for mode in ("direct", "tree"):
        it = SyncSGD(ComputeModel(dict.fromkeys(ws, 0.0)), iterations=3)
        sim = Simulator(
            g,
            FairPolicy(),
            it,
            server_host="ps",
            workers=ws,
            update_bytes=MB,
            model_bytes=20 * MB,
            model_broadcast=mode,
        )
        records = sim.run()
        assert len(it.makespans) == 3 and sim.version == 3
        bases = Counter((r.base_version, r.worker) for r in records)
        assert bases == Counter((v, w) for v in range(3) for w in ws)  # each round once, its model
        makespans[mode] = it.makespans
    assert all(t < d - 0.5 for t, d in zip(makespans["tree"], makespans["direct"], strict=True))


def test_direct_is_the_default_and_unchanged() -> None:
    ws = ["w0", "w1", "w2", "w3"]
    g = star(["ps", *ws], {"ps": 8e6, **dict.fromkeys(ws, 80e6)})
    spans = []
    for explicit in (False, True):
        it = SyncSGD(ComputeModel(dict.fromkeys(ws, 0.0)), iterations=1)
        if explicit:
            sim = Simulator(
                g,
                FairPolicy(),
                it,
                server_host="ps",
                workers=ws,
                update_bytes=1e6,
                model_bytes=1e6,
                model_broadcast="direct",
            )
        else:
            sim = Simulator(
                g, FairPolicy(), it, server_host="ps", workers=ws, update_bytes=1e6, model_bytes=1e6
            )
        sim.run()
        assert sim.model_broadcast == "direct"
        spans.append(it.makespans)
    assert spans[0] == spans[1] == [pytest.approx(4.0 + 4.0)]  # 4 model copies, then 4 updates
    with pytest.raises(ValueError, match="model_broadcast"):
        Simulator(g, FairPolicy(), it, server_host="ps", workers=ws, update_bytes=1, model_broadcast="ring")


def test_tree_without_model_bytes_or_on_the_servers_host_is_instant() -> None:
    g, ws = two_racks()
    got: list[tuple[str, int]] = []
    for nbytes, workers in ((0.0, ws), (20 * MB, ["ps"])):
        sim = Simulator(
            g,
            FairPolicy(),
            Once(),
            server_host="ps",
            workers=workers,
            update_bytes=MB,
            model_bytes=nbytes,
            model_broadcast="tree",
        )
        sim.broadcast_model(workers, lambda w, v: got.append((w, v)))
    assert sorted(got) == sorted([(w, 0) for w in ws] + [("ps", 0)])


def test_execution_forwards_each_chunk_once_in_order() -> None:
    g, ws = two_racks()
    plan = plan_broadcast(g, "ps", ws, 20 * MB, chunks=3)
    pending: list[tuple[str, object]] = []
    done: list[str] = []
    run = BroadcastExecution(plan, lambda n, p, b, arrived: pending.append((n, arrived)), done.append)
    run.start()
    seen = []
    while pending:
        name, arrived = pending.pop(0)
        seen.append(name)
        arrived()  # type: ignore[operator]
    assert run.done and sorted(done) == sorted(ws)
    assert len(seen) == len(set(seen)) == 3 * len(ws)
    for e in plan.edges:  # every edge's chunks in order; a child forwards chunk i after it is in
        mine = [s for s in seen if s.startswith(f"{e.parent}>{e.child}#")]
        assert mine == [f"{e.parent}>{e.child}#{i}" for i in range(3)]
        for i in range(3):
            if e.parent != "ps":
                into = next(s for s in seen if s.endswith(f">{e.parent}#{i}"))
                assert seen.index(into) < seen.index(f"{e.parent}>{e.child}#{i}")


def test_cli_model_broadcast_tree_beats_direct(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--preset", "two-tier", "--workers", "11", "--hosts-per-rack", "6"]
    base += ["--oversubscription", "6", "--mode", "sync", "--model-mb", "20", "--update-mb", "1"]
    base += ["--policy", "fair", "--iterations", "1", "--jitter", "0", "--quiet"]
    spans = {}
    for mode in ("direct", "tree"):
        out = tmp_path / f"{mode}.json"
        assert main([*base, "--model-broadcast", mode, "--json", str(out)]) == 0
        (stats,) = json.loads(out.read_text())
        spans[mode] = stats["makespan_mean"]
    assert spans["tree"] < spans["direct"]
    with pytest.raises(SystemExit) as exc:
        main([*base, "--model-broadcast", "ring"])
    assert exc.value.code == 2
    capsys.readouterr()
