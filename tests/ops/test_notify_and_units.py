"""sd_notify datagrams, the journal's level prefix, the shipped units and install-units."""

from __future__ import annotations

import fnmatch
import logging
import shutil
import socket
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlfabric.cli import main
from mlfabric.systemd import JournalFormatter, Notifier, watchdog_interval
from mlfabric.units import UNITS, render_unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(tmp_path / "notify"))
    rx.settimeout(5)
    yield rx, str(tmp_path / "notify")
    rx.close()


def test_notify_sends_the_protocol_lines(notify_socket: tuple[socket.socket, str]) -> None:
    rx, path = notify_socket
    n = Notifier(environ={"NOTIFY_SOCKET": path})
    assert n.ready("serving on 127.0.0.1:7077")
    assert rx.recv(4096) == b"READY=1\nSTATUS=serving on 127.0.0.1:7077"
    n.reloading()
    assert rx.recv(4096) == b"RELOADING=1\nSTATUS=reloading"
    n.watchdog()
    assert rx.recv(4096) == b"WATCHDOG=1"
    n.stopping()
    assert rx.recv(4096) == b"STOPPING=1\nSTATUS=stopping"
    with pytest.raises(ValueError, match="one line"):
        n.status("two\nlines")


def test_abstract_notify_socket() -> None:
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"mlfabric-test-{id(rx)}"
    rx.bind("\0" + name)
    rx.settimeout(5)
    try:
        assert Notifier(environ={"NOTIFY_SOCKET": "@" + name}).notify(READY=1)
        assert rx.recv(64) == b"READY=1"
    finally:
        rx.close()


def test_without_systemd_nothing_is_sent() -> None:
    n = Notifier(environ={})
    assert not n.enabled
    assert not n.ready("x") and not n.watchdog()


def test_watchdog_interval_is_half_the_timeout_of_this_process() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}, pid=7) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, pid=7) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, pid=7) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None


@pytest.mark.parametrize(
    ("level", "prefix"),
    [(logging.ERROR, "<3>"), (logging.WARNING, "<4>"), (logging.INFO, "<6>"), (logging.DEBUG, "<7>")],
)
def test_journal_lines_carry_their_priority(level: int, prefix: str) -> None:
    record = logging.LogRecord("mlfabric", level, __file__, 1, "m", None, None)
    assert JournalFormatter("%(message)s").format(record) == f"{prefix}m"


@pytest.mark.parametrize("name", UNITS)
def test_units_are_notify_with_reload_restart_and_hardening(name: str) -> None:
    text = render_unit(name, "/opt/venv/bin/mlfabric", "/etc/mlfabric")
    lines = set(text.splitlines())
    kind = name.removeprefix("mlfabric-").removesuffix(".service")
    assert f"ExecStart=/opt/venv/bin/mlfabric {kind} --config /etc/mlfabric/{kind}.toml" in lines
    for line in (
        "Type=notify",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "DynamicUser=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
    ):
        assert line in lines, line
    assert any(line.startswith("WatchdogSec=") for line in lines)
    assert any(line.startswith("RuntimeDirectory=") for line in lines)
    assert any(line.startswith("StateDirectory=") for line in lines)
    assert "@" not in text.replace("@system-service", "")


def test_package_data_ships_the_units_and_configs() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "mlfabric"
    ]
    data = ROOT / "mlfabric" / "data"
    files = [str(p.relative_to(ROOT / "mlfabric")) for p in data.rglob("*") if p.is_file()]
    assert files
    for f in files:
        assert any(fnmatch.fnmatch(f, p) for p in patterns), f


def test_install_units_writes_units_and_never_overwrites_configs(tmp_path: Path) -> None:
    (tmp_path / "etc/mlfabric").mkdir(parents=True)
    (tmp_path / "etc/mlfabric/daemon.toml").write_text('host = "mine"\n')
    args = ["install-units", "--prefix", str(tmp_path), "--python", "/srv/py/bin/python3", "--configs"]
    assert main(args) == 0
    unit = (tmp_path / "etc/systemd/system/mlfabric-daemon.service").read_text()
    assert "ExecStart=/srv/py/bin/python3 -m mlfabric daemon --config /etc/mlfabric/daemon.toml" in unit
    assert (tmp_path / "etc/mlfabric/daemon.toml").read_text() == 'host = "mine"\n'
    assert "policy" in (tmp_path / "etc/mlfabric/scheduler.toml").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    assert main(["install-units", "--unit-dir", str(tmp_path)]) == 0
    out = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / u) for u in UNITS)], capture_output=True, text=True
    )
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


def test_the_example_configs_install_units_writes_pass_config_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27 item 5: scheduler.toml named a topology.toml that was not written."""
    assert (
        main(["install-units", "--prefix", str(tmp_path), "--python", "/srv/py/bin/python3", "--configs"])
        == 0
    )
    for name in ("scheduler.toml", "daemon.toml"):
        assert main(["config", "check", str(tmp_path / "etc/mlfabric" / name)]) == 0, capsys.readouterr().err


def test_config_check_reports_every_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "scheduler.toml"
    bad.write_text('policy = "best"\nmetrics-port = 9\nbatch_window_us = -1\ntopology = "missing.toml"\n')
    assert main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    for problem in ("'policy'", "'metrics-port'", "'batch_window_us'", "missing.toml"):
        assert problem in err, (problem, err)


def test_install_units_warns_when_the_units_would_run_a_program_under_tmp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install-units", "--unit-dir", str(tmp_path), "--exec", "/tmp/venv/bin/mlfabric"]) == 0
    assert "PrivateTmp=yes" in capsys.readouterr().err
    assert main(["install-units", "--unit-dir", str(tmp_path), "--exec", "/opt/venv/bin/mlfabric"]) == 0
    assert "PrivateTmp" not in capsys.readouterr().err


def test_install_units_authenticates_by_default_and_says_what_it_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27, secure by default: the deployment authenticates unless --no-auth."""
    from mlfabric.config import load_config

    args = ["install-units", "--prefix", str(tmp_path / "on"), "--python", "/srv/py/bin/python3", "--configs"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "authentication is on" in err and "mlfabric certs --out" in err and "ca.pem" in err
    etc = tmp_path / "on/etc"
    for kind in ("scheduler", "daemon"):
        unit = (etc / f"systemd/system/mlfabric-{kind}.service").read_text().splitlines()
        assert "LoadCredential=tls:/etc/mlfabric/tls" in unit
        config = load_config(etc / f"mlfabric/{kind}.toml", kind)
        assert config["tls_ca"] == f"/run/credentials/mlfabric-{kind}.service/tls_ca.pem"
        assert config["tls_cert"] and config["tls_key"]
    daemon = load_config(etc / "mlfabric/daemon.toml", "daemon")
    assert daemon["data_auth"] == "hmac" and daemon["data_secret"].endswith("tls_dataplane.secret")
    assert daemon["local_peer_check"] is True and daemon["local_group"] == "mlfabric"

    # the files of `mlfabric certs` in place: nothing is said missing; ca.key there is warned of
    tls = etc / "mlfabric/tls"
    tls.mkdir()
    for name in ("ca.pem", "ca.key", "h0.pem", "h0.key", "mlfabric-scheduler.pem", "mlfabric-scheduler.key"):
        (tls / name).write_text("x")
    (tls / "dataplane.secret").write_text("00" * 32)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "lacks" not in err and "ca.key" in err

    off = ["install-units", "--prefix", str(tmp_path / "off"), "--python", "/srv/py/bin/python3", "--configs"]
    assert main([*off, "--no-auth"]) == 0
    assert "authentication" not in capsys.readouterr().err
    for kind in ("scheduler", "daemon"):
        unit = (tmp_path / f"off/etc/systemd/system/mlfabric-{kind}.service").read_text().splitlines()
        assert not any(line.startswith("LoadCredential=") for line in unit)
        assert "tls_ca" not in load_config(tmp_path / f"off/etc/mlfabric/{kind}.toml", kind)
