"""``mlfabric install-units``: write the systemd units (and example configs) of mlfabric.

The unit files ship in the package (``mlfabric/data/units/*.service``) with two
placeholders: ``@EXEC@``, the ``mlfabric`` command to run, and ``@CONFIG_DIR@``, where
``scheduler.toml`` and ``daemon.toml`` live. ``install-units`` fills them in and writes::

    <prefix>/etc/systemd/system/mlfabric-scheduler.service
    <prefix>/etc/systemd/system/mlfabric-daemon.service
    <prefix>/etc/mlfabric/{scheduler,daemon,topology}.toml  (examples: --configs; never overwritten)

``--prefix`` (default ``/``) roots every path (packaging, tests); ``--unit-dir`` writes the
units to a directory of their own instead. ``--exec`` is the command the units run:
by default the ``mlfabric`` script installed beside this Python, else ``<python> -m mlfabric``,
so a virtualenv's units run that virtualenv. Then ``systemctl daemon-reload`` and
``systemctl enable --now mlfabric-daemon`` (and ``mlfabric-scheduler`` on its host).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from importlib import resources
from pathlib import Path

__all__ = ["UNITS", "configure", "default_exec", "hidden_by_private_tmp", "render_unit", "run", "write_units"]

#: the unit files shipped in the package
UNITS = ("mlfabric-scheduler.service", "mlfabric-daemon.service")
_CONFIGS = ("scheduler.toml", "daemon.toml", "topology.toml")  # scheduler.toml names topology.toml


def default_exec(python: str | None = None) -> str:
    """The command the units run: the ``mlfabric`` script beside ``python``, else ``python -m mlfabric``.

    Examples
    --------
    >>> default_exec("/nonexistent/bin/python3")
    '/nonexistent/bin/python3 -m mlfabric'
    """
    python = python or sys.executable
    script = Path(python).with_name("mlfabric")
    if script.is_file():
        return str(script)
    return f"{shlex.quote(python)} -m mlfabric"


def render_unit(name: str, exec_command: str, config_dir: str = "/etc/mlfabric") -> str:
    """The text of the shipped unit ``name`` with its placeholders filled in.

    Examples
    --------
    >>> text = render_unit("mlfabric-daemon.service", "/opt/venv/bin/mlfabric")
    >>> [line for line in text.splitlines() if line.startswith("ExecStart=")]
    ['ExecStart=/opt/venv/bin/mlfabric daemon --config /etc/mlfabric/daemon.toml']
    """
    if name not in UNITS:
        raise ValueError(f"no unit {name!r} (units: {', '.join(UNITS)})")
    template = resources.files("mlfabric").joinpath("data", "units", name).read_text(encoding="utf-8")
    return template.replace("@EXEC@", exec_command).replace("@CONFIG_DIR@", config_dir.rstrip("/"))


def write_units(
    unit_dir: Path, exec_command: str, config_dir: str = "/etc/mlfabric", configs_to: Path | None = None
) -> list[Path]:
    """Write the units to ``unit_dir`` (and example configs to ``configs_to`` when absent).

    Returns
    -------
    list of Path
        The files written.
    """
    written = []
    unit_dir.mkdir(parents=True, exist_ok=True)
    for name in UNITS:
        path = unit_dir / name
        path.write_text(render_unit(name, exec_command, config_dir), encoding="utf-8")
        written.append(path)
    if configs_to is not None:
        configs_to.mkdir(parents=True, exist_ok=True)
        for name in _CONFIGS:
            path = configs_to / name
            if not path.exists():
                text = (
                    resources.files("mlfabric").joinpath("data", "config", name).read_text(encoding="utf-8")
                )
                path.write_text(text, encoding="utf-8")
                written.append(path)
    return written


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``mlfabric install-units`` arguments to ``parser``."""
    parser.add_argument("--prefix", default="/", help="root of the paths written (default /)")
    parser.add_argument(
        "--unit-dir",
        metavar="DIR",
        help="write the units here (default: <prefix>/etc/systemd/system)",
    )
    parser.add_argument(
        "--exec",
        dest="exec_command",
        metavar="CMD",
        help="the mlfabric command the units run (default: the mlfabric script beside this Python, "
        f"now {default_exec()!r})",
    )
    parser.add_argument(
        "--python", metavar="PATH", help="run the units with this Python's mlfabric (instead of --exec)"
    )
    parser.add_argument(
        "--config-dir",
        default="/etc/mlfabric",
        help="where the units read scheduler.toml and daemon.toml (default /etc/mlfabric)",
    )
    parser.add_argument(
        "--configs",
        action="store_true",
        help="also write example scheduler.toml, daemon.toml and topology.toml to <prefix>/<config-dir> "
        "(never overwritten)",
    )


def hidden_by_private_tmp(exec_command: str) -> str | None:
    """The program of ``exec_command`` if it lies under /tmp or /var/tmp, else None.

    The units say ``PrivateTmp=yes``: the service sees empty /tmp and /var/tmp of its own,
    so a program there (a virtualenv made in /tmp) is not found and the unit fails to start.

    Examples
    --------
    >>> hidden_by_private_tmp("/tmp/venv/bin/mlfabric")
    '/tmp/venv/bin/mlfabric'
    >>> hidden_by_private_tmp("/opt/venv/bin/python3 -m mlfabric") is None
    True
    """
    program = shlex.split(exec_command)[0] if exec_command.strip() else ""
    parts = Path(program).parts
    return program if parts[:2] == ("/", "tmp") or parts[:3] == ("/", "var", "tmp") else None


def run(args: argparse.Namespace) -> int:
    """Write the files; print each path."""
    prefix = Path(args.prefix)
    unit_dir = Path(args.unit_dir) if args.unit_dir else prefix / "etc/systemd/system"
    exec_command = args.exec_command or default_exec(args.python)
    hidden = hidden_by_private_tmp(exec_command)
    if hidden is not None:
        print(
            f"mlfabric install-units: warning: the units run {hidden}, under /tmp or /var/tmp, which "
            "PrivateTmp=yes hides from them: they would not start; install mlfabric elsewhere "
            "(or give --exec/--python)",
            file=sys.stderr,
        )
    configs_to = prefix / args.config_dir.lstrip("/") if args.configs else None
    try:
        written = write_units(unit_dir, exec_command, args.config_dir, configs_to)
    except OSError as exc:
        print(f"mlfabric install-units: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    if prefix == Path("/") and not args.unit_dir:
        print("now: systemctl daemon-reload; systemctl enable --now mlfabric-daemon", file=sys.stderr)
    return 0
