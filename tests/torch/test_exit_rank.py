"""``exit_rank`` ends a rank's process with its code, its output flushed (no interpreter teardown)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

SCRIPT = """
import atexit, sys
import mlfabric.torch as mt
atexit.register(lambda: print("teardown ran"))
sys.stdout.write("results written")   # no newline: only a flush puts it out
sys.stderr.write("and logged")
mt.exit_rank(3)
print("after exit_rank")
"""


def test_exit_rank_flushes_and_ends_with_the_code_before_any_teardown() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert done.stdout == "results written"  # flushed; neither the atexit hook nor the rest ran
    assert done.stderr == "and logged"
