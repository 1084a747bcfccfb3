"""``sbp cluster``: the PD members (DESCRIBE_PD_CLUSTER) and the range servers holding ranges.

SBP has no request that lists range servers or reads back the metrics they report to the PD,
so the range servers shown are those named by the ranges of the live streams, each checked
with a PING. The command exits 0 only when the PD answers and every listed server does.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from sbp_spark.protocol.errors import SbpError

from .common import add_pd_argument, cli_errors, connect, print_table


@dataclass
class ServerView:
    """A range server as seen through the ranges it holds."""

    server_id: int
    address: str
    ranges: int = 0
    open_ranges: int = 0
    primary_of: int = 0
    ping_ms: float | None = None
    error: str = ""


def gather(client: Any, pd_only: bool = False) -> dict[str, Any]:
    """The PD members and (unless ``pd_only``) the range servers of every live stream's
    ranges, pinged."""
    pd_cluster = client.pd.describe_pd_cluster()
    members = [{"name": n.name, "address": n.advertise_addr, "leader": n.is_leader}
               for n in pd_cluster.members]
    if pd_only:
        return {"pd": pd_of_client(client), "members": members}
    streams = client.list_streams()
    servers: dict[tuple[int, str], ServerView] = {}
    counts: dict[str, int] = defaultdict(int)
    for stream in streams:
        for rng in client.list_ranges(stream.stream_id):
            counts["ranges"] += 1
            for replica in rng.servers:
                key = (replica.server.server_id, replica.server.advertise_addr)
                view = servers.setdefault(key, ServerView(*key))
                view.ranges += 1
                view.open_ranges += int(rng.is_open)
                view.primary_of += int(replica.is_primary)
    for view in servers.values():
        try:
            view.ping_ms = client.range_server(view.address).ping() * 1000.0
        except SbpError as exc:
            view.error = str(exc)
    return {
        "pd": pd_of_client(client),
        "members": members,
        "streams": len(streams),
        "ranges": counts["ranges"],
        "range_servers": [asdict(v) for v in sorted(servers.values(),
                                                    key=lambda v: v.server_id)],
    }


def pd_of_client(client: Any) -> str:
    return ",".join(client.pd.addresses)


def _print(facts: dict[str, Any]) -> None:
    if "streams" in facts:
        print(f"PD {facts['pd']}: {facts['streams']} streams, {facts['ranges']} ranges")
        print()
    print("PD members")
    print_table([[m["name"], m["address"], "leader" if m["leader"] else "follower"]
                 for m in facts["members"]], ["NAME", "ADDRESS", "ROLE"])
    if "range_servers" not in facts:
        return
    print()
    servers = facts["range_servers"]
    if not servers:
        print("Range servers: none holds a range yet (they appear once streams are placed "
              "on them)")
        return
    print("Range servers holding ranges")
    rows = []
    for s in servers:
        state = f"up, ping {s['ping_ms']:.1f} ms" if s["ping_ms"] is not None else (
            f"DOWN: {s['error']}")
        rows.append([str(s["server_id"]), s["address"], str(s["ranges"]),
                     str(s["open_ranges"]), str(s["primary_of"]), state])
    print_table(rows, ["ID", "ADDRESS", "RANGES", "OPEN", "PRIMARY", "STATE"])


@cli_errors
def cluster_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        facts = gather(client, pd_only=args.pd_only)
    if args.json:
        print(json.dumps(facts))
    else:
        _print(facts)
    down = [s for s in facts.get("range_servers", []) if s["ping_ms"] is None]
    return 1 if down else 0


def add_cluster_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp cluster``."""
    p = subparsers.add_parser(
        "cluster", help="show the PD members and the range servers",
        description="Show the PD members (and which leads), and the range servers that hold "
                    "ranges of live streams, with how many ranges each holds and a PING round "
                    "trip. Exits 0 when the PD and every listed range server answer, 1 "
                    "otherwise (usable as a health check). Range-server load metrics are "
                    "not shown: SBP has no request that reads them back from the PD.")
    add_pd_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--pd-only", action="store_true",
                   help="only ask the PD for its members (a quick health check of the PD)")
    p.set_defaults(handler=cluster_command, command="sbp cluster")
