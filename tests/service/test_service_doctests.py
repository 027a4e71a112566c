"""The Examples sections of the scheduler service modules run and hold."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["state", "dispatch", "batching", "service", "cli"]


@pytest.mark.parametrize("name", MODULES)
def test_examples(name: str) -> None:
    module = importlib.import_module(f"mlfabric.scheduler.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
