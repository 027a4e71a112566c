"""The tensor codec as training code sees it: named tensors <-> a flat payload (DESIGN §7).

The codec itself — layouts, dtype checks, encode and decode, the NaN/inf scan — is
:mod:`mlfabric.wire.tensors`, shared by the client and the daemon; this module is its public
face for training code and the client (:mod:`mlfabric.api`, :mod:`mlfabric.server`,
:mod:`mlfabric.tensorio`), and re-exports its names. Moving a payload in and out of a memfd is
:mod:`mlfabric.tensorio`.
"""

from __future__ import annotations

from mlfabric.wire import tensors as _codec
from mlfabric.wire.tensors import *  # noqa: F403 - the codec's public names, as they are there
from mlfabric.wire.tensors import _is_torch as _is_torch  # the client's torch detection

__all__ = list(_codec.__all__)
