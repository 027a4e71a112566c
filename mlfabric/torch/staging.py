"""CUDA tensors in and out of mlfabric: staged through pinned host buffers on a side stream.

A push's bytes go to the daemon through a memfd, so a CUDA tensor must reach host memory
first. A plain ``tensor.cpu()`` would block the calling thread until the training stream
drained, and copy into pageable memory (a second, staged copy inside the driver). Here:

- :meth:`Stager.to_host` issues each device->host copy on a *side* stream, into a pinned
  buffer from a pool, after making the side stream wait for the work the training stream has
  queued so far (so the copy sees the finished gradient); it records an event and returns
  at once. Whoever needs the bytes (the optimizer's sender thread, or :meth:`Worker.push`)
  waits on that event only, never on the training stream: the copies of one update overlap
  the transfer of the one before, and the training stream keeps running.
- :meth:`Stager.to_device` is the way back (``get(device=...)``): host -> pinned -> device on
  the side stream, and the training stream waits on its event (a device-side wait; the host
  does not block).

Which tensors take this path is decided by :meth:`DeviceOps.is_device` (for CUDA:
``tensor.is_cuda``). The CUDA calls are behind :class:`DeviceOps` so that the staging logic
(buffer reuse, event order, release) is tested on CPU with a fake (tests/torch/test_staging.py);
``experiments/gpu_check.py`` runs :class:`CudaOps` on a GPU.

Examples
--------
>>> stager = Stager(CudaOps())                             # doctest: +SKIP
>>> staged = stager.to_host({"w": grad_on_gpu})            # doctest: +SKIP
>>> host = staged.wait()                                   # doctest: +SKIP
>>> worker.push("ps0", host); staged.release()             # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["CudaOps", "DeviceOps", "Staged", "Stager", "default_stager", "has_device_tensors"]


class DeviceOps(Protocol):
    """The device calls the staging needs (:class:`CudaOps` on a GPU; a fake in unit tests)."""

    def is_device(self, tensor: Any) -> bool:
        """True for a tensor that lives on the device (staged), False for a host tensor."""
        ...

    def current_stream(self, device: Any) -> Any:
        """The stream the caller (the training loop) issues its work on."""
        ...

    def side_stream(self, device: Any) -> Any:
        """The stream the staging copies run on (one per device, created once)."""
        ...

    def wait_stream(self, waiter: Any, other: Any) -> None:
        """Make ``waiter`` wait (on the device) for the work queued on ``other`` so far."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait (on the device) for ``event``."""
        ...

    def pinned(self, numel: int, dtype: Any) -> torch.Tensor:
        """A flat page-locked host tensor."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Issue ``dst.copy_(src, non_blocking=True)`` on ``stream`` (returns before it ran)."""
        ...

    def keep_alive(self, tensor: Any, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``stream``'s queued work is done."""
        ...

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now."""
        ...

    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed (never blocks)."""
        ...

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` completed."""
        ...


class CudaOps:
    """:class:`DeviceOps` for CUDA (one side stream per device, pinned buffers)."""

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def is_device(self, tensor: Any) -> bool:
        return bool(getattr(tensor, "is_cuda", False))

    def current_stream(self, device: Any) -> Any:
        return torch.cuda.current_stream(device)

    def side_stream(self, device: Any) -> Any:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            return stream

    def wait_stream(self, waiter: Any, other: Any) -> None:
        waiter.wait_stream(other)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def pinned(self, numel: int, dtype: Any) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def keep_alive(self, tensor: Any, stream: Any) -> None:
        tensor.record_stream(stream)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()


def has_device_tensors(tensors: Mapping[str, Any], ops: DeviceOps | None = None) -> bool:
    """Whether any tensor of ``tensors`` is on the device (CUDA unless ``ops`` says otherwise).

    Examples
    --------
    >>> has_device_tensors({"w": torch.ones(2)})
    False
    """
    if ops is not None:
        return any(ops.is_device(v) for v in tensors.values())
    return any(bool(getattr(v, "is_cuda", False)) for v in tensors.values())


@dataclass
class Staged:
    """Device->host copies in flight (from :meth:`Stager.to_host`).

    Attributes
    ----------
    tensors : dict
        name -> host tensor (a view of a pinned buffer for a staged tensor, the tensor itself
        for one that was on the host already); valid once :meth:`wait` returned.
    event : object or None
        Completes when the copies did (None: nothing was staged).
    """

    tensors: dict[str, Any]
    event: Any
    _stager: Stager
    _buffers: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> dict[str, Any]:
        """The host tensors, once the copies completed (waits for their event, not the stream)."""
        if self.event is not None:
            self._stager.ops.synchronize(self.event)
        return self.tensors

    def release(self) -> None:
        """Give the pinned buffers back for reuse (after the last reader of :attr:`tensors`)."""
        buffers, self._buffers = self._buffers, []
        self._stager._give_back(buffers)


class Stager:
    """Stages tensors between a device and pinned host buffers (pooled, reused).

    Parameters
    ----------
    ops : DeviceOps, optional
        The device calls; default :class:`CudaOps`.
    max_free_bytes : int
        Pinned bytes kept for reuse (buffers beyond it are freed on release).

    Examples
    --------
    >>> stager = Stager()
    >>> staged = stager.to_host({"w": torch.ones(2)})   # host tensors pass through
    >>> staged.wait()["w"].tolist(), staged.event is None
    ([1.0, 1.0], True)
    """

    def __init__(self, ops: DeviceOps | None = None, *, max_free_bytes: int = 1 << 30) -> None:
        self.ops: DeviceOps = ops if ops is not None else CudaOps()
        self.max_free_bytes = max_free_bytes
        self._free: dict[tuple[Any, int], list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []  # uploads whose copies may run
        self._lock = threading.Lock()
        self.allocated = 0  # pinned buffers ever allocated (a test sees reuse in it)

    def _take(self, numel: int, dtype: Any) -> torch.Tensor:
        with self._lock:
            self._reap_locked()
            free = self._free.get((dtype, numel))
            if free:
                buf = free.pop()
                self._free_bytes -= buf.numel() * buf.element_size()
                return buf
            self.allocated += 1
        return self.ops.pinned(numel, dtype)

    def _give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for buf in buffers:
                size = buf.numel() * buf.element_size()
                if self._free_bytes + size > self.max_free_bytes:
                    continue  # dropped: freed by torch
                self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)
                self._free_bytes += size

    def _reap_locked(self) -> None:
        """Buffers of finished uploads back to the pool (their copies read them no more)."""
        still = []
        for event, buffers in self._pending:
            if self.ops.done(event):
                for buf in buffers:
                    self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)
                    self._free_bytes += buf.numel() * buf.element_size()
            else:
                still.append((event, buffers))
        self._pending = still

    def to_host(self, tensors: Mapping[str, Any]) -> Staged:
        """Issue device->host copies of the device tensors on the side stream; returns at once.

        The side stream first waits for the work queued on the caller's current stream (the
        gradient must be finished before it is copied); the source tensors are kept alive
        for the side stream. Host tensors pass through untouched.
        """
        out: dict[str, Any] = {}
        buffers: list[torch.Tensor] = []
        # contiguous copies (if any) are queued on the current stream before the side stream waits
        sources = {
            name: value.detach().contiguous() for name, value in tensors.items() if self.ops.is_device(value)
        }
        side = None
        for name, value in tensors.items():
            src = sources.get(name)
            if src is None:
                out[name] = value
                continue
            if side is None:
                side = self.ops.side_stream(src.device)
                self.ops.wait_stream(side, self.ops.current_stream(src.device))
            buf = self._take(src.numel(), src.dtype)
            buffers.append(buf)
            host = buf.view(src.shape)
            self.ops.copy(host, src, side)
            self.ops.keep_alive(src, side)
            out[name] = host
        event = self.ops.record(side) if side is not None else None
        return Staged(out, event, self, buffers)

    def to_device(self, tensors: Mapping[str, Any], device: Any) -> dict[str, Any]:
        """Host tensors copied to ``device`` on the side stream; the current stream waits for them.

        The host waits for nothing: work the caller issues next on its current stream runs
        after the copies (a device-side wait on their event). The pinned buffers return to
        the pool once the copies completed.
        """
        dev = torch.device(device)
        side = self.ops.side_stream(dev)
        current = self.ops.current_stream(dev)
        self.ops.wait_stream(side, current)  # the memory of tensors freed on it may be reused here
        out: dict[str, Any] = {}
        buffers: list[torch.Tensor] = []
        for name, value in tensors.items():
            src = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            buf = self._take(src.numel(), src.dtype)
            buffers.append(buf)
            staged = buf.view(src.shape)
            staged.copy_(src)  # host to pinned host (pageable memory cannot be copied asynchronously)
            dst = torch.empty(src.shape, dtype=src.dtype, device=dev)
            self.ops.copy(dst, staged, side)
            out[name] = dst
        if buffers:
            event = self.ops.record(side)
            self.ops.wait_event(current, event)
            with self._lock:
                self._pending.append((event, buffers))
        return out


_DEFAULT: Stager | None = None
_DEFAULT_LOCK = threading.Lock()


def default_stager() -> Stager:
    """The process's :class:`Stager` over :class:`CudaOps` (created on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Stager()
        return _DEFAULT
