"""The Python API's server loop and callbacks, and torch tensors end to end through a daemon."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import mlfabric


def test_serve_stops_after_max_updates_and_on_request_shapes_get(make_daemon: Any) -> None:
    d = make_daemon("h")
    sock = d.config.socket_path
    server = mlfabric.register_as_server("job", "ps0", {"w": np.zeros(3)}, daemon=sock)
    seen: list[mlfabric.UpdateMeta] = []

    @server.on_update
    def apply(update: dict, meta: mlfabric.UpdateMeta) -> dict:
        seen.append(meta)
        return {"w": server.model["w"] + 2 * update["w"]}  # a replacement model

    @server.on_request
    def public() -> dict:
        return {"w": server.model["w"], "version_tag": np.array([server.version], np.float64)}

    worker = mlfabric.register_as_worker("job", name="wk", daemon=sock, wait=5)
    handles = [worker.push("ps0", {"w": np.full(3, float(i + 1))}, norm=7.0) for i in range(3)]
    assert server.serve(max_updates=2, timeout=10) == 2
    assert server.version == 2
    assert sum(h.done() for h in handles) <= 2  # the third is not served yet
    done = threading.Event()
    thread = threading.Thread(target=server.serve, kwargs={"until": done})
    thread.start()
    results = [h.wait(10) for h in handles]
    done.set()
    thread.join(5)
    assert not thread.is_alive()
    version, model = worker.get("ps0")
    assert version == 3 and set(model) == {"w", "version_tag"}
    np.testing.assert_array_equal(model["w"], np.full(3, 2.0 * (1 + 2 + 3)))
    assert model["version_tag"].tolist() == [3.0]
    assert [(m.worker, m.norm, m.num_updates, m.base_version) for m in seen] == [("wk", 7.0, 1, 0)] * 3
    assert [m.delay for m in seen] == [0, 1, 2]
    # the updates raced to the server; each push learned the version its update made
    assert [m.update_id for m in seen] == [r.update_id for r in sorted(results, key=lambda r: r.version)]
    assert sorted(r.version for r in results) == [1, 2, 3]
    worker.close()
    server.close()


def test_params_round_trip() -> None:
    p = mlfabric.Params(tau_max=3, div_max=1.5)
    assert mlfabric.Params.from_pb(p.to_pb()) == p
    assert mlfabric.Params.from_pb(mlfabric.Params().to_pb()) == mlfabric.Params()


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_torch_tensors_end_to_end(make_daemon: Any, dtype: str) -> None:
    tdtype = getattr(torch, dtype)
    ps, w0 = make_daemon("ps"), make_daemon("w0")
    model = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(tdtype)}
    server = mlfabric.register_as_server(
        "job", "ps0", {"w": model["w"].clone()}, daemon=ps.config.socket_path
    )
    got: list[Any] = []
    server.on_update(lambda update, meta: got.append(update["w"]))
    thread = threading.Thread(target=server.serve, kwargs={"max_updates": 1, "timeout": 10})
    thread.start()
    worker = mlfabric.register_as_worker("job", daemon=w0.config.socket_path, wait=5)
    update = torch.full((2, 3), 0.5, dtype=tdtype)
    assert worker.push("ps0", {"w": update}).wait(10).applied
    thread.join(10)
    assert got[0].dtype == tdtype and torch.equal(got[0], update)  # torch in, torch out at the server
    version, back = worker.get("ps0", as_torch=True)
    assert version == 1 and back["w"].dtype == tdtype and torch.equal(back["w"], model["w"])
    _, raw = worker.get("ps0")
    assert raw["w"].dtype == (np.uint16 if dtype == "bfloat16" else np.dtype(dtype))
    worker.close()
    server.close()


def test_a_second_process_registering_a_live_workers_name_is_refused(make_daemon: Any) -> None:
    """Its leaving would otherwise unregister the name the first process still pushes under."""
    sock = make_daemon("h").config.socket_path
    server = mlfabric.register_as_server("job", "ps0", {"w": np.zeros(3)}, daemon=sock)
    first = mlfabric.register_as_worker("job", name="wk", daemon=sock, wait=5)
    with pytest.raises(mlfabric.MlfabricError) as info:
        mlfabric.register_as_worker("job", name="wk", daemon=sock, wait=5)
    assert info.value.code == "duplicate_worker" and "'wk'" in str(info.value)
    handle = first.push("ps0", {"w": np.ones(3)})
    assert server.serve(max_updates=1, timeout=10) == 1
    assert handle.wait(10).applied
    first.close()  # a registration right after waits (up to 2 s) for the daemon to see it go
    again = mlfabric.register_as_worker("job", name="wk", daemon=sock, wait=5)
    again.close()
    server.close()
