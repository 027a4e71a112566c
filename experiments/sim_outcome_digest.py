"""A digest of a simulation's outcomes, to check that a change of the code changed no decision (issue 24).

Runs ``mlfabric simulate`` in the setting of ``bench_sim_scale.py`` (two-tier, 16 hosts per
rack, 4:1 uplinks, a quarter of the NICs 4x slower, a tenth of the workers 3x slower, 2
pushes per worker) in this process and hashes every update's record (id, worker, base
version, ready, released and arrival times, delay, outcome, reason; floats by ``repr``, so
to the last bit), every aggregate, and the numbers of events, decisions and the server's
version. Two checkouts give the same digest for a policy and seed exactly when their runs
decided the same. Prints one JSON line per (policy, seed) with the digest and the CPU seconds
of the simulation.

Run it under each checkout (its ``PYTHONPATH``) and compare::

    PYTHONPATH=/path/to/old python experiments/sim_outcome_digest.py --policies fair stf --seeds 0 1 2
    PYTHONPATH=. python experiments/sim_outcome_digest.py --policies fair stf --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import time
from typing import Any

from bench_sim_scale import POLICIES, SETTING


def digest(workers: int, policy: str, seed: int) -> dict[str, Any]:
    """Simulate one (policy, seed) and hash its outcomes.

    Parameters
    ----------
    workers : int
        Simulated workers.
    policy : str
        A policy name of ``mlfabric simulate``.
    seed : int
        The scenario's seed.

    Returns
    -------
    dict
        policy, seed, workers, counts, ``digest`` (16 hex digits) and ``cpu_s``.
    """
    from mlfabric.scheduler.sim import cli, scenario

    sims: list[Any] = []
    run_scenario = scenario.run_scenario

    def keep(*args: Any, **kwargs: Any) -> Any:
        stats, sim = run_scenario(*args, **kwargs)
        sims.append(sim)
        return stats, sim

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    argv = [*SETTING, "--workers", str(workers), "--policy", policy, "--seed", str(seed), "--quiet"]
    scenario.run_scenario = keep  # (cli.run imports it at call time)
    try:
        t0 = time.process_time()
        with contextlib.redirect_stdout(io.StringIO()):
            cli.run(parser.parse_args(argv))
        cpu = time.process_time() - t0
    finally:
        scenario.run_scenario = run_scenario
    (sim,) = sims
    h = hashlib.sha256()
    for r in sim.records:
        fields = (r.update_id, r.worker, r.base_version, r.ready_at, r.released_at, r.arrived_at)
        h.update(repr((*fields, r.delay, r.outcome, r.reason)).encode())
    for agg in sim.aggregates:
        h.update(repr(agg).encode())
    h.update(repr((sim.events, sim.decisions, sim.version)).encode())
    return {
        "policy": policy,
        "seed": seed,
        "workers": workers,
        "records": len(sim.records),
        "aggregates": len(sim.aggregates),
        "events": sim.events,
        "decisions": sim.decisions,
        "digest": h.hexdigest()[:16],
        "cpu_s": round(cpu, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the digest of each (policy, seed)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1024)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args(argv)
    for policy in args.policies:
        for seed in args.seeds:
            print(json.dumps(digest(args.workers, policy, seed)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
