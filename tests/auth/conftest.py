"""Fixtures of the authentication tests (helpers in authkit.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.auth.authkit import Procs, make_certs


def _need_cryptography() -> None:
    pytest.importorskip(
        "cryptography", reason="`mlfabric certs` needs the auth extra: pip install -e '.[dev]' (or '.[auth]')"
    )


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, certificates of h0, h1, the scheduler (127.0.0.1), admin, and the data secret."""
    _need_cryptography()
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same names signed by another CA (a stranger's)."""
    _need_cryptography()
    return make_certs(tmp_path_factory.mktemp("other-certs"))


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop()
