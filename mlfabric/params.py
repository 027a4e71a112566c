"""A job's bounds, ``tau_max`` and ``div_max`` (paper Table 1, ``params``), and their wire message.

Split out of :mod:`mlfabric.api`, which re-exports :class:`Params` (also as ``mlfabric.Params``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlfabric.aggregators.codecs.payload import codec_spec, parse_codec
from mlfabric.aggregators.codecs.snapshot import parse_model_codec
from mlfabric.proto.v1 import control_pb2
from mlfabric.scheduler.core.codec_choice import auto_spec, is_auto, parse_auto

__all__ = ["Params"]


@dataclass(frozen=True)
class Params:
    """A job's bounds (paper Table 1, ``params``; DESIGN §4).

    Parameters
    ----------
    tau_max : int or None
        No update whose delay (server version at apply time minus its base version) exceeds
        ``tau_max`` is ever applied. None: unbounded.
    div_max : float or None
        Bound on the sum of norms applied at a server and not yet at its replica (only with a
        replica, :func:`mlfabric.register_as_replica`). None or 0: chain replication (every
        update at the replica before its push resolves; DESIGN §4, docs/replication.md).
    sync_workers : int
        Synchronous training when > 0: the server applies one step per round, the sum of this
        many worker updates (its daemon sums them as they arrive); every push of a round
        resolves when the round is applied. 0 (default): asynchronous, one step per update.
    refuse_non_finite : bool
        True (default): the server refuses (DROPPED, naming the tensor) an update holding a
        NaN or an infinity instead of applying it to the model. False: such updates are applied.
    compression : str or None
        The codec the job's workers push with unless a push names its own
        (``push(..., codec=...)``; docs/compression.md): None or ``"none"``, ``"fp16"``,
        ``"bf16"``, ``"int8"`` (own scales per block of 256), ``"int8:bound=B"`` (a shared
        scale ``B / 127``: aggregator hops sum the words without decoding), ``"topk:ratio=R"``,
        ``"randk:ratio=R"`` (``rescale=0`` for error feedback); or ``"auto"``
        (``"auto:budget=E,bound=B"``): the scheduler chooses per worker host and server from
        the path's bandwidth, among the codecs whose relative error is at most ``E``
        (default 0.02; int8 with a shared scale only with a bound ``B``). Checked here: an
        unknown codec or a bad parameter is a ValueError naming it and the known ones.
    model_compression : str or None
        The codec the servers' models travel with to the workers' ``get`` (docs/compression.md):
        None or ``"none"`` (as they are), ``"fp16"`` or ``"bf16"``. A server publishes its
        float32/float64 tensors encoded (its own :attr:`~mlfabric.Server.model` stays exact);
        a worker's ``get`` decodes them to their own dtype. Checked here like ``compression``
        (int8 is refused: a model is not an update that error feedback corrects).

    Examples
    --------
    >>> Params(tau_max=4).to_pb().tau_max
    4
    >>> Params().to_pb().tau_max
    -1
    >>> Params.from_pb(Params(sync_workers=4).to_pb()).sync_workers
    4
    >>> Params.from_pb(Params(refuse_non_finite=False).to_pb()).refuse_non_finite
    False
    >>> Params.from_pb(Params(compression="int8:bound=4").to_pb()).compression
    'int8:bound=4.0'
    >>> Params.from_pb(Params(compression="auto:budget=0.001").to_pb()).compression
    'auto:budget=0.001'
    >>> Params(compression="zstd")
    Traceback (most recent call last):
    ...
    ValueError: unknown codec 'zstd' (known: none, bf16, fp16, int8, randk, topk)
    >>> Params.from_pb(Params(model_compression="fp16").to_pb()).model_compression
    'fp16'
    >>> Params(model_compression="int8")
    Traceback (most recent call last):
    ...
    ValueError: codec 'int8' does not carry a model (known for a model: none, bf16, fp16)
    """

    tau_max: int | None = None
    div_max: float | None = None
    sync_workers: int = 0
    refuse_non_finite: bool = True
    compression: str | None = None
    model_compression: str | None = None

    def __post_init__(self) -> None:
        if is_auto(self.compression):
            parse_auto(str(self.compression))  # a ValueError naming the parameter
        else:
            parse_codec(self.compression)  # a ValueError naming the codec and the known ones
        parse_model_codec(self.model_compression)
        if self.tau_max is not None and (isinstance(self.tau_max, bool) or int(self.tau_max) < 0):
            raise ValueError(f"tau_max must be an integer >= 0 or None (unbounded), got {self.tau_max!r}")
        if self.div_max is not None and not float(self.div_max) >= 0:
            raise ValueError(
                f"div_max must be a number >= 0 (0: chain replication) or None, got {self.div_max!r}"
            )
        if isinstance(self.sync_workers, bool) or int(self.sync_workers) < 0:
            raise ValueError(
                f"sync_workers must be an integer >= 0 (0: asynchronous), got {self.sync_workers!r}"
            )

    def to_pb(self) -> Any:
        """The ``JobParams`` message (``tau_max`` ``-1`` for unbounded; ``div_max`` ``0``: chain)."""
        return control_pb2.JobParams(
            tau_max=-1 if self.tau_max is None else int(self.tau_max),
            div_max=0.0 if self.div_max is None else float(self.div_max),
            sync_workers=int(self.sync_workers),
            allow_non_finite=not self.refuse_non_finite,
            compression=auto_spec(parse_auto(str(self.compression)))
            if is_auto(self.compression)
            else codec_spec(parse_codec(self.compression)),
            model_compression=codec_spec(parse_model_codec(self.model_compression)),
        )

    @classmethod
    def from_pb(cls, message: Any) -> Params:
        """Params from a ``JobParams`` message."""
        return cls(
            tau_max=None if message.tau_max < 0 else int(message.tau_max),
            div_max=None if message.div_max <= 0 else float(message.div_max),
            sync_workers=int(message.sync_workers),
            refuse_non_finite=not message.allow_non_finite,
            compression=message.compression or None,
            model_compression=message.model_compression or None,
        )
