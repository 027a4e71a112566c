"""register_as_replica refuses bad input with named errors (docs/replication.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mlfabric
from mlfabric.cluster import LocalCluster

TOPOLOGY = """
hosts = ["ps", "rep"]
switches = ["sw"]
[[links]]
a = "ps"
b = "sw"
mbps = 1000
[[links]]
a = "rep"
b = "sw"
mbps = 1000
"""

MODEL = {"w": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.ones(4)}


def test_bad_replica_registrations_are_refused_naming_the_problem(tmp_path: Path) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    with LocalCluster(topology, policy="stf", workdir=tmp_path / "run") as cluster:
        rep_sock, ps_sock = cluster.socket("rep"), cluster.socket("ps")
        with mlfabric.register_as_server("job", "ps0", MODEL, mlfabric.Params(div_max=1.0), daemon=ps_sock):
            cases = [
                (("nojob", "ps0", None, rep_sock), "unknown_job", "nojob"),
                (("job", "ps9", None, rep_sock), "unknown_server", "ps9"),
                (("job", "ps0", {"w": np.zeros((3, 2)), "b": np.ones(4)}, rep_sock), "model_mismatch", "'w'"),
                (("job", "ps0", {"w": MODEL["w"]}, rep_sock), "model_mismatch", "'b'"),
                (("job", "ps0", None, ps_sock), "refused", "own host"),
            ]
            for (job, server, model, sock), code, named in cases:
                with pytest.raises(mlfabric.MlfabricError, match=named) as info:
                    mlfabric.register_as_replica(job, server, model, daemon=sock, timeout=20)
                assert info.value.code == code, (job, server, info.value)
            with mlfabric.register_as_replica("job", "ps0", MODEL, daemon=rep_sock, timeout=20) as replica:
                assert replica.version == 0
                assert all(np.array_equal(replica.model[k], MODEL[k]) for k in MODEL)
                with pytest.raises(mlfabric.MlfabricError, match="already has replica") as info:
                    mlfabric.register_as_replica("job", "ps0", daemon=rep_sock, timeout=20)
                assert info.value.code == "duplicate_replica"
