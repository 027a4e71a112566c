"""The one place policies are built by name, with the re-plan trigger they run with.

The scheduler service (``mlfabric scheduler --policy``) and the simulator
(``mlfabric simulate --policy``) both call :func:`make_policy`, so a policy name means the
same object, horizon and re-plan trigger in both (DESIGN §4):

* ``fair`` — :class:`~mlfabric.scheduler.policies.fair.FairPolicy`;
* ``stf`` — :class:`~mlfabric.scheduler.policies.stf.STFPolicy` planning the first
  ``horizon`` sends of the STF order per decision, re-deciding once the planned sends fall
  to a quarter of the horizon (:func:`~mlfabric.scheduler.policies.dispatch.low_water_mark`);
* ``stf+agg`` — :class:`~mlfabric.scheduler.policies.aggregation.AggregationPolicy`
  (aggregation groups over the STF order, paper Fig. 6);
* ``stf+tree`` — :class:`~mlfabric.scheduler.policies.tree_policy.TreePolicy` (multi-level
  aggregation trees from the bandwidth graph: in-rack first, then across racks); with
  ``pipelined_aggregates``, synchronous rounds as pipelined (cut-through) trees
  (:mod:`~mlfabric.scheduler.policies.pipelined`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mlfabric.scheduler.policies.base import Policy
from mlfabric.scheduler.policies.dispatch import ReplanTrigger, low_water_mark

__all__ = ["DEFAULT_STF_HORIZON", "POLICIES", "PolicyOptions", "PolicySetup", "make_policy"]

#: sends the ``stf`` policy plans per decision unless told otherwise
DEFAULT_STF_HORIZON = 256


@dataclass(frozen=True)
class PolicyOptions:
    """What a registered policy may be configured with (each uses what applies to it).

    Attributes
    ----------
    horizon : int or None
        Sends planned per decision (``stf``); ``None``: every pending update.
    aggregators : tuple of str or None
        Hosts that may aggregate (``stf+agg``); ``None``: every host but the servers.
    sync : bool
        Plan for synchronous SGD (``stf+agg``: smallest makespan per iteration).
    scope : str
        The run aggregate ids belong to (``stf+agg``, ``stf+tree``: ``agg:<server>.<scope>:<n>``;
        empty: ``agg:<server>:<n>``).
    pipelined_aggregates : bool
        ``stf+tree``: plan synchronous rounds as pipelined aggregation trees (for executors
        that forward an aggregate's chunks as its members' arrive).
    """

    horizon: int | None = DEFAULT_STF_HORIZON
    aggregators: tuple[str, ...] | None = None
    sync: bool = True
    scope: str = ""
    pipelined_aggregates: bool = False


class PolicySetup(NamedTuple):
    """A policy and the trigger that says when to decide again without a new update."""

    policy: Policy
    trigger: ReplanTrigger


def _fair(options: PolicyOptions) -> PolicySetup:
    from mlfabric.scheduler.policies.fair import FairPolicy

    return PolicySetup(FairPolicy(), ReplanTrigger())


def _stf(options: PolicyOptions) -> PolicySetup:
    from mlfabric.scheduler.policies.stf import STFPolicy

    return PolicySetup(STFPolicy(horizon=options.horizon), ReplanTrigger(low_water_mark(options.horizon)))


def _stf_agg(options: PolicyOptions) -> PolicySetup:
    from mlfabric.scheduler.policies.aggregation import AggregationPolicy

    policy = AggregationPolicy(sync=options.sync, aggregators=options.aggregators, scope=options.scope)
    return PolicySetup(policy, ReplanTrigger())


def _stf_tree(options: PolicyOptions) -> PolicySetup:
    from mlfabric.scheduler.policies.tree_policy import TreePolicy

    policy = TreePolicy(
        aggregators=options.aggregators, scope=options.scope, pipelined=options.pipelined_aggregates
    )
    return PolicySetup(policy, ReplanTrigger())


#: policy name -> builder
POLICIES: dict[str, Callable[[PolicyOptions], PolicySetup]] = {
    "fair": _fair,
    "stf": _stf,
    "stf+agg": _stf_agg,
    "stf+tree": _stf_tree,
}


def make_policy(
    name: str,
    *,
    horizon: int | None = DEFAULT_STF_HORIZON,
    aggregators: Sequence[str] | None = None,
    sync: bool = True,
    scope: str = "",
    pipelined_aggregates: bool = False,
) -> PolicySetup:
    """A fresh policy by name, with its re-plan trigger.

    Parameters
    ----------
    name : str
        A key of :data:`POLICIES`.
    horizon : int or None
        ``stf``: sends planned per decision; 0 or ``None`` plans every pending update.
    aggregators : sequence of str, optional
        ``stf+agg``: hosts that may aggregate (default: every host but the servers).
    sync : bool
        ``stf+agg``: plan for synchronous SGD (default) or asynchronous.
    scope : str
        ``stf+agg``, ``stf+tree``: the run aggregate ids belong to, ``agg:<server>.<scope>:<n>``
        (default empty: ``agg:<server>:<n>``, deterministic for the simulator). The scheduler
        service passes a random incarnation per run: aggregate ids then never repeat across
        scheduler restarts, which the server daemons' de-duplication by id relies on.
    pipelined_aggregates : bool
        ``stf+tree``: synchronous rounds as pipelined aggregation trees (default off:
        store-and-forward; the simulator's ``--pipelined-aggregates``).

    Returns
    -------
    PolicySetup

    Raises
    ------
    ValueError
        For an unknown name (the message lists the known ones) or a negative horizon.

    Examples
    --------
    >>> s = make_policy("stf", horizon=8)
    >>> s.policy.name, s.policy.horizon, s.trigger.low_water
    ('stf', 8, 2)
    >>> make_policy("stf", horizon=0).policy.horizon is None
    True
    >>> make_policy("fair").trigger.low_water
    0
    >>> make_policy("stf+agg", scope="7f3a").policy.scope
    '7f3a'
    >>> make_policy("lifo")
    Traceback (most recent call last):
    ...
    ValueError: unknown policy 'lifo' (known: fair, stf, stf+agg, stf+tree)
    """
    try:
        build = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy '{name}' (known: {', '.join(sorted(POLICIES))})") from None
    if horizon is not None and horizon < 0:
        raise ValueError(f"horizon must be >= 0 sends, got {horizon}")
    options = PolicyOptions(
        horizon=horizon or None,
        aggregators=tuple(aggregators) if aggregators is not None else None,
        sync=sync,
        scope=scope,
        pipelined_aggregates=pipelined_aggregates,
    )
    return build(options)
