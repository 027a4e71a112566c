"""Every subcommand of the ``mlfabric`` command has a working ``--help``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlfabric.cli import SUBCOMMANDS


def _mlfabric(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlfabric", *argv], capture_output=True, text=True, timeout=60
    )


def test_top_level_help_lists_every_subcommand() -> None:
    out = _mlfabric("--help")
    assert out.returncode == 0, out.stderr
    for name in SUBCOMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_help(name: str) -> None:
    out = _mlfabric(name, "--help")
    assert out.returncode == 0, out.stderr
    assert f"usage: mlfabric {name}" in out.stdout


def test_unknown_subcommand_fails_with_usage() -> None:
    out = _mlfabric("no-such-command")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr
