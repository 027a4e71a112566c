"""Fluid discrete-event simulator of mlfabric policies (DESIGN §6).

* :mod:`~mlfabric.scheduler.sim.fluid` — max-min fair sharing by progressive filling;
  the network through time (bandwidth changes);
* :mod:`~mlfabric.scheduler.sim.engine` — the event loop playing scheduler service,
  dispatcher, network and server around the real policy objects;
* :mod:`~mlfabric.scheduler.sim.iteration` — asynchronous and synchronous SGD workers;
* :mod:`~mlfabric.scheduler.sim.workload` — compute times, stragglers, bandwidth schedules;
* :mod:`~mlfabric.scheduler.sim.scenario` — preset clusters and one-call runs;
* :mod:`~mlfabric.scheduler.sim.report` — per-policy statistics and tables;
* :mod:`~mlfabric.scheduler.sim.tracing` — a run as a checkable, traceable schedule.

``mlfabric simulate`` (:mod:`mlfabric.scheduler.sim.cli`) is the command line.
"""
