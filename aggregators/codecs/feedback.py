"""Error feedback: what a codec lost is kept at the sender and added to the next update.

With a codec ``C`` and a residual ``e`` (zero at first), a step sends ``C(g + e)`` and keeps
``e' = g + e - decode(C(g + e))`` (Seide et al. 2014, Karimireddy et al. 2019). Over ``T``
steps the decoded updates sum to ``sum(g) - e_T``: nothing is lost, only delayed, and the
residual stays bounded for a *contractive* codec (``||C(x) - x|| <= q ||x||``, ``q < 1``):
the casts, int8, top-k and random-k without rescaling. Random-k rescaled by ``n/k`` is not
contractive (its residual can grow without bound), so :class:`ErrorFeedback` refuses it.

:func:`compensate` is the pure step; :class:`ErrorFeedback` keeps one residual per tensor
name (a worker's state; it lives at the sender, never in the payload).
"""

from __future__ import annotations

import numpy as np

from mlfabric.aggregators.codecs.base import Codec, CodecError, Encoded, as_float_array
from mlfabric.aggregators.codecs.sparse import RandomKCodec

__all__ = ["ErrorFeedback", "compensate"]


def compensate(
    codec: Codec, array: np.ndarray, residual: np.ndarray | None, *, rng: np.random.Generator | None = None
) -> tuple[Encoded, np.ndarray]:
    """One error-feedback step: encode ``array + residual``, return it and the new residual.

    Parameters
    ----------
    codec : Codec
        The codec.
    array : numpy.ndarray
        This step's update (float16/32/64; not modified).
    residual : numpy.ndarray or None
        float32, ``array``'s shape; None at the first step.
    rng : numpy.random.Generator, optional
        For a randomised codec.

    Returns
    -------
    encoded : Encoded
        What to send (dtype float32: the corrected update is float32).
    residual : numpy.ndarray
        float32, ``array``'s shape: what was not sent.

    Raises
    ------
    CodecError
        ``array`` is not a floating array, or ``residual`` has another shape (field
        ``residual``).

    Examples
    --------
    >>> from mlfabric.aggregators.codecs import TopKCodec
    >>> codec = TopKCodec(ratio=0.5)
    >>> enc, e = compensate(codec, np.array([3.0, 1.0, -0.5, 2.0], np.float32), None)
    >>> codec.decode(enc).tolist(), e.tolist()
    ([3.0, 0.0, 0.0, 2.0], [0.0, 1.0, -0.5, 0.0])
    >>> enc, e = compensate(codec, np.array([0.0, 0.5, -1.0, 0.1], np.float32), e)
    >>> codec.decode(enc).tolist(), e.tolist()
    ([0.0, 1.5, -1.5, 0.0], [0.0, 0.0, 0.0, 0.10000000149011612])
    """
    flat = as_float_array(array)
    corrected = flat.astype(np.float32)  # a copy: becomes the new residual
    if residual is not None:
        if not isinstance(residual, np.ndarray) or residual.shape != array.shape:
            got = residual.shape if isinstance(residual, np.ndarray) else type(residual).__name__
            raise CodecError("residual", f"expected shape {array.shape} (the update's), got {got}")
        corrected += residual.reshape(-1)
    corrected = corrected.reshape(array.shape)
    encoded = codec.encode(corrected, rng=rng)
    corrected -= codec.decode(encoded)
    return encoded, corrected


class ErrorFeedback:
    """Error feedback around a codec, one residual per tensor name (the sender's state).

    Parameters
    ----------
    codec : Codec
        A contractive codec (not ``RandomKCodec(rescale=True)``).

    Raises
    ------
    ValueError
        ``codec`` is a rescaled random-k.

    Examples
    --------
    >>> from mlfabric.aggregators.codecs import Int8Codec, TopKCodec
    >>> ef = ErrorFeedback(TopKCodec(ratio=0.5))
    >>> g = np.array([3.0, 1.0, -0.5, 2.0], np.float32)
    >>> sent = [ef.codec.decode(ef.encode("w", g)) for _ in range(4)]
    >>> (np.sum(sent, axis=0) + ef.residual("w")).tolist() == (4 * g).tolist()
    True
    >>> ErrorFeedback(Int8Codec(bound=1.0)).residual("w") is None
    True
    """

    def __init__(self, codec: Codec) -> None:
        if isinstance(codec, RandomKCodec) and codec.rescale:
            raise ValueError("error feedback needs a contractive codec: use RandomKCodec(rescale=False)")
        self.codec = codec
        self._residuals: dict[str, np.ndarray] = {}

    def encode(self, name: str, array: np.ndarray, *, rng: np.random.Generator | None = None) -> Encoded:
        """Encode tensor ``name``'s update with its residual added; keep the new residual.

        Raises
        ------
        CodecError
            ``array``'s shape is not the one this name had (field ``residual``): call
            :meth:`reset` first if the tensor changed.
        """
        encoded, residual = self.step(name, array, rng=rng)
        self.keep(name, residual)
        return encoded

    def step(
        self, name: str, array: np.ndarray, *, rng: np.random.Generator | None = None
    ) -> tuple[Encoded, np.ndarray]:
        """:meth:`encode` without keeping the new residual: ``(encoded, residual)``; :meth:`keep` it.

        For a sender that encodes several tensors and keeps their residuals only once all of
        them were encoded (a push refused half-way leaves the residuals as they were).
        """
        return compensate(self.codec, array, self._residuals.get(name), rng=rng)

    def keep(self, name: str, residual: np.ndarray) -> None:
        """Keep ``residual`` (from :meth:`step`) as tensor ``name``'s."""
        self._residuals[name] = residual

    def residual(self, name: str) -> np.ndarray | None:
        """Tensor ``name``'s residual (float32), None before its first update."""
        return self._residuals.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one tensor's residual, or all of them."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)
