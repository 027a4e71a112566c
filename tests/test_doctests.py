"""Every Examples section in the package's docstrings runs and gives what it shows.

Modules are discovered with :func:`pkgutil.walk_packages`, so a new module is covered
without touching this file. The installed top-level packages live in separate folders
(``package-dir``), so each is walked from its own path.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

#: the installed packages whose folders are walked
ROOTS = ("mlfabric", "mlfabric.scheduler", "mlfabric.daemon", "mlfabric.aggregators")
#: not importable on purpose (entry points) or generated
SKIP_PREFIXES = ("mlfabric.__main__", "mlfabric.proto")


def _modules() -> list[str]:
    names: set[str] = set(ROOTS)
    for root in ROOTS:
        package = importlib.import_module(root)
        names |= {info.name for info in pkgutil.walk_packages(package.__path__, root + ".")}
    return sorted(n for n in names if not n.startswith(SKIP_PREFIXES))


def test_discovery_finds_every_subsystem() -> None:
    names = _modules()
    for sub in ("core", "policies", "plan", "sim", "service"):
        assert any(n.startswith(f"mlfabric.scheduler.{sub}.") for n in names), sub


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"
