"""Forged and malformed pushes and registrations: refused early, naming the problem (DESIGN §3).

A push whose base version is ahead of the server, a non-finite update, a list instead of a
dict, a tensor of the wrong shape, dtype or name, a job name over the local message limit and
a negative div_max each get a clear error or a DROPPED naming it; the model stays untouched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
import mlfabric.tensorio


def _serve(daemon: Any, params: mlfabric.Params) -> tuple[Any, threading.Thread]:
    server = mlfabric.register_as_server(
        "job",
        "ps0",
        {"w": np.zeros((2, 3)), "b": np.zeros(4, np.float32)},
        params,
        daemon=daemon.config.socket_path,
    )
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def served(make_daemon: Any) -> Iterator[dict[str, Any]]:
    """Daemons "ps" (server ps0, tau_max 0) and "w0" (a worker)."""
    ps, w0 = make_daemon("ps"), make_daemon("w0")
    server, thread = _serve(ps, mlfabric.Params(tau_max=0))
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    yield {"ps": ps, "w0": w0, "server": server, "worker": worker}
    worker.close()
    server.stop()
    thread.join(5)
    server.close()


def _good(value: float = 1.0) -> dict[str, np.ndarray]:
    return {"w": np.full((2, 3), value), "b": np.full(4, value, np.float32)}


def test_base_version_ahead_of_the_server_is_dropped_naming_it(served: dict[str, Any]) -> None:
    worker, server = served["worker"], served["server"]
    result = worker.push("ps0", _good(), base_version=10**9).wait(10)
    assert result.status == mlfabric.DROPPED
    assert "base version 1000000000" in result.reason and "ahead" in result.reason
    assert server.version == 0
    assert worker.push("ps0", _good(), base_version=0).wait(10).applied


def test_negative_base_version_is_refused_naming_it(served: dict[str, Any], monkeypatch: Any) -> None:
    """Was applied, with a delay larger than the version (issue 27)."""
    worker, server = served["worker"], served["server"]
    with pytest.raises(mlfabric.MlfabricError, match="base_version -1 is negative"):
        worker.push("ps0", _good(), base_version=-1)
    monkeypatch.setattr(mlfabric.api, "_check_base_version", lambda base: None)  # the daemon checks too
    with pytest.raises(mlfabric.MlfabricError, match="base_version -5 is negative") as refused:
        worker.push("ps0", _good(), base_version=-5).wait(10)
    assert refused.value.code == "bad_request" and server.version == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_update_is_dropped_naming_the_tensor(served: dict[str, Any], bad: float) -> None:
    worker, server = served["worker"], served["server"]
    update = _good()
    update["b"][2] = bad
    result = worker.push("ps0", update).wait(10)
    assert result.status == mlfabric.DROPPED
    assert "non-finite" in result.reason and "'b'" in result.reason
    assert server.version == 0
    _, model = worker.get("ps0")
    assert np.isfinite(model["b"]).all()


def test_non_finite_updates_can_be_allowed_per_job(make_daemon: Any) -> None:
    d = make_daemon("h")
    server, thread = _serve(d, mlfabric.Params(refuse_non_finite=False))
    worker = mlfabric.register_as_worker("job", daemon=d.config.socket_path, wait=5)
    try:
        assert not worker.params.refuse_non_finite
        update = _good()
        update["w"][0, 0] = np.inf
        assert worker.push("ps0", update).wait(10).applied
    finally:
        worker.close()
        server.stop()
        thread.join(5)
        server.close()


def test_push_of_a_list_raises_type_error_naming_the_expected_type(served: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match="dict"):
        served["worker"].push("ps0", [np.zeros((2, 3)), np.zeros(4, np.float32)])


@pytest.mark.parametrize(
    ("update", "expected"),
    [
        ({"w": np.zeros((3, 2)), "b": np.zeros(4, np.float32)}, "tensor 'w': update has shape (3, 2)"),
        ({"w": np.zeros((2, 3)), "b": np.zeros(4, np.float64)}, "tensor 'b': update has shape (4,) float64"),
        ({"w": np.zeros((2, 3)), "x": np.zeros(4, np.float32)}, "tensor 'x': not in the model"),
    ],
)
def test_wrong_spec_raises_at_push(served: dict[str, Any], update: dict, expected: str) -> None:
    with pytest.raises(mlfabric.MlfabricError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        served["worker"].push("ps0", update)
    assert served["server"].version == 0


def test_wrong_shape_is_refused_before_the_tensor_is_copied(served: dict[str, Any], monkeypatch: Any) -> None:
    copies: list[int] = []
    real = mlfabric.tensorio.encode_pooled

    def counting(pool: Any, tensors: Any) -> Any:
        copies.append(1)
        return real(pool, tensors)

    monkeypatch.setattr(mlfabric.tensorio, "encode_pooled", counting)
    with pytest.raises(mlfabric.MlfabricError, match="shape"):
        served["worker"].push("ps0", {"w": np.zeros((200, 300)), "b": np.zeros(4, np.float32)})
    assert copies == []


def test_job_name_over_the_local_message_limit_names_the_limit(make_daemon: Any) -> None:
    d = make_daemon("h")
    started = time.monotonic()
    limit = 16 << 20  # the local message limit
    with pytest.raises(mlfabric.MlfabricError, match=f"{limit}-byte limit"):
        mlfabric.register_as_worker("j" * (limit + 1), daemon=d.config.socket_path, wait=0)
    assert time.monotonic() - started < 10


def test_negative_div_max_is_refused_before_registration(make_daemon: Any) -> None:
    d = make_daemon("h")
    with pytest.raises(ValueError, match="div_max must be a number >= 0"):
        mlfabric.register_as_server(
            "job", "ps0", {"w": np.zeros(2)}, mlfabric.Params(div_max=-5.0), daemon=d.config.socket_path
        )


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_first_non_finite_finds_one_bad_element_in_any_block(dtype: str, bad: float) -> None:
    values = np.ones(200_000, np.float32)
    values[150_001] = bad  # in the third block
    raw_bfloat16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    tensor = raw_bfloat16 if dtype == "bfloat16" else values.astype(dtype)
    assert mlfabric.tensors.first_non_finite({"ok": np.zeros(3), "t": tensor}) == "t"
    big = np.full(200_000, np.finfo(np.float16).max, np.float16)  # sums overflow, values finite
    assert mlfabric.tensors.first_non_finite({"t": big}) is None
