"""A participant process for the all-reduce tests: join, write a marker, all-reduce, print the sum.

Usage: python participant.py JOB RANK WORLD_SIZE ELEMENTS MARKER_FILE
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import mlfabric


def main() -> None:
    job, rank, world, elements, marker = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
    group = mlfabric.join_allreduce(job, world_size=world, participant=f"r{rank}")
    handle = group.allreduce_async({"w": np.full(elements, float(rank + 1))}, timeout=60)
    Path(marker).write_text("submitted")
    total = handle.wait()
    print(float(total["w"][0]), flush=True)


if __name__ == "__main__":
    main()
