"""Traffic-control arguments for shaped links (DESIGN §6): tbf with a correct burst.

Pure functions that build ``tc`` argument lists; :mod:`mlfabric.testbed.cluster` runs them.

A token bucket filter refills ``rate / HZ`` bytes per timer tick at worst, and the veth
driver hands it GSO packets of up to 64 KiB of payload *plus headers*. A bucket smaller than
either under-delivers badly (a 50 Mbit/s link measured at a fraction of its rate). A bucket
of exactly 64 KiB is not enough either: measured on this kernel, lowering a tbf's rate
(``tc qdisc change``, 100 -> 25 Mbit/s, bucket 64 KiB) under two sustained TCP flows left
both at 0 bytes/s until the rate went back up, and a 128 KiB floor removed the stalls. So
the burst is ``max(rate / HZ, 128 KiB)`` with the lowest common kernel ``HZ`` (100).
"""

from __future__ import annotations

import math

__all__ = [
    "MIN_BURST",
    "TIMER_HZ",
    "netem_args",
    "tbf_args",
    "tbf_burst",
    "tbf_limit",
]

#: Bucket floor: room for the largest GSO packet (64 KiB + headers) with margin, bytes.
MIN_BURST = 128 * 1024
#: Kernel timer frequency assumed for the burst; 100 is the lowest common value.
TIMER_HZ = 100
#: Queueing a shaped port allows before it drops, seconds at the link rate.
QUEUE_SECONDS = 0.05
BITS_PER_BYTE = 8


def tbf_burst(rate: float, hz: int = TIMER_HZ) -> int:
    """Bucket size in bytes for a tbf at ``rate`` bytes/s.

    Parameters
    ----------
    rate : float
        Shaping rate, bytes/s (the bandwidth graph's ``capacity``).
    hz : int
        Kernel timer frequency the bucket must cover one tick of.

    Returns
    -------
    int
        ``max(ceil(rate / hz), 128 KiB)``.

    Examples
    --------
    >>> tbf_burst(50e6 / 8)  # 50 Mbit/s: the 128 KiB GSO floor wins
    131072
    >>> tbf_burst(10e9 / 8)  # 10 Gbit/s: one 10 ms tick of bytes
    12500000
    """
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    return max(math.ceil(rate / hz), MIN_BURST)


def tbf_limit(rate: float, burst: int) -> int:
    """Queue limit in bytes: the burst plus :data:`QUEUE_SECONDS` of traffic at ``rate``.

    Examples
    --------
    >>> tbf_limit(6.25e6, 131072)
    443572
    """
    return burst + math.ceil(rate * QUEUE_SECONDS)


def tbf_args(dev: str, rate: float, *, change: bool = False, parent: str = "root") -> list[str]:
    """``tc`` arguments that add (or change) a tbf shaping ``dev`` to ``rate`` bytes/s.

    Parameters
    ----------
    dev : str
        Interface name (inside the namespace the command runs in).
    rate : float
        Rate in bytes/s; emitted in bits/s, which is what ``tc`` calls ``bit``.
    change : bool
        ``tc qdisc change`` (dynamic bandwidth, the paper's NS settings) instead of ``add``.
    parent : str
        ``root`` or a parent handle such as ``1:1`` when below a netem qdisc.

    Examples
    --------
    >>> tbf_args("eth0", 6.25e6)
    ['qdisc', 'add', 'dev', 'eth0', 'root', 'handle', '10:', 'tbf', 'rate', '50000000bit', \
'burst', '131072', 'limit', '443572']
    """
    burst = tbf_burst(rate)
    where = ["root"] if parent == "root" else ["parent", parent]
    return [
        "qdisc",
        "change" if change else "add",
        "dev",
        dev,
        *where,
        "handle",
        "10:",
        "tbf",
        "rate",
        f"{round(rate * BITS_PER_BYTE)}bit",
        "burst",
        str(burst),
        "limit",
        str(tbf_limit(rate, burst)),
    ]


def netem_args(dev: str, latency: float) -> list[str]:
    """``tc`` arguments for a root netem adding ``latency`` seconds, with handle ``1:``.

    The tbf then goes below it with ``parent="1:1"``. Only used when the kernel has netem.

    Examples
    --------
    >>> netem_args("eth0", 0.0005)
    ['qdisc', 'add', 'dev', 'eth0', 'root', 'handle', '1:', 'netem', 'delay', '500us']
    """
    return ["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{round(latency * 1e6)}us"]
