"""The online scheduling policies and the decision pipeline (DESIGN §4).

* :mod:`~mlfabric.scheduler.policies.base` — the policy interface: :class:`Snapshot`,
  :class:`PendingUpdate`, :class:`InFlight` in; one typed :class:`Decision` out (sends,
  drops, aggregates, replica sends);
* :mod:`~mlfabric.scheduler.policies.registry` — ``make_policy(name, ...)``: the policy
  and its re-plan trigger, for the service and the simulator alike;
* :mod:`~mlfabric.scheduler.policies.fair`, :mod:`~mlfabric.scheduler.policies.stf`,
  :mod:`~mlfabric.scheduler.policies.aggregation` — ``fair``, ``stf`` (paper §5 Fig. 4-5)
  and ``stf+agg`` (Fig. 6); :mod:`~mlfabric.scheduler.policies.replication` — bounded
  divergence (Fig. 3), not yet a policy;
* :mod:`~mlfabric.scheduler.policies.planning` — what the planning policies share: pending
  updates as core updates, the aggregator pool, in-flight transfers reserved, aggregate ids;
* :mod:`~mlfabric.scheduler.policies.convert` — the one adapter from a planned
  :class:`~mlfabric.scheduler.core.schedule.Schedule` to a :class:`Decision`;
* :mod:`~mlfabric.scheduler.policies.dispatch` — adaptive batching, the dispatcher
  releasing sends as their predecessors end, the re-plan trigger;
* :mod:`~mlfabric.scheduler.policies.runner` — :class:`DecisionRunner`: decide, adopt,
  release; the one code path of the scheduler service and the simulator.

Everything here is pure: no I/O, no clock (times are arguments), no globals. It imports
only :mod:`mlfabric.scheduler.core` (``tests/test_layout.py``).
"""
