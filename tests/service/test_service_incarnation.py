"""Every scheduler run draws its own incarnation, the scope of its aggregate ids (DESIGN §3).

A restarted scheduler numbers its aggregates from 0 again; the incarnation keeps those ids
apart from the previous run's, which the server daemons still remember by id.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from mlfabric.scheduler.service import cli


def test_each_run_scopes_its_aggregate_ids_with_a_fresh_incarnation(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Any] = []
    real = cli.build_policy

    def spy(*args: Any, **kwargs: Any) -> Any:
        setup = real(*args, **kwargs)
        built.append(setup.policy)
        return setup

    monkeypatch.setattr(cli, "build_policy", spy)
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--policy", "stf+agg", "--listen", "no-port"])
    assert cli.run(args) == 2 and cli.run(args) == 2  # stops at the bad --listen, after the policy
    scopes = [p.scope for p in built]
    assert len(scopes) == 2 and all(scopes) and scopes[0] != scopes[1]
