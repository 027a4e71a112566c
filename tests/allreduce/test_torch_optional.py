"""torch is optional: the core and the all-reduce API import without it; mlfabric.torch names the extra."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import mlfabric, mlfabric.api, mlfabric.allreduce
assert callable(mlfabric.join_allreduce)
try:
    import mlfabric.torch
except ImportError as exc:
    assert "mlfabric[torch]" in str(exc), exc
    print("ok")
"""


def test_core_imports_without_torch_and_the_hook_names_the_extra() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
