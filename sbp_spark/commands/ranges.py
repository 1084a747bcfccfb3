"""``sbp ranges list|seal``: the ranges of streams, and sealing a stream's open range."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .common import (
    add_pd_argument,
    cli_errors,
    connect,
    item_failure,
    json_flag,
    more_positionals,
    named,
    print_table,
    report_failures,
    resolve_streams,
    stream_arg,
    stream_text,
)
from .streams import next_offset_of


def _servers_text(rng: Any) -> str:
    return ",".join(
        f"{r.server.server_id}{'*' if r.is_primary else ''}@{r.server.advertise_addr}"
        for r in rng.servers)


def _range_facts(client: Any, rng: Any) -> dict[str, Any]:
    return {
        "stream_id": rng.stream_id,
        "range_index": rng.range_index,
        "start_offset": rng.start_offset,
        "next_offset": next_offset_of(client, rng),
        "end_offset": rng.end_offset,
        "open": rng.is_open,
        "servers": [{"server_id": r.server.server_id, "address": r.server.advertise_addr,
                     "primary": r.is_primary} for r in rng.servers],
    }


def _print_ranges(facts: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for item in facts:
            print(json.dumps(item))
        return
    rows = []
    for f in facts:
        servers = ",".join(f"{s['server_id']}{'*' if s['primary'] else ''}@{s['address']}"
                           for s in f["servers"])
        end = "-" if f["open"] else f"{f['end_offset']:,}"
        rows.append([str(f["stream_id"]), str(f["range_index"]), f"{f['start_offset']:,}",
                     f"{f['next_offset']:,}", end, "open" if f["open"] else "sealed", servers])
    print_table(rows, ["STREAM", "RANGE", "START", "NEXT", "END", "STATE",
                       "SERVERS (*=primary)"])


@cli_errors
def list_command(args: argparse.Namespace) -> int:
    # The ranges of every stream found; every id or name that was not is named, each once.
    with connect(args) as client:
        found, failures = resolve_streams(client, args.stream_ids, args)
        results = client.pd.list_ranges([sid for _, sid in found]) if found else []
        facts = []
        for (ref, _), result in zip(found, results, strict=True):
            error = result.exception()
            if error is None:
                facts += [_range_facts(client, r) for r in result.unwrap()]
            else:
                failures.append(item_failure(error, ref, args))
        if facts or not failures:
            _print_ranges(facts, args.json)
    return report_failures(failures, args)


@cli_errors
def seal_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        stream_id = client.stream_id(args.stream_id)
        new_range = client.seal_range(stream_id)
        ranges = client.list_ranges(stream_id)
        sealed = [r for r in ranges if r.range_index == new_range.range_index - 1]
        if sealed:
            print(f"sealed range {sealed[0].range_index} of {stream_text(args.stream_id)} at "
                  f"offset "
                  f"{sealed[0].end_offset:,}")
        print(f"open range is now {new_range.range_index}, starting at offset "
              f"{new_range.start_offset:,} on servers {_servers_text(new_range)}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp ranges list|seal``."""
    ranges = subparsers.add_parser(
        "ranges", help="list or seal the ranges of a stream",
        description="A stream is a sequence of ranges; only the last one is open for appends.")
    sub = ranges.add_subparsers(dest="ranges_command", metavar="{list,seal}", required=True)

    p = sub.add_parser("list", help="list the ranges of streams",
                       description="List each range of the streams: offsets, state (open or "
                                   "sealed) and the range servers holding it.")
    add_pd_argument(p)
    p.add_argument("stream_ids", nargs="+", type=stream_arg, metavar="STREAM",
                   help="stream ids or names")
    more_positionals(p, "stream_ids", stream_arg)
    json_flag(p)
    named(p, "ranges list", list_command)

    p = sub.add_parser("seal", help="seal the open range and open the next one",
                       description="Seal the stream's open range where it ends now and open a "
                                   "new range (possibly on other range servers) for appends.")
    add_pd_argument(p)
    p.add_argument("stream_id", type=stream_arg, metavar="STREAM",
                   help="the stream's id or name")
    named(p, "ranges seal", seal_command)
