"""Local search over the members of an aggregation tree (:mod:`~mlfabric.scheduler.policies.trees`).

The tree planner's candidates are shaped by the topology: every payload crossing an
aggregation point is summed at one host below it. The best plan of a round may break that
shape — on racks that are not oversubscribed the bottlenecks are the aggregators' and the
server's NICs, and the ILP spreads the updates of one rack over the aggregators of several
(``experiments/results/bench_trees.md``). :func:`improve_members` starts from a tree and
moves single updates while that shortens the estimated round:

* an update into another aggregate (of any level) or straight to the server;
* an update together with another one (taken out of its aggregate) into a new aggregate at
  an idle host (an eligible host that sums nothing yet; the second update's own host when
  it is eligible, so that update moves by a zero-hop transfer).

Moves are scored by the caller's estimate (first improvement, passes until none improves or
the budget of scored trees is spent). Aggregates left with one member are dissolved (the
member takes their place); empty ones are removed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mlfabric.scheduler.core.schedule import aggregate_id

__all__: list[str] = []

#: at most this many trees are scored by one :func:`improve_members` call
MOVE_BUDGET = 600


@dataclass
class Node:
    """One aggregate of a candidate tree: the point, its host and members (payload ids)."""

    point: str
    aggregator: str
    members: list[str]
    parent: str | None = None  # aggregate id of the next point up, or None: to the server


Tree = tuple[dict[str, Node], dict[str, str]]  # aggregates by id; payload id -> its aggregate


def _detach(nodes: dict[str, Node], parent: dict[str, str], pid: str) -> None:
    """Take payload ``pid`` out of its aggregate; an aggregate left with one member is dissolved.

    The remaining member takes the dissolved aggregate's place (its parent's member list, or
    straight to the server); an aggregate left with none is taken out of its parent in turn.
    """
    aid = parent.pop(pid, None)
    if aid is None:
        return
    node = nodes[aid]
    node.members.remove(pid)
    if len(node.members) >= 2:
        return
    up = node.parent
    del nodes[aid]
    if not node.members:
        if up is not None:
            _detach(nodes, parent, aid)
        return
    (only,) = node.members
    if only in nodes:
        nodes[only].parent = up
    if up is None:
        parent.pop(only, None)
        return
    siblings = nodes[up].members
    siblings[siblings.index(aid)] = only
    parent[only] = up
    del parent[aid]


def _attach(nodes: dict[str, Node], parent: dict[str, str], pid: str, aid: str | None) -> None:
    if aid is None:
        return
    nodes[aid].members.append(pid)
    parent[pid] = aid


def _fresh(tree: Tree) -> Tree:
    nodes, parent = tree
    out = {a: Node(n.point, n.aggregator, list(n.members), n.parent) for a, n in nodes.items()}
    return out, dict(parent)


def improve_members(
    tree: Tree,
    updates: Sequence[str],
    source: Mapping[str, str],
    idle_hosts: Sequence[str],
    eligible: frozenset[str],
    score: Callable[[dict[str, Node], dict[str, str]], float],
    prefix: str,
    budget: int = MOVE_BUDGET,
) -> tuple[Tree, float]:
    """Move single updates between aggregates while the estimate ``score`` improves.

    Parameters
    ----------
    tree : (dict, dict)
        The starting tree: aggregates by id, payload id -> aggregate id (absent: to the server).
    updates : sequence of str
        The round's update ids.
    source : mapping
        Update id -> its worker host.
    idle_hosts : sequence of str
        Hosts that may start a new aggregate (fastest NICs first).
    eligible : frozenset of str
        Hosts that may aggregate at all.
    score : callable
        ``score(nodes, parent)``: the estimated makespan of a tree.
    prefix : str
        Scope of new aggregate ids.
    budget : int
        Most trees scored.

    Returns
    -------
    ((dict, dict), float)
        The best tree found (a new object; ``tree`` is not changed) and its score.

    Examples
    --------
    Two updates summed at ``h9`` while the score prefers them direct:

    >>> t = ({"agg:x:0": Node("sw", "h9", ["u1", "u2"])}, {"u1": "agg:x:0", "u2": "agg:x:0"})
    >>> score = lambda nodes, parent: len(nodes) + len(parent)
    >>> src = {"u1": "h1", "u2": "h2"}
    >>> (nodes, parent), best = improve_members(t, ["u1", "u2"], src, [], frozenset(), score, "x")
    >>> nodes, parent, best
    ({}, {}, 0)
    """
    best = _fresh(tree)
    best_score = score(*best)
    used = budget - 1
    made = 1 + max((int(a.rsplit(":", 1)[1]) for a in best[0]), default=-1)
    improved = True
    while improved and used > 0:
        improved = False
        for uid in updates:
            nodes, parent = best
            here = parent.get(uid)
            busy = {n.aggregator for n in nodes.values()}
            targets: list[tuple[str | None, str | None, str | None]] = [
                (a, None, None) for a in nodes if a != here
            ]
            if here is not None:
                targets.append((None, None, None))
            for mate in updates:  # pair uid with another update at an idle host
                if mate == uid:
                    continue
                own = source[mate]
                hosts = [own] if own in eligible and own not in busy else []
                # the first two (no pass over every idle host per pair, issue 24)
                hosts += itertools.islice((h for h in idle_hosts if h not in busy and h != own), 2)
                targets += [(None, mate, h) for h in hosts]
            for target, other, host in targets:
                if used <= 0:
                    break
                trial = _fresh(best)
                t_nodes, t_parent = trial
                _detach(t_nodes, t_parent, uid)
                if other is not None and host is not None:
                    _detach(t_nodes, t_parent, other)
                    new = aggregate_id(prefix, made)
                    t_nodes[new] = Node("", host, [])
                    _attach(t_nodes, t_parent, uid, new)
                    _attach(t_nodes, t_parent, other, new)
                elif target is not None:
                    if target not in t_nodes:  # dissolved by the detach
                        continue
                    _attach(t_nodes, t_parent, uid, target)
                used -= 1
                value = score(t_nodes, t_parent)
                if value < best_score - 1e-12:
                    best, best_score, improved = trial, value, True
                    if other is not None:
                        made += 1
                    break
    return best, best_score
