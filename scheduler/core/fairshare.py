"""Max-min fair sharing of links by flows: progressive filling (DESIGN §4, §6).

The rates long-lived TCP flows converge to on shared links: the ``fair`` baseline's
model (:func:`~mlfabric.scheduler.plan.heuristics.fair_schedule`) and the reference of the
simulator's vectorized filling (:mod:`mlfabric.scheduler.sim.fluid`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

__all__ = ["max_min_rates"]

#: a link's id (any hashable: a name, a ``(u, v)`` pair)
Link = TypeVar("Link", bound=Hashable)
#: a flow's id (any hashable)
FlowId = TypeVar("FlowId", bound=Hashable)


def max_min_rates(
    flows: Mapping[FlowId, Sequence[Link]], capacity: Mapping[Link, float]
) -> dict[FlowId, float]:
    """Max-min fair rates of ``flows`` over links of ``capacity`` by progressive filling.

    Parameters
    ----------
    flows : mapping
        Flow id -> the links it crosses. A flow with no links is unconstrained (rate
        ``inf``).
    capacity : mapping
        Link -> capacity (bytes/s, >= 0).

    Returns
    -------
    dict
        Flow id -> rate (bytes/s). No link carries more than its capacity, and no flow
        can be raised without lowering a flow whose rate is no larger (max-min fairness).

    Notes
    -----
    Water-filling with a lazy min-heap of link fair shares ``remaining / unfrozen``.
    Freezing flows at the smallest share never lowers another link's share, so stale
    heap entries are skipped by a per-link version. ``O((F·P + L) log L)`` for ``F``
    flows of ``P`` links over ``L`` links.

    Examples
    --------
    One flow on link ``a`` (10), one on ``a`` and ``b`` (4), one on ``b``: ``b`` splits
    evenly, the first flow takes what ``a`` has left.

    >>> r = max_min_rates({"f1": ["a"], "f2": ["a", "b"], "f3": ["b"]}, {"a": 10.0, "b": 4.0})
    >>> r == {"f1": 8.0, "f2": 2.0, "f3": 2.0}
    True
    """
    link_flows: dict[Link, list[FlowId]] = {}
    rates: dict[FlowId, float] = {}
    for f, links in flows.items():
        if not links:
            rates[f] = math.inf
        for link in links:
            link_flows.setdefault(link, []).append(f)
    remaining = {link: max(0.0, float(capacity[link])) for link in link_flows}
    unfrozen = {link: len(fs) for link, fs in link_flows.items()}
    version = dict.fromkeys(link_flows, 0)
    heap: list[tuple[float, int, int, Link]] = []
    order = {link: i for i, link in enumerate(link_flows)}  # deterministic tie-break
    for link, n in unfrozen.items():
        heap.append((remaining[link] / n, order[link], 0, link))
    heapq.heapify(heap)
    while heap:
        share, _, ver, link = heapq.heappop(heap)
        if ver != version[link] or unfrozen[link] == 0:
            continue
        for f in link_flows[link]:
            if f in rates:
                continue
            rates[f] = share
            for other in flows[f]:
                remaining[other] = max(0.0, remaining[other] - share)
                unfrozen[other] -= 1
                version[other] += 1
                if other != link and unfrozen[other] > 0:
                    heapq.heappush(
                        heap, (remaining[other] / unfrozen[other], order[other], version[other], other)
                    )
    return rates
