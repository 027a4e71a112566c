"""The Grafana dashboard parses and queries only metrics the scheduler and daemons export."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("scheduler/service/core.py", "scheduler/service/metrics.py", "daemon/metrics.py")


def test_every_queried_metric_is_exported() -> None:
    dashboard = json.loads((ROOT / "grafana/mlfabric-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs
    code = "".join((ROOT / s).read_text() for s in SOURCES)
    names = {n for e in exprs for n in re.findall(r"\bmlfabric_\w+", e)}
    for name in sorted(names):
        base = re.sub(r"_(total|bucket|count|sum)$", "", name)
        assert f'"{base}"' in code, f"the dashboard queries {name}, which nothing exports"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
