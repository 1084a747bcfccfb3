"""``sbp streams list|describe|update|trim|delete`` and ``sbp ranges list|seal``.

(``sbp streams create`` lives in ``sbp_spark.cli`` with the server commands.)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import (
    EXIT_ERROR,
    UsageError,
    add_pd_argument,
    cli_errors,
    connect,
    describe_error,
    more_positionals,
    non_negative_int,
    print_table,
    replicas_arg,
    retention_arg,
    stream_id_arg,
)


def _retention_text(ms: int) -> str:
    return "forever" if ms < 0 else f"{ms} ms"


def _servers_text(rng: Any) -> str:
    return ",".join(
        f"{r.server.server_id}{'*' if r.is_primary else ''}@{r.server.advertise_addr}"
        for r in rng.servers)


def next_offset_of(client: Any, rng: Any) -> int:
    """Where the next record of ``rng`` goes: live from its primary if the range is open."""
    if not rng.is_open:
        return rng.end_offset
    return client.open_range_end(rng)


def _stream_facts(client: Any, stream: Any) -> dict[str, Any]:
    ranges = [] if stream.deleted else client.list_ranges(stream.stream_id)
    next_offset = next_offset_of(client, ranges[-1]) if ranges else stream.start_offset
    return {
        "stream_id": stream.stream_id,
        "replicas": stream.replica_nums,
        "retention_ms": stream.retention_period_ms,
        "start_offset": stream.start_offset,
        "next_offset": next_offset,
        "ranges": len(ranges),
        "deleted": stream.deleted,
    }


def _print_streams(facts: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for item in facts:
            print(json.dumps(item))
        return
    rows = [[str(f["stream_id"]), str(f["replicas"]), _retention_text(f["retention_ms"]),
             f"{f['start_offset']:,}", f"{f['next_offset']:,}", str(f["ranges"]),
             "deleted" if f["deleted"] else ""] for f in facts]
    print_table(rows, ["STREAM", "REPLICAS", "RETENTION", "START", "NEXT", "RANGES", ""])


@cli_errors
def list_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        streams = client.list_streams()
        _print_streams([_stream_facts(client, s) for s in streams], args.json)
    return 0


def _item_failure(error: Exception, stream_id: int, args: argparse.Namespace) -> str:
    """The error line's message for one stream of a batch, naming the stream."""
    message = describe_error(error, args) or str(error)
    return message if str(stream_id) in message else f"stream {stream_id}: {message}"


def _report_failures(failures: list[str], args: argparse.Namespace) -> int:
    """One error line per stream that failed; the exit status."""
    for message in failures:
        print(f"{args.command}: error: {message}", file=sys.stderr)
    return EXIT_ERROR if failures else 0


@cli_errors
def describe_command(args: argparse.Namespace) -> int:
    # Show every stream found and name every id that was not, each id once.
    stream_ids = list(dict.fromkeys(args.stream_ids))
    with connect(args) as client:
        results = client.pd.describe_streams(stream_ids)
        found, failures = [], []
        for stream_id, result in zip(stream_ids, results, strict=True):
            error = result.exception()
            if error is None:
                found.append(result.unwrap())
            else:
                failures.append(_item_failure(error, stream_id, args))
        if found:
            _print_streams([_stream_facts(client, s) for s in found], args.json)
    return _report_failures(failures, args)


@cli_errors
def update_command(args: argparse.Namespace) -> int:
    if args.replicas is None and args.retention_ms is None:
        raise UsageError("nothing to update: give --replicas and/or --retention-ms")
    with connect(args) as client:
        stream = client.update_stream(args.stream_id, replicas=args.replicas,
                                      retention_ms=args.retention_ms)
        _print_streams([_stream_facts(client, stream)], args.json)
    return 0


@cli_errors
def trim_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        stream = client.trim_stream(args.stream_id, args.offset)
        print(f"stream {stream.stream_id} now starts at offset {stream.start_offset:,}")
    return 0


@cli_errors
def delete_command(args: argparse.Namespace) -> int:
    # The PD deletes each stream it can, whatever happens to the others: say which ones it
    # deleted and which it could not, each id once (a repeat would fail as "was deleted").
    stream_ids = list(dict.fromkeys(args.stream_ids))
    with connect(args) as client:
        results = client.pd.delete_streams(stream_ids)
    failures = []
    for stream_id, result in zip(stream_ids, results, strict=True):
        error = result.exception()
        if error is None:
            print(f"deleted stream {stream_id}")
        else:
            failures.append(_item_failure(error, stream_id, args))
    return _report_failures(failures, args)


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
def ranges_list_command(args: argparse.Namespace) -> int:
    # The ranges of every stream found; every id that was not is named, each id once.
    stream_ids = list(dict.fromkeys(args.stream_ids))
    with connect(args) as client:
        results = client.pd.list_ranges(stream_ids)
        facts, failures = [], []
        for stream_id, result in zip(stream_ids, results, strict=True):
            error = result.exception()
            if error is None:
                facts += [_range_facts(client, r) for r in result.unwrap()]
            else:
                failures.append(_item_failure(error, stream_id, args))
        if facts or not failures:
            _print_ranges(facts, args.json)
    return _report_failures(failures, args)


@cli_errors
def ranges_seal_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        new_range = client.seal_range(args.stream_id)
        ranges = client.list_ranges(args.stream_id)
        sealed = [r for r in ranges if r.range_index == new_range.range_index - 1]
        if sealed:
            print(f"sealed range {sealed[0].range_index} of stream {args.stream_id} at offset "
                  f"{sealed[0].end_offset:,}")
        print(f"open range is now {new_range.range_index}, starting at offset "
              f"{new_range.start_offset:,} on servers {_servers_text(new_range)}")
    return 0


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per line instead of a table")


def _named(parser: argparse.ArgumentParser, name: str, handler: Any) -> None:
    parser.set_defaults(handler=handler, command=f"sbp {name}")


def add_stream_commands(streams: argparse._SubParsersAction) -> None:
    """Add list/describe/update/trim/delete to the ``sbp streams`` subparsers."""
    p = streams.add_parser("list", help="list streams with their offsets",
                           description="List every stream that is not deleted, with its "
                                       "settings, start offset, next offset and number of "
                                       "ranges.")
    add_pd_argument(p)
    _json_flag(p)
    _named(p, "streams list", list_command)

    p = streams.add_parser("describe", help="show streams' settings and offsets",
                           description="Show settings, start and next offset and the number "
                                       "of ranges of the given streams.")
    add_pd_argument(p)
    p.add_argument("stream_ids", nargs="+", type=stream_id_arg, metavar="STREAM_ID")
    more_positionals(p, "stream_ids", stream_id_arg)
    _json_flag(p)
    _named(p, "streams describe", describe_command)

    p = streams.add_parser("update", help="change a stream's replicas or retention",
                           description="Change the replica count (for ranges opened from now "
                                       "on) or the retention of a stream.")
    add_pd_argument(p)
    p.add_argument("stream_id", type=stream_id_arg, metavar="STREAM_ID")
    p.add_argument("--replicas", type=replicas_arg, metavar="N",
                   help="replicas of each range opened from now on (1-127)")
    p.add_argument("--retention-ms", type=retention_arg, metavar="MS",
                   help="how long records are kept, -1 = forever")
    _json_flag(p)
    _named(p, "streams update", update_command)

    p = streams.add_parser("trim", help="drop a stream's records below an offset",
                           description="Drop every record of the stream below OFFSET; reads "
                                       "of those offsets then fail with 'offset out of range'.")
    add_pd_argument(p)
    p.add_argument("stream_id", type=stream_id_arg, metavar="STREAM_ID")
    p.add_argument("offset", type=non_negative_int, metavar="OFFSET",
                   help="the stream's new first offset")
    _named(p, "streams trim", trim_command)

    p = streams.add_parser("delete", help="delete streams",
                           description="Delete streams and their data.")
    add_pd_argument(p)
    p.add_argument("stream_ids", nargs="+", type=stream_id_arg, metavar="STREAM_ID")
    more_positionals(p, "stream_ids", stream_id_arg)
    _named(p, "streams delete", delete_command)


def add_ranges_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp ranges list|seal``."""
    ranges = subparsers.add_parser(
        "ranges", help="list or seal the ranges of a stream",
        description="A stream is a sequence of ranges; only the last one is open for appends.")
    sub = ranges.add_subparsers(dest="ranges_command", metavar="{list,seal}", required=True)

    p = sub.add_parser("list", help="list the ranges of streams",
                       description="List each range of the streams: offsets, state (open or "
                                   "sealed) and the range servers holding it.")
    add_pd_argument(p)
    p.add_argument("stream_ids", nargs="+", type=stream_id_arg, metavar="STREAM_ID")
    more_positionals(p, "stream_ids", stream_id_arg)
    _json_flag(p)
    _named(p, "ranges list", ranges_list_command)

    p = sub.add_parser("seal", help="seal the open range and open the next one",
                       description="Seal the stream's open range where it ends now and open a "
                                   "new range (possibly on other range servers) for appends.")
    add_pd_argument(p)
    p.add_argument("stream_id", type=stream_id_arg, metavar="STREAM_ID")
    _named(p, "ranges seal", ranges_seal_command)


