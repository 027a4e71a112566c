"""A participant that all-reduces over a gloo process group with mlfabric's kept plan.

Usage: python group_participant.py JOB RANK WORLD INIT_METHOD OUT [--mismatch]

Joins the process group and the job, all-reduces ``CALLS`` times (exact integer sums checked),
writes a JSON report (the plans, the plan requests, errors) to OUT. With ``--mismatch`` rank 1
all-reduces a tensor of another shape on its first call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

import mlfabric
from mlfabric.localclient import MlfabricError

CALLS = 4
N = 1 << 21  # 8 MB: enough that a tree beats the ring on the planner's model


def main() -> None:
    job, rank, world, init, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    mismatch = "--mismatch" in sys.argv
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = mlfabric.join_allreduce(
        job, world_size=world, participant=f"rank{rank}", process_group=dist.group.WORLD, timeout=30
    )
    report: dict[str, object] = {"rank": rank, "plans": [], "errors": []}
    expected = (np.arange(N) % 97 * sum(range(1, world + 1))).astype(np.float32)
    for call in range(CALLS):
        n = N - 1 if mismatch and rank == 1 and call == 0 else N
        mine = (np.arange(n) % 97 * (rank + 1)).astype(np.float32)
        try:
            handle = group.allreduce_async({"w": mine}, name="grads")
            total = handle.wait(60)
        except MlfabricError as exc:
            report["errors"].append([call, exc.code, str(exc)])  # type: ignore[attr-defined]
            continue
        if not np.array_equal(total["w"], expected):
            raise SystemExit(f"rank {rank}: wrong sum at call {call}")
        report["plans"].append(handle.plan)  # type: ignore[attr-defined]
    report["plan_requests"] = group.executor.plan_requests
    Path(out).write_text(json.dumps(report))
    group.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from mlfabric.torch import exit_rank

    exit_rank(0)  # gloo's threads outlive the group: no interpreter teardown
