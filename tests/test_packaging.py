"""The distribution installs exactly the ``mlfabric`` package tree."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_holds_exactly_the_mlfabric_tree(tmp_path: Path) -> None:
    pytest.importorskip("build", reason="the 'build' package (the [dev] extra) builds the wheel")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("mlfabric-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"mlfabric"}, f"unexpected top-level entries: {sorted(top - dist_info)}"
    for module in (
        "mlfabric/__init__.py",
        "mlfabric/cli.py",
        "mlfabric/scheduler/__init__.py",
        "mlfabric/scheduler/core/graph.py",
        "mlfabric/scheduler/service/aggregates/book.py",
        "mlfabric/daemon/__init__.py",
        "mlfabric/aggregators/__init__.py",
        "mlfabric/aggregators/codecs/int8.py",
        "mlfabric/proto/v1/control_pb2.py",
        "mlfabric/proto/mlfabric/v1/control.proto",
    ):
        assert module in names, f"{module} missing from the wheel"
    assert not any(n.startswith(("scheduler/", "daemon/", "tests/", "experiments/")) for n in names)


def test_core_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import mlfabric, mlfabric.api, mlfabric.scheduler.policies.base, mlfabric.scheduler.core.graph\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
