"""Types of the C extension scheduler/core/_plan_native.c (the tree planner's per-update loops)."""

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

def transfer(
    timelines: dict[Any, Any],
    links: tuple[tuple[str, str], ...],
    nbytes: float,
    ready: float,
    who: str,
    reservation: type | None,
    /,
) -> tuple[float, float, tuple[Any, ...]] | None: ...
def ten(
    tls: Any, timelines: dict[Any, Any], links: tuple[tuple[str, str], ...], nbytes: float, ready: float, /
) -> tuple[float, float] | None: ...
def copy_timelines(timelines: dict[Any, Any], timeline: type, /) -> dict[Any, Any]: ...
def reserve_until(
    tls: Any,
    timelines: dict[Any, Any],
    links: tuple[tuple[str, str], ...],
    start: float,
    end: float,
    who: str,
    reservation: type,
    timeline: type,
    eps: float,
    /,
) -> tuple[Any, ...] | None: ...
def reserve_tree(
    timelines: Any,
    routes: Any,
    order: list[Any],
    nodes: dict[str, Any],
    parent: dict[str, str],
    server: str,
    size: dict[str, float],
    readies: list[float],
    now: float,
    transfer: type,
    reservation: type,
    fields: tuple[str, ...] | None,
    timeline: type | None,
    eps: float,
    /,
) -> tuple[list[Any], float]: ...
def estimate(
    updates: list[tuple[float, float, str, str]],
    nodes: dict[str, Any],
    parent: dict[str, str],
    server: str,
    order: list[str],
    routes: Any,
    shared: dict[str, dict[str, tuple[int, ...]]],
    now: float,
    /,
) -> float: ...
def build(
    groups: Mapping[tuple[str, ...], list[str]],
    depth: Mapping[str, int],
    index: Mapping[str, int],
    below: Mapping[str, list[str]],
    top: Mapping[str, tuple[list[str], set[str]]],
    rank: Mapping[str, int],
    host_of: Mapping[str, str],
    points: frozenset[str],
    prefix: str,
    bypass: dict[str, int],
    fan_in: int,
    node: type,
    fields: tuple[str, ...] | None,
    /,
) -> tuple[dict[str, Any], dict[str, str]]: ...
def follows(
    transfers: tuple[Any, ...],
    busy: Sequence[tuple[str, Sequence[Hashable], float]],
    ids: dict[str, str],
    rows: type = ...,
    /,
) -> list[tuple[str, ...]] | None: ...
def stf_run(
    classes: list[tuple[float, list[tuple[float, str]], int]],
    class_of: dict[str, int],
    class_of_key: dict[tuple[object, ...], int],
    on_first_link: dict[Any, list[str]],
    book_on_link: Mapping[Any, Mapping[str, None]] | None,
    popped: set[Any] | None,
    by_id: dict[str, Any],
    links_of: dict[str, tuple[tuple[str, str], ...]],
    names: Mapping[str, str] | None,
    now: float,
    tau_max: int | Mapping[str, int] | None,
    server_version: int | Mapping[str, int],
    ahead: dict[str, int],
    limit: int,
    tls: Any,
    tls_links: dict[Any, Any],
    succ: dict[str, dict[str, dict[str, Any]]],
    start: float,
    profiles: Any,
    transfer: type,
    fields: tuple[str, ...] | None,
    reservation: type | None,
    timeline: type,
    eps: float,
    drop_reason: Any,
    drops: dict[str, str],
    ix_of: Mapping[str, tuple[Any, ...]] | None = None,
    link_list: list[Any] | None = None,
    cap_cache: list[Any] | None = None,
    class_index: Any = None,
    keep: bool = True,
    shared: list[list[tuple[float, str]]] | None = None,
    /,
) -> list[Any] | None: ...
def dispatch_index(
    sends: tuple[Any, ...], /
) -> tuple[dict[str, Any], dict[str, int], dict[str, int], dict[str, str | list[str]], set[str]] | None: ...
def list_diff(old: list[T], new: list[T], /) -> tuple[list[T], list[T]] | None: ...
def changed_capacities(
    caps: dict[tuple[str, str], float], succ: dict[str, dict[str, dict[str, Any]]], /
) -> list[tuple[str, str]]: ...
def instances(cls: type[T], fields: tuple[str, ...], rows: list[tuple[Any, ...]], /) -> list[T]: ...
def tree_hosts(
    next_hops: dict[str, str], hosts: dict[str, Any], lid: dict[Any, int], links: list[Any], host: type, /
) -> None: ...
def tree_shape(
    tree: Any,
    hosts: dict[str, Any],
    server: str,
    eligible: frozenset[str],
    sources: frozenset[str],
    every: list[str],
    /,
) -> tuple[dict[str, tuple[str, ...]], dict[str, list[str]]]: ...
def tree_bottlenecks(
    adj: dict[str, dict[str, dict[str, Any]]], next_hops: dict[str, str], server: str, /
) -> dict[str, float]: ...
def tree_dst(
    path: tuple[str, ...], adj: dict[str, dict[str, Any]], lid: dict[Any, int], links: list[Any], dst: type, /
) -> Any: ...
def decision_sends(
    transfers: tuple[Any, ...],
    after: list[tuple[str, ...]],
    ids: dict[str, str],
    planned: set[str],
    send: type,
    fields: tuple[str, ...] | None,
    rows: type = ...,
    /,
) -> tuple[list[Any], dict[str, tuple[Any, tuple[str, ...]]]] | None: ...
def tree_tables(
    order: list[Any],
    paths: dict[str, tuple[str, ...]],
    adj: dict[str, dict[str, Any]],
    eligible: frozenset[str],
    below: dict[str, list[str]],
    /,
) -> tuple[
    dict[str, tuple[list[str], set[str]]],
    dict[tuple[str, ...], list[str]],
    dict[str, int],
    dict[str, int],
    dict[str, str],
]: ...
def update_rows(
    order: list[Any], now: float, /
) -> tuple[list[tuple[float, float, str, str]], list[float], dict[str, float]]: ...
def per_byte(adj: dict[str, dict[str, dict[str, Any]]], links: list[tuple[str, str]], /) -> list[float]: ...
