"""The release of mlfabric: one definition for the package and the wire (``Hello.version``).

Examples
--------
>>> __version__.count(".")
2
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
