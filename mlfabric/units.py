"""``mlfabric install-units``: write the systemd units (and example configs) of mlfabric.

The unit files and example configs ship in the package (``mlfabric/data/``) with
placeholders: ``@EXEC@``, the ``mlfabric`` command to run, ``@CONFIG_DIR@``, where
``scheduler.toml`` and ``daemon.toml`` live, and ``@AUTH@``, which starts the lines of
authentication. ``install-units`` fills them in and writes::

    <prefix>/etc/systemd/system/mlfabric-scheduler.service
    <prefix>/etc/systemd/system/mlfabric-daemon.service
    <prefix>/etc/mlfabric/{scheduler,daemon,topology}.toml  (examples: --configs; never overwritten)

Authentication is on unless ``--no-auth`` (docs/security.md): the units hand the files of
``<config-dir>/tls`` (made by ``mlfabric certs``) to the services as credentials
(``LoadCredential=``, readable by the service's dynamic user alone), and the configs turn on
mTLS to the scheduler, ``data_auth = "hmac"`` and ``local_peer_check``, naming those files.
``install-units`` says which files are still missing and the ``mlfabric certs`` command that
makes them. ``--no-auth`` writes those lines commented out, for a trusted network.

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

__all__ = [
    "UNITS",
    "auth_files_missing",
    "configure",
    "default_exec",
    "hidden_by_private_tmp",
    "render",
    "render_unit",
    "run",
    "write_units",
]

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


def render(
    template: str, config_dir: str = "/etc/mlfabric", auth: bool = True, exec_command: str = ""
) -> str:
    """``template`` with the placeholders of the shipped units and configs filled in.

    Examples
    --------
    >>> render("@AUTH@tls_ca = '@CONFIG_DIR@/ca.pem'  # auth@AUTH_STATE@")
    "tls_ca = '/etc/mlfabric/ca.pem'  # auth: on"
    >>> render("@AUTH@tls_ca = '@CONFIG_DIR@/ca.pem'  # auth@AUTH_STATE@", "/srv/mlf/", auth=False)[:50]
    "# tls_ca = '/srv/mlf/ca.pem'  # auth: off (install"
    """
    state = ": on" if auth else ": off (install-units --no-auth); uncomment the lines below to turn it on"
    return (
        template.replace("@EXEC@", exec_command)
        .replace("@CONFIG_DIR@", config_dir.rstrip("/"))
        .replace("@AUTH_STATE@", state)
        .replace("@AUTH@", "" if auth else "# ")
    )


def render_unit(name: str, exec_command: str, config_dir: str = "/etc/mlfabric", auth: bool = True) -> str:
    """The text of the shipped unit ``name`` with its placeholders filled in.

    Examples
    --------
    >>> text = render_unit("mlfabric-daemon.service", "/opt/venv/bin/mlfabric")
    >>> [line for line in text.splitlines() if line.startswith(("ExecStart=", "LoadCredential="))]
    ['ExecStart=/opt/venv/bin/mlfabric daemon --config /etc/mlfabric/daemon.toml', \
'LoadCredential=tls:/etc/mlfabric/tls']
    """
    if name not in UNITS:
        raise ValueError(f"no unit {name!r} (units: {', '.join(UNITS)})")
    template = resources.files("mlfabric").joinpath("data", "units", name).read_text(encoding="utf-8")
    return render(template, config_dir, auth, exec_command)


def auth_files_missing(tls_dir: Path) -> list[str]:
    """What ``tls_dir`` lacks of the files the authenticated configs name (host h0's, by default).

    Examples
    --------
    >>> auth_files_missing(Path("/nonexistent"))[:3]
    ['ca.pem', 'dataplane.secret', '<host>.pem and <host>.key']
    """
    names = {p.name for p in tls_dir.iterdir()} if tls_dir.is_dir() else set()
    missing = [f for f in ("ca.pem", "dataplane.secret") if f not in names]
    stems = {n[:-4] for n in names if n.endswith(".pem")} & {n[:-4] for n in names if n.endswith(".key")}
    if not stems - {"ca", "admin", "mlfabric-scheduler"}:
        missing.append("<host>.pem and <host>.key")
    if "mlfabric-scheduler" not in stems:
        missing.append("mlfabric-scheduler.pem and .key (the scheduler's host)")
    return missing


def write_units(
    unit_dir: Path,
    exec_command: str,
    config_dir: str = "/etc/mlfabric",
    configs_to: Path | None = None,
    auth: bool = True,
) -> list[Path]:
    """Write the units to ``unit_dir`` (and example configs to ``configs_to`` when absent).

    ``auth``: the units load ``<config_dir>/tls`` as credentials and the configs authenticate
    (False: those lines commented out).

    Returns
    -------
    list of Path
        The files written.
    """
    written = []
    unit_dir.mkdir(parents=True, exist_ok=True)
    for name in UNITS:
        path = unit_dir / name
        path.write_text(render_unit(name, exec_command, config_dir, auth), encoding="utf-8")
        written.append(path)
    if configs_to is not None:
        configs_to.mkdir(parents=True, exist_ok=True)
        for name in _CONFIGS:
            path = configs_to / name
            if not path.exists():
                text = (
                    resources.files("mlfabric").joinpath("data", "config", name).read_text(encoding="utf-8")
                )
                path.write_text(render(text, config_dir, auth), encoding="utf-8")
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
    parser.add_argument(
        "--no-auth",
        dest="auth",
        action="store_false",
        help="write the units and configs without authentication (a trusted network only). By default "
        "they authenticate: mTLS to the scheduler, hmac on the data plane, the local socket's peer check, "
        "with the files of `mlfabric certs` in <config-dir>/tls, handed to the services by LoadCredential= "
        "(docs/security.md)",
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


def _say_what_auth_needs(tls_dir: Path, shown: str) -> None:
    """Name the files the authenticated units still lack (and how to make them), or ca.key where
    the services would be handed it."""
    missing = auth_files_missing(tls_dir)
    if missing:
        print(
            f"mlfabric install-units: authentication is on (mTLS control plane, hmac data plane, local peer "
            f"check): the units load the files of {shown}, which lacks {', '.join(missing)}. Make them with\n"
            f"    mlfabric certs --out tls --hosts h0,h1,... --scheduler mlfabric-scheduler[,ADDRESS]"
            f"   # pip install 'mlfabric[auth]'\n"
            f"and copy to {shown} on each host its own <host>.pem/.key, ca.pem and dataplane.secret (on the "
            f"scheduler's host mlfabric-scheduler.pem/.key); set host, tls_cert and tls_key in daemon.toml. "
            f"Until then a unit whose files are missing does not start. On a trusted network: --no-auth "
            f"(docs/security.md)",
            file=sys.stderr,
        )
    if (tls_dir / "ca.key").exists():
        print(
            f"mlfabric install-units: warning: {shown}/ca.key would be handed to the services with the other "
            "files: keep the CA's key off the hosts (it signs certificates for any host)",
            file=sys.stderr,
        )


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
        written = write_units(unit_dir, exec_command, args.config_dir, configs_to, args.auth)
    except OSError as exc:
        print(f"mlfabric install-units: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    if args.auth:
        shown = args.config_dir.rstrip("/") + "/tls"
        _say_what_auth_needs(prefix / args.config_dir.lstrip("/") / "tls", shown)
    if prefix == Path("/") and not args.unit_dir:
        print("now: systemctl daemon-reload; systemctl enable --now mlfabric-daemon", file=sys.stderr)
    return 0
