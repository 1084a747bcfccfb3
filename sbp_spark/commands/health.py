"""``sbp cluster``: the PD members, and every range server the PD knows with its liveness,
load, last reported metrics and a PING round trip; or, as a health check, one of them."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sbp_spark.protocol.errors import SbpError

from .common import (
    CommandError,
    add_pd_argument,
    address_arg,
    cli_errors,
    connect,
    print_table,
)

# Metrics shown in the table (all of them are in --json).
_SHOWN_METRICS = (
    ("memory_used", "MEM", "bytes"),
    ("disk_free_space", "DISK FREE", "bytes"),
    ("network_append_rate", "APPEND/S", "count"),
    ("network_fetch_rate", "FETCH/S", "count"),
    ("network_append_avg_latency", "APPEND MS", "count"),
)


@dataclass
class ServerView:
    """A range server as the PD reports it, plus what its ranges and a PING say."""

    server_id: int
    address: str
    live: bool = False
    heartbeat_age_ms: int | None = None
    open_ranges: int = 0
    # Counted by walking every stream's ranges; None when that walk was skipped.
    ranges: int | None = None
    primary_of: int | None = None
    metrics: dict[str, int] = field(default_factory=dict)
    metrics_age_ms: int | None = None
    ping_ms: float | None = None
    error: str = ""


def gather(client: Any, pd_only: bool = False, range_server: str | None = None
           ) -> dict[str, Any]:
    """The PD members and (unless ``pd_only``) every range server the PD knows, pinged.

    With ``range_server`` (an advertised address), only that server, and without walking
    every stream's ranges: cheap enough to run as a health check every few seconds. Raises
    ``CommandError`` when the PD does not know that address.
    """
    # The range servers first: only the leader knows them, so the members are then asked of
    # the node that leads, not of a follower whose view may still name a dead leader.
    states = [] if pd_only else client.pd.range_servers()
    pd_cluster = client.pd.describe_pd_cluster()
    members = [{"name": n.name, "address": n.advertise_addr, "leader": n.is_leader}
               for n in pd_cluster.members]
    if pd_only:
        return {"pd": pd_of_client(client), "members": members}
    now_ms = int(time.time() * 1000)
    servers: dict[int, ServerView] = {}
    for state in states:
        if range_server is not None and state.server.advertise_addr != range_server:
            continue
        view = ServerView(state.server.server_id, state.server.advertise_addr, live=state.live,
                          open_ranges=state.open_ranges)
        if state.silent_ms >= 0:  # the leader's own clock: no clocks compared
            view.heartbeat_age_ms = state.silent_ms
        elif state.last_heartbeat_ms >= 0:  # a leader that has not heard it yet: its record
            view.heartbeat_age_ms = max(now_ms - state.last_heartbeat_ms, 0)
        if state.metrics is not None:
            view.metrics = {f.name: getattr(state.metrics, f.name)
                            for f in fields(state.metrics) if f.name != "range_server"}
            view.metrics_age_ms = max(now_ms - state.metrics_ms, 0)
        servers[view.server_id] = view
    facts: dict[str, Any] = {"pd": pd_of_client(client), "members": members}
    if range_server is None:
        facts.update(_count_ranges(client, servers))
    elif not servers:
        raise CommandError(f"range server {range_server} is not registered with the PD at "
                           f"{facts['pd']}")
    for view in servers.values():
        try:
            view.ping_ms = client.range_server(view.address).ping() * 1000.0
        except SbpError as exc:
            view.error = str(exc)
    facts["range_servers"] = [asdict(v) for v in sorted(servers.values(),
                                                        key=lambda v: v.server_id)]
    return facts


def _count_ranges(client: Any, servers: dict[int, ServerView]) -> dict[str, int]:
    """Walk every stream's ranges: count what each server holds (adding servers the ranges
    name that the PD no longer lists) and return the stream and range totals."""
    held: Counter[int] = Counter()
    led: Counter[int] = Counter()
    streams = client.list_streams()
    range_count = 0
    for stream in streams:
        for rng in client.list_ranges(stream.stream_id):
            range_count += 1
            for replica in rng.servers:
                server_id = replica.server.server_id
                if server_id not in servers:
                    servers[server_id] = ServerView(server_id, replica.server.advertise_addr)
                held[server_id] += 1
                led[server_id] += int(replica.is_primary)
    for server_id, view in servers.items():
        view.ranges, view.primary_of = held[server_id], led[server_id]
    return {"streams": len(streams), "ranges": range_count}


def pd_of_client(client: Any) -> str:
    return ",".join(client.pd.addresses)


def _human(value: int, unit: str) -> str:
    if unit != "bytes":
        return str(value)
    size = float(value)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or suffix == "TiB":
            return f"{size:.0f} {suffix}" if suffix == "B" else f"{size:.1f} {suffix}"
        size /= 1024
    return str(value)


def _print(facts: dict[str, Any]) -> None:
    if "streams" in facts:
        print(f"PD {facts['pd']}: {facts['streams']} streams, {facts['ranges']} ranges")
        print()
    leaders = [m for m in facts["members"] if m["leader"]]
    print(f"PD members (leader: {leaders[0]['name']} at {leaders[0]['address']})" if leaders
          else "PD members (no leader elected right now)")
    print_table([[m["name"], m["address"], "leader" if m["leader"] else "follower"]
                 for m in facts["members"]], ["NAME", "ADDRESS", "ROLE"])
    if "range_servers" not in facts:
        return
    print()
    servers = facts["range_servers"]
    if not servers:
        print("Range servers: none has registered with the PD yet")
        return
    print("Range servers")
    rows = []
    for s in servers:
        if s["ping_ms"] is not None:
            state = f"up, ping {s['ping_ms']:.1f} ms"
        else:
            state = f"DOWN: {s['error']}"
        if not s["live"]:
            state += " (no recent heartbeat)"
        metrics = s["metrics"]
        shown = [_human(metrics[name], unit) if name in metrics else "-"
                 for name, _, unit in _SHOWN_METRICS]
        counts = ["-" if s[name] is None else str(s[name]) for name in ("ranges", "primary_of")]
        rows.append([str(s["server_id"]), s["address"], str(s["open_ranges"]), *counts,
                     *shown, state])
    print_table(rows, ["ID", "ADDRESS", "OPEN", "RANGES", "PRIMARY",
                       *(title for _, title, _ in _SHOWN_METRICS), "STATE"])


@cli_errors
def cluster_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        facts = gather(client, pd_only=args.pd_only, range_server=args.range_server)
    if args.json:
        print(json.dumps(facts))
    else:
        _print(facts)
    if not any(m["leader"] for m in facts["members"]):
        # No node serves metadata: nothing can be created, planned or failed over.
        print("sbp cluster: unhealthy: no PD node leads right now", file=sys.stderr)
        return 1
    if "range_servers" not in facts:
        return 0
    servers = facts["range_servers"]
    if not servers:
        # Nothing can be stored: a health check must not pass on an empty cluster.
        print("sbp cluster: unhealthy: no range server has registered with the PD",
              file=sys.stderr)
        return 1
    down = [s for s in servers if s["ping_ms"] is None or not s["live"]]
    # A server that is down but holds no range (the walk counted none: it was taken out of
    # service, or never got one) costs no stream anything; the PD has no command to forget
    # it, so counting it would fail the check until the PD's data is rebuilt.
    idle = [s for s in down if s["ranges"] == 0]
    if idle:
        print("sbp cluster: not counted against health: range server(s) "
              + ", ".join(f"{s['server_id']} at {s['address']}" for s in idle)
              + " down but holding no range", file=sys.stderr)
    return 1 if len(down) > len(idle) else 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp cluster``."""
    p = subparsers.add_parser(
        "cluster", help="show the PD members and the range servers",
        description="Show the PD members (and which leads), and every range server the PD "
                    "knows: whether it heartbeats, the ranges it holds, the load metrics it "
                    "last reported (all of them with --json) and a PING round trip. Exits 0 "
                    "when the PD (a leader among its nodes) and every range server that holds "
                    "a range answer, 1 otherwise or when no range server has registered "
                    "(usable as a "
                    "health check; --pd-only and --range-server make cheaper ones).")
    add_pd_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    checks = p.add_mutually_exclusive_group()
    checks.add_argument("--pd-only", action="store_true",
                        help="only ask the PD for its members (a quick health check of the PD)")
    checks.add_argument("--range-server", metavar="HOST:PORT", type=address_arg,
                        help="only the range server advertised as HOST:PORT: exit 0 when the PD "
                             "sees it heartbeat and it answers a PING (a health check of one "
                             "range server that does not walk every stream)")
    p.set_defaults(handler=cluster_command, command="sbp cluster")
