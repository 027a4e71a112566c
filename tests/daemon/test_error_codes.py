"""The daemon switches on the scheduler's ErrorCode, never on the wording of its message."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest

import mlfabric
from mlfabric.proto.v1 import control_pb2


def _refuse(scheduler: Any, monkeypatch: Any, job: str, code: control_pb2.ErrorCode, error: str) -> list[str]:
    """Make the fake scheduler refuse every registration in ``job`` with ``code``; names registered."""
    original = scheduler._on_message
    asked: list[str] = []

    def on_message(host: str, address: str, m: Any) -> None:
        if m.WhichOneof("kind") == "register_role" and m.register_role.job == job:
            asked.append(m.register_role.name)
            ack = control_pb2.RoleAck(request_id=m.register_role.request_id, ok=False, error=error, code=code)
            scheduler.send(host, control_pb2.Directive(role_ack=ack))
            return
        original(host, address, m)

    monkeypatch.setattr(scheduler, "_on_message", on_message)
    return asked


def test_refused_server_gets_the_code_whatever_the_message_says(
    make_daemon: Any, scheduler: Any, monkeypatch: Any
) -> None:
    d = make_daemon("h")
    _refuse(scheduler, monkeypatch, "j", control_pb2.ERROR_CODE_DUPLICATE_SERVER, "unknown job 'j' (wording)")
    with pytest.raises(mlfabric.MlfabricError) as info:
        mlfabric.register_as_server("j", "ps", {"w": np.zeros(2)}, daemon=d.config.socket_path)
    assert info.value.code == "duplicate_server" and "wording" in str(info.value)


def test_worker_waits_only_while_the_job_has_no_server(
    make_daemon: Any, scheduler: Any, monkeypatch: Any
) -> None:
    d = make_daemon("h")
    asked = _refuse(
        scheduler, monkeypatch, "j", control_pb2.ERROR_CODE_UNKNOWN_WORKER, "no servers (wording)"
    )
    with pytest.raises(mlfabric.MlfabricError) as info:
        mlfabric.register_as_worker("j", name="w", daemon=d.config.socket_path, wait=30)
    assert info.value.code == "unknown_worker"
    assert asked == ["w"], "a refusal other than UNKNOWN_JOB is final, not retried"


def test_a_code_this_daemon_does_not_know_is_refused(
    make_daemon: Any, scheduler: Any, monkeypatch: Any
) -> None:
    d = make_daemon("h")
    # an ErrorCode no enum value of this version names, as the wire may carry it
    unknown = cast(control_pb2.ErrorCode, 999)
    _refuse(scheduler, monkeypatch, "j", unknown, "a newer scheduler's reason")
    with pytest.raises(mlfabric.MlfabricError) as info:
        mlfabric.register_as_server("j", "ps", {"w": np.zeros(2)}, daemon=d.config.socket_path)
    assert info.value.code == "refused" and "newer" in str(info.value)


def test_tensor_error_is_an_mlfabric_error_and_exported() -> None:
    """Issue 27 item 10: TensorError was a plain ValueError, not exported."""
    assert issubclass(mlfabric.TensorError, mlfabric.MlfabricError)
    assert issubclass(mlfabric.TensorError, ValueError)  # as before
    with pytest.raises(mlfabric.MlfabricError) as info:
        mlfabric.tensors.plan_layout({"w": np.zeros(3, dtype=np.int8)})
    assert isinstance(info.value, mlfabric.TensorError) and info.value.code == "bad_tensor"
