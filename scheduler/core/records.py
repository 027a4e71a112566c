"""Many dataclass instances at once: the planners' per-update records without their ``__init__``.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` — about a
microsecond per object, thousands of times per decision at 1,024 workers (issue 24).
:func:`instances` fills each instance's fields in C instead (``_plan_native.instances``),
for a dataclass whose generated ``__init__`` only sets them (:func:`init_fields`), then
calls the class's ``__post_init__`` on each, as that ``__init__`` would (``Update``'s); the
objects are the same (fields, equality, hash, ``repr``, frozenness). Without the C
extension, or for any other class, it calls the class.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any, TypeVar

from mlfabric.scheduler.core.native import _plan_native

__all__ = ["init_fields", "instances"]

T = TypeVar("T")

_FIELDS: dict[type, tuple[str, ...] | None] = {}
_SET_FIELDS: dict[type, tuple[str, ...] | None] = {}


def init_fields(cls: type) -> tuple[str, ...] | None:
    """The fields ``cls.__init__`` sets, in order, where that is all it does; else None.

    That is: a dataclass whose ``__init__`` is the generated one (every field an argument,
    in order, no ``InitVar``) and which has no ``__post_init__``.

    Examples
    --------
    >>> @dataclasses.dataclass(frozen=True)
    ... class P:
    ...     x: int
    ...     y: int = 0
    >>> init_fields(P), init_fields(int)
    (('x', 'y'), None)
    """
    if cls in _FIELDS:
        return _FIELDS[cls]
    got = _FIELDS[cls] = None if hasattr(cls, "__post_init__") else _set_fields(cls)
    return got


def _set_fields(cls: type) -> tuple[str, ...] | None:
    """The fields the generated ``__init__`` of dataclass ``cls`` sets, in order (its
    ``__post_init__`` aside); None where ``__init__`` is not that."""
    if cls in _SET_FIELDS:
        return _SET_FIELDS[cls]
    got: tuple[str, ...] | None = None
    if dataclasses.is_dataclass(cls):
        fields = dataclasses.fields(cls)
        init = cls.__dict__.get("__init__")
        params = list(inspect.signature(init).parameters)[1:] if init is not None else None
        generated = init is not None and init.__code__.co_filename == "<string>"  # made by dataclasses
        names = tuple(f.name for f in fields)
        if generated and all(f.init for f in fields) and params is not None and tuple(params) == names:
            got = names
    _SET_FIELDS[cls] = got
    return got


def instances(cls: type[T], rows: Sequence[tuple[Any, ...]]) -> list[T]:
    """``[cls(*row) for row in rows]``, each row naming every field of ``cls`` in order.

    Examples
    --------
    >>> from mlfabric.scheduler.policies.base import Send
    >>> s = instances(Send, [("u1", "h0", ("h1", "h0"), (), 0.0, 1.0)])
    >>> s == [Send("u1", "h0", ("h1", "h0"), (), 0.0, 1.0)]
    True
    """
    fields = _set_fields(cls)
    if _plan_native is None or fields is None:
        return [cls(*row) for row in rows]
    out: list[T] = _plan_native.instances(cls, fields, rows if isinstance(rows, list) else list(rows))
    post = getattr(cls, "__post_init__", None)
    if post is not None:  # as the generated __init__ ends (no InitVar: every parameter a field)
        for obj in out:
            post(obj)
    return out
