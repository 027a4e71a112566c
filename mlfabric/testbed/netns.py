"""Running ``ip``/``tc``, checking the prerequisites, and sweeping stale runs (DESIGN §6).

Everything that touches the system goes through a :class:`Runner` (passed in), so the
logic can be tested with a fake. Names: a run prefix is ``mlf`` + 6 hex digits
(:func:`new_prefix`); every namespace of a run is called ``<prefix>-...``. Each live run
keeps a small JSON *marker* ``<state_dir>/<prefix>.json`` (owner pid, persistent or
not). :func:`sweep_stale` deletes only namespaces whose name matches the prefix pattern
and whose run has no marker, or whose owner is dead and did not ask to persist
(``mlfabric testbed up`` persists until ``mlfabric testbed down``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "DEFAULT_STATE_DIR",
    "NAMESPACE_PATTERN",
    "CommandError",
    "Runner",
    "SubprocessRunner",
    "TestbedUnavailable",
    "list_namespaces",
    "missing_prerequisites",
    "netem_available",
    "new_prefix",
    "pid_alive",
    "read_marker",
    "remove_marker",
    "stale_prefixes",
    "sweep_stale",
    "write_marker",
]

#: Where live runs keep their markers (``--state-dir`` overrides it).
DEFAULT_STATE_DIR = Path("/run/mlfabric/testbeds")
#: A namespace that belongs to some run of ours: ``mlf`` + 6 hex digits + ``-`` + rest.
NAMESPACE_PATTERN = re.compile(r"^(mlf[0-9a-f]{6})-[A-Za-z0-9_.-]+$")


class TestbedUnavailable(RuntimeError):
    """The machine cannot host a testbed; the message says exactly what is missing."""

    __test__ = False  # not a pytest test class


class CommandError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


class Runner(Protocol):
    """Runs one command to completion; raises :class:`CommandError` when it fails."""

    def __call__(self, argv: Sequence[str], *, check: bool = True) -> str:
        """Run ``argv``; return its stdout."""
        ...


@dataclass(frozen=True)
class SubprocessRunner:
    """The real :class:`Runner`: :func:`subprocess.run` with a timeout."""

    timeout: float = 20.0

    def __call__(self, argv: Sequence[str], *, check: bool = True) -> str:
        """Run ``argv``; return stdout; raise :class:`CommandError` on failure if ``check``."""
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=self.timeout, check=False)
        if check and proc.returncode != 0:
            raise CommandError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout


def missing_prerequisites(which: Any = shutil.which, euid: int | None = None) -> list[str]:
    """What this machine lacks to build a testbed (empty when everything is there).

    Parameters
    ----------
    which : callable
        ``shutil.which``-like lookup (a fake in tests).
    euid : int, optional
        Effective user id; defaults to :func:`os.geteuid`.

    Returns
    -------
    list of str
        Human-readable reasons, e.g. ``"not root (euid 1000); network namespaces need root"``.

    Examples
    --------
    >>> missing_prerequisites(which=lambda name: None, euid=1000)  # doctest: +NORMALIZE_WHITESPACE
    ['not root (euid 1000); network namespaces need root',
     "no 'ip' command (iproute2) on PATH", "no 'tc' command (iproute2) on PATH"]
    """
    missing = []
    uid = os.geteuid() if euid is None else euid
    if uid != 0:
        missing.append(f"not root (euid {uid}); network namespaces need root")
    for tool in ("ip", "tc"):
        if which(tool) is None:
            missing.append(f"no '{tool}' command (iproute2) on PATH")
    return missing


def netem_available(runner: Runner, namespace: str) -> bool:
    """Whether the kernel has netem, probed on ``lo`` of a namespace we own (then removed)."""
    try:
        runner(["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"])
    except CommandError:
        return False
    runner(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], check=False)
    return True


def new_prefix(rng: random.Random) -> str:
    """A fresh run prefix, ``mlf`` + 6 hex digits.

    Examples
    --------
    >>> new_prefix(random.Random(1))
    'mlf2265b1'
    """
    return f"mlf{rng.getrandbits(24):06x}"


def list_namespaces(runner: Runner) -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    out = runner(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_marker(state_dir: Path, prefix: str, data: dict[str, Any]) -> Path:
    """Write ``<state_dir>/<prefix>.json`` atomically; return its path."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / f"{prefix}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)
    return path


def read_marker(state_dir: Path, prefix: str) -> dict[str, Any] | None:
    """The marker of run ``prefix``, or ``None`` if there is none (or it is unreadable)."""
    try:
        data = json.loads((state_dir / f"{prefix}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def remove_marker(state_dir: Path, prefix: str) -> None:
    """Delete the marker of run ``prefix`` if it exists."""
    (state_dir / f"{prefix}.json").unlink(missing_ok=True)


def stale_prefixes(
    namespaces: Sequence[str], markers: dict[str, dict[str, Any] | None], alive: Any = pid_alive
) -> set[str]:
    """The run prefixes among ``namespaces`` that nobody owns any more.

    Parameters
    ----------
    namespaces : sequence of str
        All namespace names; names not matching :data:`NAMESPACE_PATTERN` are ignored.
    markers : dict
        Prefix -> its marker (``None``: no marker).
    alive : callable
        ``pid -> bool``.

    Returns
    -------
    set of str
        Prefixes without a marker, or whose owner is dead and not ``persistent``.

    Examples
    --------
    >>> ns = ["mlf00aaaa-h0-ps", "mlf00bbbb-ctl", "mlf00cccc-ctl", "other", "mlfzz-ctl"]
    >>> markers = {"mlf00aaaa": None, "mlf00bbbb": {"pid": 1}, "mlf00cccc": {"pid": 2}}
    >>> sorted(stale_prefixes(ns, markers, alive=lambda pid: pid == 1))
    ['mlf00aaaa', 'mlf00cccc']
    """
    stale = set()
    for name in namespaces:
        match = NAMESPACE_PATTERN.match(name)
        if not match:
            continue
        prefix = match.group(1)
        marker = markers.get(prefix)
        owned = marker is not None and (marker.get("persistent") or alive(int(marker.get("pid", 0))))
        if not owned:
            stale.add(prefix)
    return stale


def sweep_stale(runner: Runner, state_dir: Path = DEFAULT_STATE_DIR) -> list[str]:
    """Delete the namespaces (and markers) of dead runs; return the deleted namespaces.

    Only names matching :data:`NAMESPACE_PATTERN` are ever touched. Deleting a namespace
    deletes the veth ends and bridges inside it, so nothing else needs sweeping. A run's
    marker is looked up in ``state_dir`` and in :data:`DEFAULT_STATE_DIR`, so a sweep with
    one state directory does not take the live runs recorded in the other.
    """
    names = list_namespaces(runner)
    prefixes = {m.group(1) for n in names if (m := NAMESPACE_PATTERN.match(n))}
    dirs = [state_dir, DEFAULT_STATE_DIR]
    markers = {p: next((mk for d in dirs if (mk := read_marker(d, p)) is not None), None) for p in prefixes}
    stale = stale_prefixes(names, markers)
    deleted = []
    for name in names:
        match = NAMESPACE_PATTERN.match(name)
        if match and match.group(1) in stale:
            runner(["ip", "netns", "del", name], check=False)
            deleted.append(name)
    for prefix in stale:
        for d in dirs:
            remove_marker(d, prefix)
    return deleted
