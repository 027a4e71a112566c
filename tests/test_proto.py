"""The committed protobuf/gRPC stubs are exactly what the generator makes, and all import."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "proto" / "v1"


def test_committed_stubs_match_regenerated(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the [dev] extra) regenerates the stubs")
    out = tmp_path / "v1"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(out)], check=True)
    generated = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    committed = {
        p.name: p.read_text() for p in STUBS.iterdir() if p.is_file() and p.suffix in {".py", ".pyi"}
    }
    assert sorted(generated) == sorted(committed), "stub file sets differ: run python scripts/gen_protos.py"
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run python scripts/gen_protos.py and commit the result"


def test_every_generated_module_imports() -> None:
    import mlfabric.proto.v1 as v1

    names = [m.name for m in pkgutil.iter_modules(v1.__path__)]
    assert {"control_pb2", "control_pb2_grpc", "dataplane_pb2", "local_pb2"} <= set(names)
    for name in names:
        module = importlib.import_module(f"mlfabric.proto.v1.{name}")
        if name.endswith("_pb2"):
            assert module.DESCRIPTOR.package == "mlfabric.v1"


def test_scheduler_service_is_declared() -> None:
    from mlfabric.proto.v1 import control_pb2, control_pb2_grpc

    service = control_pb2.DESCRIPTOR.services_by_name["Scheduler"]
    assert "Session" in service.methods_by_name
    assert hasattr(control_pb2_grpc, "SchedulerServicer")
