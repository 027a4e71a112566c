"""Ready files: how a started process tells its launcher where it listens.

``mlfabric scheduler --ready-file F`` and ``mlfabric daemon --ready-file F`` write a small JSON
object (pid, addresses, socket) once they serve; launchers (:mod:`mlfabric.cluster`, the
testbed, tests) wait for ``F`` to exist and read it. The file appears complete or not at
all: it is written to a temporary file in the same directory and renamed over ``F``, and
the temporary file is removed when writing fails.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["write_ready_file"]


def write_ready_file(path: str | Path, info: dict[str, Any]) -> None:
    """Write ``info`` as JSON to ``path`` atomically (temp file in the same directory, rename).

    Parameters
    ----------
    path : str or Path
        The ready file; its directory must exist.
    info : dict
        JSON-serialisable content.

    Raises
    ------
    TypeError
        When ``info`` is not JSON-serialisable (``path`` is then untouched, no temp file left).
    OSError
        When the directory is not writable.

    Examples
    --------
    >>> import json, pathlib, tempfile
    >>> d = tempfile.mkdtemp(); p = pathlib.Path(d, "ready.json")
    >>> write_ready_file(p, {"pid": 1}); json.loads(p.read_text())
    {'pid': 1}
    >>> sorted(f.name for f in pathlib.Path(d).iterdir())
    ['ready.json']
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(info, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
