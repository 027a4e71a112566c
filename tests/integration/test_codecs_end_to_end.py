"""int8 and top-k members aggregated at an aggregator SIGKILLed and restarted: exactly once (issue 26).

The setting of ``test_aggregates_end_to_end.py`` (a scheduler running ``stf+agg``, the
aggregator hop ``x`` the only daemon that may aggregate), with the server's link at 1 Mbit/s
enforced by the daemons, a model of 5100 elements (``codec_roles.py``), and the job's codec
``int8:bound=10,stochastic=0`` (``Params(compression=...)``): every push travels as int8 words
with the shared scale 10 / 127, aggregates are summed on the words (int32) and forwarded as
int8/int16 words; or ``topk:ratio=0.05``: every push travels as its 255 largest values and
their positions, aggregates are summed into float32 and forwarded on the union of their
members' positions. The aggregator's daemon is SIGKILLed once a member reached it and started
again; the workers push their second half only then, so aggregates are made at the restarted
daemon (about 35 per run).

Every push resolves APPLIED, DROPPED or UNKNOWN (with a reason); no member is applied twice;
the final model equals the initial one minus the **decoded** applied members (nearest
rounding: each update's decode is known exactly, so a member applied twice or lost shows),
and (int8) is within the codec's error (half a scale per element per member) of the exact sum.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlfabric.aggregators.codecs import decode
from mlfabric.aggregators.codecs.payload import encode_update, encoded_of, parse_codec
from mlfabric.cluster import wait_for_ready_file
from mlfabric.tensors import encode_into, plan_layout
from tests.integration.jobs import applied_pushes, finish, read_outcome, spawn_workers, wait_for
from tests.integration.test_aggregates_end_to_end import (
    TOPOLOGY,
    AggregatorCluster,
    _member_at_x,
)

HERE = Path(__file__).resolve().parent
INT8, TOPK = "int8:bound=10,stochastic=0", "topk:ratio=0.05"
TAU_MAX = 30
WORKERS = [("a", 0), ("a", 1), ("b", 2), ("b", 3)]
PUSHES_PER_WORKER = 40


class RestartingCluster(AggregatorCluster):
    """:class:`AggregatorCluster` that can start a host's daemon again (after it was killed)."""

    def restart_daemon(self, host: str, name: str) -> None:
        ready = self.workdir / "ready" / f"{name}.json"
        argv = [
            *("daemon", "--host", host, "--scheduler", str(self.scheduler_address)),
            *("--socket", self.socket(host), "--data-listen", self._data_listen(host)),
            *("--ready-file", str(ready), *self._daemon_args(host)),
        ]
        self.daemons[host] = wait_for_ready_file(ready, self._launch(host, name, argv), self.ready_timeout)


def _codec_roles() -> Any:  # the model and updates the server and the workers used
    spec = importlib.util.spec_from_file_location("codec_roles", HERE / "codec_roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _decoded(update: dict[str, np.ndarray], spec: str) -> dict[str, np.ndarray]:
    """What the server applies of ``update`` sent with ``spec`` (deterministic: known exactly)."""
    codec = parse_codec(spec)
    assert codec is not None
    words, encoded = encode_update(update, codec)
    layouts, total = plan_layout(words, encoded)
    buf = bytearray(total)
    encode_into(memoryview(buf), words, layouts)
    return {x.name: np.asarray(decode(encoded_of(x, memoryview(buf))), np.float64) for x in layouts}


def _x_forwards(run: Path) -> list[dict[str, Any]]:
    path = run / "reports" / "x.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["update_id"].startswith("agg:") and r["dst_host"] == "ps"]


@pytest.mark.slow
@pytest.mark.parametrize("codec", [INT8, TOPK])
def test_members_at_a_killed_and_restarted_aggregator_are_applied_exactly_once(
    tmp_path: Path, codec: str
) -> None:
    roles = _codec_roles()
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY.replace("mbps = 10\n", "mbps = 1\n", 1))  # the server's link: 1 Mbit/s
    out = tmp_path / "out"
    out.mkdir()
    run = tmp_path / "run"
    cluster = RestartingCluster(
        topology,
        policy="stf+agg",
        workdir=run,
        enforce_nic_rates=True,  # the server's 1 Mbit/s link is real: updates queue for it
        extra_scheduler_args=["--aggregate-timeout", "10"],
    )
    try:
        cluster.start()
        argv = [sys.executable, str(HERE / "codec_roles.py"), "server", str(out), str(TAU_MAX), codec]
        server = cluster.spawn("ps", argv, name="server")
        wait_for(out / "server.ready", server, 60)
        workers = spawn_workers(
            cluster, [sys.executable, str(HERE / "codec_roles.py"), "worker"], out, WORKERS, PUSHES_PER_WORKER
        )
        _member_at_x(cluster, server, 60)
        aggregator = next(p for p in cluster.processes() if p.name == "daemon-x")
        aggregator.popen.send_signal(signal.SIGKILL)
        aggregator.popen.wait(10)
        before = len(_x_forwards(run))
        cluster.restart_daemon("x", "daemon-x-restarted")
        (out / "go").touch()  # the second halves: aggregated at the restarted daemon
        finish(server, workers)
    finally:
        cluster.stop()

    results, _, members = read_outcome(out, WORKERS, PUSHES_PER_WORKER)
    forwards = _x_forwards(run)
    assert len(forwards) > before, "the restarted aggregator forwarded no aggregate"
    elements = sum(int(np.prod(s)) for s in roles.SHAPES.values())
    if codec == INT8:  # int8 words (int16 where the sum needs them), not float64's 8 bytes
        assert all(int(f["bytes"]) <= 2 * elements for f in forwards), forwards
    else:  # the union of the members' positions: at least one member's 255, fewer than dense
        assert all(8 * 255 <= int(f["bytes"]) < 8 * elements for f in forwards), forwards
    initial = roles.initial_model()
    decoded = {k: v.copy() for k, v in initial.items()}
    exact = {k: v.copy() for k, v in initial.items()}
    applied = applied_pushes(results, members, TAU_MAX)
    for rank, p in applied:
        update = roles.update_for(rank, p["index"])
        sent = _decoded(update, codec)
        for k in initial:
            decoded[k] -= sent[k]
            exact[k] -= update[k]
    count = len(applied)
    final = np.load(out / "final.npz")
    scale = 10 / 127
    for k in initial:
        np.testing.assert_allclose(final[k], decoded[k], rtol=0, atol=1e-3)  # each member once
        if codec == INT8:
            assert np.abs(final[k] - exact[k]).max() <= count * scale / 2 + 1e-3  # the codec's error
