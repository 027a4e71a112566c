"""The scheduler's sub-packages, and the daemon's layers, depend on each other one way only.

Scheduler: ``core`` (graph, schedule, timeline, checker, trace, estimation) uses nothing of the
other sub-packages; ``policies`` uses ``core``; ``plan``, ``sim`` and ``service`` use
``policies`` and ``core`` and not each other.

Daemon (DESIGN §12): ``channels`` (how messages and bytes get in and out) import no role and
not the host; ``roles`` may use ``channels``; the host's modules directly in ``daemon/`` use
both. Nothing in ``daemon/`` imports ``mlfabric``'s public API: only the neutral modules of
:data:`DAEMON_MAY_IMPORT`; and ``mlfabric/`` (the client side) imports nothing of the daemon.

Checked on the source (every ``import`` statement, at module level or inside functions), so a
lazy import cannot hide an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "scheduler"
PACKAGE = "mlfabric.scheduler"

#: sub-package -> the sub-packages it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "policies": frozenset({"core"}),
    "plan": frozenset({"core", "policies"}),
    "sim": frozenset({"core", "policies"}),
    "service": frozenset({"core", "policies"}),
}

#: (importing module, imported module) pairs allowed for now, each with the reason
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module_name(path: Path, root: Path | None = None, package: str | None = None) -> str:
    parts = list(path.relative_to(ROOT if root is None else root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE if package is None else package, *parts])


def _imports(path: Path, root: Path | None = None, top: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (under ``root``, installed as
    ``top``: the scheduler by default); relative ones resolved."""
    module = _module_name(path, root, top)
    top = PACKAGE if top is None else top
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # ``from mlfabric.scheduler import sim`` imports the sub-package ``sim``
            names = [f"{base}.{a.name}" for a in node.names] if base in (top, "mlfabric") else [base]
            found.extend((node.lineno, name) for name in names)
    return found


def _subpackage(module: str) -> str | None:
    """The sub-package of ``mlfabric.scheduler`` that ``module`` is in (None if outside)."""
    if not module.startswith(PACKAGE + "."):
        return None
    return module[len(PACKAGE) + 1 :].split(".")[0]


def violations() -> list[str]:
    """Every import against :data:`ALLOWED` (not in :data:`KNOWN_EXCEPTIONS`), as readable lines."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        own = _subpackage(module)
        if own is None or own not in ALLOWED:
            continue
        for line, imported in _imports(path):
            target = _subpackage(imported)
            if target is None or target == own or target in ALLOWED[own]:
                continue
            if any(module == m and imported.startswith(i) for m, i in KNOWN_EXCEPTIONS):
                continue
            allowed = ", ".join(sorted(ALLOWED[own])) or "nothing"
            bad.append(
                f"scheduler/{path.relative_to(ROOT).as_posix()}:{line}: {own} imports {imported} "
                f"({own} may import {allowed} of {PACKAGE})"
            )
    return bad


def test_every_subpackage_is_known() -> None:
    subpackages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == set(ALLOWED)


def test_imports_go_one_way() -> None:
    bad = violations()
    assert not bad, "imports against the layout:\n" + "\n".join(bad)


def test_known_exceptions_are_still_needed() -> None:
    """An exception that no longer occurs is removed, so the arrow cannot come back."""
    for (module, imported), reason in KNOWN_EXCEPTIONS.items():
        path = ROOT.joinpath(*module.split(".")[2:]).with_suffix(".py")
        if not path.is_file() or not any(i.startswith(imported) for _, i in _imports(path)):
            pytest.fail(f"{module} no longer imports {imported} ({reason}): drop the exception")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "from mlfabric.scheduler.service.batching import BatchWindow\n",
            "imports mlfabric.scheduler.service",
        ),
        ("import mlfabric.scheduler.sim.fluid\n", "imports mlfabric.scheduler.sim.fluid"),
        ("def f():\n    from ..service import core\n", "imports mlfabric.scheduler.service"),
        ("from mlfabric.scheduler import plan\n", "imports mlfabric.scheduler.plan"),
    ],
)
def test_a_wrong_arrow_is_reported(
    source: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check sees module-level, lazy, relative and package imports (in a copy of the tree)."""
    for sub in ALLOWED:
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "__init__.py").write_text("")
    (tmp_path / "policies" / "bad.py").write_text(source)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    bad = violations()
    assert len(bad) == 1 and expected in bad[0] and bad[0].startswith("scheduler/policies/bad.py:"), bad


# ---------------------------------------------------------------------------- the daemon

DAEMON_ROOT = ROOT.parent / "daemon"
DAEMON = "mlfabric.daemon"
CLIENT_ROOT = ROOT.parent / "mlfabric"

#: the daemon's layers (a sub-package, or "host": the modules directly in daemon/) -> the
#: layers each may import besides itself
DAEMON_LAYERS: dict[str, frozenset[str]] = {
    "channels": frozenset(),
    "roles": frozenset({"channels"}),
    "host": frozenset({"channels", "roles"}),
}

#: what the daemon may import of ``mlfabric`` outside ``mlfabric.daemon``, with the reason
DAEMON_MAY_IMPORT: dict[str, str] = {
    "mlfabric.wire": "what client and daemon share: tensor layout, codec and checks, local framing, "
    "CRC, memfd, report fields, the version",
    "mlfabric.proto": "the wire contracts' generated stubs",
    "mlfabric.aggregators": "the summing kernels (pure)",
    "mlfabric.scheduler.core": "topology parsing for --enforce-nic-rates (pure)",
    "mlfabric.readyfile": "process plumbing: the ready file (no public API)",
    "mlfabric.systemd": "process plumbing: sd_notify (no public API)",
    "mlfabric.config": "process plumbing: the daemon's TOML config and its options (no public API)",
}


def _daemon_layer(module: str) -> str | None:
    """The layer of ``mlfabric.daemon`` that ``module`` is in (None if outside the daemon)."""
    if module != DAEMON and not module.startswith(DAEMON + "."):
        return None
    first = module[len(DAEMON) + 1 :].split(".")[0]
    return first if first in DAEMON_LAYERS and first != "host" else "host"


def daemon_violations(root: Path | None = None) -> list[str]:
    """Every import of a daemon module against :data:`DAEMON_LAYERS` or :data:`DAEMON_MAY_IMPORT`."""
    root = DAEMON_ROOT if root is None else root
    bad = []
    for path in sorted(root.rglob("*.py")):
        own = _daemon_layer(_module_name(path, root, DAEMON))
        assert own is not None
        where = f"daemon/{path.relative_to(root).as_posix()}"
        for line, imported in _imports(path, root, DAEMON):
            layer = _daemon_layer(imported)
            if layer is not None:
                if layer != own and layer not in DAEMON_LAYERS[own]:
                    allowed = ", ".join(sorted(DAEMON_LAYERS[own])) or "nothing"
                    bad.append(f"{where}:{line}: {own} imports {imported} ({own} may import {allowed})")
            elif imported.split(".")[0] == "mlfabric" and not any(
                imported == m or imported.startswith(m + ".") for m in DAEMON_MAY_IMPORT
            ):
                bad.append(f"{where}:{line}: imports {imported}, not one of {sorted(DAEMON_MAY_IMPORT)}")
    return bad


def test_every_daemon_subpackage_is_a_layer() -> None:
    subpackages = {p.name for p in DAEMON_ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == set(DAEMON_LAYERS) - {"host"}


def test_daemon_imports_go_one_way() -> None:
    bad = daemon_violations()
    assert not bad, "imports against the daemon's layers:\n" + "\n".join(bad)


def test_the_client_imports_nothing_of_the_daemon() -> None:
    bad = [
        f"mlfabric/{path.relative_to(CLIENT_ROOT).as_posix()}:{line}: imports {imported}"
        for path in sorted(CLIENT_ROOT.rglob("*.py"))
        for line, imported in _imports(path, CLIENT_ROOT, "mlfabric")
        if imported == DAEMON or imported.startswith(DAEMON + ".")
    ]
    assert not bad, "the client side imports the daemon:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("where", "source", "expected"),
    [
        (
            "channels",
            "from mlfabric.daemon.roles.base import Verdict\n",
            "channels imports mlfabric.daemon.roles",
        ),
        ("channels", "def f():\n    from .. import host\n", "channels imports mlfabric.daemon.host"),
        ("roles", "from mlfabric.daemon.host import Daemon\n", "roles imports mlfabric.daemon.host"),
        ("roles", "from mlfabric import tensors\n", "imports mlfabric.tensors, not one of"),
        ("roles", "import mlfabric.api\n", "imports mlfabric.api, not one of"),
    ],
)
def test_a_wrong_daemon_arrow_is_reported(where: str, source: str, expected: str, tmp_path: Path) -> None:
    """Module-level, lazy, relative and package imports against the layers (in a copy of the tree)."""
    for sub in ("channels", "roles"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "__init__.py").write_text("")
    (tmp_path / "host.py").write_text(
        "from mlfabric.daemon.roles import base\nfrom mlfabric.wire import memfd\n"
    )
    (tmp_path / where / "bad.py").write_text(source)
    bad = daemon_violations(tmp_path)
    assert len(bad) == 1 and expected in bad[0] and bad[0].startswith(f"daemon/{where}/bad.py:"), bad


# ---------------------------------------------------------------------------- the aggregators

AGGREGATORS_ROOT = ROOT.parent / "aggregators"
AGGREGATORS = "mlfabric.aggregators"
#: what ``aggregators/`` (kernels, codecs) may import of mlfabric: the daemon imports it, so
#: nothing of the client API and nothing of the daemon
AGGREGATORS_MAY_IMPORT = ("mlfabric.aggregators", "mlfabric.wire")


def test_the_aggregators_import_only_neutral_modules() -> None:
    bad = [
        f"aggregators/{path.relative_to(AGGREGATORS_ROOT).as_posix()}:{line}: imports {imported}"
        for path in sorted(AGGREGATORS_ROOT.rglob("*.py"))
        for line, imported in _imports(path, AGGREGATORS_ROOT, AGGREGATORS)
        if imported.split(".")[0] == "mlfabric"
        and not any(imported == m or imported.startswith(m + ".") for m in AGGREGATORS_MAY_IMPORT)
    ]
    assert any(AGGREGATORS_ROOT.rglob("codecs/*.py"))
    assert not bad, "aggregators/ imports beyond " + str(AGGREGATORS_MAY_IMPORT) + ":\n" + "\n".join(bad)
