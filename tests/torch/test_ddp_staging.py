"""The DDP hook stages a device bucket over the daemons (a fake of the CUDA calls selects the path)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import mlfabric  # noqa: E402
from mlfabric.cluster import LocalCluster  # noqa: E402
from mlfabric.torch import HookState, allreduce_hook  # noqa: E402
from mlfabric.torch.staging import Stager  # noqa: E402
from tests.torch.fakes import FakeOps  # noqa: E402


class Bucket:
    """What the hook reads of DDP's ``GradBucket``."""

    def __init__(self, buffer: Any, index: int) -> None:
        self._buffer, self._index = buffer, index

    def buffer(self) -> Any:
        return self._buffer

    def index(self) -> int:
        return self._index


def test_a_device_bucket_is_staged_summed_and_brought_back(cluster: LocalCluster) -> None:
    buffers = [torch.arange(10.0) * (r + 1) for r in range(2)]
    fakes = [FakeOps(), FakeOps()]

    def rank(r: int) -> Any:
        with mlfabric.join_allreduce(
            "ddp", world_size=2, participant=f"r{r}", daemon=cluster.socket(f"h{r}")
        ) as group:
            state = HookState(group, timeout=60, stager=Stager(fakes[r]))
            buckets: list[Any] = [Bucket(buffers[r].clone(), i) for i in range(2)]
            return [allreduce_hook(state, b).wait() for b in buckets]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank, range(2)))
    expected = (buffers[0] + buffers[1]) / 2
    for r in range(2):
        for got in results[r]:
            assert torch.equal(got, expected), (r, got)
        log = fakes[r].log
        assert log.count(("copy", "side")) == 4  # per bucket: to the host and back
        assert log.count(("synchronize", "side")) == 2  # on the helper thread, for the copy to the host
        assert log.count(("wait_event", "current", "side")) == 2
