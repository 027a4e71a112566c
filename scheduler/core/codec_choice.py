"""The ``auto`` codec: which codec a transfer should travel with (issue 26, docs/compression.md).

A codec pays for itself on a transfer when the link time it saves is more than the time its
encode and decode cost. :func:`choose_codec` is that rule, a pure function of plain data: the
bottleneck bandwidth of the transfer's path (or, once the pushes' rate is measured, the
path's links with their load: :class:`LinkUse`, :func:`link_seconds`), its bytes, each
codec's measured rates, ratio and error (:class:`CodecRate`, defaults :data:`MEASURED_RATES`
from ``experiments/bench_codecs.py``, slowed by the hosts' CPU load), whether the next hop
must sum what arrives (an aggregator: only the summable codecs keep their compression there)
and the job's error budget (:class:`AutoSpec`, ``Params(compression="auto:budget=0.01")``).

:func:`parse_auto` reads the job's spec (``"auto"``, ``"auto:budget=B,bound=X"``) and
:func:`auto_spec` writes it back. No I/O, no globals read: the rates are an argument.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_BUDGET",
    "MEASURED_RATES",
    "AutoSpec",
    "CodecChoice",
    "CodecRate",
    "LinkUse",
    "auto_spec",
    "choose_codec",
    "is_auto",
    "link_seconds",
    "parse_auto",
]

#: the relative error a job's ``auto`` allows unless it says: int8 (own scales or a shared bound)
DEFAULT_BUDGET = 0.02


@dataclass(frozen=True)
class CodecRate:
    """What one codec costs and gives, per byte of uncompressed (float32) input.

    Attributes
    ----------
    encode, decode : float
        Bytes of input per second (one core).
    ratio : float
        Input bytes per byte on the wire.
    error : float
        Relative L2 error of one round trip.
    summable : bool
        An aggregator sums it without decoding and forwards it in the codec (fp16, bf16,
        int8 with a shared bound); else it decodes and forwards the sum uncompressed.
    """

    encode: float
    decode: float
    ratio: float
    error: float
    summable: bool


#: ``python experiments/bench_codecs.py --mib 64 --rounds 7 --members 4 --bound 6`` (one core,
#: medians; experiments/results/bench_codecs.md). ``int8:bound``: the shared-scale int8 a job
#: gets with ``auto:bound=B`` (its error is that of N(0, 1) values under ``B = 6``).
MEASURED_RATES: Mapping[str, CodecRate] = {
    "fp16": CodecRate(0.83e9, 1.69e9, 2.0, 2.08e-4, True),
    "bf16": CodecRate(2.14e9, 3.62e9, 2.0, 1.66e-3, True),
    "int8": CodecRate(0.76e9, 2.76e9, 3.94, 9.84e-3, False),
    "int8:bound": CodecRate(1.00e9, 3.94e9, 4.0, 1.93e-2, True),
}


@dataclass(frozen=True)
class AutoSpec:
    """A job's ``auto`` compression: the error it accepts, and an int8 bound if it has one.

    Attributes
    ----------
    budget : float
        The largest relative error (:attr:`CodecRate.error`) of a codec the scheduler may
        choose; 0: none is chosen.
    bound : float or None
        With a bound, shared-scale int8 (``int8:bound=B``, summable at aggregators) is a
        candidate too.
    """

    budget: float = DEFAULT_BUDGET
    bound: float | None = None


def is_auto(spec: object) -> bool:
    """Whether a codec spec asks for the scheduler's choice (``"auto"`` or ``"auto:..."``).

    Examples
    --------
    >>> is_auto("auto"), is_auto("auto:budget=0.001"), is_auto("int8"), is_auto(None)
    (True, True, False, False)
    """
    return isinstance(spec, str) and spec.strip().partition(":")[0] == "auto"


def parse_auto(spec: str) -> AutoSpec:
    """The :class:`AutoSpec` of ``"auto"`` or ``"auto:budget=B,bound=X"``.

    Raises
    ------
    ValueError
        Not an auto spec, an unknown key, or a budget < 0 or a bound <= 0 (or not finite).

    Examples
    --------
    >>> parse_auto("auto")
    AutoSpec(budget=0.02, bound=None)
    >>> parse_auto("auto:budget=0.001,bound=6")
    AutoSpec(budget=0.001, bound=6.0)
    >>> parse_auto("auto:level=3")
    Traceback (most recent call last):
    ...
    ValueError: codec 'auto:level=3': unknown parameter 'level=3' (accepted: budget, bound)
    """
    name, _, rest = spec.strip().partition(":")
    if name != "auto":
        raise ValueError(f"codec {spec!r} is not 'auto'")
    values: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in ("budget", "bound"):
            raise ValueError(f"codec {spec!r}: unknown parameter {item!r} (accepted: budget, bound)")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"codec {spec!r}: {key} must be a number, got {value!r}") from None
    budget, bound = values.get("budget", DEFAULT_BUDGET), values.get("bound")
    if not (math.isfinite(budget) and budget >= 0):
        raise ValueError(f"codec {spec!r}: budget must be finite and >= 0, got {budget}")
    if bound is not None and not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"codec {spec!r}: bound must be finite and > 0, got {bound}")
    return AutoSpec(budget, bound)


def auto_spec(auto: AutoSpec) -> str:
    """The spec string of an :class:`AutoSpec` (:func:`parse_auto` reads it back).

    Examples
    --------
    >>> auto_spec(AutoSpec()), auto_spec(parse_auto("auto:bound=6,budget=0.05"))
    ('auto', 'auto:budget=0.05,bound=6.0')
    """
    parts = [] if auto.budget == DEFAULT_BUDGET else [f"budget={auto.budget!r}"]
    parts += [] if auto.bound is None else [f"bound={auto.bound!r}"]
    return "auto" + (":" + ",".join(parts) if parts else "")


@dataclass(frozen=True)
class LinkUse:
    """One link of a transfer's path, with the load the pushes crossing it offer.

    Attributes
    ----------
    capacity : float
        Bytes/s.
    users : int
        Hosts whose pushes cross it (they take turns on it: time-sharing).
    utilisation : float
        The uncompressed bytes per second those pushes offer, over ``capacity`` (measured from
        their rate; >= 1: the link is saturated).
    """

    capacity: float
    users: int
    utilisation: float


def link_seconds(links: Sequence[LinkUse], nbytes: float, ratio: float = 1.0) -> float:
    """The expected time of a transfer of ``nbytes`` (sent ``ratio`` times smaller) on a path.

    On each link the transfer takes ``s = nbytes / ratio / capacity`` alone and waits for the
    transfers ahead of it: ``s / (1 - u)`` at utilisation ``u`` (the offered load, also
    ``ratio`` times smaller if every host's pushes are), at most ``users * s`` (each host's
    transfer once ahead of it: the saturated time-shared link). The path's time is its slowest
    link's.

    Examples
    --------
    A 1 Gbit/s link eight hosts push 4.5 MB across, loaded to 36 %: 56 ms, not the 288 ms of
    eight transfers in a row; int8's quarter of the bytes: 10 ms.

    >>> link = [LinkUse(125e6, 8, 0.36)]
    >>> round(link_seconds(link, 4.5e6) * 1e3), round(link_seconds(link, 4.5e6, 4.0) * 1e3)
    (56, 10)
    >>> round(link_seconds([LinkUse(125e6, 8, 1.2)], 4.5e6) * 1e3)    # saturated
    288
    """
    worst = 0.0
    for link in links:
        alone = nbytes / ratio / link.capacity
        load = link.utilisation / ratio
        waited = alone * link.users if load >= 1 else min(alone / (1 - load), alone * link.users)
        worst = max(worst, waited)
    return worst


@dataclass(frozen=True)
class CodecChoice:
    """The codec chosen for a transfer and why.

    Attributes
    ----------
    codec : str
        The codec's spec (``"fp16"``, ``"int8"``, ``"int8:bound=6.0"``); ``""``: none.
    bandwidth : float
        The path's bottleneck bandwidth the choice used, bytes/s.
    nbytes : int
        The transfer's uncompressed bytes.
    seconds : float
        The transfer's expected time with the codec: encode, the link, decode.
    seconds_none : float
        The same uncompressed (the link alone).
    """

    codec: str
    bandwidth: float
    nbytes: int
    seconds: float
    seconds_none: float


def choose_codec(
    bandwidth: float,
    nbytes: int,
    rates: Mapping[str, CodecRate],
    *,
    auto: AutoSpec = AutoSpec(),
    must_sum: bool = False,
    links: Sequence[LinkUse] | None = None,
    cpu_load: tuple[float, float] = (0.0, 0.0),
    margin: float = 0.0,
) -> CodecChoice:
    """The codec a transfer of ``nbytes`` over a path of ``bandwidth`` should travel with.

    The rule: of the codecs in ``rates`` whose error is within ``auto.budget`` (and, when
    ``must_sum``, that an aggregator sums without decoding), take the one with the least
    expected time ``nbytes / encode + nbytes / ratio / bandwidth + nbytes / decode``; none
    unless that is shorter than ``(1 - margin)`` times ``nbytes / bandwidth``, i.e. unless the
    link time saved is more than the encode and decode time (and a ``margin`` of the time
    uncompressed). Ties go to none, then to the smaller error. With ``links`` the link times
    are :func:`link_seconds` of the path as loaded instead of the bandwidth's; with a
    ``cpu_load`` the encode and decode rates are divided by the sender's and receiver's load
    per core (where above 1: the cores are shared).

    Parameters
    ----------
    bandwidth : float
        The bottleneck bandwidth of the transfer's path (bytes/s), e.g. the least estimated
        capacity (or share of it) over the path's links. ``inf``: none.
    nbytes : int
        The transfer's bytes uncompressed (>= 0).
    rates : mapping of str to CodecRate
        The candidate codecs by spec name (``"fp16"``, ``"bf16"``, ``"int8"``, and
        ``"int8:bound"``, a candidate only when ``auto.bound`` is set); e.g.
        :data:`MEASURED_RATES`.
    auto : AutoSpec
        The job's error budget and int8 bound.
    must_sum : bool
        The next hop sums what arrives (an aggregator): only summable codecs (fp16, bf16,
        int8 with a shared bound) keep their bytes down past it.
    links : sequence of LinkUse, optional
        The path's links with their measured load (default: unmeasured, the ``bandwidth``).
    cpu_load : (float, float)
        The encoding and the decoding host's CPU load per core (0: unknown, a core each).
    margin : float
        The least fraction of the uncompressed time a codec must save (in [0, 1)): where it
        saves less, its error and the CPU it takes from training are not worth it.

    Returns
    -------
    CodecChoice

    Raises
    ------
    ValueError
        A bandwidth <= 0 or NaN, or negative bytes.

    Examples
    --------
    4.5 MB over a 25 Mbit/s uplink: int8 saves 1.1 s of link time for 8 ms of encoding and decoding.

    >>> c = choose_codec(25e6 / 8, 4_500_000, MEASURED_RATES)
    >>> c.codec, round(c.seconds_none, 2), round(c.seconds, 2)
    ('int8', 1.44, 0.37)

    The same in a 100 Gbit/s rack: the link takes 0.36 ms, encoding alone 6 ms.

    >>> choose_codec(100e9 / 8, 4_500_000, MEASURED_RATES).codec
    ''

    A budget of 0.001 leaves fp16; an aggregator next, and a bound, allow shared-scale int8.

    >>> choose_codec(25e6 / 8, 4_500_000, MEASURED_RATES, auto=AutoSpec(budget=0.001)).codec
    'fp16'
    >>> choose_codec(25e6 / 8, 4_500_000, MEASURED_RATES, must_sum=True).codec
    'bf16'
    >>> choose_codec(25e6 / 8, 4_500_000, MEASURED_RATES, auto=AutoSpec(bound=6.0), must_sum=True).codec
    'int8:bound=6.0'

    Eight hosts sharing a 1 Gbit/s link: as if each had an eighth of it, int8 pays. Measured
    at 36 % load, with the cores shared 5 to 1, int8 would save 8 of 56 ms, less than a 25 %
    margin, and bf16 17 ms; shared 10 to 1, none saves a quarter.

    >>> choose_codec(125e6 / 8, 4_500_000, MEASURED_RATES, margin=0.25).codec
    'int8'
    >>> used = [LinkUse(125e6, 8, 0.36)]
    >>> c = choose_codec(125e6 / 8, 4_500_000, MEASURED_RATES, links=used, cpu_load=(5, 5), margin=0.25)
    >>> c.codec, round(c.seconds_none * 1e3), round(c.seconds * 1e3)
    ('bf16', 56, 39)
    >>> choose_codec(125e6 / 8, 4_500_000, MEASURED_RATES, links=used, cpu_load=(10, 10), margin=0.25).codec
    ''
    """
    if not bandwidth > 0:
        raise ValueError(f"a path's bandwidth must be > 0 bytes/s, got {bandwidth}")
    if nbytes < 0:
        raise ValueError(f"a transfer's bytes must be >= 0, got {nbytes}")
    if not 0 <= margin < 1:
        raise ValueError(f"a codec's margin must be in [0, 1), got {margin}")

    def link_time(ratio: float) -> float:
        """The transfer's seconds on its path with a codec of ``ratio`` (1: uncompressed)."""
        if links is None:
            return nbytes / ratio / bandwidth
        return link_seconds(links, nbytes, ratio)

    none = link_time(1.0)
    slow_encode, slow_decode = (max(1.0, load) for load in cpu_load)
    best, best_key = "", ((1 - margin) * none, 0.0)
    for name, rate in sorted(rates.items()):
        if rate.error > auto.budget or (must_sum and not rate.summable):
            continue
        if name == "int8:bound":
            if auto.bound is None:
                continue
            name = f"int8:bound={auto.bound!r}"
        cpu = nbytes * slow_encode / rate.encode + nbytes * slow_decode / rate.decode
        seconds = cpu + link_time(rate.ratio)
        if (seconds, rate.error) < best_key:
            best, best_key = name, (seconds, rate.error)
    return CodecChoice(best, float(bandwidth), int(nbytes), best_key[0] if best else none, none)
