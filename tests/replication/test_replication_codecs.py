"""A replica applies compressed updates as its server does (docs/compression.md, docs/replication.md).

The replication test's cluster (``test_replication.py``) with the job's codec
``int8:bound=10,stochastic=0``: the server's daemon logs each payload it applied as it came
(int8 words and their encoding) and the replica's process decodes it the same way, so the two
models are bit-identical and equal the initial one minus the decoded updates.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlfabric.aggregators.codecs import decode
from mlfabric.aggregators.codecs.payload import encode_update, encoded_of, parse_codec
from mlfabric.tensors import encode_into, plan_layout
from tests.replication.test_replication import Run, _model, _roles

CODEC = "int8:bound=10,stochastic=0"


@pytest.mark.slow
def test_a_replica_applies_compressed_updates_bit_identically_to_its_server(tmp_path: Path) -> None:
    run = Run(tmp_path, div_max=40.0, server_args=(CODEC,))
    try:
        run.start_workers(pushes=15, gap=0.0)
        results = run.finish(run.server, run.replica)
    finally:
        run.stop()
    assert all(p["status"] == "APPLIED" for ps in results.values() for p in ps), results
    roles, codec = _roles(), parse_codec(CODEC)
    assert codec is not None
    expected = roles.initial_model()
    for rank, pushes in results.items():
        for p in pushes:
            words, encoded = encode_update(roles.update_for(rank, p["index"]), codec)
            layouts, total = plan_layout(words, encoded)
            buf = bytearray(total)
            encode_into(memoryview(buf), words, layouts)
            for x in layouts:
                expected[x.name] -= decode(encoded_of(x, memoryview(buf)))
    server, replica = _model(run.out, "server"), _model(run.out, "replica")
    for k in expected:
        np.testing.assert_allclose(server[k], expected[k], rtol=0, atol=1e-4)
        assert np.array_equal(replica[k], server[k]), "the replica differs from its server"
        assert not np.array_equal(server[k], np.round(server[k]))  # the int8 decodes are not integers
    applied = json.loads((run.out / "replica.json").read_text())["applied"]
    assert applied == json.loads((run.out / "server.json").read_text())["applied"]
