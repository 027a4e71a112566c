"""The contracts between processes are defined once, and each side imports the one definition.

- the client (``mlfabric/api.py``, ``mlfabric/server.py``, ``mlfabric/localclient.py``) imports
  no daemon module and the daemon imports no client module: what both need lives in
  ``mlfabric/wire/``, which imports neither;
- the daemon's control channel and the scheduler's service use the one keepalive setting;
- the ready file appears whole or not at all.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from mlfabric.daemon.channels import control
from mlfabric.readyfile import write_ready_file
from mlfabric.scheduler.service import core
from mlfabric.wire import keepalive

ROOT = Path(__file__).resolve().parent.parent
CLIENT = [ROOT / "mlfabric" / n for n in ("api.py", "server.py", "localclient.py")]
DAEMON = sorted((ROOT / "daemon").rglob("*.py"))
WIRE = sorted((ROOT / "mlfabric" / "wire").glob("*.py"))

#: (file, imported module) allowed for now, with the reason
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in files:
        rel = str(path.relative_to(ROOT))
        for module in sorted(_imports(path)):
            known = any(r == rel and (module + ".").startswith(m + ".") for r, m in KNOWN_EXCEPTIONS)
            if module.startswith(forbidden) and not known:
                bad.append(f"{rel} imports {module}")
    return bad


def test_client_imports_no_daemon_module() -> None:
    assert _violations(CLIENT, ("mlfabric.daemon",)) == []


def test_daemon_imports_no_client_module() -> None:
    assert _violations(DAEMON, ("mlfabric.api", "mlfabric.server", "mlfabric.localclient")) == []


def test_wire_imports_neither_side_nor_the_scheduler() -> None:
    sides = (
        "mlfabric.api",
        "mlfabric.server",
        "mlfabric.localclient",
        "mlfabric.daemon",
        "mlfabric.scheduler",
    )
    assert WIRE and _violations(WIRE, sides) == []


def test_known_exceptions_still_exist() -> None:
    for rel, module in KNOWN_EXCEPTIONS:
        assert module in _imports(ROOT / rel), f"{rel} no longer imports {module}: drop the exception"


def test_daemon_channel_uses_the_keepalive_the_service_expects(monkeypatch: Any) -> None:
    seen: list[Any] = []

    def insecure_channel(target: str, options: Any = None) -> Any:
        seen.append(options)
        raise RuntimeError("no channel in this test")

    monkeypatch.setattr(grpc, "insecure_channel", insecure_channel)
    stream = control.ControlStream(
        "127.0.0.1:1", hello=lambda: None, on_directive=print, on_connected=print, on_disconnected=print
    )
    with pytest.raises(RuntimeError, match="no channel"):
        stream._channel_factory("127.0.0.1:1")
    assert seen == [keepalive.CHANNEL_OPTIONS]
    assert core.CLIENT_CHANNEL_OPTIONS is keepalive.CHANNEL_OPTIONS
    server = dict(core.SERVER_OPTIONS)
    ping = dict(keepalive.CHANNEL_OPTIONS)["grpc.keepalive_time_ms"]
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] <= ping


def test_ready_file_is_written_whole(tmp_path: Path) -> None:
    path = tmp_path / "ready.json"
    write_ready_file(path, {"pid": os.getpid(), "address": "127.0.0.1:7077"})
    assert json.loads(path.read_text()) == {"pid": os.getpid(), "address": "127.0.0.1:7077"}
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]


def test_error_mid_write_leaves_no_temp_file_and_the_old_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "ready.json"
    write_ready_file(path, {"pid": 1})
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_ready_file(path, {"pid": 2, "bad": object()})  # fails after part of the JSON is written
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]
    assert json.loads(path.read_text()) == {"pid": 1}
