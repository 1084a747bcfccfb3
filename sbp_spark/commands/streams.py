"""``sbp streams create|list|describe|update|trim|delete``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sbp_spark.protocol.constants import MAX_REPLICAS
from sbp_spark.protocol.names import NAME_RULE, check_name

from .common import (
    MAX_INT64,
    UsageError,
    add_pd_argument,
    cli_errors,
    connect,
    int_in,
    item_failure,
    json_flag,
    more_positionals,
    named,
    non_negative_int,
    print_table,
    replicas_arg,
    report_failures,
    resolve_streams,
    retention_arg,
    stream_arg,
    stream_text,
    usage,
)

# Streams one CREATE_STREAMS of `sbp streams create` asks for: the PD stores and places each
# stream before it answers, so a request for many at once would outlast the client's timeout
# (20,000 did) with nothing printed of what was made.
CREATE_CHUNK = 100
MAX_CREATE_COUNT = 1_000_000


def _retention_text(ms: int) -> str:
    return "forever" if ms < 0 else f"{ms} ms"


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
        "name": stream.name,
        "replicas": stream.replica_nums,
        "retention_ms": stream.retention_period_ms,
        "start_offset": stream.start_offset,
        "next_offset": next_offset,
        "ranges": len(ranges),
        "deleted": stream.deleted,
        "retain_for_consumers": stream.retain_for_consumers,
        "retain_cap_bytes": stream.retain_cap_bytes,
        "retain_cap_ms": stream.retain_cap_ms,
    }


def _print_streams(facts: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for item in facts:
            print(json.dumps(item))
        return
    rows = [[str(f["stream_id"]), f["name"], str(f["replicas"]),
             _retention_text(f["retention_ms"]), f"{f['start_offset']:,}",
             f"{f['next_offset']:,}", str(f["ranges"]), "deleted" if f["deleted"] else ""]
            for f in facts]
    print_table(rows, ["STREAM", "NAME", "REPLICAS", "RETENTION", "START", "NEXT", "RANGES",
                       ""])


@cli_errors
def create_command(args: argparse.Namespace) -> int:
    names = args.names
    if names:
        if len(set(names)) != len(names):
            raise UsageError("a --name is given twice: names are unique")
        if args.count not in (None, len(names)):
            raise UsageError(f"--count {args.count} differs from the {len(names)} --name "
                             "given: leave --count out")
    with connect(args) as client:
        if names:
            for name in names:  # one at a time: the id of each is printed once it exists
                print(client.create_stream(name, replicas=args.replicas,
                                           retention_ms=args.retention_ms).stream_id,
                      flush=True)
            return 0
        left = args.count or 1
        while left:
            streams = client.create_streams(count=min(left, CREATE_CHUNK),
                                            replicas=args.replicas,
                                            retention_ms=args.retention_ms)
            for stream in streams:
                print(stream.stream_id, flush=True)
            left -= len(streams)
    return 0


@cli_errors
def list_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        streams = client.list_streams()
        _print_streams([_stream_facts(client, s) for s in streams], args.json)
    return 0


@cli_errors
def describe_command(args: argparse.Namespace) -> int:
    # Show every stream found and name every id or name that was not, each once.
    refs = list(dict.fromkeys(args.stream_ids))
    ids = [r for r in refs if isinstance(r, int)]
    names = [r for r in refs if isinstance(r, str)]
    with connect(args) as client:
        answers = dict(zip([*ids, *names], client.pd.describe_streams(ids, names),
                           strict=True))
        found, failures = [], []
        for stream_id in refs:
            result = answers[stream_id]
            error = result.exception()
            if error is None:
                found.append(result.unwrap())
            else:
                failures.append(item_failure(error, stream_id, args))
        if found:
            _print_streams([_stream_facts(client, s) for s in found], args.json)
    return report_failures(failures, args)


@cli_errors
def update_command(args: argparse.Namespace) -> int:
    if (args.replicas is None and args.retention_ms is None and args.retain is None
            and args.retain_cap_bytes is None and args.retain_cap_ms is None):
        raise UsageError("nothing to update: give --replicas, --retention-ms and/or "
                         "--retain-for-consumers (with --retain-cap-bytes/--retain-cap-ms)")
    if args.retain is False and (args.retain_cap_bytes is not None
                                 or args.retain_cap_ms is not None):
        raise UsageError("--retain-cap-bytes and --retain-cap-ms bound "
                         "--retain-for-consumers: not with --no-retain-for-consumers")
    with connect(args) as client:
        stream = client.update_stream(args.stream_id, replicas=args.replicas,
                                      retention_ms=args.retention_ms,
                                      retain_for_consumers=args.retain,
                                      retain_cap_bytes=args.retain_cap_bytes,
                                      retain_cap_ms=args.retain_cap_ms)
        _print_streams([_stream_facts(client, stream)], args.json)
    return 0


@cli_errors
def trim_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        stream = client.trim_stream(args.stream_id, args.offset)
        print(f"{stream_text(args.stream_id)} now starts at offset {stream.start_offset:,}")
    return 0


@cli_errors
def delete_command(args: argparse.Namespace) -> int:
    # The PD deletes each stream it can, whatever happens to the others: say which ones it
    # deleted and which it could not, each once (a repeat would fail as "was deleted").
    with connect(args) as client:
        found, failures = resolve_streams(client, args.stream_ids, args)
        results = client.pd.delete_streams([sid for _, sid in found]) if found else []
    for (ref, stream_id), result in zip(found, results, strict=True):
        error = result.exception()
        if error is None:
            named_as = "" if isinstance(ref, int) else f" ({ref})"
            print(f"deleted stream {stream_id}{named_as}")
        else:
            failures.append(item_failure(error, ref, args))
    return report_failures(failures, args)


def _name_arg(text: str) -> str:
    try:
        return check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _create_retention_ms(text: str) -> int:
    value = int_in(1, also=(-1,))(text)
    if value > MAX_INT64:  # a signed 64-bit integer on the wire
        raise argparse.ArgumentTypeError(f"{value} must be at most {MAX_INT64}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp streams`` and its commands."""
    parser = subparsers.add_parser("streams", help="create and manage streams",
                                   description="Create and manage streams.")
    streams = parser.add_subparsers(title="commands", metavar="COMMAND")
    parser.set_defaults(handler=lambda _args: usage(parser))

    p = streams.add_parser(
        "create", help="create streams and print their ids",
        description="Create streams; prints each new stream id on its own line. A stream "
                    "may have a name, unique among the streams of the cluster, that every "
                    f"command takes in place of its id: a name is {NAME_RULE}.")
    add_pd_argument(p)
    p.add_argument("--replicas", type=int_in(1, MAX_REPLICAS), default=1, metavar="N",
                   help="range servers holding each range (default 1)")
    p.add_argument("--retention-ms", type=_create_retention_ms, default=-1,
                   metavar="MS", help="keep records this long (default -1: forever)")
    p.add_argument("--name", dest="names", action="append", type=_name_arg, metavar="NAME",
                   help="the stream's name (repeat for several streams, one per name)")
    p.add_argument("--count", type=int_in(1, MAX_CREATE_COUNT), default=None, metavar="K",
                   help=f"how many streams to create (default 1, at most "
                        f"{MAX_CREATE_COUNT:,}); asked of the PD {CREATE_CHUNK} at a "
                        "time, each id printed once its stream exists")
    named(p, "streams create", create_command)

    p = streams.add_parser("list", help="list streams with their offsets",
                           description="List every stream that is not deleted, with its "
                                       "settings, start offset, next offset and number of "
                                       "ranges.")
    add_pd_argument(p)
    json_flag(p)
    named(p, "streams list", list_command)

    p = streams.add_parser("describe", help="show streams' settings and offsets",
                           description="Show settings, start and next offset and the number "
                                       "of ranges of the given streams.")
    add_pd_argument(p)
    p.add_argument("stream_ids", nargs="+", type=stream_arg, metavar="STREAM")
    more_positionals(p, "stream_ids", stream_arg)
    json_flag(p)
    named(p, "streams describe", describe_command)

    p = streams.add_parser("update", help="change a stream's replicas or retention",
                           description="Change the replica count (for ranges opened from now "
                                       "on) or the retention of a stream.")
    add_pd_argument(p)
    p.add_argument("stream_id", type=stream_arg, metavar="STREAM",
                   help="the stream's id or name")
    p.add_argument("--replicas", type=replicas_arg, metavar="N",
                   help="replicas of each range opened from now on (1-127)")
    p.add_argument("--retention-ms", type=retention_arg, metavar="MS",
                   help="how long records are kept, -1 = forever")
    retain = p.add_mutually_exclusive_group()
    retain.add_argument("--retain-for-consumers", dest="retain", action="store_const",
                        const=True, default=None,
                        help="keep the records the stream's named consumers have not read "
                             "past the retention period and trims (up to the caps)")
    retain.add_argument("--no-retain-for-consumers", dest="retain", action="store_const",
                        const=False, help="let retention and trims ignore consumers again")
    p.add_argument("--retain-cap-bytes", type=int_in(1, MAX_INT64, also=(-1,)), metavar="BYTES",
                   help="past this many bytes held for consumers on a range server, the "
                        "cap wins and the oldest go (-1 = no cap)")
    p.add_argument("--retain-cap-ms", type=int_in(1, MAX_INT64, also=(-1,)), metavar="MS",
                   help="records older than this go whatever consumers have read (-1 = no "
                        "cap)")
    json_flag(p)
    named(p, "streams update", update_command)

    p = streams.add_parser("trim", help="drop a stream's records below an offset",
                           description="Drop every record of the stream below OFFSET; reads "
                                       "of those offsets then fail with 'offset out of range'.")
    add_pd_argument(p)
    p.add_argument("stream_id", type=stream_arg, metavar="STREAM",
                   help="the stream's id or name")
    p.add_argument("offset", type=non_negative_int, metavar="OFFSET",
                   help="the stream's new first offset")
    named(p, "streams trim", trim_command)

    p = streams.add_parser("delete", help="delete streams",
                           description="Delete streams and their data.")
    add_pd_argument(p)
    p.add_argument("stream_ids", nargs="+", type=stream_arg, metavar="STREAM")
    more_positionals(p, "stream_ids", stream_arg)
    named(p, "streams delete", delete_command)
