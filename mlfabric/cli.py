"""The ``mlfabric`` console command.

Each subcommand lives in its own module, which provides ``configure(parser)`` (add the
subcommand's arguments) and ``run(args) -> int`` (do the work, return the exit code).
Modules import their heavy dependencies inside ``run`` so that ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "scheduler": ("mlfabric.scheduler.service.cli", "run the central scheduler service (one per cluster)"),
    "daemon": ("mlfabric.daemon.cli", "run a host daemon (one per host)"),
    "demo": ("mlfabric.demo", "train on an emulated cluster on this machine: fair, stf and stf+agg"),
    "simulate": ("mlfabric.scheduler.sim.cli", "simulate policies on large clusters (fluid, discrete-event)"),
    "plan": ("mlfabric.scheduler.plan.cli", "plan an instance offline: ILP, STF, fair, and their gaps"),
    "testbed": ("mlfabric.testbed.cli", "build an emulated cluster of network namespaces (root)"),
    "config": ("mlfabric.config", "check a scheduler or daemon config file; list the config keys"),
    "install-units": (
        "mlfabric.units",
        "write the systemd units (and --configs: example configs), authenticated unless --no-auth",
    ),
    "status": ("mlfabric.status", "a running cluster: hosts, jobs, links, and what holds each job back"),
    "certs": ("mlfabric.certs", "make a test CA, host/scheduler certificates and the data-plane secret"),
    "trace": ("mlfabric.trace_cli", "record a running cluster's planned and measured transfers (Perfetto)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser.

    Only ``command``'s module is imported and asked for its arguments (so one subcommand
    starts fast and does not depend on the others); the rest are listed with their help.
    """
    from mlfabric import __version__

    parser = argparse.ArgumentParser(
        prog="mlfabric",
        description="MLfabric: network-aware scheduling of distributed-training transfers.",
    )
    parser.add_argument("--version", action="version", version=f"mlfabric {__version__}")
    parser.add_argument(
        "--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text, description=help_text)
            continue
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or help_text).strip()
        p = sub.add_parser(
            name, help=help_text, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.configure(p)
        p.set_defaults(_module=module, _parser=p)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; a ``--config FILE`` of ``scheduler``/``daemon`` supplies the defaults.

    Options on the command line (``--log-level`` before the subcommand too) override the file.

    Raises
    ------
    mlfabric.config.ConfigError
        The config file is bad.
    """
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if getattr(args, "config", None) and command in ("scheduler", "daemon"):
        from mlfabric.config import parse_args_with_config

        given_level = args.log_level if any(a.split("=")[0] == "--log-level" for a in argv) else None
        args = parse_args_with_config(parser, argv, command, subparser=args._parser)
        if given_level is not None:  # argparse lets the subcommand's defaults win; the user's flag should
            args.log_level = given_level
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlfabric`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    from mlfabric.config import ConfigError

    try:
        args = parse_args(argv)
    except ConfigError as exc:
        print(f"mlfabric {command}: error: {exc}", file=sys.stderr)
        return 2
    from mlfabric.systemd import configure_logging

    configure_logging(args.log_level)
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
