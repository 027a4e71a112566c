"""Reload's graph swap, the service's policies in the config, the daemon's push deadline option."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import networkx as nx
import pytest

from mlfabric.config import NOT_IN_SERVICE, SERVICE_POLICIES, ConfigError, load_config, parse_args_with_config
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.registry import POLICIES
from mlfabric.scheduler.service.cli import build_policy
from mlfabric.scheduler.service.state import SchedulerState


def test_replace_graph_follows_the_new_links_and_refuses_losing_a_daemons_host() -> None:
    s = SchedulerState(star(3, 8e9))
    s.connect("h0", "127.0.0.1:1")
    assert s.path("h0", "h1") == ("h0", "sw", "h1")  # cached
    direct = nx.DiGraph(star(3, 8e9))
    direct.add_edge("h0", "h1", capacity=8e9)
    s.replace_graph(direct)
    assert s.graph is direct and s.path("h0", "h1") == ("h0", "h1")  # the cache followed
    s.connect("h2", "127.0.0.1:2")
    with pytest.raises(ValueError, match="lacks the hosts of connected daemons: h2"):
        s.replace_graph(star(["h0", "h1"], 8e9))
    assert s.graph is direct and s.path("h0", "h1") == ("h0", "h1")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_config_accepts_exactly_the_policies_the_service_runs(tmp_path: Path, name: str) -> None:
    path = tmp_path / "scheduler.toml"
    path.write_text(f'policy = "{name}"\n')
    try:
        build_policy(name)
    except ValueError as exc:
        service_error: str | None = str(exc)
    else:
        service_error = None
    try:
        load_config(path, "scheduler")
    except ConfigError as exc:
        assert service_error is not None, f"the config refuses {name}, which the service runs: {exc}"
        assert name in NOT_IN_SERVICE
        assert NOT_IN_SERVICE[name] in str(exc) and NOT_IN_SERVICE[name] in service_error  # the same why
    else:
        assert service_error is None, f"the config accepts {name}, which the service refuses: {service_error}"
        assert name in SERVICE_POLICIES


def test_the_tree_policy_in_a_config_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.toml"
    path.write_text('policy = "stf+tree"\n')
    assert load_config(path, "scheduler")["policy"] == "stf+tree"


def test_the_push_deadline_is_an_option_and_a_key_that_reaches_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlfabric.daemon import cli, host

    path = tmp_path / "daemon.toml"
    path.write_text('host = "h0"\nscheduler = "127.0.0.1:1"\npush_timeout = 2.5\n')
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    assert parse_args_with_config(parser, ["--config", str(path)], "daemon").push_timeout == 2.5
    args = parse_args_with_config(parser, ["--config", str(path), "--push-timeout", "7"], "daemon")
    assert args.push_timeout == 7.0

    seen: list[Any] = []

    class Recorder:
        def __init__(self, config: Any, **_: Any) -> None:
            seen.append(config)

        def start(self, timeout: float) -> None:
            raise OSError("not started in this test")

    monkeypatch.setattr(host, "Daemon", Recorder)
    args.socket = str(tmp_path / "d.sock")
    assert cli.run(args) == 1
    assert [c.push_timeout for c in seen] == [7.0]
    args.push_timeout = 0.0
    assert cli.run(args) == 2
    path.write_text('host = "h0"\nscheduler = "127.0.0.1:1"\npush_timeout = 0\n')
    with pytest.raises(ConfigError, match=r"key 'push_timeout': bad value 0 \(must be >= 0.001\)"):
        load_config(path, "daemon")


def _harness() -> Any:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "experiments" / "harness.py"
    spec = importlib.util.spec_from_file_location("harness", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_experiments_harness_starts_mlfabric_and_stops_what_ignores_sigterm(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    harness = _harness()
    proc, info = harness.start(
        ["scheduler", "--listen", "127.0.0.1:0", "--star", "2"], tmp_path / "s.json", tmp_path / "s.log"
    )
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
        ]
    )
    time.sleep(0.3)  # the handler is installed
    t0 = time.monotonic()
    harness.stop_all([proc])  # stops on SIGTERM within its grace
    harness.stop_all([stubborn], grace=1.0)
    assert info["pid"] == proc.pid and info["address"].startswith("127.0.0.1:")
    assert proc.returncode == 0 and stubborn.returncode == -9 and time.monotonic() - t0 < 10
    with pytest.raises(RuntimeError, match=r"scheduler did not start: .*--stf-horizon must be >= 0"):
        harness.start(
            ["scheduler", "--listen", "127.0.0.1:0", "--stf-horizon", "-1"],
            tmp_path / "b.json",
            tmp_path / "b.log",
        )
