"""Post-local SGD over mlfabric trains exactly as torch's own hook and averager over gloo (issue 26)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlfabric.cluster import LocalCluster

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from mlfabric.examples.ddp_digits import build_model
from tests.allreduce.test_ddp_hook import train

STEPS, START, PERIOD = 14, 4, 3  # all-reduce steps 0-3, average after steps 4, 7, 10, 13


@pytest.mark.slow
def test_post_local_sgd_over_mlfabric_trains_like_torchs_over_gloo(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    world = 2
    local_sgd = ("--local-sgd", f"{START}:{PERIOD}")
    ours = train(cluster, "mlfabric-daemons", world, tmp_path, STEPS, *local_sgd)
    gloo = train(cluster, "gloo", world, tmp_path, STEPS, *local_sgd)
    names = sorted(gloo[0]["params"])
    for rank in range(world):
        for name in names:
            np.testing.assert_allclose(
                ours[rank]["params"][name],
                gloo[rank]["params"][name],
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{rank} {name}",
            )
    # the last step (13) averaged the model: the ranks agree
    for name in names:
        np.testing.assert_allclose(ours[1]["params"][name], ours[0]["params"][name], rtol=1e-6, atol=1e-7)
    initial = {name: p.detach().numpy() for name, p in build_model(0).named_parameters()}
    moved = max(float(np.abs(ours[0]["params"][n] - initial[n]).max()) for n in names)
    assert moved > 1e-3


def test_local_sgd_rejects_an_intra_node_gradient_all_reduce() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    import mlfabric.torch as mt

    with pytest.raises(ValueError, match="post_local_gradient_allreduce"):
        mt.LocalSGDState(
            PostLocalSGDState(None, None, 2, post_local_gradient_allreduce=True),
            None,  # type: ignore[arg-type]  # refused before the hook state is looked at
        )
    with pytest.raises(ValueError, match="period"):
        mt.PeriodicModelAverager(None, period=0)  # type: ignore[arg-type]
