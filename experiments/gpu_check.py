"""The CUDA path on a real GPU: correctness of push/get/optimizer with CUDA tensors, and copy overlap.

Self-contained: starts a local mlfabric cluster (scheduler + one daemon, real processes on
loopback), serves a model from this process and pushes CUDA tensors to it. Without CUDA it
says so and exits 0 (``SKIPPED``). Checks (each prints ``ok`` or raises):

1. ``push`` of CUDA tensors (float32, float16, bfloat16, a non-contiguous one): the server's
   model is the initial one minus the pushed values, exactly;
2. ``get(device="cuda")`` returns the model on the GPU, equal to the server's;
3. ``DistributedOptimizer`` on a CUDA model, one worker, SGD with momentum: the parameters
   after a few steps equal those of the wrapped optimizer alone (to float32 rounding).

Then measures, with CUDA events and the wall clock (median of ``--rounds`` rounds):

- copy/compute overlap: a matmul loop on the training stream alone, the staging copies
  (:meth:`mlfabric.torch.staging.Stager.to_host`) of ``--mib`` MiB alone, and both issued
  together; ``overlap = (compute + copy - both) / min(compute, copy)`` (1: the copy fully
  hidden, 0: serialised);
- copy/transfer overlap: pushing ``--groups`` groups one after the other with a blocking
  ``.cpu()`` then ``push`` each, vs staging all groups first and pushing each as its copy
  completes (the optimizer's sender): wall time of each, and the ratio.

Run (on a machine with a GPU)::

    python experiments/gpu_check.py --mib 64 --groups 8 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=64, help="MiB staged per round")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device (torch.cuda.is_available() is False); nothing was checked")
        return 0
    import mlfabric
    from mlfabric.cluster import LocalCluster
    from mlfabric.torch import DistributedOptimizer, GroupServers
    from mlfabric.torch.staging import Stager

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    work = Path(tempfile.mkdtemp(prefix="mlfgpu-"))
    (work / "t.toml").write_text(
        'hosts = ["h0"]\nswitches = ["sw"]\n[[links]]\na = "h0"\nb = "sw"\nmbps = 100000\n'
    )
    dev = torch.device("cuda")
    with LocalCluster(work / "t.toml", policy="stf", workdir=work / "run") as cluster:
        sock = cluster.socket("h0")
        # 1. push of CUDA tensors
        init = {
            "a": torch.zeros(1000),
            "h": torch.zeros(64, dtype=torch.float16),
            "b": torch.zeros(32, dtype=torch.bfloat16),
            "t": torch.zeros(8, 16),
        }
        server = mlfabric.register_as_server(
            "gpu", "ps", {k: v.clone() for k, v in init.items()}, daemon=sock
        )
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, kwargs={"until": stop}, daemon=True)
        thread.start()
        worker = mlfabric.register_as_worker("gpu", name="w", daemon=sock)
        update = {
            "a": torch.randn(1000, device=dev),
            "h": torch.randn(64, device=dev).half(),
            "b": torch.randn(32, device=dev).bfloat16(),
            "t": torch.randn(16, 8, device=dev).t(),  # non-contiguous
        }
        result = worker.push("ps", update).wait(timeout=60)
        assert result.status == mlfabric.APPLIED, result
        for k in init:
            assert torch.equal(server.model[k], init[k] - update[k].cpu()), k
        print("1. push of CUDA tensors: ok")
        # 2. get(device=)
        _, model = worker.get("ps", min_version=result.version, device="cuda")
        torch.cuda.current_stream().synchronize()
        for k in init:
            assert model[k].is_cuda and torch.equal(model[k].cpu(), server.model[k]), k
        print("2. get(device='cuda'): ok")
        stop.set()
        thread.join()
        worker.close()
        server.close()
        # 3. the optimizer on a CUDA model
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
        alone = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(
            dev
        )
        alone.load_state_dict(net.state_dict())
        with GroupServers("gpu2", net.named_parameters(), group_bytes=0, daemon=sock):
            w2 = mlfabric.register_as_worker("gpu2", name="w", daemon=sock)
            opt = DistributedOptimizer(
                torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                net.named_parameters(),
                w2,
                group_bytes=0,
            )
            ref = torch.optim.SGD(alone.parameters(), lr=0.1, momentum=0.9)
            opt.pull()
            for step in range(5):
                x = torch.randn(32, 64, device=dev, generator=torch.Generator(dev).manual_seed(step))
                y = torch.randint(0, 10, (32,), device=dev, generator=torch.Generator(dev).manual_seed(step))
                for m, o in ((net, opt), (alone, ref)):
                    o.zero_grad()
                    torch.nn.functional.cross_entropy(m(x), y).backward()
                    o.step()
            for (n, p), (_, q) in zip(net.named_parameters(), alone.named_parameters(), strict=True):
                torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=n)
            opt.close()
            w2.close()
        print("3. DistributedOptimizer on CUDA parameters: ok")
        # measurements
        stager = Stager()
        n = args.mib * (1 << 20) // 4
        src = torch.randn(n, device=dev)
        mat = torch.randn(4096, 4096, device=dev)

        def compute() -> None:
            for _ in range(20):
                mat @ mat

        def timed(fn: object) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()  # type: ignore[operator]
            end.record()
            torch.cuda.synchronize()  # the host work (pushes) ran before end was recorded
            return start.elapsed_time(end) / 1e3

        def copy_only() -> None:
            stager.to_host({"x": src}).wait()

        # the staged tensor is ready before the compute is queued: the copy can overlap it
        def both_independent() -> None:
            ready = {"x": src}
            staged = stager.to_host(ready)  # queued before the compute: overlaps it
            compute()
            staged.wait()
            staged.release()
            torch.cuda.current_stream().synchronize()

        rows = []
        for _ in range(args.rounds + 1):
            rows.append((timed(compute), timed(copy_only), timed(both_independent)))
        rows = rows[1:]
        t_compute, t_copy, t_both = (statistics.median(r[i] for r in rows) for i in range(3))
        print(
            f"copy/compute: compute {t_compute * 1e3:.1f} ms, copy of {args.mib} MiB {t_copy * 1e3:.1f} ms "
            f"({args.mib / 1024 / t_copy:.2f} GiB/s), both {t_both * 1e3:.1f} ms, "
            f"overlap {(t_compute + t_copy - t_both) / min(t_compute, t_copy):.2f}"
        )
        # copy/transfer: blocking .cpu() + push per group vs staged pipeline
        names = [f"ps{i}" for i in range(args.groups)]
        servers = [
            mlfabric.register_as_server(
                "gpu3", names[i], {f"g{i}": torch.zeros(n // args.groups)}, daemon=sock
            )
            for i in range(args.groups)
        ]
        stop = threading.Event()
        threads = [threading.Thread(target=s.serve, kwargs={"until": stop}, daemon=True) for s in servers]
        for t in threads:
            t.start()
        w3 = mlfabric.register_as_worker("gpu3", name="w", daemon=sock)
        parts = [torch.randn(n // args.groups, device=dev) for _ in range(args.groups)]

        def blocking() -> None:
            handles = [w3.push(names[i], {f"g{i}": parts[i].cpu()}) for i in range(args.groups)]
            for h in handles:
                assert h.wait(timeout=120).applied

        def pipelined() -> None:
            staged = [stager.to_host({f"g{i}": parts[i]}) for i in range(args.groups)]
            handles = []
            for i, s in enumerate(staged):
                handles.append(w3.push(names[i], s.wait()))
                s.release()
            for h in handles:
                assert h.wait(timeout=120).applied

        pairs = []
        for _ in range(args.rounds + 1):
            pairs.append((timed(blocking), timed(pipelined)))
        pairs = pairs[1:]
        bl, pi = (statistics.median(p[i] for p in pairs) for i in range(2))
        spread = [f"{p[0] / p[1]:.2f}" for p in pairs]
        print(
            f"copy/transfer, {args.groups} groups of {args.mib / args.groups:.1f} MiB: blocking .cpu()+push "
            f"{bl * 1e3:.1f} ms, staged pipeline {pi * 1e3:.1f} ms, ratio {bl / pi:.2f} (per round {spread})"
        )
        stop.set()
        for t in threads:
            t.join()
        w3.close()
        for s in servers:
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
