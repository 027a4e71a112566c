"""Roles after a scheduler restart: a worker re-registers whatever the order daemons come back in,
and a worker whose role is gone for good gets an error on push, not endless drops (DESIGN §3)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.proto.v1 import control_pb2
from tests.daemon.test_daemon_push import cluster, wait_until  # noqa: F401 - the fixture

UPDATE = {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)}


def _restart(scheduler: Any) -> Any:
    port = int(scheduler.address.rsplit(":", 1)[1])
    scheduler.stop()
    fresh = type(scheduler)()
    return fresh, port


def _refuse_workers(fresh: Any, code: control_pb2.ErrorCode, error: str) -> list[str]:
    """Refuse every worker registration with ``code``; drop updates of unregistered workers."""
    original = fresh._on_message
    asked: list[str] = []

    def on_message(host: str, address: str, m: Any) -> None:
        kind = m.WhichOneof("kind")
        if kind == "register_role" and m.register_role.role == control_pb2.ROLE_WORKER:
            asked.append(m.register_role.name)
            ack = control_pb2.RoleAck(request_id=m.register_role.request_id, ok=False, error=error, code=code)
            fresh.send(host, control_pb2.Directive(role_ack=ack))
            return
        if kind == "update_ready":  # what the real scheduler does with a worker it does not know
            r = m.update_ready
            drop = control_pb2.DropDirective(
                update_id=r.update_id,
                reason=f"job {r.job!r} has no worker {r.worker!r} on host {host!r}",
                code=control_pb2.ERROR_CODE_UNKNOWN_WORKER,
            )
            fresh.send(host, control_pb2.Directive(drop=drop))
            return
        original(host, address, m)

    fresh._on_message = on_message
    return asked


def test_worker_whose_role_is_gone_gets_an_error_on_push(cluster: dict[str, Any], scheduler: Any) -> None:  # noqa: F811
    worker = cluster["worker"]
    assert worker.push("ps0", UPDATE).wait(10).applied
    fresh, port = _restart(scheduler)
    asked = _refuse_workers(fresh, control_pb2.ERROR_CODE_REFUSED, "worker name 'w0' is taken")
    fresh.start(port)
    try:
        wait_until(lambda: asked == ["w0"], timeout=15)
        role = cluster["w0"].worker  # the refusal is on its way back: wait until the daemon has it
        wait_until(lambda: any(lost for lost, _ in list(role._unregistered.values())), timeout=15)
        with pytest.raises(mlfabric.MlfabricError) as info:
            worker.push("ps0", UPDATE).wait(10)
        assert info.value.code == "role_lost"
        assert "w0" in str(info.value) and "worker name 'w0' is taken" in str(info.value)
    finally:
        fresh.stop()


def test_worker_refused_while_its_job_has_no_server_keeps_retrying(
    cluster: dict[str, Any],  # noqa: F811 - the fixture
    scheduler: Any,
) -> None:
    """The worker's daemon is back before the server's: its pushes name that, then it converges.

    Without a fallback (``fallback_after=None``); test_degradation.py has the kept pushes.
    """
    worker, server = cluster["worker"], cluster["server"]
    cluster["w0"].worker.fallback.after = None
    fresh, port = _restart(scheduler)
    fresh.hold = True
    original = fresh._on_message
    servers_allowed: list[bool] = []

    def on_message(host: str, address: str, m: Any) -> None:
        r = m.register_role if m.WhichOneof("kind") == "register_role" else None
        if r is not None and r.role == control_pb2.ROLE_SERVER and not servers_allowed:
            return  # the server's daemon is "not back yet": its registration goes unanswered
        original(host, address, m)

    fresh._on_message = on_message
    fresh.start(port)
    try:
        wait_until(lambda: any(h == "w0" for h, _, _ in fresh.registered), timeout=15)
        result = worker.push("ps0", UPDATE).wait(10)
        assert result.status == mlfabric.DROPPED and "not registered" in result.reason
        assert not fresh.ready  # not sent to a scheduler that does not know the worker
        servers_allowed.append(True)
        ps = cluster["ps"]
        ps._on_connected(None)  # the server's daemon comes back and re-registers
        wait_until(lambda: sum(h == "w0" for h, _, _ in fresh.registered) >= 2, timeout=15)
        fresh.hold = False
        wait_until(lambda: worker.push("ps0", UPDATE).wait(10).applied, timeout=15)
        assert server.version >= 1
    finally:
        fresh.stop()
