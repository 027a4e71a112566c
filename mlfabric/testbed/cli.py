"""Build an emulated cluster of network namespaces from a topology file (needs root).

  mlfabric testbed up cluster.toml          # create it; prints the hosts and addresses
  mlfabric testbed status                   # the live testbeds and their hosts
  mlfabric testbed exec w0 -- ip addr       # run a command inside host w0
  mlfabric testbed exec @control -- mlfabric scheduler --listen 198.19.0.1:0 ...
  mlfabric testbed down                     # delete it (all namespaces of the run)
  mlfabric testbed sweep                    # delete namespaces left by dead runs

Each host is a namespace with one shaped NIC on 198.18.0.0/16; switches are bridges; each
direction of a link is shaped with tbf at its rate. Hosts also reach the scheduler's
namespace (@control, 198.19.0.1) over an unshaped control network. The live testbed is
recorded in a small JSON file under --state-dir so that `down` and `exec` find it.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``testbed`` subcommand's arguments."""
    from mlfabric.testbed.netns import DEFAULT_STATE_DIR

    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"where live testbeds are recorded ({DEFAULT_STATE_DIR})",
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="create a testbed from a topology file")
    up.add_argument("topology", type=Path, help="topology TOML (the format the scheduler reads)")
    up.add_argument("--prefix", help="run prefix, mlf + 6 hex digits (default: random)")
    for name, text in (("down", "delete a testbed"), ("status", "show live testbeds")):
        p = sub.add_parser(name, help=text)
        p.add_argument("topology", type=Path, nargs="?", help="only the testbed built from this file")
        p.add_argument("--prefix", help="only the testbed with this prefix")
    ex = sub.add_parser("exec", help="run a command inside an emulated host (or @control)")
    ex.add_argument("--prefix", help="which testbed, if several are live (give it before HOST)")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    sub.add_parser("sweep", help="delete namespaces of dead runs (only mlfXXXXXX-* names)")


def _live(state_dir: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(state_dir.glob("mlf*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict):
            data["prefix"] = path.stem
            runs.append(data)
    return runs


def _select(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = _live(args.state_dir)
    if getattr(args, "prefix", None):
        runs = [r for r in runs if r["prefix"] == args.prefix]
    topology = getattr(args, "topology", None)
    if topology is not None:
        runs = [r for r in runs if r.get("topology") == str(topology.resolve())]
    return runs


def _up(args: argparse.Namespace) -> int:
    from mlfabric.scheduler.core.graph import TopologyError, load_topology
    from mlfabric.testbed.cluster import Testbed
    from mlfabric.testbed.netns import CommandError, TestbedUnavailable, new_prefix
    from mlfabric.testbed.plan import LayoutError

    prefix = args.prefix or new_prefix(random.Random())
    try:
        graph = load_topology(args.topology)
        testbed = Testbed(
            graph,
            prefix,
            state_dir=args.state_dir,
            persistent=True,
            info={"topology": str(args.topology.resolve())},
        )
        testbed.up()
    except (TopologyError, LayoutError, TestbedUnavailable, CommandError) as exc:
        print(f"mlfabric testbed up: {exc}", file=sys.stderr)
        return 2
    print(f"testbed {prefix} is up ({args.topology})")
    print(f"  scheduler namespace @control: {testbed.control_address()}")
    for host in testbed.hosts:
        print(f"  {host:<12} {testbed.address(host):<16} control {testbed.control_address(host)}")
    for note in testbed.notes:
        print(f"  note: {note}")
    print(f"run a command inside a host: mlfabric testbed exec {testbed.hosts[0]} -- ip addr")
    print(f"delete it: mlfabric testbed down --prefix {prefix}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from mlfabric.testbed.netns import NAMESPACE_PATTERN, SubprocessRunner, remove_marker

    runs = _select(args)
    if not args.prefix:
        # without --prefix, only testbeds made by `up`: never one a running program owns
        runs = [r for r in runs if r.get("persistent")]
    if not runs:
        print("no live testbed matches", file=sys.stderr)
        return 1
    if len(runs) > 1 and not args.prefix:
        print(
            f"mlfabric testbed down: {len(runs)} testbeds match; pick one with --prefix "
            f"({', '.join(r['prefix'] for r in runs)})",
            file=sys.stderr,
        )
        return 2
    runner = SubprocessRunner()
    for r in runs:
        for ns in r.get("namespaces", []):
            match = NAMESPACE_PATTERN.match(ns)
            if match and match.group(1) == r["prefix"]:
                runner(["ip", "netns", "del", ns], check=False)
        remove_marker(args.state_dir, r["prefix"])
        print(f"testbed {r['prefix']} is down")
    return 0


def _status(args: argparse.Namespace) -> int:
    from mlfabric.testbed.netns import SubprocessRunner, list_namespaces, pid_alive

    runs = _select(args)
    present = set(list_namespaces(SubprocessRunner())) if shutil.which("ip") else set()
    if not runs:
        print("no live testbed")
    for r in runs:
        names = r.get("namespaces", [])
        alive = sum(ns in present for ns in names)
        owner = "persistent" if r.get("persistent") else f"owner pid {r.get('pid')}"
        if not r.get("persistent") and not pid_alive(int(r.get("pid", 0))):
            owner += " (dead: `mlfabric testbed sweep` removes it)"
        print(f"testbed {r['prefix']}: {alive}/{len(names)} namespaces present, {owner}")
        if r.get("topology"):
            print(f"  topology {r['topology']}")
        print(f"  @control {r.get('control_namespace')} {r.get('control_address')}")
        for host, ns in r.get("hosts", {}).items():
            print(f"  {host:<12} {r['addresses'][host]:<16} {ns}")
    return 0


def _exec(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("mlfabric testbed exec: give a command after --", file=sys.stderr)
        return 2
    runs = _select(args)
    if len(runs) != 1:
        print(
            f"mlfabric testbed exec: {len(runs)} live testbeds match; pick one with --prefix "
            f"({', '.join(r['prefix'] for r in runs) or 'none is up'})",
            file=sys.stderr,
        )
        return 2
    r = runs[0]
    hosts = dict(r.get("hosts", {}))
    hosts["@control"] = r.get("control_namespace", "")
    if args.host not in hosts:
        print(f"mlfabric testbed exec: no host '{args.host}' (hosts: {', '.join(hosts)})", file=sys.stderr)
        return 2
    return subprocess.call(["ip", "netns", "exec", hosts[args.host], *argv])


def _sweep(args: argparse.Namespace) -> int:
    from mlfabric.testbed.netns import SubprocessRunner, sweep_stale

    deleted = sweep_stale(SubprocessRunner(), args.state_dir)
    print(f"deleted {len(deleted)} stale namespace(s)" + (": " + ", ".join(deleted) if deleted else ""))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``mlfabric testbed ACTION``; return the exit code."""
    from mlfabric.testbed.netns import missing_prerequisites

    if args.action in ("up", "down", "exec", "sweep"):
        missing = missing_prerequisites()
        if missing:
            print(f"mlfabric testbed {args.action}: " + "; ".join(missing), file=sys.stderr)
            return 2
    actions = {"up": _up, "down": _down, "status": _status, "exec": _exec, "sweep": _sweep}
    return actions[args.action](args)
