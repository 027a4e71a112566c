"""The namespace testbed on this kernel (root): shaping, rate changes, CLI, cleanup, end to end.

Skipped, with the reason, without root, ``ip`` or ``tc``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import load_topology, parse_topology
from mlfabric.testbed import cli
from mlfabric.testbed.cluster import CONTROL, Testbed
from mlfabric.testbed.linkcheck import measure_transfer
from mlfabric.testbed.netns import CommandError, SubprocessRunner, list_namespaces

pytestmark = pytest.mark.root

RATE = 50e6 / 8  # bytes/s
GOODPUT = RATE * 1448 / 1514  # TCP payload rate of a shaped Ethernet link (MSS 1448, timestamps)
TOPOLOGY = """
hosts = ["ps", "w0", "w1"]
switches = ["tor"]

[[links]]
a = "ps"
b = "tor"
mbps = 50

[[links]]
a = "w0"
b = "tor"
mbps = 50

[[links]]
a = "w1"
b = "tor"
mbps = 50
"""


def _ours(prefix: str) -> list[str]:
    return [n for n in list_namespaces(SubprocessRunner()) if n.startswith(prefix + "-")]


@pytest.fixture
def topology_file(tmp_path: Path) -> Path:
    path = tmp_path / "three.toml"
    path.write_text(TOPOLOGY)
    return path


def test_three_hosts_get_the_link_rate_and_leave_nothing(
    make_testbed: Callable[[nx.DiGraph], Testbed], topology_file: Path
) -> None:
    testbed = make_testbed(load_topology(topology_file))
    assert len(_ours(testbed.prefix)) == 5  # 3 hosts, 1 switch, control
    out = testbed.exec("w0", ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
    assert testbed.address("w0") in out
    measured = measure_transfer(testbed, "w0", "ps", int(RATE * 1.5))
    assert measured.bytes == int(RATE * 1.5)
    assert 0.9 * RATE <= measured.throughput <= 1.1 * RATE, measured
    # dynamic bandwidth: ps's ingress (the switch port's egress) drops to 20 Mbit/s
    testbed.set_rate(("tor", "ps"), 20e6 / 8)
    slower = measure_transfer(testbed, "w1", "ps", int(20e6 / 8 * 1.5))
    assert 0.9 * 20e6 / 8 <= slower.throughput <= 1.1 * 20e6 / 8, slower
    assert testbed.rate(("tor", "ps")) == 20e6 / 8
    assert testbed.rate(("ps", "tor")) == RATE
    testbed.down()
    assert _ours(testbed.prefix) == []


def test_lowering_the_rate_mid_transfer_does_not_stall_it(
    make_testbed: Callable[[nx.DiGraph], Testbed], topology_file: Path
) -> None:
    # A rate drop under load must not stall the flows. (With a 64 KiB bucket, sustained flows
    # sending 64 KiB GSO packets stalled at 0 bytes/s after a 100 -> 25 Mbit/s change until the
    # rate went back up; this short test exercises the path but does not always hit that.)
    testbed = make_testbed(load_topology(topology_file))
    for link in (("tor", "ps"), ("w0", "tor"), ("w1", "tor")):
        testbed.set_rate(link, 100e6 / 8)
    results: list[object] = []
    senders = [
        threading.Thread(target=lambda w=w: results.append(measure_transfer(testbed, w, "ps", 9_000_000)))
        for w in ("w0", "w1")
    ]
    for t in senders:
        t.start()
    time.sleep(1.0)  # ~12 MB through at 100 Mbit/s; 6 MB left at 25 Mbit/s: ~2 s more
    testbed.set_rate(("tor", "ps"), 25e6 / 8)
    for t in senders:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in senders), "a transfer stalled after the rate change"
    assert len(results) == 2


def test_a_failed_build_deletes_what_it_created(testbed_state_dir: Path) -> None:
    class FailingRunner(SubprocessRunner):
        def __call__(self, argv: Sequence[str], *, check: bool = True) -> str:
            if argv[:1] == ["tc"]:
                raise CommandError("injected tc failure")
            return super().__call__(argv, check=check)

    graph = parse_topology({"hosts": ["a", "b"], "links": [{"a": "a", "b": "b", "mbps": 10}]})
    testbed = Testbed(graph, "mlf0fa11e", state_dir=testbed_state_dir, runner=FailingRunner())
    with pytest.raises(CommandError, match="injected"):
        testbed.up()
    assert _ours("mlf0fa11e") == []
    assert not (testbed_state_dir / "mlf0fa11e.json").exists()


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return cli.run(parser.parse_args(list(argv)))


def test_cli_up_status_exec_down(
    make_testbed: Callable[[nx.DiGraph], Testbed], topology_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = "mlf0c11e5"
    owned = make_testbed(load_topology(topology_file))  # a program's testbed: `down` must not touch it
    try:
        assert _cli("up", str(topology_file), "--prefix", prefix) == 0
        assert "198.18.0.1" in capsys.readouterr().out
        assert len(_ours(prefix)) == 5
        assert _cli("status", "--prefix", prefix) == 0
        assert "5/5 namespaces present, persistent" in capsys.readouterr().out
        assert _cli("exec", "--prefix", prefix, "w1", "--", "ip", "-4", "-o", "addr", "show", "eth0") == 0
        assert _cli("exec", "--prefix", prefix, "nope", "--", "true") == 2
        assert _cli("exec", "--prefix", prefix, CONTROL, "--", "true") == 0
    finally:
        assert _cli("down") == 0  # the one testbed made by `up`
    assert _ours(prefix) == []
    assert len(_ours(owned.prefix)) == 5
    assert _cli("down", "--prefix", prefix) == 1  # nothing left to delete


# --------------------------------------------------------------- end to end (daemons)

DAEMON_READY = all(
    importlib.util.find_spec(m) is not None for m in ("mlfabric.daemon.cli", "mlfabric.scheduler.service.cli")
)


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "window"), [("fair", 1), ("stf", 2)])
@pytest.mark.skipif(not DAEMON_READY, reason="daemon or scheduler CLI missing")
def test_pushes_end_to_end_through_scheduler_and_daemons(
    make_testbed: Callable[[nx.DiGraph], Testbed],
    topology_file: Path,
    tmp_path: Path,
    policy: str,
    window: int,
) -> None:
    from mlfabric.testbed.launch import TestbedCluster

    testbed = make_testbed(load_topology(topology_file))
    update_bytes, pushes = 4_000_000, 4
    roles = [sys.executable, "-m", "mlfabric.testbed.roles"]
    common = ["--job", "j", "--update-bytes", str(update_bytes)]
    limits = ["--no-get", "--pushes", str(pushes), "--window", str(window), "--out"]
    with TestbedCluster(testbed, topology_file, policy=policy, workdir=tmp_path / "run") as cluster:
        server = cluster.spawn(
            "ps", [*roles, "server", *common, "--name", "ps", "--out", str(tmp_path / "ps.json")]
        )
        workers = [
            cluster.spawn(
                w,
                [
                    *roles,
                    "worker",
                    *common,
                    "--name",
                    w,
                    "--server",
                    "ps",
                    *limits,
                    str(tmp_path / f"{w}.csv"),
                ],
            )
            for w in ("w0", "w1")
        ]
        for proc in workers:
            cluster.wait(proc, timeout=30)
        server.popen.terminate()
        cluster.wait(server, timeout=15)
    reports = cluster.transfer_reports()  # the daemons' --report-file lines
    rows = [r for w in ("w0", "w1") for r in csv.DictReader((tmp_path / f"{w}.csv").open())]
    assert len(rows) == 2 * pushes
    by_id = {r["update_id"]: r for r in rows}
    assert sorted(r["update_id"] for r in reports) == sorted(by_id)
    for report in reports:
        push = by_id[report["update_id"]]
        assert (report["src_host"], report["dst_host"]) == (push["worker"], "ps")
        assert report["ok"] and report["outcome"] == push["status"] and report["bytes"] == update_bytes
        assert float(push["start"]) <= report["start"] <= report["end"] <= float(push["end"])
    for w in ("w0", "w1"):  # with a window of 2 a worker's next push starts before its last resolved
        mine = sorted((float(r["start"]), float(r["end"])) for r in rows if r["worker"] == w)
        overlapping = any(later[0] < earlier[1] for earlier, later in itertools.pairwise(mine))
        assert overlapping == (window > 1), mine
    assert all(r["status"] in ("APPLIED", "DROPPED") for r in rows)
    summary = json.loads((tmp_path / "ps.json").read_text())
    applied = sum(r["status"] == "APPLIED" for r in rows)
    assert summary["version"] == applied == summary["applied"]
    # Two workers (one or two pushes at a time each) sharing ps's 50 Mbit/s ingress: the rate
    # of all the pushes' bytes over the span from the first push to the last verdict (which
    # includes the first hand-off and the last apply).
    span = max(float(r["end"]) for r in rows) - min(float(r["start"]) for r in rows)
    throughput = len(rows) * update_bytes / span
    # Never above the shaped rate (the shaping holds); at least 70% of what TCP can carry on
    # the link (payload is 1448 of every 1514 bytes) -- a floor that catches a link or a data
    # path that under-delivers (a tbf burst too small delivers a fraction), not a speed target:
    # on 2 shared cores the gaps between a worker's pushes (verdict, next hand-off) vary with
    # the load (CI measured 0.84 of goodput once).
    assert 0.7 * GOODPUT <= throughput <= 1.1 * RATE, throughput
