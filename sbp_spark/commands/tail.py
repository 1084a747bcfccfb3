"""``sbp tail``: print a stream's records from an offset, and with ``-f`` keep following it.

Values are written as they are stored, one per line. Following waits on the open range with a
long-polling FETCH (``max_wait_ms``), so new records show up as soon as they are appended, and
moves on to the next range when the PD seals the one being read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

from sbp_spark.protocol.errors import SbpError, ServerError

from .common import CommandError, add_pd_argument, cli_errors, connect, stream_arg
from .streams import next_offset_of

DEFAULT_WAIT_MS = 1_000
# Pause before asking the PD again after a range was sealed under a reader, so a PD that has
# not caught up yet is not asked in a tight loop.
METADATA_RETRY_S = 0.05
# While following, a range server that cannot be reached (restarting, failing over) is tried
# again, via the PD, after this long, doubling up to the most.
UNREACHABLE_RETRY_S = 0.1
UNREACHABLE_RETRY_MAX_S = 2.0


def from_arg(text: str) -> str | int:
    """argparse type for ``--from``: earliest, latest, an offset N, or -N (N before the end)."""
    value = text.strip().lower()
    if value in ("earliest", "latest"):
        return value
    if re.fullmatch(r"-0+", value):
        return "latest"  # 0 records before the end (as an int, -0 would be offset 0)
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not earliest, latest, an offset N or -N (N records before the end)")


def iter_records(batch: Any) -> Iterator[tuple[int, bytes | None, bytes]]:
    """(offset, key, value) of every record of one fetched batch.

    payload=arrow batches (a DataFrame's own columns) come out as one JSON object per row;
    payload=records keys and values stored as text come out UTF-8 encoded.
    """
    from sbp_spark.protocol.records import (
        ENVELOPE_SIZE,
        PAYLOAD_RECORDS,
        BodyFormat,
        body_to_arrow,
        payload_kind,
    )

    header = batch.header
    body = batch.data[ENVELOPE_SIZE:]
    if header.body_format == BodyFormat.OPAQUE:
        yield header.base_offset, None, bytes(body)
        return
    table = body_to_arrow(body)
    if payload_kind(table.schema) == PAYLOAD_RECORDS:
        keys = _bytes_column(batch, table, "key")
        values = _bytes_column(batch, table, "value")
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            yield header.base_offset + i, key, value if value is not None else b""
        return
    for i, row in enumerate(table.to_pylist()):
        yield header.base_offset + i, None, json.dumps(row, default=str).encode()


def _bytes_column(batch: Any, table: Any, name: str) -> list[bytes | None]:
    """A payload=records column's values as bytes: binary as stored, text (which foreign
    writers may store) UTF-8 encoded. A batch without keys has None for each."""
    import pyarrow as pa

    index = table.schema.get_field_index(name)
    where = (f"the payload=records batch of stream {batch.stream_id} at offset "
             f"{batch.header.base_offset}")
    if index < 0:
        if name == "key" and name not in table.schema.names:
            return [None] * table.num_rows
        raise CommandError(f"{where} has no single {name!r} column")
    column = table.column(index)
    kind = column.type
    types = pa.types
    if types.is_string(kind) or types.is_large_string(kind) or types.is_string_view(kind):
        return [None if v is None else v.encode() for v in column.to_pylist()]
    if (types.is_binary(kind) or types.is_large_binary(kind) or types.is_binary_view(kind)
            or types.is_fixed_size_binary(kind)):
        return column.to_pylist()
    raise CommandError(f"{where} has a {name!r} column of type {kind}: only binary or "
                       f"string columns can be printed")


class _Printer:
    def __init__(self, out: IO[bytes], offsets: bool, keys: bool, limit: int | None) -> None:
        self.out, self.offsets, self.keys, self.limit = out, offsets, keys, limit
        self.printed = 0

    @property
    def done(self) -> bool:
        return self.limit is not None and self.printed >= self.limit

    def record(self, offset: int, key: bytes | None, value: bytes) -> None:
        if self.offsets:
            self.out.write(b"%d\t" % offset)
        if self.keys:
            self.out.write((key or b"") + b"\t")
        self.out.write(value + b"\n")
        self.printed += 1


def _find_range(ranges: list[Any], offset: int) -> Any | None:
    for rng in ranges:
        if rng.start_offset <= offset and (rng.is_open or offset < rng.end_offset):
            return rng
    return None


def resolve_start(client: Any, stream_id: int, start: str | int) -> tuple[int, int]:
    """(first offset to print, the stream's next offset) for ``--from``."""
    (stream,) = client.describe_streams([stream_id])
    ranges = client.list_ranges(stream_id)
    first = max(stream.start_offset, ranges[0].start_offset) if ranges else stream.start_offset
    end = next_offset_of(client, ranges[-1]) if ranges else first
    if start == "earliest":
        return first, end
    if start == "latest":
        return end, end
    assert isinstance(start, int)
    if start < 0:
        return max(first, end + start), end
    if start < first:
        raise CommandError(f"offset {start} of stream {stream_id} was trimmed away: the stream "
                           f"starts at {first}")
    if start > end:
        raise CommandError(f"offset {start} is beyond the end of stream {stream_id} (its next "
                           f"offset is {end})")
    return start, end


class _Unreachable:
    """The waits of ``follow`` while the range being read cannot be reached."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.retry_s = 0.0

    def wait(self, exc: SbpError) -> None:
        if not self.retry_s:
            print(f"sbp tail: {exc}; waiting for stream {self.stream_id} to be readable again",
                  file=sys.stderr, flush=True)
        self.retry_s = min(max(self.retry_s * 2, UNREACHABLE_RETRY_S), UNREACHABLE_RETRY_MAX_S)
        time.sleep(self.retry_s)

    def over(self) -> None:
        if self.retry_s:
            print(f"sbp tail: stream {self.stream_id} is readable again", file=sys.stderr,
                  flush=True)
            self.retry_s = 0.0


def follow(client: Any, stream_id: int, offset: int, stop_at: int | None, wait_ms: int,
           printer: _Printer) -> None:
    """Print records from ``offset``; stop before ``stop_at`` (None = follow for ever).

    Following, a range server that cannot be reached is waited for (said once on stderr):
    a restart or a failover must not end ``tail -f``. The PD is asked where the range is
    before each try, so a server back on another port is found; a PD that cannot be reached
    ends it."""
    unreachable = _Unreachable(stream_id)
    while not printer.done and (stop_at is None or offset < stop_at):
        rng = _find_range(client.list_ranges(stream_id), offset)
        if rng is None:
            raise CommandError(f"no range of stream {stream_id} holds offset {offset} (trimmed "
                               "or deleted while reading)")
        waiting = stop_at is None and rng.is_open
        progressed = False
        try:
            for batch in client.fetch(rng, offset,
                                      end_offset=-1 if stop_at is None else stop_at,
                                      max_wait_ms=wait_ms if waiting else 0):
                for record_offset, key, value in iter_records(batch):
                    if record_offset < offset:
                        continue
                    if stop_at is not None and record_offset >= stop_at:
                        break
                    printer.record(record_offset, key, value)
                    if printer.done:
                        break
                offset = max(offset, batch.header.end_offset)
                progressed = True
                printer.out.flush()
                if printer.done:
                    return
        except SbpError as exc:
            if isinstance(exc, ServerError) and exc.invalid_metadata:
                # The range was sealed or moved while being read: ask the PD again.
                if not progressed:
                    time.sleep(METADATA_RETRY_S)
                continue
            # Following, what may pass (a server restarting or shutting down) is waited out.
            if stop_at is not None or not exc.retriable:
                raise
            unreachable.wait(exc)
            continue
        unreachable.over()
        if not progressed and not waiting and rng.is_open:
            return  # caught up with an open range and not following


@cli_errors
def tail_command(args: argparse.Namespace) -> int:
    if args.max is not None and args.max < 1:
        raise ValueError("--max must be >= 1")
    if args.wait_ms < 1:
        raise ValueError("--wait-ms must be >= 1")
    printer = _Printer(sys.stdout.buffer, args.print_offsets, args.print_keys, args.max)
    with connect(args) as client:
        stream_id = client.stream_id(args.stream_id)
        offset, end = resolve_start(client, stream_id, args.start)
        try:
            follow(client, stream_id, offset, None if args.follow else end, args.wait_ms,
                   printer)
        finally:
            sys.stdout.buffer.flush()
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp tail``."""
    p = subparsers.add_parser(
        "tail", help="print a stream's records (and follow it with -f)",
        description="Print the values of a stream's records, one per line, from --from up to "
                    "the stream's current end; with -f keep waiting for new records, like "
                    "tail -f. payload=arrow records are printed as JSON objects.")
    add_pd_argument(p)
    p.add_argument("stream_id", type=stream_arg, metavar="STREAM",
                   help="the stream's id or name")
    p.add_argument("--from", dest="start", type=from_arg, default="earliest",
                   metavar="earliest|latest|N|-N",
                   help="first record: the stream's first (default), its end, offset N, or "
                        "N records before the end")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing new records as they are appended, waiting out range "
                        "server restarts (Ctrl-C to stop)")
    p.add_argument("-n", "--max", type=int, metavar="N", help="stop after N records")
    p.add_argument("--print-offsets", action="store_true",
                   help="start each line with the record's offset and a tab")
    p.add_argument("--print-keys", action="store_true",
                   help="print the record's key and a tab before its value")
    p.add_argument("--wait-ms", type=int, default=DEFAULT_WAIT_MS, metavar="MS",
                   help=f"how long one long-poll waits for new records when following "
                        f"(default {DEFAULT_WAIT_MS})")
    p.set_defaults(handler=tail_command, command="sbp tail")
