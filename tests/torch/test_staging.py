"""The staging of device tensors (mlfabric.torch.staging) with a fake of the CUDA calls.

The real CUDA path runs in experiments/gpu_check.py on a machine with a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mlfabric.torch.staging import Stager  # noqa: E402
from tests.torch.fakes import FakeOps  # noqa: E402


def test_to_host_issues_copies_on_the_side_stream_after_the_training_stream_and_waits_on_the_event() -> None:
    ops = FakeOps()
    stager = Stager(ops)
    grad = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.float64)}
    staged = stager.to_host(grad)
    # returned before any copy ran: nothing blocked on the device
    assert staged.tensors["w"].eq(-1).all()
    assert ops.log[0] == ("wait_stream", "side", "current")  # the gradient is finished first
    assert [e for e in ops.log if e[0] == "copy"] == [("copy", "side")] * 2
    assert ("keep_alive", "side") in ops.log and ops.log[-1] == ("record", "side")
    host = staged.wait()
    assert ops.log[-1] == ("synchronize", "side")  # the event, never the training stream
    assert torch.equal(host["w"], grad["w"]) and host["w"].shape == (2, 3)
    assert torch.equal(host["b"], grad["b"]) and host["b"].dtype == torch.float64


def test_pinned_buffers_are_reused_after_release_and_not_before() -> None:
    ops = FakeOps()
    stager = Stager(ops)
    first = stager.to_host({"w": torch.ones(4)})
    second = stager.to_host({"w": torch.ones(4)})  # the first still holds its buffer
    assert ops.pinned_allocations == 2
    first.wait()
    second.wait()
    first.release()
    second.release()
    third = stager.to_host({"w": torch.full((4,), 7.0)})
    assert ops.pinned_allocations == 2  # reused
    assert third.wait()["w"].tolist() == [7.0] * 4


def test_to_device_makes_the_training_stream_wait_and_reuses_buffers_once_copied() -> None:
    ops = FakeOps()
    stager = Stager(ops)
    out = stager.to_device({"w": torch.arange(3.0)}, "cpu")
    assert ops.log == [
        ("wait_stream", "side", "current"),  # memory freed on the training stream may be reused
        ("copy", "side"),
        ("record", "side"),
        ("wait_event", "current", "side"),  # a device-side wait: the host does not block
    ]
    assert out["w"].tolist() == [0.0, 1.0, 2.0]
    again = stager.to_device({"w": torch.arange(3.0) + 1}, "cpu")
    assert ops.pinned_allocations == 1  # the first copy completed: its buffer came back
    assert again["w"].tolist() == [1.0, 2.0, 3.0]


def test_to_device_keeps_a_buffer_whose_copy_is_pending() -> None:
    ops = FakeOps()
    ops.wait_event = lambda stream, event: None  # type: ignore[method-assign]  # the copy stays queued
    stager = Stager(ops)
    stager.to_device({"w": torch.arange(3.0)}, "cpu")
    stager.to_device({"w": torch.arange(3.0)}, "cpu")
    assert ops.pinned_allocations == 2
    ops.side.run_until(len(ops.side.work))
    stager.to_device({"w": torch.arange(3.0)}, "cpu")
    assert ops.pinned_allocations == 2


def test_host_tensors_pass_through_untouched() -> None:
    ops = FakeOps()
    ops.is_device = lambda tensor: False  # type: ignore[method-assign]
    staged = Stager(ops).to_host({"w": torch.ones(2)})
    assert staged.event is None and ops.log == [] and staged.wait()["w"].tolist() == [1.0, 1.0]
