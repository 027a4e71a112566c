"""DistributedOptimizer's pipelined pulls: each group's model fetched as soon as its own verdict is in.

Pure logic of the optimizer against a fake worker whose verdicts the test releases one by one
(the real cluster runs in test_optimizer.py): which model is fetched, when, with which floor,
and that the parameters end as the servers' models.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mlfabric.localclient import APPLIED, DROPPED, PushHandle, PushResult  # noqa: E402
from mlfabric.torch import DistributedOptimizer  # noqa: E402


class HeldPush(PushHandle):
    """A push whose verdict the test gives (:meth:`resolve`)."""

    def resolve(self, status: str, version: int) -> None:
        self._result = PushResult(status, 0, version, "" if status == APPLIED else "tau_max", self.server)
        self._done.set()


class FakeWorker:
    """Pushes held until resolved; ``get`` serves a fixed model per server and logs each call."""

    def __init__(self, models: dict[str, dict[str, Any]]) -> None:
        self.models = models
        self.servers: dict[str, Any] = {}
        self.pushes: dict[str, HeldPush] = {}
        self.gets: list[tuple[str, int | None, str]] = []  # (server, min_version, thread)
        self.lock = threading.Lock()

    def push(self, server: str, update: dict[str, Any]) -> HeldPush:
        handle = HeldPush(server)
        with self.lock:
            self.pushes[server] = handle
        return handle

    def get(self, server: str, *, min_version: int | None = None, **_: Any) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.gets.append((server, min_version, threading.current_thread().name))
        return 7, {k: v.clone() for k, v in self.models[server].items()}

    def wait_for(self, what: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.005)


def setup(pipeline: bool, mode: str = "async") -> tuple[Any, DistributedOptimizer, FakeWorker]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    served = {  # one server per tensor (group_bytes=0); the servers' model: every value 0.5
        f"ps.{i}": {n: torch.full_like(p.detach(), 0.5)} for i, (n, p) in enumerate(model.named_parameters())
    }
    worker = FakeWorker(served)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        worker,
        mode=mode,
        group_bytes=0,
        pipeline=pipeline,
        on_drop="count",
        timeout=10.0,
    )
    return model, opt, worker


def backward(model: Any) -> None:
    model(torch.randn(5, 4)).sum().backward()


def test_a_groups_model_is_fetched_once_its_own_verdict_is_in_while_the_others_are_pending() -> None:
    model, opt, worker = setup(pipeline=True)
    opt.zero_grad()
    backward(model)  # the hooks push every group from the sender thread
    worker.wait_for(lambda: len(worker.pushes) == 4)
    worker.pushes["ps.3"].resolve(APPLIED, 5)
    worker.wait_for(lambda: len(worker.gets) == 1)
    time.sleep(0.05)  # nothing else is fetched while the other verdicts are pending
    assert [(s, floor) for s, floor, _ in worker.gets] == [("ps.3", None)]
    assert worker.gets[0][2].startswith("mlfabric-pull")  # not the training thread
    for server in ("ps.0", "ps.1", "ps.2"):
        worker.pushes[server].resolve(APPLIED, 5)
    opt.step()
    assert sorted(s for s, _, _ in worker.gets) == ["ps.0", "ps.1", "ps.2", "ps.3"]  # each once
    assert all(torch.equal(p.detach(), torch.full_like(p, 0.5)) for p in model.parameters())
    assert opt.applied == 4 and opt.steps == 1
    opt.close()


def test_sync_fetches_each_groups_round_and_a_dropped_groups_current_model() -> None:
    model, opt, worker = setup(pipeline=True, mode="sync")
    opt.zero_grad()
    backward(model)
    worker.wait_for(lambda: len(worker.pushes) == 4)
    for i, server in enumerate(("ps.0", "ps.1", "ps.2")):
        worker.pushes[server].resolve(APPLIED, 10 + i)
    worker.pushes["ps.3"].resolve(DROPPED, 3)
    opt.step()
    assert sorted((s, floor) for s, floor, _ in worker.gets) == [
        ("ps.0", 10),
        ("ps.1", 11),
        ("ps.2", 12),
        ("ps.3", None),  # dropped: no round of its own to wait for
    ]
    assert opt.dropped == 1 and opt.applied == 3
    assert all(torch.equal(p.detach(), torch.full_like(p, 0.5)) for p in model.parameters())
    opt.close()


def test_without_pipeline_the_models_are_fetched_in_step_after_every_verdict() -> None:
    model, opt, worker = setup(pipeline=False)
    opt.zero_grad()
    backward(model)
    worker.wait_for(lambda: len(worker.pushes) == 4)
    for server in ("ps.3", "ps.2", "ps.1", "ps.0"):
        worker.pushes[server].resolve(APPLIED, 5)
    time.sleep(0.05)
    assert worker.gets == []  # nothing before step()
    opt.step()
    assert [s for s, _, _ in worker.gets] == ["ps.0", "ps.1", "ps.2", "ps.3"]
    assert {t for _, _, t in worker.gets} == {threading.current_thread().name}
    opt.close()


def test_pull_fetches_the_groups_concurrently_and_loads_them() -> None:
    model, opt, worker = setup(pipeline=True)
    opt.pull({1: 4})
    assert sorted((s, floor) for s, floor, _ in worker.gets) == [
        ("ps.0", None),
        ("ps.1", 4),
        ("ps.2", None),
        ("ps.3", None),
    ]
    assert all(t.startswith("mlfabric-pull") for _, _, t in worker.gets)
    assert all(torch.equal(p.detach(), torch.full_like(p, 0.5)) for p in model.parameters())
    opt.close()
