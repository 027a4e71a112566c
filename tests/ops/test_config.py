"""Config files: every option is a documented key, errors name file, key and value, flags override."""

from __future__ import annotations

import argparse
import importlib
import tomllib
from pathlib import Path

import pytest

from mlfabric.config import (
    DAEMON_KEYS,
    SCHEDULER_KEYS,
    ConfigError,
    describe,
    load_config,
    load_graph,
    parse_args_with_config,
    parse_config,
)
from mlfabric.config import run as config_run


def _dests(module: str) -> set[str]:
    parser = argparse.ArgumentParser()
    importlib.import_module(module).configure(parser)
    return {a.dest for a in parser._actions if a.dest not in ("help", "config")}


@pytest.mark.parametrize(
    ("module", "keys"),
    [("mlfabric.scheduler.service.cli", SCHEDULER_KEYS), ("mlfabric.daemon.cli", DAEMON_KEYS)],
)
def test_every_option_is_a_key_with_its_default(module: str, keys: tuple) -> None:
    parser = argparse.ArgumentParser()
    importlib.import_module(module).configure(parser)
    names = {k.name for k in keys}
    assert _dests(module) | {"log_level"} == names
    for key in keys:
        if key.name != "log_level":
            assert parser.get_default(key.name) == key.default, key.name
        assert key.doc


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("policy = 'best'", "key 'policy': bad value 'best' (expected one of fair, stf, stf+agg, stf+tree)"),
        ("metrics_port = '9100'", "key 'metrics_port': bad value '9100' (expected an integer)"),
        ("stf_horizon = -1", "key 'stf_horizon': bad value -1 (must be >= 0)"),
        ("nic_gbps = true", "key 'nic_gbps': bad value True (expected a number)"),
        ("metrics-port = 1", "unknown key 'metrics-port' in a scheduler config (options use '_', not '-')"),
        ("star = 2\ntopology = 't.toml'", "keys 'topology' and 'star' exclude each other"),
        ("listen = ", "not valid TOML"),
    ],
)
def test_errors_name_the_file_the_key_and_the_value(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "scheduler.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, "scheduler")
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read"):
        load_config(tmp_path / "nope.toml", "daemon")


def test_relative_paths_are_relative_to_the_file_and_topology_may_be_inline(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/daemon.toml").write_text('host = "h0"\nready_file = "r.json"\nsocket = "/run/x.sock"\n')
    values = load_config(tmp_path / "etc/daemon.toml", "daemon")
    assert values == {"host": "h0", "ready_file": str(tmp_path / "etc/r.json"), "socket": "/run/x.sock"}
    inline = parse_config(
        {"topology": {"hosts": ["a", "b"], "links": [{"a": "a", "b": "b", "gbps": 8}]}}, "scheduler"
    )
    assert load_graph(inline["topology"])["a"]["b"]["capacity"] == 1e9
    with pytest.raises(ConfigError, match=r"s\.toml: key 'topology'"):
        load_graph({"hosts": ["a"], "links": [{"a": "a", "b": "zz", "gbps": 1}]}, "s.toml")


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path: Path) -> None:
    from mlfabric.scheduler.service.cli import configure

    path = tmp_path / "scheduler.toml"
    path.write_text('policy = "stf"\nstf_horizon = 16\nlisten = "0.0.0.0:7000"\n')
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parse_args_with_config(parser, ["--config", str(path), "--stf-horizon", "8"], "scheduler")
    assert (args.policy, args.stf_horizon, args.listen, args.nic_gbps) == ("stf", 8, "0.0.0.0:7000", 10.0)


def test_the_daemon_needs_host_and_scheduler_from_somewhere(tmp_path: Path) -> None:
    from mlfabric.cli import main

    path = tmp_path / "daemon.toml"
    path.write_text('scheduler = "127.0.0.1:1"\n')
    assert main(["daemon", "--config", str(path)]) == 2
    path.write_text('scheduler = "127.0.0.1:1"\nsend_attempts = 0\n')
    assert main(["daemon", "--config", str(path), "--host", "h0"]) == 2


def test_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "scheduler.toml"
    good.write_text(
        'policy = "fair"\n[topology]\nhosts = ["a", "b"]\nlinks = [{a = "a", b = "b", gbps = 1}]\n'
    )
    assert config_run(argparse.Namespace(action="check", file=str(good), kind=None)) == 0
    assert "valid scheduler config" in capsys.readouterr().out
    bad = tmp_path / "daemon.toml"
    bad.write_text('host = "h0"\nround_timeout = "soon"\n')
    assert config_run(argparse.Namespace(action="check", file=str(bad), kind=None)) == 1
    assert "key 'round_timeout': bad value 'soon'" in capsys.readouterr().err
    broken_topology = tmp_path / "s2.toml"
    broken_topology.write_text('topology = "missing.toml"\n')
    assert config_run(argparse.Namespace(action="check", file=str(broken_topology), kind="scheduler")) == 1
    assert "no such topology file" in capsys.readouterr().err


def test_the_shipped_example_configs_are_valid() -> None:
    from importlib import resources

    from mlfabric.units import render

    for kind in ("scheduler", "daemon"):
        template = resources.files("mlfabric").joinpath("data", "config", f"{kind}.toml").read_text()
        for auth in (True, False):
            config = parse_config(tomllib.loads(render(template, auth=auth)), kind)
            assert config
            assert ("tls_ca" in config) == auth


def test_describe_lists_every_key() -> None:
    lines = describe("scheduler").splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == [k.name for k in SCHEDULER_KEYS]
    assert "policy (str, default: 'fair'; one of fair, stf, stf+agg, stf+tree)" in describe("scheduler")


def test_the_command_lines_log_level_wins_over_the_file(tmp_path: Path) -> None:
    from mlfabric.cli import parse_args

    path = tmp_path / "daemon.toml"
    path.write_text('log_level = "ERROR"\nhost = "h0"\n')
    assert parse_args(["daemon", "--config", str(path)]).log_level == "ERROR"
    args = parse_args(["--log-level", "INFO", "daemon", "--config", str(path)])
    assert (args.log_level, args.host) == ("INFO", "h0")
    assert parse_args(["--log-level=DEBUG", "daemon", "--config", str(path)]).log_level == "DEBUG"
