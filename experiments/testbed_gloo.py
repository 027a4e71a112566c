"""The straightforward gloo parameter server of the testbed experiments (``--systems gloo``).

Rank 0 keeps one blocking ``recv`` per worker in its own thread (all workers' gradients flow
to it concurrently), applies whichever arrives and sends that worker the new model;
asynchronous, as ``testbed_e2e.py`` runs it (``testbed_aggregation.py`` has the synchronous
one). :func:`run_gloo` starts the ranks on the testbed's hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from digits_task import AccuracyLog, accuracy, dataset, gradient, load_numpy, make_model, one_thread
from harness import init_gloo, stop_all, wait_file

__all__ = ["gloo_role", "gloo_server", "run_gloo", "unflatten"]


def unflatten(flat: Any, names: list, shapes: list, sizes: list) -> dict[str, np.ndarray]:
    """Split one flat tensor back into named parameter arrays."""
    parts = flat.split(sizes)
    return {k: parts[i].reshape(shapes[i]).numpy() for i, k in enumerate(names)}


def gloo_role(args: argparse.Namespace) -> int:
    """One rank of the gloo parameter server (rank 0 serves, the others work)."""
    one_thread()
    import torch
    import torch.distributed as dist

    init_gloo(args.store, args.rank, args.world, args.ready_file)
    model = make_model()
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])
    if args.rank == 0:
        return gloo_server(args, model, flat, names, shapes, sizes)
    xtr, ytr, _, _ = dataset()
    rng = np.random.default_rng(args.seed)
    buf = torch.empty_like(flat)
    while True:
        dist.recv(buf, src=0)
        load_numpy(model, unflatten(buf, names, shapes, sizes))
        update = gradient(model, xtr, ytr, args.batch, rng, args.lr)
        time.sleep(args.compute_delay)
        dist.send(torch.cat([torch.as_tensor(update[k]).reshape(-1) for k in names]), dst=0)


def gloo_server(
    args: argparse.Namespace, model: Any, flat: Any, names: list, shapes: list, sizes: list
) -> int:
    """Rank 0: one thread per worker receives its gradients (all concurrently) and answers with the model.

    Gloo's ``Work.is_completed`` does not advance for point-to-point operations nobody
    waits on, so the straightforward asynchronous server is a blocking ``recv`` per worker
    in its own thread; the threads apply under one lock.
    """
    import torch.distributed as dist

    _, _, xte, yte = dataset()
    log = AccuracyLog(Path(args.out), args.target)
    lock = threading.Lock()
    state = {"version": 0}
    delays: list[int] = []
    done = threading.Event()

    def serve(rank: int) -> None:
        buf = flat.clone()
        with lock:
            model_copy, sent_version = flat.clone(), state["version"]
        while not done.is_set():
            dist.send(model_copy, dst=rank)
            dist.recv(buf, src=rank)
            with lock:
                flat.sub_(buf)
                delays.append(state["version"] - sent_version)
                state["version"] += 1
                model_copy, sent_version = flat.clone(), state["version"]

    for rank in range(1, args.world):
        threading.Thread(target=serve, args=(rank,), daemon=True).start()
    deadline = time.monotonic() + args.time_limit
    last = 0
    while time.monotonic() < deadline and log.reached is None:
        time.sleep(0.25)
        with lock:
            version, snapshot = state["version"], flat.clone()
        if version != last:
            last = version
            load_numpy(model, unflatten(snapshot, names, shapes, sizes))
            log.record(version, accuracy(model, xte, yte))
    done.set()
    with lock:
        log.save({"applied": state["version"], "dropped": 0, "delays": list(delays)})
    os._exit(0)  # the threads are blocked in gloo; the driver terminates the workers


def run_gloo(
    testbed: Any,
    workers: list[str],
    args: argparse.Namespace,
    delays: dict[str, float],
    rates: Any,
    workdir: Path,
    me: list[str],
    common: list[str],
) -> dict[str, Any]:
    out, ready = workdir / "server.json", workdir / "server.ready"
    env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    world = len(workers) + 1
    base = [*me, "--role", "gloo", *common, "--world", str(world)]
    rank0_files = ["--out", str(out), "--ready-file", str(ready)]
    procs = []
    try:
        with open(workdir / "rank0.log", "wb") as log0:
            server = testbed.popen(
                "ps",
                [*base, "--rank", "0", "--store", f"{testbed.address('ps')}:0", *rank0_files],
                env=env,
                stdout=log0,
                stderr=subprocess.STDOUT,
            )
            procs.append(server)
            port = json.loads(wait_file(ready, server, 60))["port"]
            rates.start()
            for i, w in enumerate(workers):
                argv = [*base, "--rank", str(i + 1), "--store", f"{testbed.address('ps')}:{port}"]
                argv += ["--seed", str(i), "--compute-delay", str(delays[w]), "--out", "-"]
                procs.append(testbed.popen(w, argv, env=env, stdout=log0, stderr=subprocess.STDOUT))
            server.wait(timeout=args.time_limit + 120)
            rates.stop()
    finally:
        stop_all(procs)  # a rank may be stuck in gloo
    return json.loads(out.read_text())
