"""Local SGD on the parameter-server path: H local steps between pushes (issue 26).

A worker that pushes every step puts one update on the server's link per gradient. With local
SGD it keeps its own copy of the model, applies its updates to that copy, and pushes their sum
(the accumulated delta) every ``period`` steps as **one** update, then fetches the model again
(Lin et al. 2020, "Don't use large mini-batches, use local SGD"): ``period`` times fewer
transfers, not smaller ones, so it composes with the codecs (``codec=``, ``error_feedback=``;
docs/compression.md). **Post-local SGD** pushes every step for the first ``warmup`` steps,
then every ``period``.

The units are the push's: an update is what the worker would push without local SGD, and the
server's ``on_update`` applies ``model -= update`` (the examples' rule: the worker pushes the
learning rate times its gradient, the server subtracts; an aggregate or a synchronous round is
the sum of its members). The local copy follows the same rule, so a delta pushed equals the
copy's distance from the model it was fetched as, and the server applies it exactly as it
would apply one update (exactly once: one push is one update; APPLIED, DROPPED or UNKNOWN as
any push). A delta DROPPED (stale beyond ``tau_max``) or UNKNOWN is not sent again, as
without local SGD: the worker fetches the model and goes on from it.

The pieces: :func:`push_due` (the schedule, pure), :func:`accumulate` and :func:`apply_local`
(the arithmetic, pure), and :class:`LocalSGD`, which holds the copy and the delta and talks to
a :class:`~mlfabric.api.Worker` (passed in).

On the all-reduce path post-local SGD is torch's hook and averager on mlfabric's all-reduce
(:mod:`mlfabric.torch.localsgd`). Their schedules differ by one step: torch's
``PeriodicModelAverager`` averages at its steps ``warmup, warmup + period, ...`` (counted
from 0), this one pushes after steps ``period, 2 * period, ...`` past the warmup (counted from
1), so ``n`` steps make exactly ``n / period`` pushes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["LocalSGD", "accumulate", "apply_local", "push_due"]


def push_due(step: int, period: int, warmup: int = 0) -> bool:
    """Whether the worker pushes after its ``step``-th local step (counted from 1).

    Every step up to ``warmup``; after that every ``period``-th step past the warmup.

    Examples
    --------
    >>> [s for s in range(1, 13) if push_due(s, period=4)]
    [4, 8, 12]
    >>> [s for s in range(1, 13) if push_due(s, period=4, warmup=2)]
    [1, 2, 6, 10]
    >>> push_due(0, period=4)
    Traceback (most recent call last):
    ...
    ValueError: step 0: local steps are counted from 1
    """
    if step < 1:
        raise ValueError(f"step {step}: local steps are counted from 1")
    _check_schedule(period, warmup)
    return step <= warmup or (step - warmup) % period == 0


def _check_schedule(period: int, warmup: int) -> None:
    if int(period) != period or period < 1:
        raise ValueError(f"period {period!r}: local steps between pushes must be an integer >= 1")
    if int(warmup) != warmup or warmup < 0:
        raise ValueError(f"warmup {warmup!r}: steps pushed one by one must be an integer >= 0")


def _array(value: Any) -> np.ndarray:
    """A tensor as a numpy array (torch CPU tensors through ``numpy()``, others as they are)."""
    detach = getattr(value, "detach", None)
    if detach is not None:
        return np.asarray(detach().cpu().numpy())
    return np.asarray(value)


def accumulate(delta: Mapping[str, np.ndarray] | None, update: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``delta + update`` per tensor (a new dict; ``None`` is the empty delta), in each tensor's dtype.

    Parameters
    ----------
    delta : dict or None
        The updates of the steps since the last push, summed.
    update : dict
        name -> numpy array or torch tensor: this step's update, in the units of a push.

    Raises
    ------
    ValueError
        The update's names or shapes differ from the delta's (naming the tensor).

    Examples
    --------
    >>> d = accumulate(None, {"w": np.ones(2, np.float32)})
    >>> accumulate(d, {"w": np.full(2, 0.5, np.float32)})["w"].tolist()
    [1.5, 1.5]
    >>> accumulate(d, {"v": np.ones(2)})
    Traceback (most recent call last):
    ...
    ValueError: update has tensors ['v'], the delta ['w']
    """
    arrays = {k: _array(v) for k, v in update.items()}
    if delta is None:
        return {k: v.copy() for k, v in arrays.items()}
    if sorted(arrays) != sorted(delta):
        raise ValueError(f"update has tensors {sorted(arrays)}, the delta {sorted(delta)}")
    out = {}
    for name, acc in delta.items():
        if arrays[name].shape != acc.shape:
            raise ValueError(f"tensor {name!r}: update of shape {arrays[name].shape}, delta {acc.shape}")
        out[name] = (acc + arrays[name]).astype(acc.dtype, copy=False)
    return out


def apply_local(model: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The server's rule on the local copy: ``model - update`` per tensor, in the model's dtypes.

    Examples
    --------
    >>> apply_local({"w": np.ones(2, np.float32)}, {"w": np.full(2, 0.25)})["w"]
    array([0.75, 0.75], dtype=float32)
    """
    out = {}
    for name, value in model.items():
        base = _array(value)
        if name not in update:
            raise ValueError(f"update lacks tensor {name!r} of the model")
        out[name] = (base - _array(update[name])).astype(base.dtype, copy=False)
    return out


class LocalSGD:
    """A worker's local model and delta: local steps, one push of their sum every ``period`` steps.

    Parameters
    ----------
    worker : Worker
        The registered worker (:func:`mlfabric.register_as_worker`) that pushes and gets.
    server : str
        The server's name.
    period : int
        Local steps per push after the warmup (H; 1: push every step, as without local SGD).
    warmup : int
        Post-local SGD: push every step for the first ``warmup`` steps (K).
    codec, error_feedback :
        Passed to every :meth:`~mlfabric.api.Worker.push` (docs/compression.md): the delta
        travels encoded, the residual is kept across pushes as for single updates.
    scale : float
        The delta is pushed times ``scale`` (FedAvg's server learning rate; default 1: the
        whole sum). ``1 / period`` pushes the mean of the local steps, a step as large as one
        update's: where the server sums many workers' deltas (asynchronous aggregates,
        synchronous rounds) a whole sum of ``period`` steps from each can overshoot.
    timeout : float
        Seconds to wait for a push's verdict and for the model.

    Attributes
    ----------
    model : dict
        The local copy (numpy arrays), what the next step's gradient is computed on.
    version : int
        The server's version the copy was fetched as (the next push's base version).
    steps, pushes : int
        Local steps taken, pushes made.
    delta : dict or None
        The updates since the last push, summed (None: none since).

    Examples
    --------
    >>> local = LocalSGD(worker, "ps0", period=4, codec="int8", error_feedback=True)  # doctest: +SKIP
    >>> local.fetch()                                                    # doctest: +SKIP
    >>> for x, y in batches:                                             # doctest: +SKIP
    ...     result = local.step(lr * gradient(local.model, x, y))   # a PushResult every 4th step
    >>> local.flush()                                   # push what the last steps left  # doctest: +SKIP
    """

    def __init__(
        self,
        worker: Any,
        server: str,
        *,
        period: int = 1,
        warmup: int = 0,
        codec: object = None,
        error_feedback: bool = False,
        scale: float = 1.0,
        timeout: float = 120.0,
    ) -> None:
        _check_schedule(period, warmup)
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"scale {scale!r}: the delta's factor must be a finite number > 0")
        self.worker, self.server = worker, server
        self.period, self.warmup = int(period), int(warmup)
        self.codec, self.error_feedback, self.timeout = codec, error_feedback, timeout
        self.scale = float(scale)
        self.model: dict[str, np.ndarray] = {}
        self.version = 0
        self.steps = self.pushes = 0
        self.delta: dict[str, np.ndarray] | None = None

    def fetch(self, min_version: int | None = None) -> int:
        """Get the server's model (at least ``min_version``) as the local copy; its version."""
        self.version, model = self.worker.get(self.server, min_version=min_version, timeout=self.timeout)
        self.model = {k: np.array(v) for k, v in model.items()}
        return self.version

    def step(self, update: Mapping[str, Any]) -> Any:
        """Apply ``update`` to the local copy and add it to the delta; push when the schedule says.

        Returns
        -------
        PushResult or None
            The verdict of the delta's push when this step pushed (the model is fetched again
            after it: at least the version the delta was applied in), else None.
        """
        if not self.model:
            raise RuntimeError("LocalSGD.step before fetch(): there is no local model yet")
        self.delta = accumulate(self.delta, update)
        self.model = apply_local(self.model, update)
        self.steps += 1
        return self.flush() if push_due(self.steps, self.period, self.warmup) else None

    def flush(self) -> Any:
        """Push the delta now (if any step is left unpushed), wait for its verdict, fetch the model.

        Returns
        -------
        PushResult or None
            None when there was nothing to push.
        """
        if self.delta is None:
            return None
        delta, self.delta = self.delta, None
        if self.scale != 1.0:
            delta = {k: (v * self.scale).astype(v.dtype, copy=False) for k, v in delta.items()}
        handle = self.worker.push(
            self.server,
            delta,
            base_version=self.version,
            codec=self.codec,
            error_feedback=self.error_feedback,
        )
        self.pushes += 1
        result = handle.wait(timeout=self.timeout)
        self.fetch(min_version=result.version if result.applied else None)
        return result
