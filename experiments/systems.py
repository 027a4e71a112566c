"""How the testbed experiments name a system: ``POLICY[@CODEC[@MODEL_CODEC]][@hH[kK][sS]]``.

``testbed_e2e.py``, ``testbed_codecs.py``, ``testbed_aggregation.py`` and ``testbed_racks.py``
take ``--systems`` as comma-separated names: an mlfabric policy (``stf``, ``stf+agg``), the
workers' codec (``int8+ef``: ``+ef`` adds error feedback; any spec ``push(codec=...)`` takes),
the model's codec, and local SGD (``h4``: 4 local steps a push; ``k10``: every step for the
first 10; ``s0.25``: the delta pushed times 0.25). Pure parsing, no I/O.
"""

from __future__ import annotations

import argparse
import re

__all__ = [
    "LOCAL_STEPS",
    "add_local_options",
    "local_schedule",
    "split_system",
    "split_systems",
    "worker_argv",
]


def add_local_options(parser: argparse.ArgumentParser) -> None:
    """A worker role's local SGD options (:func:`worker_argv` writes them)."""
    parser.add_argument("--local-period", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--local-warmup", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--local-scale", type=float, default=1.0, help=argparse.SUPPRESS)


def split_systems(text: str) -> list[str]:
    """``--systems``: comma-separated systems; a part whose text before any ``@`` has an ``=``
    continues the codec parameters of the one before it (``randk:ratio=0.01,rescale=0+ef``).

    Examples
    --------
    >>> split_systems("stf,stf+agg@topk:ratio=0.01+ef@fp16,stf@randk:ratio=0.01,rescale=0+ef")
    ['stf', 'stf+agg@topk:ratio=0.01+ef@fp16', 'stf@randk:ratio=0.01,rescale=0+ef']
    >>> split_systems("fair,stf+agg@int8:bound=6,stochastic=0@h4,stf+agg@fp16")
    ['fair', 'stf+agg@int8:bound=6,stochastic=0@h4', 'stf+agg@fp16']
    """
    systems: list[str] = []
    for part in text.split(","):
        if systems and "=" in part.split("@")[0]:
            systems[-1] += "," + part  # a codec parameter, not a system
        else:
            systems.append(part)
    return systems


LOCAL_STEPS = re.compile(r"h(\d+)(?:k(\d+))?(?:s(\d*\.?\d+))?")


#: the part of a system that pipelines its aggregates (the scheduler's ``--pipelined-aggregates``)
PIPELINED = "pipe"


def pipelined(system: str) -> bool:
    """Whether ``system`` pipelines its aggregates (a part ``@pipe``: ``stf+tree@pipe``).

    Examples
    --------
    >>> pipelined("stf+tree@pipe"), pipelined("stf+tree@fp16"), split_system("stf+tree@pipe@fp16")
    (True, False, ('stf+tree', 'fp16', None))
    """
    return PIPELINED in system.split("@")[1:]


def split_system(system: str) -> tuple[str, str | None, str | None]:
    """``policy@codec[@model_codec][@hH[kK][sS]][@pipe]`` as the policy, the workers' codec and the model's.

    A part ``hH[kK][sS]`` (local SGD, :func:`local_schedule`) is not a codec, nor is ``pipe``
    (:func:`pipelined`).

    Examples
    --------
    >>> split_system("stf@int8+ef@fp16"), split_system("stf@fp16"), split_system("fair")
    (('stf', 'int8+ef', 'fp16'), ('stf', 'fp16', None), ('fair', None, None))
    >>> split_system("stf+agg@topk:ratio=0.01+ef@fp16")
    ('stf+agg', 'topk:ratio=0.01+ef', 'fp16')
    >>> split_system("stf+agg@h4"), split_system("stf+agg@int8+ef@h4k10")
    (('stf+agg', None, None), ('stf+agg', 'int8+ef', None))
    """
    policy, *parts = system.split("@")
    codecs = [part for part in parts if not LOCAL_STEPS.fullmatch(part) and part != PIPELINED] + ["", ""]
    return policy, codecs[0] or None, codecs[1] or None


def local_schedule(system: str) -> tuple[int, int, float]:
    """Local SGD of a system's ``@hH[kK][sS]``: H steps per push, warmup K, the delta's scale S.

    (:class:`mlfabric.LocalSGD`'s ``period``, ``warmup`` and ``scale``.)

    Examples
    --------
    >>> local_schedule("stf+agg@h4"), local_schedule("stf@int8+ef@h4k10"), local_schedule("stf")
    ((4, 0, 1.0), (4, 10, 1.0), (1, 0, 1.0))
    >>> local_schedule("stf+agg@h4s0.25")
    (4, 0, 0.25)
    """
    for part in system.split("@")[1:]:
        match = LOCAL_STEPS.fullmatch(part)
        if match:
            return int(match[1]), int(match[2] or 0), float(match[3] or 1.0)
    return 1, 0, 1.0


def worker_argv(system: str) -> list[str]:
    """The push options of a system's workers (``--role mlf-worker``): codec and local SGD.

    Examples
    --------
    >>> worker_argv("stf+agg@int8+ef@h4k10")
    ['--codec', 'int8+ef', '--local-period', '4', '--local-warmup', '10', '--local-scale', '1.0']
    >>> worker_argv("stf")
    []
    """
    _, codec, _ = split_system(system)
    period, warmup, scale = local_schedule(system)
    argv = ["--codec", codec] if codec else []
    if period > 1 or warmup:
        argv += ["--local-period", str(period), "--local-warmup", str(warmup), "--local-scale", str(scale)]
    return argv


# ---------------------------------------------------------------------------- driver
