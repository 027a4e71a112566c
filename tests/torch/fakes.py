"""A fake of the CUDA calls of :mod:`mlfabric.torch.staging`, for unit tests of the staging logic.

Streams are queues of deferred work: a copy issued on a stream runs only when an event
recorded after it is synchronized (as a real asynchronous copy has not happened yet when
``copy_(non_blocking=True)`` returns). Every call is logged, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.work: list[Callable[[], object]] = []
        self.ran = 0

    def run_until(self, n: int) -> None:
        while self.ran < n:
            self.work[self.ran]()
            self.ran += 1


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.mark = stream, len(stream.work)


class FakeOps:
    """:class:`mlfabric.torch.staging.DeviceOps` on the CPU: every torch tensor counts as on the device."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.current = FakeStream("current")
        self.side = FakeStream("side")
        self.pinned_allocations = 0

    def is_device(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor)

    def current_stream(self, device: Any) -> FakeStream:
        return self.current

    def side_stream(self, device: Any) -> FakeStream:
        return self.side

    def wait_stream(self, waiter: FakeStream, other: FakeStream) -> None:
        self.log.append(("wait_stream", waiter.name, other.name))

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        # the host runs "current stream" work at once: whatever it issues next comes after the event
        self.log.append(("wait_event", stream.name, event.stream.name))
        event.stream.run_until(event.mark)

    def pinned(self, numel: int, dtype: Any) -> torch.Tensor:
        self.pinned_allocations += 1
        return torch.full((numel,), -1, dtype=dtype)  # not the data: a copy that did not run shows

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("copy", stream.name))
        src = src.clone()  # what the device holds when the stream reaches the copy
        stream.work.append(lambda: dst.copy_(src))

    def keep_alive(self, tensor: Any, stream: FakeStream) -> None:
        self.log.append(("keep_alive", stream.name))

    def record(self, stream: FakeStream) -> FakeEvent:
        self.log.append(("record", stream.name))
        return FakeEvent(stream)

    def done(self, event: FakeEvent) -> bool:
        return event.stream.ran >= event.mark

    def synchronize(self, event: FakeEvent) -> None:
        self.log.append(("synchronize", event.stream.name))
        event.stream.run_until(event.mark)
