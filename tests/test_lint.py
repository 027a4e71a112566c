"""ruff and mypy stay clean (their configuration is in pyproject.toml), and mypy sees across packages.

Both tools come with the ``[dev]`` extra, which the README's test command installs: a missing
one fails here rather than skipping, so CI cannot pass without linting. mypy finds
``mlfabric.daemon``, ``mlfabric.scheduler``, ``mlfabric.aggregators`` and ``mlfabric.proto``
through the links ``mlfabric/daemon -> ../daemon`` (and so on; see DEVELOPERS.md, Layout).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: one import from each package behind a link, and a use of it; {} is the annotation
CROSS_PACKAGE = (
    ("from mlfabric.daemon.config import DaemonConfig", "config: {} = DaemonConfig", "type[DaemonConfig]"),
    (
        "from mlfabric.scheduler.core.graph import path_links",
        'links: {} = path_links(["a", "b"])',
        "list[tuple[str, str]]",
    ),
    ("from mlfabric.aggregators.kernels import Run, plan_runs", "runs: {} = plan_runs([])", "list[Run]"),
    ("from mlfabric.proto.v1.control_pb2 import Hello", "hello: {} = Hello()", "Hello"),
)


def _tool(name: str) -> list[str]:
    """``python -m name`` of the running interpreter; fails (not skips) when it is not installed."""
    if importlib.util.find_spec(name) is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]' (the README's test set-up)")
    return [sys.executable, "-m", name]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)


def test_ruff_check() -> None:
    out = _run(*_tool("ruff"), "check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format() -> None:
    out = _run(*_tool("ruff"), "format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy() -> None:
    out = _run(*_tool("mypy"))
    assert out.returncode == 0, out.stdout + out.stderr


def _check_file(path: Path, annotate: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    """mypy, with the project's configuration, on a file using each of :data:`CROSS_PACKAGE`."""
    imports = [i for i, _, _ in CROSS_PACKAGE]
    uses = [use.format(a) for (_, use, _), a in zip(CROSS_PACKAGE, annotate, strict=True)]
    path.write_text("\n".join([*imports, "", *uses, ""]))
    # silent: only the file's own errors (the packages are checked by test_mypy)
    return _run(
        *_tool("mypy"),
        "--config-file",
        "pyproject.toml",
        "--follow-imports=silent",
        "--cache-dir",
        str(cache),
        str(path),
    )


@pytest.mark.slow
def test_mypy_sees_types_across_packages(tmp_path: Path) -> None:
    """A wrong type from each linked package is an error; the right ones pass (they were all Any)."""
    bad = _check_file(tmp_path / "bad.py", ["int"] * len(CROSS_PACKAGE), tmp_path / "cache")
    report = bad.stdout + bad.stderr
    assert bad.returncode == 1, report
    first = len(CROSS_PACKAGE) + 2  # the line of the first use
    for line, (_, _, actual) in enumerate(CROSS_PACKAGE, start=first):
        expected = f'bad.py:{line}: error: Incompatible types in assignment (expression has type "{actual}"'
        assert expected in report, report
    good = _check_file(tmp_path / "good.py", [a for _, _, a in CROSS_PACKAGE], tmp_path / "cache")
    assert good.returncode == 0, good.stdout + good.stderr
