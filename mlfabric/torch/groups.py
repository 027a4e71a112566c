"""The servers' side of :class:`mlfabric.torch.DistributedOptimizer`: parameter groups and their servers.

A push carries every tensor of its server's model, so the parameters are split into groups
(:func:`plan_groups`) and group ``i`` is the whole model of server ``"<prefix>.<i>"``
(:func:`server_name`); :class:`GroupServers` registers and serves them. Workers and servers
derive the groups from the same names and shapes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from mlfabric.localclient import MlfabricError

__all__ = ["GROUP_BYTES", "GroupServers", "plan_groups", "server_name"]

#: Default upper bound of a group's bytes (a larger tensor is a group of its own).
GROUP_BYTES = 1 << 20


def plan_groups(sizes: Sequence[tuple[str, int]], group_bytes: int = GROUP_BYTES) -> list[list[str]]:
    """Split parameters into groups of consecutive tensors of at most ``group_bytes`` each.

    Parameters
    ----------
    sizes : sequence of (name, nbytes)
        The parameters in ``named_parameters`` order.
    group_bytes : int
        A group's bound; 0: one group per tensor. A tensor larger than it is a group alone.

    Returns
    -------
    list of list of str
        The groups, in parameter order; group ``i`` is served by :func:`server_name` ``(prefix, i)``.

    Examples
    --------
    >>> plan_groups([("w1", 400), ("b1", 8), ("w2", 100), ("b2", 4)], group_bytes=256)
    [['w1'], ['b1', 'w2', 'b2']]
    >>> plan_groups([("a", 4), ("b", 4)], group_bytes=0)
    [['a'], ['b']]
    """
    groups: list[list[str]] = []
    size = 0
    for name, nbytes in sizes:
        if groups and group_bytes > 0 and size + nbytes <= group_bytes:
            groups[-1].append(name)
            size += nbytes
        else:
            groups.append([name])
            size = nbytes
    return groups


def server_name(prefix: str, index: int) -> str:
    """The server of group ``index``.

    Examples
    --------
    >>> server_name("ps", 3)
    'ps.3'
    """
    return f"{prefix}.{index}"


def _named(named_parameters: Iterable[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    named = [(str(n), p) for n, p in named_parameters]
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(
            f"named_parameters repeats a name: {sorted({n for n in names if names.count(n) > 1})}"
        )
    return named


def _groups_of(named: Sequence[tuple[str, torch.Tensor]], group_bytes: int) -> list[list[str]]:
    return plan_groups([(n, p.numel() * p.element_size()) for n, p in named], group_bytes)


class GroupServers:
    """The server role for a :class:`DistributedOptimizer`: one mlfabric server per group.

    Parameters
    ----------
    job : str
    named_parameters : iterable of (name, tensor)
        The initial model (copied; the workers' ``named_parameters`` must name and shape it alike).
    prefix : str
        Servers are ``"<prefix>.<i>"``.
    group_bytes : int
        As the workers' (:func:`plan_groups`).
    params : mlfabric.Params, optional
        The job's bounds (``sync_workers`` for synchronous training).
    shard : (int, int)
        ``(index, count)``: serve the groups ``i`` with ``i % count == index`` (several server
        processes); default all.
    daemon : str, optional
        The daemon's socket.

    Attributes
    ----------
    servers : list of mlfabric.Server
        Registered by :meth:`start`.
    worker_updates : int
        Worker updates applied (a synchronous round counts its members).
    update_ids : list of str
        The ids of the worker updates applied, in order (exactly once: no id twice).
    payloads : int
        Payloads applied over all groups (an aggregate or a synchronous round is one).
    aggregated : int
        Worker updates applied as members of an aggregate or a round (more than one a payload).
    partial_rounds : int
        Synchronous rounds applied without every member (``UpdateMeta.partial_round``).
    delays : list of int
        Each applied worker update's delay (its version lag), over all groups.
    """

    def __init__(
        self,
        job: str,
        named_parameters: Iterable[tuple[str, Any]],
        *,
        prefix: str = "ps",
        group_bytes: int = GROUP_BYTES,
        params: Any = None,
        shard: tuple[int, int] = (0, 1),
        daemon: str | None = None,
    ) -> None:
        named = _named(named_parameters)
        tensors = dict(named)
        self.job, self.prefix, self.params, self.daemon = job, prefix, params, daemon
        self.groups = _groups_of(named, group_bytes)
        index, count = shard
        self.indices = [i for i in range(len(self.groups)) if i % count == index]
        self._initial = {
            i: {n: tensors[n].detach().to("cpu", copy=True) for n in self.groups[i]} for i in self.indices
        }
        self.servers: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.worker_updates = self.payloads = self.aggregated = self.partial_rounds = 0
        self.update_ids: list[str] = []
        self.delays: list[int] = []

    def start(self) -> GroupServers:
        """Register the servers and serve each on a thread of its own (once: again, nothing)."""
        import mlfabric

        if self.servers:
            return self

        for i in self.indices:
            server = mlfabric.register_as_server(
                self.job, server_name(self.prefix, i), self._initial[i], self.params, daemon=self.daemon
            )
            server.on_update(self._applier(server))
            self.servers.append(server)
        for server in self.servers:
            thread = threading.Thread(
                target=self._serve, args=(server,), name=f"serve-{server.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def _applier(self, server: Any) -> Callable[[dict[str, Any], Any], None]:
        def apply(update: dict[str, Any], meta: Any) -> None:
            for key, value in update.items():  # the server's default: the update is subtracted
                server.model[key] -= value
            with self._lock:
                self.worker_updates += meta.num_updates
                self.update_ids.extend(meta.member_ids)
                self.payloads += 1
                self.aggregated += meta.num_updates if meta.num_updates > 1 else 0
                self.partial_rounds += int(meta.partial_round)
                self.delays.extend(meta.member_delays or (meta.delay,))

        return apply

    def _serve(self, server: Any) -> None:
        try:
            server.serve(until=self._stop)
        except MlfabricError as exc:  # the daemon connection broke: re-raised by stop()/check()
            self._errors.append(exc)

    @property
    def applied(self) -> int:
        """Updates (or rounds) applied over all groups."""
        return sum(s.applied for s in self.servers)

    @property
    def dropped(self) -> int:
        """Updates dropped over all groups."""
        return sum(s.dropped for s in self.servers)

    def model(self) -> dict[str, Any]:
        """The served groups' tensors, merged (name -> tensor)."""
        out: dict[str, Any] = {}
        for server in self.servers:
            out.update(server.model)
        return out

    def check(self) -> None:
        """Raise the first error a serving thread met."""
        if self._errors:
            raise self._errors[0]

    def stop(self) -> None:
        """Stop serving, give up the server roles; raise a serving thread's error."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        for server in self.servers:
            server.close()
        self.check()

    def __enter__(self) -> GroupServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
