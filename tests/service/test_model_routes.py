"""Model relays chosen by the scheduler: the pure choice and the directives (docs/model-relays.md)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.graph import star, two_tier
from mlfabric.scheduler.policies.broadcast import check_broadcast, plan_broadcast
from mlfabric.scheduler.policies.broadcast_model import MIN_CHUNK_BYTES
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.fair import FairPolicy
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.core import DaemonSession, SchedulerCore, StaticEstimator
from mlfabric.scheduler.service.model_routes import (
    MAX_PLANNED_HOSTS,
    ModelRouteBook,
    model_bytes,
    model_routes,
    model_upstreams,
)
from mlfabric.scheduler.service.records import JobParams, TensorSpec
from mlfabric.scheduler.service.state import SchedulerState


def test_two_tier_one_relay_per_remote_rack() -> None:
    g = two_tier(3, 4, 1e9, oversubscription=4.0)
    workers = [f"h{i}" for i in range(1, 12)]
    ups = model_upstreams(g, "h0", workers)
    assert set(ups) == set(workers)
    # rack 0 (the server's): direct; racks 1 and 2: one relay each, fetching from the server
    assert all(ups[h] == "h0" for h in ("h1", "h2", "h3"))
    assert ups["h4"] == "h0" and all(ups[h] == "h4" for h in ("h5", "h6", "h7"))
    # equal NICs: the first name in string order
    assert ups["h10"] == "h0" and all(ups[h] == "h10" for h in ("h8", "h9", "h11"))


def test_relay_is_the_fastest_nic_of_its_rack() -> None:
    nics = {f"h{i}": 1e9 for i in range(8)} | {"h6": 10e9}
    g = two_tier(2, 4, nics, oversubscription=2.0)
    ups = model_upstreams(g, "h1", ["h4", "h5", "h6", "h7"])
    assert ups == {"h6": "h1", "h4": "h6", "h5": "h6", "h7": "h6"}


def test_the_book_follows_a_new_topology() -> None:
    """The book keeps each server's shortest paths between refreshes (one BFS per server, not
    per registration); a reloaded topology is planned on afresh: four racks of two instead of
    two of four, so h6 leaves h4's rack and h7 fetches through h6."""
    state = SchedulerState(two_tier(2, 4, 1e9, oversubscription=2.0))
    for i in range(8):
        state.connect(f"h{i}", f"127.0.0.1:{9000 + i}")
    state.register_server("h1", "j", "ps", (), JobParams(), 0)
    for h in ("h4", "h5", "h6", "h7"):
        state.register_worker(h, "j", f"w{h}")
    book = ModelRouteBook(state)
    routes = {h: d.model_route.upstream_host for h, d in book.refresh().directives}
    assert routes == {"h5": "h4", "h6": "h4", "h7": "h4"}
    state.replace_graph(two_tier(4, 2, 1e9, oversubscription=2.0))
    routes = {h: d.model_route.upstream_host for h, d in book.refresh().directives}
    assert routes == {"h6": "h1", "h7": "h6"}  # h5 keeps h4: not sent again


def _racks_with_outside_server(racks: int, per_rack: int, nic_bps: float, over: float) -> Any:
    g = two_tier(racks, per_rack, nic_bps, oversubscription=over)
    g.add_node("ps", kind="host")
    g.add_edge("ps", "core", capacity=nic_bps / 8)  # the graph's capacities are bytes/s
    g.add_edge("core", "ps", capacity=nic_bps / 8)
    return g


@pytest.mark.parametrize(("racks", "per_rack", "over"), [(2, 4, 4.0), (3, 5, 2.0), (4, 3, 8.0)])
def test_with_the_model_size_known_the_routes_are_the_broadcast_tree_in_pieces(
    racks: int, per_rack: int, over: float
) -> None:
    g = _racks_with_outside_server(racks, per_rack, 100e6, over)
    hosts = [f"h{i}" for i in range(racks * per_rack)]
    nbytes = 4_500_000
    routes = model_routes(g, "ps", hosts, nbytes)
    assert set(routes.upstreams) == set(hosts)
    assert MIN_CHUNK_BYTES <= routes.chunk_bytes < nbytes
    chunks = -(-nbytes // routes.chunk_bytes)
    # a tree (every host reached from the server, no cycle) that the broadcast checker accepts
    plan = plan_broadcast(g, "ps", sorted(hosts), float(nbytes), chunks=chunks)  # the rule's order: by name
    assert routes.upstreams == plan.parents()
    check_broadcast(g, plan, "ps", hosts)
    # fewer copies leave the server than the one-level rule's (one per rack at most)
    assert sum(u == "ps" for u in routes.upstreams.values()) <= racks
    # the size unknown: the one-level rule, whole
    assert model_routes(g, "ps", hosts, 0) == type(routes)(model_upstreams(g, "ps", hosts))


def test_the_book_sends_pieces_to_every_host_once_the_model_size_is_known() -> None:
    state = SchedulerState(_racks_with_outside_server(2, 4, 100e6, 4.0))
    for i, h in enumerate(["ps", *[f"h{i}" for i in range(8)]]):
        state.connect(h, f"127.0.0.1:{9000 + i}")
    spec = (TensorSpec("w", "float32", (1024, 1024)),)
    assert model_bytes(spec) == 4 << 20
    state.register_server("ps", "j", "ps0", spec, JobParams(), 0)
    for i in range(8):
        state.register_worker(f"h{i}", "j", f"w{i}")
    got = {h: d.model_route for h, d in ModelRouteBook(state).refresh().directives}
    # the first host of each chain fetches from the server, in pieces too (its children pipeline)
    assert set(got) == {f"h{i}" for i in range(8)}
    (chunk,) = {r.chunk_bytes for r in got.values()}
    assert MIN_CHUNK_BYTES <= chunk < 4 << 20
    assert sum(r.upstream_host == "ps" for r in got.values()) <= 2  # at most one copy per rack


def test_a_bfloat16_model_is_sized_by_the_wire_dtypes() -> None:
    # numpy has no bfloat16: the size comes from the wire's table (not numpy's), as the frames'
    assert (
        model_bytes([TensorSpec("w", "bfloat16", (1024, 1024)), TensorSpec("b", "float64", (3,))])
        == (2 << 20) + 24
    )
    assert model_bytes([TensorSpec("w", "int8", (4,))]) == 0  # not a model dtype on the wire


@pytest.mark.parametrize(
    "spec",
    [("w", "", (2,)), ("w", "not-a-dtype", (2,)), ("w", "float32", (-1, 4)), ("w", "float32", ())],
)
def test_a_model_of_unknown_size_is_routed_by_the_one_level_rule(spec: tuple[Any, ...]) -> None:
    # a forged or odd registration must not break the routes (the fuzz test registers such)
    specs = (TensorSpec(*spec),)
    assert model_bytes(specs) == (4 if spec[2] == () else 0)
    g = _racks_with_outside_server(2, 4, 100e6, 4.0)
    hosts = [f"h{i}" for i in range(8)]
    if model_bytes(specs) == 0:
        assert model_routes(g, "ps", hosts, model_bytes(specs)).chunk_bytes == 0


def test_beyond_the_planned_size_each_rack_is_a_chain_from_its_relay() -> None:
    g = _racks_with_outside_server(3, 8, 100e6, 4.0)  # 24 hosts: more than MAX_PLANNED_HOSTS
    hosts = [f"h{i}" for i in range(24)]
    assert len(hosts) > MAX_PLANNED_HOSTS
    routes = model_routes(g, "ps", hosts, 4_500_000)
    one_level = model_upstreams(g, "ps", hosts)
    relays = {u for u in one_level.values() if u != "ps"}
    assert {h for h, u in routes.upstreams.items() if u == "ps"} == relays  # one copy per rack
    for relay in relays:  # its group, a chain: every host but the last feeds exactly one
        group = {h for h, u in one_level.items() if u == relay}
        children = {h: [c for c, u in routes.upstreams.items() if u == h] for h in group | {relay}}
        assert sorted(len(c) for c in children.values()) == [0] + [1] * len(group)
        assert all(routes.upstreams[h] in group | {relay} for h in group)
    assert routes.chunk_bytes > 0


def test_pieces_follow_the_link_rate_and_fast_links_move_the_model_whole() -> None:
    hosts = [f"h{i}" for i in range(8)]

    def chunk(rate: float, nbytes: int = 4_500_000) -> int:
        return model_routes(_racks_with_outside_server(2, 4, rate, 4.0), "ps", hosts, nbytes).chunk_bytes

    assert 0 < chunk(100e6) < chunk(1e9) < chunk(10e9) < 4_500_000  # slower links: more pieces
    assert chunk(100e9) in (0, *range(4_500_000 // 2, 4_500_000))  # fast links: whole, or two pieces
    assert chunk(100e9, 100_000) == 0  # one piece would be the whole model: store-and-forward


def test_a_lone_host_behind_an_uplink_fetches_directly() -> None:
    g = two_tier(3, 4, 1e9, oversubscription=2.0)
    ups = model_upstreams(g, "h0", ["h4", "h8", "h9", "h0"])
    # h0 is the server's own host (left out); h4 alone in rack 1; rack 2 has two
    assert ups == {"h4": "h0", "h8": "h0", "h9": "h8"}  # "h8" < "h9"


@pytest.mark.parametrize("n", [2, 5, 9])
def test_star_is_direct(n: int) -> None:
    g = star(n, 1e9)
    hosts = [f"h{i}" for i in range(1, n)]
    assert model_upstreams(g, "h0", hosts) == dict.fromkeys(hosts, "h0")


def test_unknown_hosts_fetch_directly() -> None:
    g = star(3, 1e9)
    assert model_upstreams(g, "nowhere", ["h1", "h2"]) == {"h1": "nowhere", "h2": "nowhere"}
    assert model_upstreams(g, "h0", ["ghost"]) == {"ghost": "h0"}


def _core() -> SchedulerCore:
    g = two_tier(2, 3, 1e9, oversubscription=3.0)
    return SchedulerCore(
        SchedulerState(g),
        FairPolicy(),
        dispatcher=Dispatcher(),
        batcher=AdaptiveBatcher(),
        estimator=StaticEstimator(g),
    )


def _routes(session: DaemonSession) -> list[Any]:
    out = []
    while not session.queue.empty():
        d = session.queue.get_nowait()
        if d is not None and d.WhichOneof("kind") == "model_route":
            out.append(d.model_route)
    return out


def test_core_sends_routes_as_workers_register_and_when_a_relay_goes() -> None:
    core = _core()
    sessions = {
        h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{9000 + i}"))
        for i, h in enumerate(["h0", "h1", "h2", "h3", "h4", "h5"])
    }

    def register(host: str, role: int, name: str) -> None:
        role_msg = pb.RegisterRole(job="j", role=role, name=name)  # type: ignore[arg-type]
        core.on_message(sessions[host], pb.DaemonMessage(register_role=role_msg))

    register("h0", pb.ROLE_SERVER, "ps")
    for h in ("h1", "h3", "h4", "h5"):
        register(h, pb.ROLE_WORKER, h)
    got = {h: _routes(s) for h, s in sessions.items()}
    # h1 (the server's rack) and the relay h3 fetch directly: no route; h4, h5 through h3
    assert got["h0"] == got["h1"] == got["h3"] == []
    for h in ("h4", "h5"):
        (route,) = got[h]
        assert (route.job, route.server, route.upstream_host) == ("j", "ps", "h3")
        assert route.upstream_address == "127.0.0.1:9003"
        assert (route.server_host, route.server_address) == ("h0", "127.0.0.1:9000")
    # a second worker on a host already routed changes nothing
    register("h4", pb.ROLE_WORKER, "h4b")
    assert _routes(sessions["h4"]) == []
    # the relay's daemon goes away: the rest of its rack gets a new relay (h4), h4 direct
    core.goodbye(sessions["h3"])
    (r4,) = _routes(sessions["h4"])
    (r5,) = _routes(sessions["h5"])
    assert r4.upstream_host == "h0" and r5.upstream_host == "h4"
    # h5's worker leaves: h4 is alone, and no route is due for it (it is direct already)
    gone = pb.UnregisterRole(job="j", role=pb.ROLE_WORKER, name="h5")
    core.on_message(sessions["h5"], pb.DaemonMessage(unregister_role=gone))
    assert _routes(sessions["h4"]) == []


def test_a_burst_of_registrations_refreshes_the_routes_once_while_the_loop_runs() -> None:
    # every daemon reconnecting at once (a restarted scheduler) must not cost one full refresh
    # each: with the core's loop running, the refreshes are coalesced (at most one per interval)
    core = _core()
    calls = []
    refresh = core.model_routes.refresh

    def counted() -> Any:
        calls.append(core.clock())
        return refresh()

    core.model_routes.refresh = counted  # type: ignore[method-assign]

    async def main() -> None:
        task = asyncio.create_task(core.run())
        await asyncio.sleep(0)  # the loop is running
        sessions = {
            h: core.hello(pb.Hello(host=h, data_address=f"127.0.0.1:{9000 + i}"))
            for i, h in enumerate(["h0", "h1", "h2", "h3", "h4", "h5"])
        }
        for host, role in [("h0", pb.ROLE_SERVER), *((h, pb.ROLE_WORKER) for h in ("h1", "h3", "h4", "h5"))]:
            msg = pb.RegisterRole(job="j", role=role, name="ps" if role == pb.ROLE_SERVER else host)
            core.on_message(sessions[host], pb.DaemonMessage(register_role=msg))
        assert calls == []  # nothing refreshed inside the handlers
        await asyncio.sleep(0.05)
        assert len(calls) == 1
        assert [r.upstream_host for r in _routes(sessions["h4"])] == ["h3"]
        assert [r.upstream_host for r in _routes(sessions["h5"])] == ["h3"]
        core.goodbye(sessions["h3"])  # a relay leaves: refreshed once more, no sooner than the interval
        await asyncio.sleep(0.3)
        assert len(calls) == 2 and calls[1] - calls[0] >= core.model_routes.interval
        assert [r.upstream_host for r in _routes(sessions["h5"])] == ["h4"]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), 10))
