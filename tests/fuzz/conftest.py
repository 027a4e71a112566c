"""Fuzzing fixtures: hypothesis strategies for every decoder's input, and a real cluster to aim at.

Strategies (the ``fz`` fixture, a namespace, since test modules cannot import each other here):

- ``proto(cls)``: any protobuf message of class ``cls``, every field drawn from a small pool
  of meaningful values (the cluster's job, server and host names, edge integers, NaN, known
  and unknown dtypes) mixed with arbitrary ones, nested messages and oneofs included;
- ``mutated(data)``: ``data`` truncated, extended, with bytes flipped or a length field
  replaced by an edge value.

``fuzz_cluster`` is one scheduler and two daemons (``ps``, ``w0``) as real processes started
with short limits (``--idle-timeout``, ``--header-timeout``, ``--max-connections``), a server
``ps0`` of job ``job`` in this process (model ``w``: 8 float64, tau_max 1000) that adds every
update it applies, and a worker ``w0``. ``healthy(cluster)`` proves the processes are alive,
a normal push is APPLIED and the model is exactly what the normal pushes made of it.

Settings: every fuzz test runs a fixed number of examples with ``derandomize=True`` (the same
inputs on every run, so CI is stable); ``HYPOTHESIS_PROFILE=long`` multiplies them by 20.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import mlfabric
from mlfabric.cluster import LocalCluster

#: Examples per fuzz test (each test asserts it ran at least this many).
EXAMPLES = 1000 * (20 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 1)

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)

JOB, SERVER, MODEL_SIZE = "job", "ps0", 8

TOPOLOGY = """
hosts = ["ps", "w0", "fz"]
switches = ["sw"]
[[links]]
a = "ps"
b = "sw"
mbps = 1000
[[links]]
a = "w0"
b = "sw"
mbps = 1000
[[links]]
a = "fz"
b = "sw"
mbps = 1000
"""

#: Limits the fuzz cluster's daemons run with (``mlfabric daemon`` flags).
DAEMON_LIMITS = ["--idle-timeout", "3", "--header-timeout", "1", "--max-connections", "64"]

# ------------------------------------------------------------------ strategies

_NAMES = [
    JOB,
    SERVER,
    "w",
    "w",
    "b",
    "w0",
    "ps",
    "fz",
    "",
    "x",
    "agg:0:1",
    "ps/1",
    "w0/1",
    "\x00",
    "é" * 3,
    "a" * 300,
]
_DTYPES = ["float32", "float16", "bfloat16", "float64", "uint8", "int64", "", "complex128", "float32\x00"]
_INTS = [0, 1, -1, 2, 7, 8, 64, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, -(2**63)]
_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e308, math.nan, math.inf, -math.inf, 5e-324]

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        pool = [v for v in _INTS if lo <= v <= hi]
        return st.one_of(st.sampled_from(pool), st.integers(lo, hi), st.integers(0, 64))
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        wide = st.floats(
            allow_nan=True, allow_infinity=True, width=64 if t == FieldDescriptor.TYPE_DOUBLE else 32
        )
        return st.one_of(st.sampled_from(_FLOATS if t == FieldDescriptor.TYPE_DOUBLE else _FLOATS[:3]), wide)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        names = _DTYPES if field.name == "dtype" else _NAMES
        return st.one_of(st.sampled_from(names), st.text(max_size=20))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=32)
    if t == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 50))
    raise TypeError(f"field {field.full_name}: unsupported type {t}")


@st.composite
def _message(draw: Any, cls: Any, depth: int) -> Any:
    msg = cls()
    desc = cls.DESCRIPTOR
    oneof_fields = {f.name for o in desc.oneofs for f in o.fields}
    chosen: set[str] = set()
    for oneof in desc.oneofs:
        pick = draw(st.sampled_from([None, *oneof.fields]))
        if pick is not None:
            chosen.add(pick.name)
    for field in desc.fields:
        if field.name in oneof_fields and field.name not in chosen:
            continue
        if field.name not in chosen and not draw(st.booleans()):
            continue  # left at its default
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth <= 0:
                continue
            sub = _message(field.message_type._concrete_class, depth - 1)
            if field.is_repeated:
                for value in draw(st.lists(sub, max_size=3)):
                    getattr(msg, field.name).add().CopyFrom(value)
            else:
                getattr(msg, field.name).CopyFrom(draw(sub))
        elif field.is_repeated:
            getattr(msg, field.name).extend(draw(st.lists(_scalar(field), max_size=4)))
        else:
            setattr(msg, field.name, draw(_scalar(field)))
    return msg


def proto(cls: Any, depth: int = 3) -> st.SearchStrategy[Any]:
    """Any message of protobuf class ``cls`` (nested messages up to ``depth`` levels)."""
    return _message(cls, depth)


@st.composite
def mutated(draw: Any, data: bytes) -> bytes:
    """``data`` with one of: truncation, extension, flipped bytes, a 4-byte field made an edge value."""
    how = draw(st.sampled_from(["truncate", "extend", "flip", "length", "same"]))
    if how == "truncate" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "extend":
        return data + draw(st.binary(min_size=1, max_size=64))
    if how == "flip" and data:
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(out) - 1))
            out[i] ^= draw(st.integers(1, 255))
        return bytes(out)
    if how == "length" and len(data) >= 4:
        at = draw(st.integers(0, len(data) - 4))
        value = draw(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 16 << 20, (16 << 20) + 1, 1 << 30]))
        return data[:at] + value.to_bytes(4, "big") + data[at + 4 :]
    return data


# ------------------------------------------------------------------ the cluster


class _FuzzCluster(LocalCluster):
    def _daemon_args(self, host: str) -> list[str]:
        return [*super()._daemon_args(host), *DAEMON_LIMITS]


def healthy(cluster: types.SimpleNamespace) -> None:
    """Raise unless the processes live, a normal push is APPLIED and the model is exactly right."""
    cluster.processes.check_alive()
    result = cluster.worker.push(SERVER, {"w": np.ones(MODEL_SIZE)}).wait(30)
    assert result.applied, f"a normal push after fuzzing: {result}"
    cluster.pushes += 1
    _version, model = cluster.worker.get(SERVER)
    np.testing.assert_array_equal(model["w"], np.full(MODEL_SIZE, float(cluster.pushes)))
    assert cluster.foreign == [], f"the server applied updates nobody legitimate pushed: {cluster.foreign}"


@pytest.fixture(scope="package")
def fuzz_cluster() -> Iterator[types.SimpleNamespace]:
    """The scheduler, daemons ``ps`` and ``w0`` (real processes), server ``ps0`` and worker ``w0``."""
    workdir = tempfile.mkdtemp(prefix="mlfz-")  # Unix socket paths must stay short
    topology = Path(workdir) / "topology.toml"
    topology.write_text(TOPOLOGY)
    procs = _FuzzCluster(topology, policy="fair", workdir=workdir, hosts=["ps", "w0"], log_level="WARNING")
    procs.start()
    stop = threading.Event()
    server = worker = thread = None
    ns = types.SimpleNamespace(processes=procs, pushes=0, foreign=[], workdir=workdir)
    try:
        server = mlfabric.register_as_server(
            JOB,
            SERVER,
            {"w": np.zeros(MODEL_SIZE)},
            mlfabric.Params(tau_max=1000),
            daemon=procs.socket("ps"),
        )

        @server.on_update
        def apply(update: dict[str, np.ndarray], meta: Any) -> None:
            if meta.worker != "w0":
                ns.foreign.append(meta.worker)
            server.model["w"] += update["w"]

        thread = threading.Thread(target=server.serve, kwargs={"until": stop}, daemon=True)
        thread.start()
        worker = mlfabric.register_as_worker(JOB, name="w0", daemon=procs.socket("w0"), wait=30)
        ns.server, ns.worker = server, worker
        ns.ps_socket, ns.w0_socket = procs.socket("ps"), procs.socket("w0")
        ns.ps_data = procs.daemons["ps"]["data_address"]
        ns.scheduler = procs.scheduler_address
        healthy(ns)
        yield ns
    finally:
        stop.set()
        if worker is not None:
            worker.close()
        if thread is not None:
            thread.join(10)
        if server is not None:
            server.close()
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def fz() -> types.SimpleNamespace:
    """The strategies and settings (see the module docstring)."""
    return types.SimpleNamespace(
        proto=proto,
        mutated=mutated,
        settings=FUZZ_SETTINGS,
        examples=EXAMPLES,
        healthy=healthy,
        job=JOB,
        server=SERVER,
        model_size=MODEL_SIZE,
        python=sys.executable,
        time=time,
    )
