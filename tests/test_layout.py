"""The scheduler's sub-packages depend on each other one way only.

``core`` (graph, schedule, timeline, checker, trace, estimation) uses nothing of the other
sub-packages; ``policies`` uses ``core``; ``plan``, ``sim`` and ``service`` use ``policies``
and ``core`` and not each other. Checked on the source (every ``import`` statement, at
module level or inside functions), so a lazy import cannot hide an arrow.
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; relative ones resolved."""
    module = _module_name(path)
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
            names = [f"{base}.{a.name}" for a in node.names] if base == PACKAGE else [base]
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
