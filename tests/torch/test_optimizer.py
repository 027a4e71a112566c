"""DistributedOptimizer against a real cluster (scheduler + daemon processes, real sockets).

The servers (:class:`GroupServers`) run in this process on h0's daemon, the workers on h1's.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import mlfabric  # noqa: E402
from mlfabric.cluster import LocalCluster  # noqa: E402
from mlfabric.torch import DistributedOptimizer, GroupServers  # noqa: E402
from mlfabric.torch.staging import Stager  # noqa: E402
from tests.torch.fakes import FakeOps  # noqa: E402


def net(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def batch(seed: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)


def loss_of(model: Any, seed: int) -> Any:
    x, y = batch(seed)
    return torch.nn.functional.cross_entropy(model(x), y)


def assert_same(a: Any, b: Any, atol: float = 1e-6) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-5, msg=n)


def assert_exactly_once(servers: GroupServers, *opts: DistributedOptimizer) -> None:
    ids = servers.update_ids
    assert len(ids) == len(set(ids)), "an update applied twice"
    assert servers.worker_updates == sum(o.pushed for o in opts) == sum(o.applied for o in opts)


@pytest.mark.parametrize(
    ("make", "wait_free"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3), True),
        (lambda ps: torch.optim.Adam(ps, lr=0.01), True),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), False),
    ],
    ids=["sgd-momentum-wait-free", "adam-wait-free", "sgd-momentum-in-step"],
)
def test_one_worker_trains_as_the_wrapped_optimizer_alone(
    cluster: LocalCluster, make: Any, wait_free: bool
) -> None:
    model, alone = net(), net()
    alone_opt = make(alone.parameters())
    with GroupServers("j", model.named_parameters(), group_bytes=0, daemon=cluster.socket("h0")) as servers:
        with mlfabric.register_as_worker("j", name="w0", daemon=cluster.socket("h1")) as worker:
            opt = DistributedOptimizer(
                make(model.parameters()), model.named_parameters(), worker, group_bytes=0, wait_free=wait_free
            )
            assert len(opt.groups) == 4  # one group (one server) per tensor
            opt.pull()
            for step in range(4):
                opt.zero_grad()
                loss_of(model, step).backward()
                opt.step()
                alone_opt.zero_grad()
                loss_of(alone, step).backward()
                alone_opt.step()
            assert all(r.status == mlfabric.APPLIED for r in opt.last_results)
            # wait-free: pushes began before step() was called; in step: none did
            assert (opt.hidden_seconds > 0) == wait_free and opt.comm_seconds > 0
            assert 0 <= opt.last_overlap < 1
            opt.close()
        assert_same(model, alone)
        assert_same(model, alone)
        served = servers.model()
        for n, p in model.named_parameters():
            torch.testing.assert_close(served[n], p.detach(), msg=n)
        assert servers.applied == 16 and opt.steps == 4
        assert_exactly_once(servers, opt)
        moved = max(
            float((p.detach() - q.detach()).abs().max())
            for p, q in zip(model.parameters(), net().parameters(), strict=False)
        )
        assert moved > 1e-3


def test_clipping_in_step_mode_matches_and_after_a_wait_free_push_is_refused(cluster: LocalCluster) -> None:
    model, alone = net(), net()
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.5)
    with GroupServers("j", model.named_parameters(), daemon=cluster.socket("h0")) as servers:
        with mlfabric.register_as_worker("j", name="w0", daemon=cluster.socket("h1")) as worker:
            sgd = torch.optim.SGD(model.parameters(), lr=0.5)
            opt = DistributedOptimizer(sgd, model.named_parameters(), worker, wait_free=False)
            opt.pull()
            for step in range(3):
                for m, o in ((model, opt), (alone, alone_opt)):
                    o.zero_grad()
                    (loss_of(m, step) * 100).backward()
                    torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.1)
                    o.step()
            assert_same(model, alone)
            opt.close()
            waitfree = DistributedOptimizer(sgd, model.named_parameters(), worker)
            waitfree.zero_grad()
            loss_of(model, 9).backward()  # pushed from the hook
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
            with pytest.raises(RuntimeError, match="changed after they were pushed"):
                waitfree.step()
            waitfree.close()
        assert_exactly_once(servers, opt, waitfree)


def test_grad_scaler_steps_and_skips_a_step_with_inf_like_the_wrapped_optimizer(
    cluster: LocalCluster,
) -> None:
    model, alone = net(), net()
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    with GroupServers("j", model.named_parameters(), group_bytes=0, daemon=cluster.socket("h0")) as servers:
        with mlfabric.register_as_worker("j", name="w0", daemon=cluster.socket("h1")) as worker:
            sgd = torch.optim.SGD(model.parameters(), lr=0.1)
            with pytest.raises(ValueError, match="group 0 holds"):  # grouped unlike the servers
                DistributedOptimizer(sgd, model.named_parameters(), worker, wait_free=False)
            opt = DistributedOptimizer(sgd, model.named_parameters(), worker, group_bytes=0, wait_free=False)
            opt.pull()
            scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
            for step in range(4):
                for m, o, scaler in ((model, opt, scalers[0]), (alone, alone_opt, scalers[1])):
                    o.zero_grad()
                    scaler.scale(loss_of(m, step)).backward()
                    if step == 2:  # an overflow: the scaler skips the step and lowers its scale
                        next(m.parameters()).grad[0, 0] = float("inf")
                    scaler.step(o)
                    scaler.update()
                if step == 2:
                    assert servers.applied == 8  # nothing pushed for the skipped step
            assert scalers[0].get_scale() == scalers[1].get_scale() == 512.0
            assert_same(model, alone)
            assert opt.steps == 3
            opt.close()
        assert servers.applied == 12
        assert_exactly_once(servers, opt)


def test_sync_mode_loads_each_rounds_model(cluster: LocalCluster) -> None:
    models = [net(), net()]
    params = mlfabric.Params(sync_workers=2)
    with GroupServers(
        "j", models[0].named_parameters(), params=params, daemon=cluster.socket("h0")
    ) as servers:
        opts: list[DistributedOptimizer] = []
        errors: list[BaseException] = []

        def train(rank: int) -> None:
            try:
                worker = mlfabric.register_as_worker("j", name=f"w{rank}", daemon=cluster.socket("h1"))
                sgd = torch.optim.SGD(models[rank].parameters(), lr=0.1)
                opt = DistributedOptimizer(sgd, models[rank].named_parameters(), worker, mode="sync")
                opts.append(opt)
                opt.pull()
                for step in range(3):
                    opt.zero_grad()
                    loss_of(models[rank], 10 * rank + step).backward()
                    opt.step()
                opt.close()
                worker.close()
            except BaseException as exc:  # noqa: BLE001  # re-raised by the test below
                errors.append(exc)

        threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert servers.applied == 3 * len(servers.servers)  # one round per step and group
        assert_exactly_once(servers, *opts)
        assert_same(models[0], models[1])  # both loaded every round's model
        served = servers.model()
        for n, p in models[0].named_parameters():
            torch.testing.assert_close(served[n], p.detach(), msg=n)


def test_a_dropped_push_raises_unless_counted(cluster: LocalCluster) -> None:
    a, b = net(), net()
    with (
        GroupServers(
            "j", a.named_parameters(), params=mlfabric.Params(tau_max=0), daemon=cluster.socket("h0")
        ),
        mlfabric.register_as_worker("j", name="wa", daemon=cluster.socket("h1")) as wa,
        mlfabric.register_as_worker("j", name="wb", daemon=cluster.socket("h1")) as wb,
    ):
        opt_a = DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), a.named_parameters(), wa)
        opt_b = DistributedOptimizer(
            torch.optim.SGD(b.parameters(), lr=0.1), b.named_parameters(), wb, on_drop="count"
        )
        opt_a.pull()
        opt_b.pull()
        for opt, m in ((opt_a, a), (opt_b, b)):  # b's base is a version behind: delay 1 > tau_max
            opt.zero_grad()
            loss_of(m, 0).backward()
            opt.step()
        assert opt_b.dropped == 1 and "tau_max 0" in opt_b.last_results[0].reason
        assert_same(a, b)  # b loaded the servers' model all the same
        opt_a.pull()
        b.zero_grad()
        loss_of(b, 1).backward()
        opt_b.step()  # now current: applied
        opt_a.zero_grad()
        loss_of(a, 2).backward()
        with pytest.raises(mlfabric.MlfabricError, match="dropped") as info:
            opt_a.step()
        assert info.value.code == "dropped"
        opt_a.close()
        opt_b.close()


def test_a_parameter_shaped_unlike_the_servers_model_is_refused_naming_it(cluster: LocalCluster) -> None:
    served = net()
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with GroupServers("j", served.named_parameters(), daemon=cluster.socket("h0")) as servers:
        before = {n: t.clone() for n, t in servers.model().items()}
        with mlfabric.register_as_worker("j", name="w0", daemon=cluster.socket("h1")) as worker:
            opt = DistributedOptimizer(
                torch.optim.SGD(other.parameters(), lr=0.1), other.named_parameters(), worker
            )
            opt.zero_grad()
            other(torch.randn(2, 8)).sum().backward()
            with pytest.raises(mlfabric.MlfabricError, match=r"'2\.weight'") as info:
                opt.step()
            assert info.value.code == "bad_tensor"
            opt.close()
        after = servers.model()
        assert all(torch.equal(before[n], after[n]) for n in before)  # the model is intact


def test_state_dict_round_trips_the_wrapped_state_and_the_step_count(cluster: LocalCluster) -> None:
    model = net()
    with (
        GroupServers("j", model.named_parameters(), daemon=cluster.socket("h0")),
        mlfabric.register_as_worker("j", name="w0", daemon=cluster.socket("h1")) as worker,
    ):
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters()), model.named_parameters(), worker)
        opt.pull()
        for step in range(2):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
        state = opt.state_dict()
        opt.close()
        again = DistributedOptimizer(torch.optim.Adam(model.parameters()), model.named_parameters(), worker)
        again.load_state_dict(state)
        assert again.steps == 2
        torch.testing.assert_close(again.state_dict(), state)
        again.close()


def test_cuda_updates_take_the_staging_path(cluster: LocalCluster) -> None:
    """The optimizer and push stage device tensors (a fake of the CUDA calls selects the path here)."""
    model, alone = net(), net()
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    ops = FakeOps()
    with (
        GroupServers("j", model.named_parameters(), group_bytes=0, daemon=cluster.socket("h0")),
        mlfabric.register_as_worker("j", name="w0", daemon=cluster.socket("h1")) as worker,
    ):
        stager = Stager(ops)
        opt = DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), worker,
                group_bytes=0, stager=stager,
            )  # fmt: skip
        opt.pull()
        for step in range(2):
            for m, o in ((model, opt), (alone, alone_opt)):
                o.zero_grad()
                loss_of(m, step).backward()
                o.step()
        assert_same(model, alone)
        assert ops.log.count(("copy", "side")) == 8 and ops.pinned_allocations == 4  # reused
        opt.close()
        worker.stager = stager  # push() itself: staged, then the event waited for
        _version, _ = worker.get("ps.3")
        result = worker.push("ps.3", {"2.bias": torch.full((3,), 0.5)}).wait(timeout=30)
        assert result.status == mlfabric.APPLIED
        assert ops.log[-1] == ("synchronize", "side")
        _, model3 = worker.get("ps.3", min_version=result.version)
        torch.testing.assert_close(
            torch.as_tensor(model3["2.bias"]), next(reversed(list(model.parameters()))).detach() - 0.5
        )
