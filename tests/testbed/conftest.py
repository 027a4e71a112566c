"""Fixtures for the namespace testbed tests: skip without root/ip/tc, always tear down."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import networkx as nx
import pytest

from mlfabric.testbed.cluster import Testbed
from mlfabric.testbed.netns import (
    DEFAULT_STATE_DIR,
    SubprocessRunner,
    missing_prerequisites,
    new_prefix,
    sweep_stale,
)


@pytest.fixture(scope="session")
def testbed_state_dir() -> Path:
    """The marker directory (the default one); stale runs of earlier sessions are swept first."""
    missing = missing_prerequisites()
    if missing:
        pytest.skip("namespace testbed unavailable: " + "; ".join(missing))
    state_dir = DEFAULT_STATE_DIR
    sweep_stale(SubprocessRunner(), state_dir)
    return state_dir


@pytest.fixture
def make_testbed(testbed_state_dir: Path) -> Iterator[Callable[[nx.DiGraph], Testbed]]:
    """Build testbeds (up) with fresh prefixes; every one is torn down after the test."""
    built: list[Testbed] = []

    def make(graph: nx.DiGraph) -> Testbed:
        testbed = Testbed(graph, new_prefix(random.Random()), state_dir=testbed_state_dir)
        built.append(testbed)
        return testbed.up()

    yield make
    for testbed in built:
        testbed.down()
