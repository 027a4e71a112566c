"""torchrun: roles by rank from torchrun's environment.

``torchrun --nnodes 1 --nproc-per-node 4 train.py`` starts four processes with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (by the elastic agent,
after its rendezvous). :func:`init` reads them, makes the server ranks (default rank 0) the
parameter servers of the job and the others its workers, and joins a gloo process group (at
``MASTER_ADDR:MASTER_PORT``) used only for the roles' barriers: the servers are registered
before any worker registers, and the servers stay until every worker is done. Every process
talks to its own host's mlfabric daemon: the ``daemon`` argument, else ``MLFABRIC_DAEMON``,
else the default socket (as :func:`mlfabric.register_as_worker` finds it).

Examples
--------
::

    ctx = mlfabric.torch.init("job1")                    # under torchrun
    if ctx.is_server:
        with ctx.serve(model.named_parameters()):         # one server per parameter group
            ctx.barrier()                                 # registered: workers may start
            ctx.barrier()                                 # every worker is done
    else:
        ctx.barrier()
        opt = mlfabric.torch.DistributedOptimizer(sgd, model.named_parameters(), worker=ctx.register_worker())
        ...                                               # train
        ctx.barrier()
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from mlfabric.torch.groups import GROUP_BYTES, GroupServers

__all__ = ["Context", "exit_rank", "init", "read_env"]

_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Context:
    """A process's place in a torchrun job (from :func:`init`).

    Attributes
    ----------
    job : str
    rank, world_size, local_rank : int
    master_addr : str
    master_port : int
    server_ranks : tuple of int
        The ranks serving the model; the others are workers.
    daemon : str or None
        This host's daemon socket (None: ``MLFABRIC_DAEMON`` or the default).

    Examples
    --------
    >>> ctx = Context("j", rank=2, world_size=4, local_rank=2, master_addr="h0", master_port=1,
    ...               server_ranks=(0,))
    >>> ctx.is_server, ctx.worker_ranks, ctx.worker_index
    (False, (1, 2, 3), 1)
    """

    job: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    server_ranks: tuple[int, ...] = (0,)
    daemon: str | None = None

    @property
    def is_server(self) -> bool:
        """This rank serves (part of) the model."""
        return self.rank in self.server_ranks

    @property
    def worker_ranks(self) -> tuple[int, ...]:
        """The ranks that train, in order."""
        return tuple(r for r in range(self.world_size) if r not in self.server_ranks)

    @property
    def worker_index(self) -> int:
        """This worker's position among the workers (its data shard); -1 on a server."""
        return self.worker_ranks.index(self.rank) if not self.is_server else -1

    def register_worker(self, *, wait: float = 60.0) -> Any:
        """Join the job as worker ``"rank<rank>"`` (:func:`mlfabric.register_as_worker`)."""
        import mlfabric

        return mlfabric.register_as_worker(self.job, name=f"rank{self.rank}", daemon=self.daemon, wait=wait)

    def serve(
        self,
        named_parameters: Iterable[tuple[str, Any]],
        *,
        params: Any = None,
        prefix: str = "ps",
        group_bytes: int = GROUP_BYTES,
    ) -> GroupServers:
        """Register and serve this server rank's share of the groups (:class:`GroupServers`)."""
        shard = (self.server_ranks.index(self.rank), len(self.server_ranks))
        return GroupServers(
            self.job,
            named_parameters,
            prefix=prefix,
            group_bytes=group_bytes,
            params=params,
            shard=shard,
            daemon=self.daemon,
        ).start()

    def barrier(self) -> None:
        """Wait for every rank (the gloo group :func:`init` joined)."""
        dist.barrier()


def read_env(env: Mapping[str, str]) -> dict[str, Any]:
    """torchrun's variables from ``env``, checked.

    Raises
    ------
    ValueError
        A variable is missing (naming it: the script was not started by torchrun) or not a number.

    Examples
    --------
    >>> read_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h0",
    ...           "MASTER_PORT": "29500"})["world_size"]
    4
    >>> read_env({"RANK": "1"})
    Traceback (most recent call last):
    ...
    ValueError: WORLD_SIZE is not set: start the script with torchrun (it sets RANK, WORLD_SIZE, ...
    """
    missing = [v for v in _VARIABLES if v not in env]
    if missing:
        raise ValueError(
            f"{missing[0]} is not set: start the script with torchrun (it sets RANK, WORLD_SIZE, "
            f"LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
        )
    try:
        return {
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env["LOCAL_RANK"]),
            "master_addr": env["MASTER_ADDR"],
            "master_port": int(env["MASTER_PORT"]),
        }
    except ValueError as exc:
        raise ValueError(f"torchrun's variables must be numbers: {exc}") from exc


def init(
    job: str,
    *,
    server_ranks: Sequence[int] = (0,),
    daemon: str | None = None,
    env: Mapping[str, str] | None = None,
    process_group: bool = True,
    timeout: float = 600.0,
) -> Context:
    """This process's role in ``job`` from torchrun's environment.

    Parameters
    ----------
    job : str
        The mlfabric job.
    server_ranks : sequence of int
        The ranks that serve the model (default rank 0); the others train.
    daemon : str, optional
        This host's daemon socket; default ``MLFABRIC_DAEMON``, else the default socket.
    env : mapping, optional
        Where torchrun's variables are read (default ``os.environ``).
    process_group : bool
        Join the gloo process group for :meth:`Context.barrier` (unless one exists already).
    timeout : float
        The process group's timeout (seconds), which bounds a barrier.

    Raises
    ------
    ValueError
        A torchrun variable is missing, a server rank is not a rank, or no rank is left to train.
    """
    found = read_env(os.environ if env is None else env)
    servers = tuple(sorted({int(r) for r in server_ranks}))
    bad = [r for r in servers if not 0 <= r < found["world_size"]]
    if bad or not servers:
        raise ValueError(f"server ranks {list(server_ranks)} must be ranks of 0..{found['world_size'] - 1}")
    if len(servers) >= found["world_size"]:
        raise ValueError(f"all {found['world_size']} ranks are server ranks {list(servers)}: none trains")
    ctx = Context(job, server_ranks=servers, daemon=daemon, **found)
    if process_group and not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            # env://: the elastic agent may host the store itself (TORCHELASTIC_USE_AGENT_STORE)
            init_method="env://" if env is None else f"tcp://{ctx.master_addr}:{ctx.master_port}",
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=timedelta(seconds=timeout),
        )
    return ctx


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank's process at once, its output flushed, skipping the interpreter's teardown.

    A rank that used a gloo process group cannot count on a clean interpreter exit: torch keeps
    the group — and its gloo worker threads — alive after ``destroy_process_group`` while a DDP
    model was ever built on it, and a worker thread that frees its last work (holding a tensor
    of Python's) while the interpreter shuts down aborts the process with "terminate called
    without an active exception" (signal 6) — one run in ~30 under load, after the rank's
    work and results were complete. A rank process therefore ends the way multiprocessing's
    children do: flush, then ``os._exit``. Call it after the results are written and the
    process group destroyed; never in a process that has more to run (a test runner).

    Examples
    --------
    ::

        if __name__ == "__main__":
            code = main()                       # trains, writes its results, destroys the group
            mlfabric.torch.exit_rank(code)
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
