"""``mlfabric simulate``: the table, the trace, the bandwidth schedule, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlfabric.cli import main


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith(("| policy", "| ---")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_async_table_has_each_policy_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["simulate", "--workers", "8", "--nic-gbps", "1", "--iterations", "2", "--quiet", "--seed", "3"]
    )
    out = capsys.readouterr().out
    assert code == 0
    rows = _rows(out)
    assert set(rows) == {"fair", "stf", "stf / fair"}
    assert rows["fair"][0] == rows["stf"][0] == "16"  # pushed: 8 workers x 2


def test_sync_aggregation_trace_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, stats = tmp_path / "t.json", tmp_path / "s.json"
    argv = ["simulate", "--workers", "8", "--server-gbps", "0.5", "--nic-gbps", "2", "--mode", "sync"]
    argv += ["--aggregation", "--iterations", "2", "--jitter", "0", "--update-mb", "1", "--quiet"]
    assert main([*argv, "--trace", str(trace), "--json", str(stats)]) == 0
    assert "stf+agg / fair" in capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "sw->ps" in tracks
    assert {e["pid"] for e in events} == {1, 2, 3}
    results = {s["policy"]: s for s in json.loads(stats.read_text())}
    assert results["stf+agg"]["makespan_mean"] < results["fair"]["makespan_mean"]


def test_bandwidth_schedule_slows_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--workers", "2", "--nic-gbps", "0.08", "--iterations", "1", "--policy", "fair"]
    base += ["--jitter", "0", "--compute-ms", "0", "--update-mb", "1", "--quiet"]
    assert main([*base, "--json", str(tmp_path / "a.json")]) == 0
    sched = tmp_path / "bw.toml"
    sched.write_text('[[change]]\nat = 0.05\na = "ps"\nb = "sw"\nmbps = 8\n')
    assert main([*base, "--bandwidth-schedule", str(sched), "--json", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    (a,) = json.loads((tmp_path / "a.json").read_text())
    (b,) = json.loads((tmp_path / "b.json").read_text())
    assert a["sim_time"] == pytest.approx(0.2 + 300e-6)  # 2 MB over 10 MB/s, after one batch window
    assert b["sim_time"] > 5 * a["sim_time"]


@pytest.mark.parametrize("preset", ["two-tier", "fat-tree"])
def test_other_presets_run(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--preset", preset, "--workers", "10", "--hosts-per-rack", "4", "--iterations", "1"]
    assert main([*argv, "--quiet"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["fair"][1] == rows["stf"][1] == "10"  # applied


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policy", "magic"], "unknown policy"),
        (["--preset", "fat-tree", "--slow-nics", "0.5:2"], "one link rate"),
        (["--straggler", "2:3"], "fraction"),
        (["--stf-horizon", "-1"], "--stf-horizon must be >= 0"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--workers", "4", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err


def test_the_stf_horizon_replans_and_changes_no_outcome(tmp_path: Path) -> None:
    """As in the service, ``stf`` plans the head of its order and decides again (DESIGN §4)."""
    argv = ["simulate", "--workers", "16", "--iterations", "2", "--policy", "stf", "--quiet"]
    runs = {}
    for horizon in ("0", "2"):
        out = tmp_path / f"h{horizon}.json"
        assert main([*argv, "--stf-horizon", horizon, "--json", str(out)]) == 0
        runs[horizon] = json.loads(out.read_text())[0]
    assert runs["2"]["decisions"] > runs["0"]["decisions"]
    same = ("applied", "dropped_policy", "completion_mean", "delay_mean")
    assert {k: runs["2"][k] for k in same} == {k: runs["0"][k] for k in same}


def test_json_is_valid_where_a_value_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 24: asynchronous runs have no makespan (NaN inside); the file must still be JSON."""
    out = tmp_path / "s.json"
    argv = ["simulate", "--workers", "4", "--nic-gbps", "1", "--iterations", "1", "--quiet"]
    argv += ["--json", str(out)]
    assert main(argv) == 0
    capsys.readouterr()

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON")

    rows = json.loads(out.read_text(), parse_constant=refuse)
    assert {r["policy"] for r in rows} == {"fair", "stf"}
    assert all(r["makespan_mean"] is None for r in rows)  # asynchronous: no makespan
    assert all(isinstance(r["delay_mean"], float) for r in rows)


def test_progress_says_events_per_second(capsys: pytest.CaptureFixture[str]) -> None:
    from mlfabric.scheduler.sim.cli import Progress

    progress = Progress("stf", every=0.0)
    progress(1.5, 300)
    err = capsys.readouterr().err
    assert "[stf]" in err and "t=1.500 s simulated, 300 events" in err and "events/s)" in err


def test_progress_lines_come_every_few_seconds_of_a_run_and_never_with_quiet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import io

    from mlfabric.scheduler.policies.fair import FairPolicy
    from mlfabric.scheduler.sim.cli import Progress
    from mlfabric.scheduler.sim.scenario import Scenario, cluster, run_scenario
    from mlfabric.scheduler.sim.workload import ComputeModel

    c = cluster("star", 64, nic_bps=1e9)
    sc = Scenario(c, ComputeModel(dict.fromkeys(c.workers, 0.01)), update_bytes=1e6, iterations=3)
    ticks = iter(range(10**9))  # a clock that moves 1 s per reading: one line per progress call
    out = io.StringIO()
    stats, _ = run_scenario(sc, FairPolicy(), progress=Progress("fair", 5.0, lambda: float(next(ticks)), out))
    lines = out.getvalue().splitlines()
    assert lines, "a long run prints progress"
    times = [float(line.split("t=")[1].split(" s simulated")[0]) for line in lines]
    assert times == sorted(times) and times[-1] <= stats.sim_time
    assert all(line.startswith("[fair] ") and "events/s)" in line for line in lines)
    # the CLI with --quiet writes nothing on stderr; without it, one line per policy at the end
    argv = ["simulate", "--workers", "4", "--nic-gbps", "1", "--iterations", "1"]
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split("]")[0] for line in err if "done:" in line] == ["  [fair", "  [stf"]
