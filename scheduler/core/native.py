"""The scheduler's C extension (``_plan_native``, built by ``pip install``), imported once, here.

The hot loops of the planners run in C with the Python's arithmetic; where the extension is
not built, ``_plan_native`` is None and the Python loops run. A build older than the Python
code beside it (a checkout updated without ``pip install -e .``) is refused at import, naming
what it lacks, rather than failing in the middle of a decision.
"""

from __future__ import annotations

__all__ = ["NATIVE_API", "_plan_native"]

#: what the Python code calls of the C extension: a build older than the code lacks some of them
NATIVE_API = (
    "build", "changed_capacities", "copy_timelines", "decision_sends", "dispatch_index", "estimate",
    "follows", "instances", "list_diff", "per_byte", "reserve_tree", "reserve_until", "stf_run",
    "ten", "transfer", "tree_bottlenecks", "tree_dst", "tree_hosts", "tree_shape", "tree_tables",
    "update_rows",
)  # fmt: skip


def _stale(module: object) -> list[str]:
    """The names of :data:`NATIVE_API` that a built extension lacks.

    Examples
    --------
    >>> _stale(object())[:2]
    ['build', 'changed_capacities']
    """
    return [name for name in NATIVE_API if not hasattr(module, name)]


try:
    from mlfabric.scheduler.core import _plan_native
except ImportError:  # pragma: no cover - not built: the Python loops run
    _plan_native = None  # type: ignore[assignment]
if _plan_native is not None and _stale(_plan_native):  # pragma: no cover - a checkout newer than its build
    raise ImportError(
        f"mlfabric's C extension {_plan_native.__file__} is older than the Python code beside it (it lacks "
        f"{', '.join(_stale(_plan_native))}): rebuild it with `pip install -e .` in the checkout"
    )
