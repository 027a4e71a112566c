"""What holds a job back, from a state driven by hand (no processes)."""

from __future__ import annotations

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.service.admin import cluster_status
from mlfabric.scheduler.service.observe import Activity
from mlfabric.scheduler.service.records import JobParams
from mlfabric.scheduler.service.state import SchedulerState


def _state(workers: dict[str, str]) -> tuple[SchedulerState, Activity]:
    s = SchedulerState(star(4, 8e9))
    act = s.recorder.activity
    for h in ("h0", "h1", "h2", "h3"):
        s.connect(h, "127.0.0.1:1")
    s.register_server("h0", "j", "ps", (), JobParams(tau_max=4), version=0)
    for name, host in workers.items():
        s.register_worker(host, "j", name)
    return s, act


def test_a_degraded_link_on_the_jobs_paths_is_named() -> None:
    s, act = _state({"w1": "h1", "w2": "h2"})
    est = nx.DiGraph(s.graph)
    est["h2"]["sw"]["capacity"] = 0.2e9  # estimated at a fifth of the configured 1e9 B/s
    est["h3"]["sw"]["capacity"] = 0.01e9  # worse, but no worker of the job is on h3
    st = cluster_status(s, est, act, now=10.0)
    assert [(b.kind, b.name) for b in st.holding_back] == [("link", "h2->sw")]
    assert st.holding_back[0].reason == "degraded: estimated 1.6 Gbit/s of a configured 8"


def test_even_workers_and_idle_links_hold_nothing_back() -> None:
    s, act = _state({"w1": "h1", "w2": "h2"})
    for i in range(4):
        for w, h in (("w1", "h1"), ("w2", "h2")):
            s.add_update(h, f"{h}/{i}", "j", "ps", w, 1, 1.0, 0, now=float(i))
    st = cluster_status(s, s.graph, act, now=4.0)
    assert list(st.holding_back) == []
    assert [w.mean_interval_seconds for w in st.jobs[0].workers] == [1.0, 1.0]
    assert st.jobs[0].servers[0].pending == 8 and st.pending == 8


def test_a_silent_worker_is_named_and_old_pushes_leave_the_window() -> None:
    s, act = _state({"w1": "h1", "w2": "h2"})
    s.add_update("h2", "h2/0", "j", "ps", "w2", 1, 1.0, 0, now=0.0)
    for i in range(3):
        s.add_update("h1", f"h1/{i}", "j", "ps", "w1", 1, 1.0, 0, now=100.0 + i)
    st = cluster_status(s, s.graph, act, now=102.0, window=30.0)
    (b,) = st.holding_back
    assert (b.kind, b.name, b.reason) == ("worker", "w2", "no push in the last 30 s while others push")


def test_early_in_a_run_rates_are_over_the_seconds_there_were() -> None:
    """Issue 27 item 8: 3 s into a run, rates were averaged over the full 30 s window (9.7 pushes/s
    for 80, a saturated bottleneck at 10 % and "holding back: nothing")."""
    s, act = _state({"w1": "h1", "w2": "h2"})
    for i in range(240):  # 80 pushes/s each for 3 s
        for w, h in (("w1", "h1"), ("w2", "h2")):
            s.add_update(h, f"{h}/{i}", "j", "ps", w, 1, 1.0, 0, now=i / 80)
    ingress = s.graph["sw"]["h0"]["capacity"]
    act.transfer(("h1", "sw", "h0"), int(ingress * 3), now=3.0)  # 3 s of the server's ingress
    st = cluster_status(s, s.graph, act, now=3.0, window=30.0)
    assert st.window_seconds == pytest.approx(3.0)
    assert [round(w.pushes_per_second) for w in st.jobs[0].workers] == [80, 80]
    (held,) = st.holding_back
    assert (held.kind, held.name) == ("link", "sw->h0") and "100%" in held.reason
