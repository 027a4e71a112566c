"""ruff and mypy stay clean (their configuration is in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)


def test_ruff_check() -> None:
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (the [dev] extra)")
    out = _run("ruff", "check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format() -> None:
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (the [dev] extra)")
    out = _run("ruff", "format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (the [dev] extra)")
    out = _run(sys.executable, "-m", "mypy")
    assert out.returncode == 0, out.stdout + out.stderr
