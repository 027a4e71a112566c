"""mlfabric: network-aware transfer scheduling for distributed deep learning.

Training code talks only to its host's daemon::

    import mlfabric

    worker = mlfabric.register_as_worker("job1")
    handle = worker.push("ps0", {"w": grad}, norm=1.0)
    result = handle.wait(timeout=30)      # APPLIED (delay, version) or DROPPED (reason)
    version, model = worker.get("ps0")

See :mod:`mlfabric.api` for the full interface (the paper's Table 1).
"""

from __future__ import annotations

from typing import Any

from mlfabric.wire.version import __version__ as __version__

_API = {
    "register_as_worker",
    "register_as_server",
    "register_as_replica",
    "Replica",
    "Worker",
    "Server",
    "PushHandle",
    "PushResult",
    "UpdateMeta",
    "Params",
    "MlfabricError",
    "TensorError",
    "APPLIED",
    "DROPPED",
    "UNKNOWN",
    "join_allreduce",
    "LocalSGD",
    "AllreduceGroup",
    "AllreduceHandle",
}

__all__ = sorted(_API | {"__version__"})


def __getattr__(name: str) -> Any:
    # The API module pulls in numpy and the protobuf stubs; load it on first use so
    # that `mlfabric --help` and the pure scheduler modules stay light.
    if name in _API:
        from mlfabric import api

        return getattr(api, name)
    raise AttributeError(f"module 'mlfabric' has no attribute {name!r}")
