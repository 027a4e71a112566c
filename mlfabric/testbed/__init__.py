"""Emulated cluster testbed on Linux network namespaces (DESIGN §6).

Each host of a topology file is a network namespace, each switch a bridge, each link a veth
pair shaped with tbf at its rate in each direction; the kernel's real TCP runs between them.

- :class:`Testbed` (:mod:`.cluster`): build, run commands in hosts, change link rates;
- :class:`~mlfabric.testbed.launch.TestbedCluster`: the scheduler and one daemon per host;
- :mod:`.schedule`: changing bandwidth (NS settings) and compute stragglers (CS settings);
- :mod:`.linkcheck`: one measured transfer per link; ``mlfabric testbed`` (:mod:`.cli`).

Needs root, ``ip`` and ``tc``; :func:`missing_prerequisites` says what is missing.
"""

from mlfabric.testbed.cluster import CONTROL, Testbed
from mlfabric.testbed.netns import TestbedUnavailable, missing_prerequisites, new_prefix, sweep_stale

__all__ = ["CONTROL", "Testbed", "TestbedUnavailable", "missing_prerequisites", "new_prefix", "sweep_stale"]
