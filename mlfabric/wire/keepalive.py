"""gRPC keepalive of the control stream: the one setting the daemon and the scheduler share.

A daemon's ``Session`` stream to the scheduler may stay idle for minutes (no pushes), and a
dead scheduler (or a proxy that silently dropped the connection) must still be noticed, so
the daemon's channel pings: :data:`CHANNEL_OPTIONS`. The scheduler's gRPC server accepts
pings as often as :data:`MIN_PING_INTERVAL_MS` without sending GOAWAY
(``mlfabric.scheduler.service.core.SERVER_OPTIONS`` uses it), which must not exceed the
channel's ping interval. Neither side imports the other: both import this module.

Examples
--------
>>> dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"] >= MIN_PING_INTERVAL_MS
True
"""

from __future__ import annotations

__all__ = ["CHANNEL_OPTIONS", "MIN_PING_INTERVAL_MS", "PING_INTERVAL_MS", "PING_TIMEOUT_MS"]

#: a ping every 10 s on the daemon's channel, even with no call active
PING_INTERVAL_MS = 10_000
#: the stream is declared dead when a ping gets no answer for 5 s
PING_TIMEOUT_MS = 5_000
#: the scheduler tolerates pings this often (half the interval: clock slack)
MIN_PING_INTERVAL_MS = PING_INTERVAL_MS // 2

#: options of a daemon's (or any client's) channel to the scheduler:
#: ``grpc.insecure_channel(address, options=CHANNEL_OPTIONS)``
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", PING_INTERVAL_MS),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
