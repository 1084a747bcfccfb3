"""``sbp consumers list|describe|delete``: the named consumers the PD records and how far
behind each is on each stream."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

from sbp_spark.client.consumers import consumer_lag

from .common import (
    add_pd_argument,
    cli_errors,
    connect,
    json_flag,
    more_positionals,
    named,
    print_table,
    report_failures,
    usage,
)


def _facts(client: Any, consumer: Any, names: dict[int, str]) -> dict[str, Any]:
    streams = []
    for lag in consumer_lag(client, consumer):
        streams.append({
            "stream_id": lag.stream_id,
            "stream_name": names.get(lag.stream_id, ""),
            "committed_offset": lag.committed_offset,
            "end_offset": lag.end_offset,
            "records_behind": lag.records_behind,
            "time_behind_ms": lag.time_behind_ms,
            "last_commit_ms": lag.commit_time_ms,
            "lost_records": lag.lost,
        })
    return {"name": consumer.name, "generation": consumer.generation,
            "created_ms": consumer.created_ms, "streams": streams}


def _when(ms: int) -> str:
    if ms < 0:
        return "-"
    when = dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


def _print(facts: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for item in facts:
            print(json.dumps(item))
        return
    rows = []
    for f in facts:
        if not f["streams"]:
            rows.append([f["name"], str(f["generation"]), "-", "", "", "", "", "-", ""])
        for s in f["streams"]:
            stream = str(s["stream_id"]) + (f" ({s['stream_name']})" if s["stream_name"] else "")
            behind_ms = "?" if s["time_behind_ms"] < 0 else f"{s['time_behind_ms']:,}"
            lost = f"lost {s['lost_records']:,}" if s["lost_records"] else ""
            rows.append([f["name"], str(f["generation"]), stream,
                         f"{s['committed_offset']:,}", f"{s['end_offset']:,}",
                         f"{s['records_behind']:,}", behind_ms, _when(s["last_commit_ms"]),
                         lost])
    print_table(rows, ["CONSUMER", "GENERATION", "STREAM", "COMMITTED", "END", "BEHIND",
                       "BEHIND_MS", "LAST_COMMIT", ""])


def _stream_names(client: Any) -> dict[int, str]:
    return {s.stream_id: s.name for s in client.list_streams()}


@cli_errors
def list_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        found = client.consumers.list_all()
        names = _stream_names(client) if found else {}
        _print([_facts(client, c, names) for c in found], args.json)
    return 0


@cli_errors
def describe_command(args: argparse.Namespace) -> int:
    wanted = list(dict.fromkeys(args.names))
    with connect(args) as client:
        results = client.consumers.describe(wanted)
        names = _stream_names(client)
        found: list[dict[str, Any]] = []
        failures: list[str] = []
        for name, result in zip(wanted, results, strict=True):
            error = result.exception()
            if error is None:
                found.append(_facts(client, result.unwrap(), names))
            else:
                failures.append(f"consumer {name!r}: {error}" if name not in str(error)
                                else str(error))
        if found:
            _print(found, args.json)
    return report_failures(failures, args)


@cli_errors
def delete_command(args: argparse.Namespace) -> int:
    wanted = list(dict.fromkeys(args.names))
    with connect(args) as client:
        results = client.consumers.delete(wanted)
    failures: list[str] = []
    for name, result in zip(wanted, results, strict=True):
        error = result.exception()
        if error is None:
            print(f"deleted consumer {name}")
        else:
            failures.append(str(error) if name in str(error) else f"consumer {name!r}: {error}")
    return report_failures(failures, args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp consumers`` and its commands."""
    parser = subparsers.add_parser(
        "consumers", help="see named consumers and their lag",
        description="Named consumers: the positions streaming queries (option consumer) "
                    "record in the cluster, and how far behind the streams' ends they are.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    parser.set_defaults(handler=lambda _args: usage(parser))

    p = commands.add_parser(
        "list", help="list consumers with their lag per stream",
        description="List every consumer with, per stream it recorded, the committed offset, "
                    "the stream's end offset, the records and the time behind (from the "
                    "records' timestamps: the newest one's minus the first unread one's), "
                    "the last commit time and the generation.")
    add_pd_argument(p)
    json_flag(p)
    named(p, "consumers list", list_command)

    p = commands.add_parser("describe", help="show consumers' positions and lag",
                            description="As list, for the consumers named.")
    add_pd_argument(p)
    p.add_argument("names", nargs="+", metavar="NAME")
    more_positionals(p, "names", str)
    json_flag(p)
    named(p, "consumers describe", describe_command)

    p = commands.add_parser("delete", help="forget consumers",
                            description="Forget consumers and their positions; a query still "
                                        "running under the name is fenced from then on.")
    add_pd_argument(p)
    p.add_argument("names", nargs="+", metavar="NAME")
    more_positionals(p, "names", str)
    named(p, "consumers delete", delete_command)
