"""The units under a real systemd (``/work/shared/tools/systemd-sandbox``): a scheduler and
two daemons as ``Type=notify`` services with their hardening and dynamic user, a push
through them, ``systemctl reload`` with a changed topology, ``systemctl kill -s KILL`` of a
daemon brought back by ``Restart=``, and ``systemctl stop`` exiting cleanly.

The units and configs are those ``mlfabric install-units --configs`` writes, authentication
on as shipped, with the files of ``mlfabric certs`` (issue 27, secure by default): the test
changes only addresses, ports and paths (two daemons on one machine: a unit per host), and
checks that the cluster authenticates — ``mlfabric status`` needs the admin certificate (no
certificate, or a host's, is refused) and the data plane refuses a peer without the secret.

The sandbox shares the host's file system apart from ``/run``, ``/tmp``, ``/var/tmp`` and
``/etc/systemd/system`` (a copy of the unit directory), so the units run this Python's
``mlfabric`` and their config files live in the unit directory (``mlfabric/`` under it).
The network namespace is the host's: the test scrapes ``/metrics`` from here.

Ports: the daemons' data plane and every metrics endpoint bind port 0 and are read from
the ready files (in the services' ``RuntimeDirectory``, read through the sandbox); the
scheduler's gRPC port goes into the daemons' config, so it is picked free right before the
start (another process could take it in between: the start would then fail and say so).

The user: the units say ``User=mlfabric`` with ``DynamicUser=yes`` — systemd allocates the
user for the service's lifetime (or uses a static ``mlfabric`` user when one exists), so
nothing is added to the host's ``/etc/passwd``, which the sandbox shares. When this
Python lives under a home directory closed to others (``/root``), a drop-in mounts empty
homes with only the interpreter's tree bound in, read-only (:func:`_home_dropin`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlfabric.daemon.channels.frames import FrameHeader, FrameLimits
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.proto.v1 import dataplane_pb2

pytestmark = [pytest.mark.slow, pytest.mark.root]

SANDBOX = Path(os.environ.get("MLFABRIC_SYSTEMD_SANDBOX", "/work/shared/tools/systemd-sandbox"))
SYSTEMD = Path("/usr/lib/systemd/systemd")
HERE = Path(__file__).resolve().parent
CONF = "/etc/systemd/system/mlfabric"  # the config directory as the services see it
UNITS = ("mlfabric-scheduler", "mlfabric-daemon-h0", "mlfabric-daemon-h1")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the sandbox unshares namespaces)"
    if not SYSTEMD.exists():
        return f"no {SYSTEMD}"
    if not SANDBOX.exists():
        return f"no sandbox script {SANDBOX}"
    import mlfabric

    private = (Path("/tmp"), Path("/var/tmp"), Path("/run"))
    for tree in (Path(sys.prefix).resolve(), Path(mlfabric.__file__).resolve().parents[1]):
        if any(tree.is_relative_to(p) for p in private):
            return (
                f"{tree} is under /tmp, /var/tmp or /run, which the sandbox replaces: its units cannot run it"
            )
    return None


if (_reason := _skip_reason()) is not None:
    pytestmark.append(pytest.mark.skip(reason=_reason))


def _topology(gbps: float) -> str:
    links = ", ".join(f'{{a = "{h}", b = "sw", gbps = {gbps}}}' for h in ("h0", "h1"))
    return f'hosts = ["h0", "h1"]\nswitches = ["sw"]\nlinks = [{links}]\n'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _home_dropin() -> str:
    """Lines letting the dynamic user run this Python when it lives under a home directory.

    ``ProtectHome=read-only`` (implied by ``DynamicUser=``) leaves ``/root`` closed to the
    service's user; ``ProtectHome=tmpfs`` mounts empty homes instead, into which the
    interpreter's (and the package's) trees are bound read-only.
    """
    import mlfabric

    homes = (Path("/root"), Path("/home"))
    trees = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(mlfabric.__file__).parents[1]}
    binds = sorted(str(t) for t in trees if any(t.is_relative_to(h) for h in homes))
    return f"ProtectHome=tmpfs\nBindReadOnlyPaths={' '.join(binds)}\n" if binds else ""


class Sandbox:
    """``systemd-sandbox`` with its own state directory (so tests never meet another's)."""

    def __init__(self, state: Path) -> None:
        self.env = {**os.environ, "SANDBOX_STATE": str(state)}

    def __call__(self, *args: str, check: bool = True, input: str | None = None) -> str:
        out = subprocess.run(
            [str(SANDBOX), *args], env=self.env, capture_output=True, text=True, timeout=120, input=input
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"systemd-sandbox {' '.join(args)}: {out.returncode}\n{out.stdout}{out.stderr}"
            )
        return out.stdout

    def systemctl(self, *args: str, check: bool = True) -> str:
        return self("run", "systemctl", *args, check=check)

    def show(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "-P", prop, unit).strip()

    def read_json(self, path: str) -> dict[str, Any]:
        return dict(json.loads(self("run", "cat", path)))

    def journal(self, unit: str) -> str:
        return self("run", "journalctl", "-D", "/run/log/journal", "--no-pager", "-u", unit, check=False)


@pytest.fixture
def sandbox() -> Iterator[tuple[Sandbox, Path]]:
    # not under /tmp or /var/tmp: the sandbox mounts fresh ones before it copies the units
    root = Path(tempfile.mkdtemp(prefix="mlfabric-units-", dir=Path.home()))
    sb = Sandbox(root / "state")
    try:
        yield sb, root / "prefix"
    finally:
        try:
            for unit in UNITS:  # leave a journal behind for a failing test
                print(sb.journal(unit)[-3000:])
        finally:
            sb("stop", check=False)
            shutil.rmtree(root)


def _mlfabric(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "mlfabric", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out


def _set(path: Path, **values: str) -> None:
    """Set TOML keys of ``path`` (replacing the line of each key that is there, else appending)."""
    lines = path.read_text().splitlines()
    for key, value in values.items():
        line = f"{key} = {value}"
        at = [i for i, text in enumerate(lines) if text.startswith(f"{key} =")]
        if at:
            lines[at[0]] = line
        else:
            lines.append(line)
    path.write_text("\n".join(lines) + "\n")


def _install(prefix: Path, scheduler_port: int) -> Path:
    """``mlfabric certs`` and ``mlfabric install-units --configs`` under ``prefix``; the unit directory.

    The sandbox's ``/etc/systemd/system`` is the copy of ``<prefix>/etc/systemd/system``, so
    the config directory is ``CONF`` under it. Changed from what install-units wrote: the
    addresses and ports (loopback, port 0), the topology, and one daemon unit per host.
    """
    units = prefix / "etc/systemd/system"
    conf = units / "mlfabric"
    _mlfabric(
        "certs", "--out", str(conf / "tls"), "--hosts", "h0,h1", "--scheduler", "mlfabric-scheduler,127.0.0.1"
    )
    (conf / "tls/ca.key").unlink()  # kept off the hosts (docs/security.md)
    installed = _mlfabric(
        "install-units",
        "--prefix",
        str(prefix),
        "--config-dir",
        CONF,
        "--configs",
        "--exec",
        f"{sys.executable} -m mlfabric",
    )
    assert "lacks" not in installed.stderr and "ca.key" not in installed.stderr, installed.stderr
    (conf / "topology.toml").write_text(_topology(1))
    _set(
        conf / "scheduler.toml",
        listen=f'"127.0.0.1:{scheduler_port}"',
        metrics_port="0",
        ready_file='"/run/mlfabric-scheduler/ready.json"',
    )
    dropin = "[Service]\n" + _home_dropin()
    (units / "mlfabric-scheduler.service.d").mkdir()
    (units / "mlfabric-scheduler.service.d/test.conf").write_text(dropin)
    daemon_unit = (units / "mlfabric-daemon.service").read_text()
    daemon_conf = (conf / "daemon.toml").read_text()
    for host in ("h0", "h1"):
        name = f"mlfabric-daemon-{host}.service"
        (units / name).write_text(daemon_unit.replace(f"{CONF}/daemon.toml", f"{CONF}/{host}/daemon.toml"))
        (conf / host).mkdir()
        config = conf / host / "daemon.toml"
        # the credentials are under the unit's name; h0's certificate -> this host's
        config.write_text(daemon_conf.replace("mlfabric-daemon.service", name).replace("h0", host))
        _set(
            config,
            scheduler=f'"127.0.0.1:{scheduler_port}"',
            data_listen='"127.0.0.1:0"',
            metrics_port="0",
            socket=f'"/run/mlfabric-{host}/daemon.sock"',
            ready_file=f'"/run/mlfabric-{host}/ready.json"',
        )
        (units / f"{name}.d").mkdir()
        # two daemons on one machine: each its own runtime directory (one per host in production)
        (units / f"{name}.d/test.conf").write_text(
            f"{dropin}RuntimeDirectory=\nRuntimeDirectory=mlfabric-{host}\n"
            f"Environment=MLFABRIC_DAEMON=/run/mlfabric-{host}/daemon.sock\n"
        )
    (units / "mlfabric-daemon.service").unlink()
    return units


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _wait(what: str, predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _push(sb: Sandbox, n: int) -> dict[str, Any]:
    out = sb(
        "run",
        sys.executable,
        str(HERE / "pushes.py"),
        "/run/mlfabric-h0/daemon.sock",
        "/run/mlfabric-h1/daemon.sock",
        str(n),
    )
    return dict(json.loads(out.splitlines()[-1]))


def test_units_under_systemd(sandbox: tuple[Sandbox, Path]) -> None:
    sb, prefix = sandbox
    port = _free_port()
    units = _install(prefix, port)
    tls = units / "mlfabric/tls"
    sb("start", str(units))
    # a booted systemd finds / shared (its mount_setup makes it so); the sandbox's unshare made
    # its mounts private, copies of the host's, so this shares them inside the sandbox only.
    # LoadCredential= moves the services' credential mounts into place through it.
    sb("run", "mount", "--make-rshared", "/")
    # the sandbox's /var/log is the host's: keep its journal in the sandbox's /run
    sb(
        "run",
        "sh",
        "-c",
        "mkdir -p /run/systemd/journald.conf.d && cat > /run/systemd/journald.conf.d/sb.conf",
        input="[Journal]\nStorage=volatile\n",
    )
    if sb.systemctl("is-active", "systemd-journald", check=False).strip() == "active":
        sb.systemctl("restart", "systemd-journald")

    # Type=notify: a daemon whose scheduler is not up yet runs but is not active (no READY=1)
    sb.systemctl("start", "--no-block", "mlfabric-daemon-h0")
    _wait("the daemon's process", lambda: sb.show("mlfabric-daemon-h0", "MainPID") != "0")
    time.sleep(1.0)
    assert sb.systemctl("is-active", "mlfabric-daemon-h0", check=False).strip() == "activating"
    assert sb("run", "sh", "-c", "test -e /run/mlfabric-h0/ready.json && echo yes || echo no").strip() == "no"
    # `start` returns once READY=1 came, the unit is active only then
    sb.systemctl("start", "mlfabric-scheduler")
    assert sb.systemctl("is-active", "mlfabric-scheduler").strip() == "active"
    sched = sb.read_json("/run/mlfabric-scheduler/ready.json")
    assert sched["address"] == f"127.0.0.1:{port}"
    assert "policy stf; 2 hosts" in sb.show("mlfabric-scheduler", "StatusText")
    sb.systemctl("start", "mlfabric-daemon-h0", "mlfabric-daemon-h1")
    for unit in UNITS:
        assert sb.systemctl("is-active", unit).strip() == "active"
    # the hardening holds: a dynamic user, not root
    pid = sb.show("mlfabric-daemon-h0", "MainPID")
    uid = sb("run", "stat", "-c", "%u", f"/proc/{pid}").strip()
    assert uid != "0"
    metrics = sched["metrics_port"]
    assert _scrape(metrics)[("mlfabric_daemons_connected", frozenset())] == 2

    # a push through the two daemons
    assert _push(sb, 10) == {"applied": 10, "dropped": 0, "reasons": []}
    h1 = sb.read_json("/run/mlfabric-h1/ready.json")
    sent = _scrape(h1["metrics_port"])[
        ("mlfabric_daemon_sent_bytes_total", frozenset({("host", "h1"), ("dst", "h0")}))
    ]
    assert sent >= 10 * 64 * 1024 * 4

    # the admin service and health beside the scheduler: mTLS, the admin's certificate only
    def status(*tls_of: str) -> subprocess.CompletedProcess[str]:
        files = [
            f"--tls-{kind}={tls / name}" for kind, name in zip(("ca", "cert", "key"), tls_of, strict=False)
        ]
        return subprocess.run(
            [sys.executable, "-m", "mlfabric", "status", "--scheduler", sched["address"], "--json", *files],
            capture_output=True,
            text=True,
            timeout=60,
        )

    admin = status("ca.pem", "admin.pem", "admin.key")
    assert admin.returncode == 0, admin.stderr
    st = json.loads(admin.stdout)
    assert st["health"] == "SERVING" and [d["host"] for d in st["daemons"]] == ["h0", "h1"]
    assert status().returncode == 1
    host = status("ca.pem", "h0.pem", "h0.key")
    assert host.returncode == 1 and "PERMISSION_DENIED" in host.stderr, host.stderr
    # the data plane: a peer without the cluster's secret is refused
    h0 = sb.read_json("/run/mlfabric-h0/ready.json")
    pool = PeerPool(FrameLimits(), connect_timeout=5, io_timeout=10)
    try:
        probe = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id="x/1", src_host="h1", job="ops")
        reply = pool.request(h0["data_address"], probe, b"")
    finally:
        pool.close()
    assert reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
    assert "authentication required" in reply.header.reason

    # reload with a changed topology: the graph changes, no session drops
    sb("run", "sh", "-c", f"cat > {CONF}/topology.toml", input=_topology(4))
    sb.systemctl("reload", "mlfabric-scheduler")
    up = ("mlfabric_link_capacity_bytes_per_second", frozenset({("src", "h1"), ("dst", "sw")}))
    _wait("the reloaded capacity", lambda: _scrape(metrics).get(up) == 4e9 / 8)
    assert _scrape(metrics)[("mlfabric_daemons_connected", frozenset())] == 2
    assert sb.show("mlfabric-scheduler", "NRestarts") == "0"
    assert sb.show("mlfabric-scheduler", "MainPID") == str(sched["pid"])
    # the journal has the levels: the reload is a warning, a daemon's arrival only info
    journal = ["journalctl", "-D", "/run/log/journal", "--no-pager", "-o", "cat", "-u", "mlfabric-scheduler"]
    _wait("the journal", lambda: "reloaded the topology" in sb("run", *journal, "-p", "warning"))
    assert "daemon of host h0 connected" not in sb("run", *journal, "-p", "warning")
    assert "daemon of host h0 connected" in sb("run", *journal, "-p", "info")

    # SIGKILL a daemon: Restart=on-failure brings it back, it registers again
    old = sb.show("mlfabric-daemon-h1", "MainPID")
    sb.systemctl("kill", "-s", "KILL", "mlfabric-daemon-h1")
    _wait(
        "the restarted daemon",
        lambda: (
            sb.show("mlfabric-daemon-h1", "NRestarts") == "1"
            and sb.systemctl("is-active", "mlfabric-daemon-h1", check=False).strip() == "active"
        ),
    )
    assert sb.show("mlfabric-daemon-h1", "MainPID") != old
    _wait(
        "the re-registered daemon", lambda: _scrape(metrics)[("mlfabric_daemons_connected", frozenset())] == 2
    )
    assert _push(sb, 5)["applied"] == 5

    # stop: SIGTERM, a clean exit 0 within TimeoutStopSec (else systemd says Result=timeout)
    for unit in ("mlfabric-daemon-h0", "mlfabric-daemon-h1", "mlfabric-scheduler"):
        sb.systemctl("stop", unit)
        assert sb.show(unit, "Result") == "success", sb.journal(unit)
        assert sb.show(unit, "ExecMainStatus") == "0"
        assert sb.systemctl("is-active", unit, check=False).strip() == "inactive"
