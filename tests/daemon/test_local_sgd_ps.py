"""Local SGD on the parameter-server path (:mod:`mlfabric.localsgd`, issue 26).

The schedule and the arithmetic are pure and tested here with a recording stand-in for the
worker; then through two in-process daemons and a real server: H = 4 makes a quarter of the
pushes, each one update applied once, and the server's model is the initial one minus the sum
of the deltas pushed (also with post-local SGD's warmup, and with an int8 codec under error
feedback).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.localsgd import LocalSGD, accumulate, apply_local, push_due

MODEL: dict[str, np.ndarray] = {
    "w": ((np.arange(600) % 129 - 64) / 64).astype(np.float32).reshape(20, 30),
    "b": np.zeros(8, np.float32),
}


def _update(step: int) -> dict[str, np.ndarray]:
    """Step ``step``'s update: multiples of 1/64, as the model (their sums are exact in float32)."""
    rng = np.random.default_rng(step)
    return {k: (rng.integers(-8, 9, v.shape) / 64).astype(np.float32) for k, v in MODEL.items()}


# ------------------------------------------------------------------------ pure parts


@pytest.mark.parametrize(
    ("period", "warmup", "pushed"),
    [(1, 0, list(range(1, 11))), (4, 0, [4, 8]), (4, 2, [1, 2, 6, 10]), (3, 5, [1, 2, 3, 4, 5, 8])],
)
def test_the_schedule_pushes_every_step_of_the_warmup_then_every_period(
    period: int, warmup: int, pushed: list[int]
) -> None:
    assert [s for s in range(1, 11) if push_due(s, period, warmup)] == pushed


@pytest.mark.parametrize(
    ("period", "warmup", "problem"),
    [(0, 0, "period 0"), (2.5, 0, "period 2.5"), (1, -1, "warmup -1"), (1, 1.5, "warmup 1.5")],
)
def test_a_bad_schedule_is_refused_naming_it(period: Any, warmup: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        push_due(1, period, warmup)
    with pytest.raises(ValueError, match=problem):
        LocalSGD(object(), "ps0", period=period, warmup=warmup)


def test_accumulate_and_apply_keep_dtypes_and_refuse_other_tensors() -> None:
    torch = pytest.importorskip("torch")
    delta = accumulate(None, {"w": torch.ones(3)})  # torch tensors come in as numpy
    delta = accumulate(delta, {"w": np.full(3, 0.5)})
    assert delta["w"].dtype == np.float32 and delta["w"].tolist() == [1.5, 1.5, 1.5]
    assert apply_local({"w": np.ones(3, np.float32)}, delta)["w"].tolist() == [-0.5, -0.5, -0.5]
    with pytest.raises(ValueError, match="tensor 'w': update of shape"):
        accumulate(delta, {"w": np.ones(4)})
    with pytest.raises(ValueError, match="lacks tensor 'w'"):
        apply_local({"w": np.ones(3)}, {"v": np.ones(3)})


class RecordingWorker:
    """Stands in for a Worker: keeps a model, applies pushes as the examples' server does."""

    def __init__(self) -> None:
        self.model = {k: v.copy() for k, v in MODEL.items()}
        self.version = 0
        self.pushed: list[tuple[dict[str, np.ndarray], dict[str, Any]]] = []
        self.gets: list[int | None] = []

    def push(self, server: str, update: dict[str, np.ndarray], **kwargs: Any) -> Any:
        self.pushed.append(({k: v.copy() for k, v in update.items()}, kwargs))
        for k, v in update.items():
            self.model[k] = self.model[k] - v
        self.version += 1
        result = mlfabric.PushResult(mlfabric.APPLIED, 0, self.version, "", "w0/1")

        class Done:
            def wait(self, timeout: float) -> Any:
                return result

        return Done()

    def get(self, server: str, *, min_version: int | None, timeout: float) -> tuple[int, dict]:
        self.gets.append(min_version)
        return self.version, {k: v.copy() for k, v in self.model.items()}


def test_the_delta_of_h_steps_is_pushed_once_then_the_model_fetched() -> None:
    worker = RecordingWorker()
    local = LocalSGD(worker, "ps0", period=4, codec="fp16", error_feedback=True)
    with pytest.raises(RuntimeError, match="before fetch"):
        local.step(_update(0))
    local.fetch()
    results = [local.step(_update(s)) for s in range(1, 11)]
    assert [i + 1 for i, r in enumerate(results) if r is not None] == [4, 8]
    assert local.flush() is not None and local.flush() is None  # steps 9-10, then nothing left
    assert (local.steps, local.pushes, len(worker.pushed)) == (10, 3, 3)
    for (delta, kwargs), steps in zip(worker.pushed, [(1, 5), (5, 9), (9, 11)], strict=True):
        assert kwargs == {"base_version": steps[0] // 4, "codec": "fp16", "error_feedback": True}
        for name in MODEL:
            np.testing.assert_array_equal(delta[name], sum(_update(s)[name] for s in range(*steps)))
    assert worker.gets == [None, 1, 2, 3]  # after each push: at least the version it made
    for name in MODEL:  # the local copy is the server's model after the last push
        np.testing.assert_array_equal(local.model[name], worker.model[name])


def test_a_scale_pushes_the_delta_times_it_and_a_bad_one_is_refused() -> None:
    worker = RecordingWorker()
    local = LocalSGD(worker, "ps0", period=4, scale=0.25)
    local.fetch()
    for s in range(1, 5):
        local.step(_update(s))
    ((delta, _),) = worker.pushed
    for name in MODEL:  # the mean of the 4 steps, in the tensor's dtype
        mean = sum(_update(s)[name] for s in range(1, 5)) * 0.25
        np.testing.assert_allclose(delta[name], mean, rtol=1e-6)
        assert delta[name].dtype == MODEL[name].dtype
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="the delta's factor"):
            LocalSGD(worker, "ps0", period=4, scale=bad)


# ------------------------------------------------------------- through the daemons


@pytest.fixture
def served(make_daemon: Any) -> Iterator[dict[str, Any]]:
    """Daemons "ps" (server ps0, applying ``model -= update``) and "w0" (a worker)."""
    ps, w0 = make_daemon("ps"), make_daemon("w0")
    server = mlfabric.register_as_server(
        "job", "ps0", {k: v.copy() for k, v in MODEL.items()}, daemon=ps.config.socket_path
    )

    @server.on_update
    def apply(update: dict[str, np.ndarray], meta: Any) -> None:
        for k, v in update.items():
            server.model[k] -= v

    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    worker.rng = np.random.default_rng(3)
    pushed: list[dict[str, np.ndarray]] = []
    push = worker.push

    def recording_push(server_name: str, update: Any, *args: Any, **kwargs: Any) -> Any:
        pushed.append({k: np.array(v) for k, v in update.items()})
        return push(server_name, update, *args, **kwargs)

    worker.push = recording_push
    yield {"server": server, "worker": worker, "pushed": pushed}
    worker.close()
    server.stop()
    thread.join(5)
    server.close()


@pytest.mark.parametrize(("period", "warmup", "pushes"), [(4, 0, 4), (4, 2, 6)], ids=["H4", "H4-K2"])
def test_h_local_steps_make_a_fraction_of_the_pushes_and_the_server_applies_their_sum(
    served: dict[str, Any], scheduler: Any, period: int, warmup: int, pushes: int
) -> None:
    server, worker, pushed = served["server"], served["worker"], served["pushed"]
    local = LocalSGD(worker, "ps0", period=period, warmup=warmup, timeout=10)
    local.fetch()
    results = [r for s in range(1, 17) if (r := local.step(_update(s))) is not None]
    results += [r] if (r := local.flush()) is not None else []
    # H4: after steps 4, 8, 12, 16; K2: 1, 2, 6, 10, 14, and 15-16 flushed
    assert len(results) == len(pushed) == len(scheduler.ready) == pushes
    assert [r.status for r in results] == [mlfabric.APPLIED] * pushes
    assert server.applied == pushes and server.version == pushes  # one push = one update, once
    for name in MODEL:
        total = sum(d[name] for d in pushed)
        np.testing.assert_array_equal(total, sum(_update(s)[name] for s in range(1, 17)))
        np.testing.assert_array_equal(server.model[name], MODEL[name] - total)
        np.testing.assert_array_equal(local.model[name], server.model[name])


def test_local_sgd_composes_with_a_codec_and_error_feedback(served: dict[str, Any]) -> None:
    server, worker, pushed = served["server"], served["worker"], served["pushed"]
    spec = "int8:bound=2,stochastic=0"
    local = LocalSGD(worker, "ps0", period=4, codec=spec, error_feedback=True, timeout=10)
    local.fetch()
    for s in range(1, 13):
        local.step(_update(s))
    assert len(pushed) == server.applied == 3
    feedback = worker.feedback("ps0")
    assert feedback is not None
    for name in MODEL:  # the server applied the deltas' sum minus the residual left at the sender
        residual = feedback.residual(name)
        assert residual is not None and np.abs(residual).max() <= 0.5 * 2 / 127 + 1e-6
        expected = MODEL[name] - sum(d[name] for d in pushed) + residual
        np.testing.assert_allclose(server.model[name], expected, atol=1e-5)
        np.testing.assert_array_equal(local.model[name], server.model[name])
