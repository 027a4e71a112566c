"""Every Examples section in the package's docstrings runs and gives what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import mlfabric

SKIP = {"mlfabric.__main__"}


SUBPACKAGES = ("mlfabric.scheduler", "mlfabric.scheduler.sim", "mlfabric.daemon", "mlfabric.aggregators")


def _modules() -> list[str]:
    # the subpackages live in other folders (package-dir), so walk each one's own path
    names = {info.name for info in pkgutil.iter_modules(mlfabric.__path__, "mlfabric.")}
    for package in SUBPACKAGES:
        names |= {
            info.name
            for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + ".")
        }
    names |= {"mlfabric.examples.digits", *SUBPACKAGES}
    names |= {
        info.name
        for info in pkgutil.iter_modules(
            importlib.import_module("mlfabric.testbed").__path__, "mlfabric.testbed."
        )
    }
    return sorted(n for n in names if n not in SKIP and not n.startswith("mlfabric.proto"))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"
