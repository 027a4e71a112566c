"""Config files of the scheduler and the daemons (``/etc/mlfabric/{scheduler,daemon}.toml``).

A config file is TOML whose keys are the long options of ``mlfabric scheduler`` or
``mlfabric daemon`` with ``-`` spelled ``_`` (``metrics_port = 9100`` is
``--metrics-port 9100``). Options given on the command line override the file. Every key,
its type, its default and its meaning is in :data:`SCHEDULER_KEYS` and :data:`DAEMON_KEYS`
(``mlfabric config keys scheduler`` prints them); an unknown key, a value of the wrong
type or out of range is an error naming the file, the key and the bad value
(:class:`ConfigError`). ``mlfabric config check FILE`` validates a file.

The scheduler's ``topology`` is a path (relative paths are relative to the config file's
directory) or an inline table in the topology format of
:mod:`mlfabric.scheduler.core.graph`::

    listen = "0.0.0.0:7077"
    policy = "stf"
    metrics_port = 9100

    [topology]
    hosts = ["h0", "h1"]
    switches = ["sw"]
    links = [{a = "h0", b = "sw", gbps = 10}, {a = "h1", b = "sw", gbps = 10}]

This module only reads files when asked (:func:`load_config`); parsing and validation are
pure (:func:`parse_config`).
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DAEMON_KEYS",
    "KINDS",
    "NOT_IN_SERVICE",
    "SCHEDULER_KEYS",
    "SERVICE_POLICIES",
    "ConfigError",
    "Key",
    "add_config_argument",
    "configure",
    "describe",
    "load_config",
    "load_graph",
    "parse_args_with_config",
    "parse_config",
    "run",
]


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file, the key and the value."""


@dataclass(frozen=True)
class Key:
    """One config key: its name (the option's ``dest``), type, default and meaning.

    ``type`` is ``str``, ``int``, ``float`` or ``bool``; ``choices`` restricts a ``str``;
    ``minimum`` bounds a number from below; ``table_ok`` lets a ``str`` key be an inline
    table instead (the scheduler's ``topology``); ``path`` resolves a relative path against
    the config file's directory; ``refused`` are (value, why) pairs of values known but not
    accepted, refused with the reason.
    """

    name: str
    type: type
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    table_ok: bool = False
    path: bool = False
    refused: tuple[tuple[str, str], ...] = ()


#: policies the scheduler service executes (``mlfabric scheduler --policy`` and the ``policy`` key)
SERVICE_POLICIES = ("fair", "stf", "stf+agg", "stf+tree")
#: policies of the factory that the service refuses, and why (none at present)
NOT_IN_SERVICE: dict[str, str] = {}

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

#: keys of ``scheduler.toml`` (the options of ``mlfabric scheduler``)
SCHEDULER_KEYS: tuple[Key, ...] = (
    Key("listen", str, "127.0.0.1:7077", "gRPC address HOST:PORT the daemons connect to; port 0 picks one"),
    Key(
        "topology",
        str,
        None,
        "the bandwidth graph: a topology TOML path, or an inline table in that format",
        table_ok=True,
        path=True,
    ),
    Key(
        "star",
        int,
        None,
        "instead of a topology: N hosts h0..h{N-1} around one switch (default 4)",
        minimum=1,
    ),
    Key("nic_gbps", float, 10.0, "NIC rate of every host of the star, Gbit/s", minimum=0.0),
    Key(
        "policy",
        str,
        "fair",
        "scheduling policy",
        choices=SERVICE_POLICIES,
        refused=tuple(NOT_IN_SERVICE.items()),
    ),
    Key("aggregate_plan", str, "async", "stf+agg planner", choices=("async", "sync")),
    Key(
        "aggregate_timeout",
        float,
        60.0,
        "stf+agg, stf+tree: seconds an aggregator waits for members",
        minimum=0.0,
    ),
    Key(
        "pipelined_aggregates",
        bool,
        False,
        "stf+agg, stf+tree: aggregators forward each piece of a sum as its float32 members land",
    ),
    Key(
        "replica_grace",
        float,
        10.0,
        "seconds a replica whose daemon lost its session stays attached; later: re-synced",
        minimum=0.0,
    ),
    Key("stf_horizon", int, 256, "stf: sends planned per decision; 0 plans every pending update", minimum=0),
    Key("batch_window_us", float, 300.0, "batch ready notifications arriving within N us", minimum=0.0),
    Key(
        "batch_max_wait_us",
        float,
        5000.0,
        "longest wait of a batch after its first notification, us",
        minimum=0.0,
    ),
    Key(
        "release_margin_us", float, 2000.0, "release a transfer N us before its predecessor ends", minimum=0.0
    ),
    Key("ready_file", str, None, "write {pid, address, ...} JSON here once serving", path=True),
    Key("metrics_port", int, None, "serve Prometheus /metrics on this port (0: any; unset: off)", minimum=0),
    Key("log_level", str, "WARNING", "log verbosity", choices=_LOG_LEVELS),
    Key(
        "tls_ca",
        str,
        None,
        "CA certificate (PEM) of the cluster; with tls_cert and tls_key: serve mTLS only "
        "(daemons must present a host certificate)",
        path=True,
    ),
    Key(
        "tls_cert",
        str,
        None,
        "this process's certificate (PEM; `mlfabric certs` makes a test set)",
        path=True,
    ),
    Key("tls_key", str, None, "this process's private key (PEM, mode 0600)", path=True),
    Key(
        "tls_admin",
        str,
        "admin",
        "under mTLS: client certificate names (comma-separated) that may read the admin service "
        "(mlfabric status, trace); host certificates may not",
    ),
)

#: keys of ``daemon.toml`` (the options of ``mlfabric daemon``)
DAEMON_KEYS: tuple[Key, ...] = (
    Key("host", str, None, "this host's name in the scheduler's bandwidth graph (required)"),
    Key("scheduler", str, None, "the scheduler's address HOST:PORT (required)"),
    Key(
        "socket",
        str,
        None,
        "local API Unix socket (default $MLFABRIC_DAEMON, else $TMPDIR/mlfabric-<uid>/daemon.sock)",
        path=True,
    ),
    Key("data_listen", str, "127.0.0.1:0", "data-plane listen address HOST:PORT (port 0: any)"),
    Key("topology", str, None, "topology TOML, for enforce_nic_rates", path=True),
    Key("enforce_nic_rates", bool, False, "shape data-plane traffic to this host's NIC rates in topology"),
    Key(
        "ready_file",
        str,
        None,
        "write {pid, socket, data_address, host} JSON here once registered",
        path=True,
    ),
    Key("connect_timeout", float, 30.0, "seconds to wait for the scheduler's welcome", minimum=0.0),
    Key("send_attempts", int, 3, "tries per transfer before DROPPED", minimum=1),
    Key("report_file", str, None, "append every transfer report here, one JSON line each", path=True),
    Key("aggregator", bool, True, "whether this host may be an aggregator hop"),
    Key(
        "push_timeout",
        float,
        60.0,
        "the push deadline: seconds a push may wait for the scheduler's directive, then DROPPED",
        minimum=0.001,
    ),
    Key(
        "round_timeout",
        float,
        60.0,
        "a synchronous round is applied this long after its first update",
        minimum=0.0,
    ),
    Key(
        "idle_timeout",
        float,
        120.0,
        "close a data-plane or local connection idle this long, seconds (0: never)",
        minimum=0.0,
    ),
    Key(
        "header_timeout",
        float,
        10.0,
        "close a connection whose frame header (or local message) is incomplete this long after its "
        "first byte, seconds (0: no limit)",
        minimum=0.0,
    ),
    Key(
        "max_connections",
        int,
        1024,
        "connections served at once on the data plane and on the local socket, each (0: no limit)",
        minimum=0,
    ),
    Key(
        "fallback_after",
        float,
        2.0,
        "seconds without the scheduler before pushes go directly to their servers (negative: never)",
    ),
    Key(
        "max_inflight_bytes",
        int,
        2 << 30,
        "payload bytes of pushes held, and of receives, at once; more waits (back-pressure)",
        minimum=1,
    ),
    Key("metrics_port", int, None, "serve Prometheus /metrics on this port (0: any; unset: off)", minimum=0),
    Key("log_level", str, "WARNING", "log verbosity", choices=_LOG_LEVELS),
    Key(
        "tls_ca",
        str,
        None,
        "CA certificate (PEM) of the cluster; with tls_cert and tls_key: mTLS to the scheduler "
        "(and the data plane's, with data_auth = tls)",
        path=True,
    ),
    Key(
        "tls_cert",
        str,
        None,
        "this process's certificate (PEM; `mlfabric certs` makes a test set)",
        path=True,
    ),
    Key("tls_key", str, None, "this process's private key (PEM, mode 0600)", path=True),
    Key(
        "tls_server_name",
        str,
        None,
        "name the scheduler's certificate must carry (default: the host part of 'scheduler')",
    ),
    Key(
        "data_auth",
        str,
        "none",
        "data-plane authentication per connection: none, hmac (shared-secret challenge/response, "
        "zero copy kept) or tls (mTLS with the host certificates, encrypted)",
        choices=("none", "hmac", "tls"),
    ),
    Key("data_secret", str, None, "the data plane's shared secret file (hex; data_auth = hmac)", path=True),
    Key(
        "local_peer_check",
        bool,
        False,
        "check local clients' uid/gid (SO_PEERCRED): only this daemon's uid, root and local_group",
    ),
    Key("local_group", str, None, "group (name or gid) whose members may use the local socket"),
)

#: config kind -> its keys
KINDS: dict[str, tuple[Key, ...]] = {"scheduler": SCHEDULER_KEYS, "daemon": DAEMON_KEYS}


def _check(key: Key, value: Any, where: str) -> Any:
    bad = f"{where}: key '{key.name}': bad value {value!r}"
    if key.table_ok and isinstance(value, dict):
        return value
    if key.type is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{bad} (expected true or false)")
        return value
    if key.type is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{bad} (expected a number)")
        value = float(value)
    elif key.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{bad} (expected an integer)")
    elif not isinstance(value, str):
        expected = "a string or a table" if key.table_ok else "a string"
        raise ConfigError(f"{bad} (expected {expected})")
    refused = dict(key.refused).get(value) if isinstance(value, str) else None
    if refused is not None:
        raise ConfigError(f"{bad}: {refused} (expected one of {', '.join(key.choices)})")
    if key.choices and value not in key.choices:
        raise ConfigError(f"{bad} (expected one of {', '.join(key.choices)})")
    if key.minimum is not None and value < key.minimum:
        raise ConfigError(f"{bad} (must be >= {key.minimum:g})")
    return value


def parse_config(
    data: Mapping[str, Any], kind: str, where: str = "<config>", base: Path | None = None
) -> dict[str, Any]:
    """Validate a parsed config file; the keys it sets, with checked values.

    Parameters
    ----------
    data : mapping
        The file's TOML, parsed.
    kind : str
        ``scheduler`` or ``daemon``.
    where : str
        The file's name, for messages.
    base : Path, optional
        Directory that relative paths are resolved against (the file's directory).

    Returns
    -------
    dict
        Key name -> value, only for keys present in ``data`` (integers of float keys
        become floats; relative paths become absolute under ``base``).

    Raises
    ------
    ConfigError
        An unknown kind or key, a value of the wrong type, not among the choices or too small.

    Examples
    --------
    >>> parse_config({"policy": "stf", "metrics_port": 9100}, "scheduler")
    {'policy': 'stf', 'metrics_port': 9100}
    >>> parse_config({"policy": "best"}, "scheduler", "s.toml")
    Traceback (most recent call last):
    ...
    mlfabric.config.ConfigError: s.toml: key 'policy': bad value 'best' (expected one of fair, stf, ...)
    >>> parse_config({"send_attempts": 0}, "daemon", "d.toml")
    Traceback (most recent call last):
    ...
    mlfabric.config.ConfigError: d.toml: key 'send_attempts': bad value 0 (must be >= 1)
    """
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown config kind {kind!r} (kinds: {', '.join(KINDS)})")
    keys = {k.name: k for k in KINDS[kind]}
    out: dict[str, Any] = {}
    errors: list[str] = []  # every bad key, one line each, not only the first
    for name, value in data.items():
        key = keys.get(name)
        if key is None:
            hint = " (options use '_', not '-')" if name.replace("-", "_") in keys else ""
            errors.append(f"{where}: unknown key '{name}' in a {kind} config{hint} (keys: {', '.join(keys)})")
            continue
        try:
            value = _check(key, value, where)
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        if key.path and isinstance(value, str) and base is not None and not Path(value).is_absolute():
            value = str(base / value)
        out[name] = value
    if "topology" in out and "star" in out and kind == "scheduler":
        errors.append(f"{where}: keys 'topology' and 'star' exclude each other; set one")
    if errors:
        raise ConfigError("\n".join(errors))
    return out


def load_config(path: str | Path, kind: str) -> dict[str, Any]:
    """Read and validate the config file ``path`` of a ``kind`` process (see :func:`parse_config`).

    Raises
    ------
    ConfigError
        The file is missing, unreadable, not TOML, or has a bad key or value; the message
        starts with the file name.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(data, kind, str(path), base=path.resolve().parent)


def parse_args_with_config(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    kind: str,
    subparser: argparse.ArgumentParser | None = None,
) -> argparse.Namespace:
    """Parse ``argv``; when it names ``--config FILE``, the file's keys become the defaults.

    Options given on the command line therefore override the file, and the file
    overrides the built-in defaults. ``subparser`` is the parser that owns the options
    (the subcommand's), when ``parser`` is the top-level one.

    Raises
    ------
    ConfigError
        The config file is bad (see :func:`load_config`).
    """
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if not path:
        return args
    (subparser or parser).set_defaults(**load_config(path, kind))
    return parser.parse_args(argv)


def add_config_argument(parser: argparse.ArgumentParser, kind: str) -> None:
    """Add ``--config FILE`` (a ``kind`` config file; command-line options override it)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"{kind} config TOML (e.g. /etc/mlfabric/{kind}.toml; `mlfabric config keys {kind}` "
        "lists its keys); options given here override it",
    )


def describe(kind: str) -> str:
    """The keys of a ``kind`` config, one per line with type, default and meaning.

    Examples
    --------
    >>> print(describe("daemon").splitlines()[0])
    host (str, default: unset): this host's name in the scheduler's bandwidth graph (required)
    """
    lines = []
    for k in KINDS[kind]:
        default = "unset" if k.default is None else repr(k.default)
        extra = f"; one of {', '.join(k.choices)}" if k.choices else ""
        lines.append(f"{k.name} ({k.type.__name__}, default: {default}{extra}): {k.doc}")
    return "\n".join(lines)


# ------------------------------------------------------------------ `mlfabric config`


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``mlfabric config`` arguments to ``parser``."""
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="validate a scheduler or daemon config file")
    check.add_argument("file", metavar="FILE")
    check.add_argument(
        "--kind",
        choices=sorted(KINDS),
        help="scheduler or daemon (default: from the file name, else the keys)",
    )
    keys = sub.add_parser("keys", help="list the keys of a config kind with their defaults")
    keys.add_argument("kind", choices=sorted(KINDS))


def _guess_kind(path: Path) -> str | None:
    for kind in KINDS:
        if kind in path.name:
            return kind
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return "daemon" if "host" in data or "scheduler" in data else "scheduler"


def run(args: argparse.Namespace) -> int:
    """``mlfabric config check FILE`` (exit 0 valid, 1 invalid) or ``mlfabric config keys KIND``."""
    import sys

    if args.action == "keys":
        print(describe(args.kind))
        return 0
    path = Path(args.file)
    kind = args.kind or _guess_kind(path) or "scheduler"
    errors: list[str] = []
    values: dict[str, Any] = {}
    try:
        values = load_config(path, kind)
    except ConfigError as exc:
        errors += str(exc).splitlines()
        # the topology is checked even when other keys are bad: every problem at once
        values = _raw_topology(path) if kind == "scheduler" else {}
    if kind == "scheduler" and isinstance(values.get("topology"), str | dict):
        try:
            load_graph(values["topology"], str(path))
        except ConfigError as exc:
            errors.append(str(exc))
    for line in errors:
        print(f"mlfabric config: error: {line}", file=sys.stderr)
    if errors:
        return 1
    print(f"{path}: valid {kind} config ({len(values)} keys set)")
    return 0


def _raw_topology(path: Path) -> dict[str, Any]:
    """The ``topology`` of a scheduler config whose other keys may be bad (a path made absolute)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    topology = data.get("topology")
    if isinstance(topology, str) and not Path(topology).is_absolute():
        topology = str(path.resolve().parent / topology)
    return {"topology": topology} if isinstance(topology, str | dict) else {}


def load_graph(topology: str | Mapping[str, Any], where: str = "<config>") -> Any:
    """The bandwidth graph of a ``topology`` value: a file path or an inline table.

    Raises
    ------
    ConfigError
        The topology is invalid; the message names ``where`` and the key.
    """
    from mlfabric.scheduler.core.graph import TopologyError, load_topology, parse_topology

    try:
        return parse_topology(topology) if isinstance(topology, Mapping) else load_topology(topology)
    except TopologyError as exc:
        raise ConfigError(f"{where}: key 'topology': {exc}") from None
