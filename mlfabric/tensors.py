"""The tensor codec as training code sees it: named tensors <-> a flat payload (DESIGN §7).

The codec itself — layouts, dtype checks, encode and decode, the NaN/inf scan — is
:mod:`mlfabric.wire.tensors`, shared by the client and the daemon; this module is its public
face for training code and the client (:mod:`mlfabric.api`, :mod:`mlfabric.server`,
:mod:`mlfabric.tensorio`), and re-exports its names. Moving a payload in and out of a memfd is
:mod:`mlfabric.tensorio`.
"""

from __future__ import annotations

from mlfabric.wire.tensors import (
    DTYPES,
    FiniteScan,
    Layout,
    TensorError,
    decode,
    dtype_name,
    encode_into,
    first_non_finite,
    l2_norm,
    layouts_from_pb,
    layouts_to_pb,
    plan_layout,
)
from mlfabric.wire.tensors import _is_torch as _is_torch  # the client's torch detection

__all__ = [
    "DTYPES",
    "FiniteScan",
    "Layout",
    "TensorError",
    "decode",
    "dtype_name",
    "encode_into",
    "first_non_finite",
    "l2_norm",
    "layouts_from_pb",
    "layouts_to_pb",
    "plan_layout",
]
