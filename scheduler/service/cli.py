"""Run the central scheduler service (one per cluster).

Daemons connect to it over gRPC (one Session stream each), register their roles and
announce ready updates; the scheduler batches the announcements, runs the policy on the
bandwidth graph and streams back send/drop directives.

The bandwidth graph comes from a TOML topology file (--topology, format in the
README) or from a star preset (--star N --nic-gbps G: hosts h0..h{N-1} around one
switch). Daemons must say hello with one of its host names.

Examples:

  mlfabric scheduler --star 4 --nic-gbps 10 --policy stf
  mlfabric scheduler --policy stf --stf-horizon 0   # plan every pending update each time
  mlfabric scheduler --listen 127.0.0.1:0 --topology cluster.toml --policy fair \\
      --ready-file /tmp/sched.json --metrics-port 9100

Exits 0 on SIGTERM/SIGINT, 2 on bad arguments or a bad topology file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
from typing import TYPE_CHECKING, Any

from mlfabric.config import (
    NOT_IN_SERVICE,
    SERVICE_POLICIES,
    ConfigError,
    add_config_argument,
    load_config,
    load_graph,
    parse_args_with_config,
)
from mlfabric.readyfile import write_ready_file
from mlfabric.scheduler.policies.registry import DEFAULT_STF_HORIZON, PolicySetup, make_policy
from mlfabric.systemd import configure_logging

if TYPE_CHECKING:  # imported when serving (``mlfabric --help`` stays light)
    from mlfabric.scheduler.service.core import SchedulerCore

__all__ = ["SERVICE_POLICIES", "build_policy", "configure", "main", "run"]

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:7077"
#: seconds the daemons' streams stay open after SIGTERM (reports in flight still resolve their
#: pushes); then they end with OK
STOP_GRACE = 1.0
#: hosts of the star used when neither --topology nor --star is given
DEFAULT_STAR = 4


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``mlfabric scheduler`` arguments to ``parser``."""
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"gRPC address to serve on; port 0 picks a free port (default {DEFAULT_LISTEN})",
    )
    graph = parser.add_mutually_exclusive_group()
    graph.add_argument("--topology", metavar="FILE", help="TOML topology file: hosts, switches, links")
    graph.add_argument(
        "--star",
        type=int,
        metavar="N",
        help=f"preset: N hosts h0..h{{N-1}} around one switch (the default, with N={DEFAULT_STAR})",
    )
    parser.add_argument(
        "--nic-gbps",
        type=float,
        default=10.0,
        metavar="G",
        help="NIC rate of every host of the star, Gbit/s (default 10)",
    )
    parser.add_argument(
        "--policy",
        default="fair",
        help="scheduling policy: fair (send at once, TCP shares), stf (shortest transfer "
        "first with network time-sharing), stf+agg (stf with aggregation groups summed at "
        "aggregator hops, paper Fig. 6) or stf+tree (multi-level aggregation trees read off the "
        "bandwidth graph, docs/aggregation-trees.md) (default fair)",
    )
    parser.add_argument(
        "--aggregate-plan",
        choices=["async", "sync"],
        default="async",
        help="stf+agg: async plans the shortest first group (Fig. 6); sync picks, per decision, "
        "the number of direct sends that makes the last update arrive earliest (default async)",
    )
    parser.add_argument(
        "--aggregate-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="stf+agg, stf+tree: seconds an aggregator waits for an aggregate's members before the "
        "members are planned afresh (default 60)",
    )
    parser.add_argument(
        "--pipelined-aggregates",
        action="store_true",
        help="stf+agg, stf+tree: the daemons forward each piece of an aggregate's sum as soon as that "
        "piece of every member is in (cut-through), instead of once the members are whole (raw "
        "float32 updates; others are summed store-and-forward); stf+tree plans synchronous rounds "
        "as pipelined trees for it (docs/pipelined-aggregation.md)",
    )
    parser.add_argument(
        "--replica-grace",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a replica whose daemon lost its scheduler session stays attached (its server "
        "keeps the log and the bound); one registered again later is re-synced (default 10)",
    )
    parser.add_argument(
        "--stf-horizon",
        type=int,
        default=DEFAULT_STF_HORIZON,
        metavar="N",
        help="stf: plan only the first N sends of the STF order per decision (the same as in "
        "the full order), and decide again once the planned sends fall to N/4 while updates "
        "remain unplanned; bounds the decision time on a large backlog. 0 plans every pending "
        f"update each time (default {DEFAULT_STF_HORIZON})",
    )
    parser.add_argument(
        "--batch-window-us",
        type=float,
        default=300.0,
        metavar="N",
        help="keep batching ready notifications while another arrives within N microseconds "
        "(default 300; a batch never waits more than --batch-max-wait-us)",
    )
    parser.add_argument(
        "--batch-max-wait-us",
        type=float,
        default=5000.0,
        metavar="N",
        help="longest wait of a batch after its first notification, microseconds (default 5000)",
    )
    parser.add_argument(
        "--release-margin-us",
        type=float,
        default=2000.0,
        metavar="N",
        help="release a transfer N microseconds before the one it waits for is expected to end, "
        "so the bottleneck never idles on control latency (default 2000)",
    )
    parser.add_argument(
        "--ready-file",
        metavar="F",
        help='once serving, write {"pid", "address", ...} as JSON to F (atomically)',
    )
    parser.add_argument(
        "--metrics-port", type=int, metavar="P", help="serve Prometheus /metrics on port P (0: any free port)"
    )
    parser.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="the cluster's CA; with --tls-cert and --tls-key: "
        "serve mTLS only, each daemon's Hello checked against its certificate",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="the scheduler's certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="the scheduler's private key")
    parser.add_argument(
        "--tls-admin",
        default="admin",
        metavar="NAME[,NAME...]",
        help="under mTLS, the client certificate names that may read Admin.Status and Admin.Trace "
        "(mlfabric status, trace); a host's certificate may not (default admin: the admin.pem of "
        "mlfabric certs)",
    )
    add_config_argument(parser, "scheduler")


def _credentials(args: argparse.Namespace) -> Any:
    """gRPC server credentials of ``--tls-*`` (None: plaintext); ValueError naming a bad file."""
    from mlfabric.wire.tls import TlsFiles, server_credentials

    files = TlsFiles.from_options(args.tls_ca, args.tls_cert, args.tls_key)
    return None if files is None else server_credentials(files)


def _fail(message: str) -> int:
    print(f"mlfabric scheduler: error: {message}", file=sys.stderr)
    return 2


def build_policy(
    name: str,
    stf_horizon: int = DEFAULT_STF_HORIZON,
    *,
    sync: bool = False,
    incarnation: str = "",
    pipelined: bool = False,
) -> PolicySetup:
    """The policy named ``name`` and its re-plan trigger, from the one policy factory.

    Parameters
    ----------
    name : str
        ``fair``, ``stf``, ``stf+agg`` or ``stf+tree`` (see :data:`SERVICE_POLICIES`).
    stf_horizon : int
        For ``stf``: sends planned per decision; 0 plans every pending update.
    sync : bool
        For ``stf+agg``: the synchronous planner (smallest makespan) instead of Fig. 6's.
    incarnation : str
        This scheduler run's id (``run`` draws a random one): the scope of its aggregate ids
        (``agg:<server>.<incarnation>:<n>``), so a restarted scheduler never reuses an id a
        server daemon already answered.
    pipelined : bool
        For ``stf+tree``: synchronous rounds planned as pipelined trees (``--pipelined-aggregates``).

    Returns
    -------
    PolicySetup
        :func:`~mlfabric.scheduler.policies.registry.make_policy`'s answer.

    Raises
    ------
    ValueError
        For a policy the service cannot run or a negative horizon.

    Examples
    --------
    >>> setup = build_policy("stf", 8)
    >>> setup.policy.horizon, setup.trigger.low_water
    (8, 2)
    >>> build_policy("stf+agg", incarnation="7f3a").policy.scope
    '7f3a'
    """
    if stf_horizon < 0:
        raise ValueError(f"--stf-horizon must be >= 0, got {stf_horizon}")
    if name not in SERVICE_POLICIES:
        make_policy(name)  # an unknown name: the factory's error lists the known ones
        if name in NOT_IN_SERVICE:
            raise ValueError(
                f"policy '{name}' is not run by the service: {NOT_IN_SERVICE[name]} "
                f"(service policies: {', '.join(SERVICE_POLICIES)})"
            )
        raise ValueError(
            f"policy '{name}' plans aggregates, which the service does not execute yet "
            f"(service policies: {', '.join(SERVICE_POLICIES)})"
        )
    return make_policy(
        name, horizon=stf_horizon, sync=sync, scope=incarnation, pipelined_aggregates=pipelined
    )


def run(args: argparse.Namespace) -> int:
    """Run the scheduler until SIGTERM/SIGINT; returns the exit code."""
    try:
        graph = _graph(args)
        incarnation = secrets.token_hex(4)  # this run's aggregate ids: never reused after a restart
        setup = build_policy(
            args.policy,
            args.stf_horizon,
            sync=args.aggregate_plan == "sync",
            incarnation=incarnation,
            pipelined=args.pipelined_aggregates,
        )
    except ValueError as exc:  # TopologyError and ConfigError are ValueErrors
        return _fail(str(exc))
    except ImportError as exc:
        return _fail(f"policy '{args.policy}' is not available: {exc}")
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        return _fail(f"--listen must be HOST:PORT, got '{args.listen}'")
    if args.batch_window_us < 0 or args.batch_max_wait_us < 0 or args.release_margin_us < 0:
        return _fail("--batch-window-us, --batch-max-wait-us and --release-margin-us must be >= 0")
    return asyncio.run(_serve(args, graph, setup))


def _graph(args: argparse.Namespace) -> Any:
    """The bandwidth graph of ``--topology`` (a path, or an inline table from ``--config``) or ``--star``."""
    from mlfabric.scheduler.core.graph import star

    if args.topology:
        return load_graph(args.topology, args.config or "--topology")
    return star(args.star if args.star is not None else DEFAULT_STAR, args.nic_gbps * 1e9)


def _reload(args: argparse.Namespace, core: SchedulerCore) -> None:
    """SIGHUP: re-read ``--config`` (if any) and the topology, swap the graph.

    The topology and ``log_level`` take effect; other changed keys (listening address,
    policy, ...) are logged as needing a restart.
    """
    level = None
    if args.config:
        values = load_config(args.config, "scheduler")
        args.topology, args.star = values.pop("topology", args.topology), values.pop("star", args.star)
        level = values.pop("log_level", None)
        restart = sorted(k for k, v in values.items() if getattr(args, k, v) != v)
        if restart:
            log.warning("reload: changed keys need a restart to take effect: %s", ", ".join(restart))
    core.replace_graph(_graph(args), _make_estimator)
    if level is not None and level != args.log_level:
        logging.getLogger().setLevel(level)
        args.log_level = level
        log.warning("reload: log level now %s", level)


def _make_estimator(graph: Any) -> Any:
    """The bandwidth estimator fed by transfer reports (static capacities if none is available)."""
    from mlfabric.scheduler.service.core import StaticEstimator

    try:
        from mlfabric.scheduler.core.estimation import BandwidthEstimator
    except ModuleNotFoundError as exc:
        if exc.name != "mlfabric.scheduler.core.estimation":
            raise
        log.warning(
            "no bandwidth estimator (mlfabric.scheduler.core.estimation): using the static capacities"
        )
        return StaticEstimator(graph)
    return BandwidthEstimator(graph)


async def _serve(args: argparse.Namespace, graph: Any, setup: PolicySetup) -> int:
    from prometheus_client import CollectorRegistry

    from mlfabric.proto.v1 import admin_pb2_grpc
    from mlfabric.scheduler.policies.dispatch import Dispatcher
    from mlfabric.scheduler.service.admin import AdminServicer
    from mlfabric.scheduler.service.batching import AdaptiveBatcher
    from mlfabric.scheduler.service.core import SchedulerCore, start_server
    from mlfabric.scheduler.service.lifecycle import status_line, supervise
    from mlfabric.scheduler.service.metrics import ServiceCollector, serve_metrics
    from mlfabric.scheduler.service.observe import Recorder
    from mlfabric.scheduler.service.state import SchedulerState
    from mlfabric.scheduler.service.tracelog import TraceLog
    from mlfabric.systemd import Notifier, watchdog_interval

    notifier = Notifier()
    trace = TraceLog()  # the live timeline (mlfabric trace), bounded
    policy = setup.policy
    core = SchedulerCore(
        SchedulerState(graph, Recorder(trace)),  # what the service observes, noted once
        policy,
        dispatcher=Dispatcher(margin=args.release_margin_us * 1e-6),
        batcher=AdaptiveBatcher(window=args.batch_window_us * 1e-6, max_wait=args.batch_max_wait_us * 1e-6),
        estimator=_make_estimator(graph),
        replan=setup.trigger,
        aggregate_timeout=args.aggregate_timeout,
        replica_grace=args.replica_grace,
        pipelined_aggregates=args.pipelined_aggregates,
    )
    try:
        credentials = _credentials(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        trace.set_clock(core.clock)
        admins = frozenset(n.strip() for n in args.tls_admin.split(",") if n.strip())
        admin = AdminServicer(core, admins if credentials is not None else None)
        server, port = await start_server(
            core,
            args.listen,
            credentials=credentials,
            extra=[("mlfabric.v1.Admin", lambda s: admin_pb2_grpc.add_AdminServicer_to_server(admin, s))],
        )
    except RuntimeError as exc:
        return _fail(f"cannot listen on {args.listen}: {exc}")
    host = args.listen.rpartition(":")[0]
    address = f"{host}:{port}"
    if credentials is None:
        from mlfabric.wire.auth import unauthenticated_warning

        warning = unauthenticated_warning("scheduler", address, "tls_ca, tls_cert and tls_key")
        if warning is not None:
            log.warning("%s", warning)
    metrics_server = None
    if args.metrics_port is not None:
        registry = CollectorRegistry()
        collector = ServiceCollector(core.stats, refresh_on_collect=False)  # the snapshot, taken on the loop
        registry.register(collector)
        try:
            metrics_server = await serve_metrics(
                registry, host.strip("[]"), args.metrics_port, before=collector.refresh
            )
        except OSError as exc:
            await server.stop(None)
            return _fail(f"cannot serve metrics on port {args.metrics_port}: {exc}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def status() -> str:
        return status_line(core.state, core.policy.name)

    def on_hup() -> None:
        notifier.reloading()
        try:
            _reload(args, core)
        except ValueError as exc:  # a bad config or topology: keep serving the old one
            log.error("reload failed: %s", exc)
            notifier.ready(f"reload failed: {exc}".splitlines()[0])
            return
        log.warning("reloaded the topology: %s", status())
        notifier.ready(status())

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    core_task = asyncio.create_task(core.run())
    if args.ready_file:
        info: dict[str, Any] = {"pid": os.getpid(), "address": address, "policy": policy.name}
        if metrics_server is not None:
            info["metrics_port"] = metrics_server.sockets[0].getsockname()[1]
        write_ready_file(args.ready_file, info)
    print(f"mlfabric scheduler: serving on {address} (policy {policy.name})", file=sys.stderr, flush=True)
    notifier.ready(f"serving on {address}; {status()}")
    supervisor = asyncio.create_task(supervise(status, notifier, watchdog_interval()))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({core_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    notifier.stopping()
    failed = core_task.done()  # the core's loops only end by failing
    core_task.cancel()
    stopper.cancel()
    supervisor.cancel()
    # no new streams from here; the open ones still carry reports in flight and the verdicts
    # they resolve for STOP_GRACE, then end with OK (not cancelled at the server's grace)
    stopping = asyncio.create_task(server.stop(grace=STOP_GRACE + 1.0))
    await asyncio.sleep(STOP_GRACE)
    for session in list(core.sessions.values()):
        session.close()
    _, late = await asyncio.wait({core_task, stopping}, timeout=3.0)
    for task in late:
        log.error("still running %.0f s after the stop: %r", STOP_GRACE + 3.0, task)
    if metrics_server is not None:
        metrics_server.close()
    if failed:
        log.error("scheduler core failed", exc_info=core_task.exception())
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run as ``python -m mlfabric.scheduler.service.cli`` (same arguments as ``mlfabric scheduler``)."""
    parser = argparse.ArgumentParser(
        prog="mlfabric scheduler", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    configure(parser)
    try:
        args = parse_args_with_config(parser, sys.argv[1:] if argv is None else argv, "scheduler")
    except ConfigError as exc:
        return _fail(str(exc))
    configure_logging(args.log_level)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
