"""An emulated cluster of network namespaces with shaped links (DESIGN §6).

:class:`Testbed` builds a bandwidth graph's hosts as namespaces, switches as bridges and
links as veth pairs shaped with tbf at each direction's rate (see
:mod:`mlfabric.testbed.plan` for the layout), runs commands inside hosts, and changes link
rates while traffic flows (the paper's NS settings, paper §7; DESIGN §6). The kernel's real TCP runs between
the namespaces.

Examples
--------
>>> from mlfabric.scheduler.core.graph import star
>>> tb = Testbed(star(["a", "b"], 50e6), prefix="mlf0000aa")   # no I/O yet
>>> tb.address("b")
'198.18.0.2'

With root, ``ip`` and ``tc``::

    with Testbed(load_topology("cluster.toml"), prefix=new_prefix(random.Random())) as tb:
        tb.exec("w0", ["python", "-c", "print('hello from w0')"])
        tb.set_rate(("ps", "tor"), 25e6 / 8)       # ps -> tor now 25 Mbit/s
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import networkx as nx

from mlfabric.testbed import tc
from mlfabric.testbed.netns import (
    DEFAULT_STATE_DIR,
    CommandError,
    Runner,
    SubprocessRunner,
    TestbedUnavailable,
    missing_prerequisites,
    netem_available,
    remove_marker,
    write_marker,
)
from mlfabric.testbed.plan import Layout, VethEnd, plan_layout

__all__ = ["CONTROL", "Testbed"]

log = logging.getLogger(__name__)

#: Pseudo-host name of the control namespace (where the scheduler runs).
CONTROL = "@control"


class Testbed:
    """A cluster of network namespaces built from a bandwidth graph.

    Parameters
    ----------
    topology : networkx.DiGraph
        The bandwidth graph (:func:`mlfabric.scheduler.core.graph.load_topology`).
    prefix : str
        Unique run prefix, ``mlf`` + 6 hex digits (:func:`~mlfabric.testbed.netns.new_prefix`).
    runner : Runner, optional
        Runs ``ip``/``tc``; defaults to :class:`~mlfabric.testbed.netns.SubprocessRunner`.
    state_dir : path
        Where the run's marker goes (see :mod:`mlfabric.testbed.netns`).
    persistent : bool
        Keep the namespaces after this process exits (``mlfabric testbed up``); otherwise
        the next stale sweep removes them once the owner is gone.
    info : mapping, optional
        Extra JSON-able fields for the run's marker (e.g. the topology file).

    Notes
    -----
    The constructor only plans (pure); :meth:`up` creates, :meth:`down` deletes.
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        topology: nx.DiGraph,
        prefix: str,
        *,
        runner: Runner | None = None,
        state_dir: Path = DEFAULT_STATE_DIR,
        persistent: bool = False,
        info: Mapping[str, Any] | None = None,
    ) -> None:
        self.graph = topology
        self.prefix = prefix
        self.layout: Layout = plan_layout(topology, prefix)
        self.state_dir = Path(state_dir)
        self.persistent = persistent
        self.info = dict(info or {})
        self.notes: list[str] = []
        self._runner: Runner = runner or SubprocessRunner()
        self._rates: dict[tuple[str, str], float] = {
            link: end.rate for link, end in self.layout.link_ends.items() if end.rate is not None
        }
        self._netem = False
        self._up = False

    # ------------------------------------------------------------------ life cycle

    def up(self) -> Testbed:
        """Create the namespaces, bridges, veth pairs, addresses and shaping.

        Raises
        ------
        TestbedUnavailable
            Not root, or no ``ip``/``tc``; the message lists what is missing.
        CommandError
            A command failed; everything created so far has been deleted.
        """
        missing = missing_prerequisites()
        if missing:
            raise TestbedUnavailable("cannot build a testbed: " + "; ".join(missing))
        write_marker(
            self.state_dir,
            self.prefix,
            {
                "pid": os.getpid(),
                "persistent": self.persistent,
                "created": time.time(),
                "namespaces": [ns.name for ns in self.layout.namespaces],
                "hosts": self.layout.host_namespace,
                "addresses": self.layout.host_address,
                "control_addresses": self.layout.host_control_address,
                "control_namespace": self.layout.control_namespace,
                "control_address": self.layout.control_address,
                **self.info,
            },
        )
        self._up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        run = self._runner
        for ns in self.layout.namespaces:
            run(["ip", "netns", "add", ns.name])
            run(["ip", "-n", ns.name, "link", "set", "lo", "up"])
            if ns.bridge:
                run(["ip", "-n", ns.name, "link", "add", ns.bridge, "type", "bridge", "stp_state", "0"])
                if ns.bridge_address:
                    run(["ip", "-n", ns.name, "addr", "add", ns.bridge_address, "dev", ns.bridge])
                run(["ip", "-n", ns.name, "link", "set", ns.bridge, "up"])
        latency_wanted = any(end.latency > 0 for end in self.layout.shaped_ends())
        if latency_wanted:
            self._netem = netem_available(run, self.layout.control_namespace)
            if not self._netem:
                self.notes.append(
                    "the kernel has no netem qdisc: link latencies from the topology are NOT emulated "
                    "(bandwidth shaping is)"
                )
                log.warning(self.notes[-1])
        for a, b in self.layout.pairs:
            run(
                [
                    *("ip", "link", "add", a.ifname, "netns", a.namespace, "type", "veth"),
                    *("peer", "name", b.ifname, "netns", b.namespace),
                ]
            )
            for end in (a, b):
                self._configure_end(end)

    def _configure_end(self, end: VethEnd) -> None:
        run = self._runner
        ip = ["ip", "-n", end.namespace]
        if end.bridge:
            run([*ip, "link", "set", end.ifname, "master", end.bridge])
        if end.address:
            run([*ip, "addr", "add", end.address, "dev", end.ifname])
        run([*ip, "link", "set", end.ifname, "up"])
        if end.rate is None:
            return
        parent = "root"
        if end.latency > 0 and self._netem:
            run(["tc", "-n", end.namespace, *tc.netem_args(end.ifname, end.latency)])
            parent = "1:1"
        run(["tc", "-n", end.namespace, *tc.tbf_args(end.ifname, end.rate, parent=parent)])

    def down(self) -> None:
        """Delete every namespace of this run (and with them their links); idempotent."""
        for ns in reversed(self.layout.namespaces):
            self._runner(["ip", "netns", "del", ns.name], check=False)
        remove_marker(self.state_dir, self.prefix)
        self._up = False

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.down()

    # ------------------------------------------------------------------ queries

    @property
    def hosts(self) -> list[str]:
        """Host names, in topology order."""
        return list(self.layout.host_namespace)

    def namespace(self, host: str) -> str:
        """The namespace of ``host`` (or of the control namespace for :data:`CONTROL`)."""
        if host == CONTROL:
            return self.layout.control_namespace
        try:
            return self.layout.host_namespace[host]
        except KeyError:
            raise KeyError(f"'{host}' is not a host of this testbed ({', '.join(self.hosts)})") from None

    def address(self, host: str) -> str:
        """The data-plane IP of ``host`` (its shaped NIC)."""
        self.namespace(host)
        return self.layout.host_address[host]

    def control_address(self, host: str = CONTROL) -> str:
        """The control-network IP of ``host``; of the scheduler's namespace by default."""
        if host == CONTROL:
            return self.layout.control_address
        self.namespace(host)
        return self.layout.host_control_address[host]

    def rate(self, link: tuple[str, str]) -> float:
        """The current shaping rate of the directed link ``(u, v)``, bytes/s."""
        return self._rates[self._check_link(link)]

    def _check_link(self, link: tuple[str, str]) -> tuple[str, str]:
        link = (link[0], link[1])
        if link not in self.layout.link_ends:
            raise KeyError(f"no link {link[0]} -> {link[1]} in this testbed")
        return link

    # ------------------------------------------------------------------ actions

    def set_rate(self, link: tuple[str, str], rate: float, direction: str = "forward") -> None:
        """Change a link's shaping rate while traffic flows (``tc qdisc change``).

        Parameters
        ----------
        link : (str, str)
            The link ``(u, v)``.
        rate : float
            New rate, bytes/s.
        direction : {"forward", "reverse", "both"}
            ``u -> v``, ``v -> u`` or both directions.
        """
        u, v = self._check_link(link)
        if direction not in ("forward", "reverse", "both"):
            raise ValueError(f"direction must be forward, reverse or both, got {direction!r}")
        targets = {"forward": [(u, v)], "reverse": [(v, u)], "both": [(u, v), (v, u)]}[direction]
        for t in targets:
            end = self.layout.link_ends[t]
            parent = "1:1" if end.latency > 0 and self._netem else "root"
            self._runner(
                ["tc", "-n", end.namespace, *tc.tbf_args(end.ifname, rate, change=True, parent=parent)]
            )
            self._rates[t] = rate

    def _argv(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def exec(
        self, host: str, argv: Sequence[str], *, timeout: float | None = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``host``'s namespace to completion; capture its output.

        Raises
        ------
        CommandError
            If ``check`` and the command exits non-zero.
        """
        proc = subprocess.run(
            self._argv(host, argv), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise CommandError(
                f"{host}: `{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}"
            )
        return proc

    def popen(
        self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace; the caller reaps it.

        ``env`` entries are added to this process's environment.
        """
        full_env = None if env is None else {**os.environ, **env}
        return subprocess.Popen(self._argv(host, argv), env=full_env, **kwargs)
