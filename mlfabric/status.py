"""``mlfabric status --scheduler ADDR``: a running cluster and what holds each job back.

Asks the scheduler's admin service (``mlfabric.v1.Admin/Status``) and its gRPC health
service, and prints: the daemons (hosts), the jobs with their servers (model version,
pending and in-flight updates) and workers (push rate, mean interval between pushes,
pending), the links (configured, estimated and measured rate, utilisation, transfers in
flight; busiest first) and the report of what holds each job back now: a straggling
worker (by its interval between pushes, i.e. its iteration time) and a busy or degraded
link. ``--json`` prints the same as one JSON object (field names as in
``proto/mlfabric/v1/admin.proto``). Exit 0; 1 when the scheduler cannot be reached.

Example::

    mlfabric status --scheduler sched.example:7077 --window 60
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mlfabric.wire.tls import TlsError, add_client_arguments, client_channel, client_error

__all__ = ["configure", "format_status", "message_json", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``mlfabric status`` arguments to ``parser``."""
    parser.add_argument("--scheduler", required=True, metavar="HOST:PORT", help="the scheduler's address")
    add_client_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--window", type=float, default=30.0, metavar="S", help="seconds behind rates (default 30)"
    )
    parser.add_argument(
        "--links", type=int, default=20, metavar="N", help="links shown, busiest first (default 20)"
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for an answer"
    )


def _gbps(bytes_per_second: float) -> str:
    return f"{bytes_per_second * 8 / 1e9:.3g}"


def format_status(st: Any, address: str, health: str, links: int = 20) -> str:
    """The text report of a ``ClusterStatus`` (see the module docstring).

    Examples
    --------
    >>> from mlfabric.proto.v1 import admin_pb2 as apb
    >>> st = apb.ClusterStatus(policy="stf", window_seconds=30)
    >>> _ = st.daemons.add(host="h0", data_address="127.0.0.1:4000", version="0.1.0")
    >>> print(format_status(st, "127.0.0.1:7077", "SERVING"))
    scheduler 127.0.0.1:7077: SERVING, policy stf; 0 pending, 0 in flight (rates over the last 30 s)
    daemons (1)
      h0  127.0.0.1:4000  0.1.0
    jobs (0)
    links (0; Gbit/s configured / estimated / measured, utilisation, in flight)
    holding back: nothing
    """
    out = [
        f"scheduler {address}: {health}, policy {st.policy}; {st.pending} pending, {st.in_flight} in flight "
        f"(rates over the last {st.window_seconds:g} s)",
        f"daemons ({len(st.daemons)})",
    ]
    out += [f"  {d.host}  {d.data_address}  {d.version}" for d in st.daemons]
    out.append(f"jobs ({len(st.jobs)})")
    for j in st.jobs:
        out.append(f"  {j.name} (tau_max {j.tau_max})")
        out += [
            f"    server {s.name} on {s.host}: version {s.version}, "
            f"{s.pending} pending, {s.in_flight} in flight"
            for s in j.servers
        ]
        for w in j.workers:
            every = f", every {w.mean_interval_seconds:.3g} s" if w.mean_interval_seconds else ""
            out.append(
                f"    worker {w.name} on {w.host}: "
                f"{w.pushes_per_second:.3g} pushes/s{every}, {w.pending} pending"
            )
    shown = sorted(st.links, key=lambda ls: (-ls.utilisation, -ls.in_flight, ls.src, ls.dst))[:links]
    out.append(f"links ({len(st.links)}; Gbit/s configured / estimated / measured, utilisation, in flight)")
    out += [
        f"  {ls.src}->{ls.dst}  {_gbps(ls.configured_bytes_per_second)} / "
        f"{_gbps(ls.estimated_bytes_per_second)} / {_gbps(ls.measured_bytes_per_second)}  "
        f"{ls.utilisation:.0%}  {ls.in_flight}"
        for ls in shown
    ]
    if len(st.links) > len(shown):
        out.append(f"  ... {len(st.links) - len(shown)} more (--links)")
    if not st.holding_back:
        out.append("holding back: nothing")
    else:
        out.append("holding back")
        out += [f"  job {b.job}: {b.kind} {b.name}: {b.reason}" for b in st.holding_back]
    return "\n".join(out)


def message_json(message: Any) -> dict[str, Any]:
    """A protobuf message as a JSON-ready dict (field names as in the .proto, every field),
    64-bit integers as numbers: protobuf's JSON mapping writes them as strings.

    Examples
    --------
    >>> from mlfabric.proto.v1 import admin_pb2 as apb
    >>> st = apb.ClusterStatus()
    >>> _ = st.jobs.add(name="j", tau_max=8).servers.add(name="ps", version=12)
    >>> job = message_json(st)["jobs"][0]
    >>> job["tau_max"], job["servers"][0]["version"]
    (8, 12)
    """
    from google.protobuf.json_format import MessageToDict

    body = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _numbers(message.DESCRIPTOR, body)


def _numbers(descriptor: Any, body: dict[str, Any]) -> dict[str, Any]:
    from google.protobuf.descriptor import FieldDescriptor as F

    wide = {F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64, F.TYPE_SFIXED64}
    for field in descriptor.fields:
        if field.name not in body:
            continue
        value = body[field.name]
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            items = value if field.is_repeated else [value]
            for item in items:
                _numbers(field.message_type, item)
        elif field.type in wide:
            body[field.name] = [int(v) for v in value] if field.is_repeated else int(value)
    return body


def run(args: argparse.Namespace) -> int:
    """Ask the scheduler and print the report."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mlfabric.proto.v1 import admin_pb2, admin_pb2_grpc

    try:
        channel = client_channel(args)
    except TlsError as exc:
        print(f"mlfabric status: error: {exc}", file=sys.stderr)
        return 2
    with channel:
        try:
            reply = admin_pb2_grpc.AdminStub(channel).Status(
                admin_pb2.StatusRequest(window_seconds=args.window), timeout=args.timeout
            )
            check = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="mlfabric.v1.Scheduler"), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(client_error("status", args, exc), file=sys.stderr)
            return 1
    health = health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
    if args.json:
        body = message_json(reply)
        print(json.dumps({"scheduler": args.scheduler, "health": health, **body}, indent=2))
    else:
        print(format_status(reply, args.scheduler, health, args.links))
    return 0
