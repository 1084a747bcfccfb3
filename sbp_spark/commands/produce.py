"""``sbp produce``: lines (or whole files) from stdin or files into a stream.

Records are sent as payload=records Arrow batches, the format the Spark connector reads by
default, so ``spark.read.format("sbp")`` shows them as ``key``/``value`` rows.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from .common import add_pd_argument, cli_errors, connect, positive_int, stream_id_arg
from .progress import Progress

DEFAULT_BATCH_RECORDS = 10_000
DEFAULT_BATCH_BYTES = 1 << 20
# Record batches handed to the stream writer at once: it keeps several APPEND frames in flight,
# so reading the input overlaps with the server storing the previous batches.
BATCHES_PER_APPEND = 8


@dataclass
class Produced:
    """What one ``produce`` run appended."""

    records: int = 0
    first_offset: int | None = None
    last_offset: int | None = None

    def add(self, appended: Iterable[Any]) -> None:
        for a in appended:
            self.records += a.record_count
            end = a.base_offset + a.record_count - 1
            self.first_offset = a.base_offset if self.first_offset is None else min(
                self.first_offset, a.base_offset)
            self.last_offset = end if self.last_offset is None else max(self.last_offset, end)


class _Source:
    """An input (a file or stdin) and how many of its bytes have been read."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stream: IO[bytes] = sys.stdin.buffer if name == "-" else open(name, "rb")
        self.size = None if name == "-" else os.fstat(self.stream.fileno()).st_size

    def close(self) -> None:
        if self.name != "-":
            self.stream.close()


def _split_key(line: bytes, separator: bytes | None, where: str) -> tuple[bytes | None, bytes]:
    if separator is None:
        return None, line
    key, found, value = line.partition(separator)
    if not found:
        raise ValueError(f"{where} has no key separator {separator.decode(errors='replace')!r}")
    return key, value


def read_records(sources: list[_Source], separator: bytes | None, whole_files: bool,
                 counter: list[int]) -> Iterator[tuple[bytes | None, bytes]]:
    """(key, value) per input line (newline dropped) or per whole file; counts bytes read."""
    for source in sources:
        label = "stdin" if source.name == "-" else source.name
        if whole_files:
            data = source.stream.read()
            counter[0] += len(data)
            yield None, data
            continue
        for number, line in enumerate(source.stream, start=1):
            counter[0] += len(line)
            if line.endswith(b"\n"):
                line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            yield _split_key(line, separator, f"line {number} of {label}")


def record_batches(records: Iterable[tuple[bytes | None, bytes]], fixed_key: bytes | None,
                   batch_records: int, batch_bytes: int) -> Iterator[Any]:
    """Encoded payload=records Arrow batches (envelope + IPC body, ready to append) of at most
    ``batch_records`` records and about ``batch_bytes`` bytes."""
    import pyarrow as pa

    from sbp_spark.protocol.records import encode_arrow_batch, make_records_batch

    keys: list[bytes | None] = []
    values: list[bytes] = []
    size = 0

    def batch() -> Any:
        key_array = None
        if fixed_key is not None:
            key_array = pa.array([fixed_key] * len(values), pa.binary())
        elif any(k is not None for k in keys):
            key_array = pa.array(keys, pa.binary())
        return encode_arrow_batch(make_records_batch(pa.array(values, pa.binary()),
                                                     key=key_array))

    for key, value in records:
        keys.append(key)
        values.append(value)
        size += len(value) + (len(key) if key else 0)
        if len(values) >= batch_records or size >= batch_bytes:
            yield batch()
            keys, values, size = [], [], 0
    if values:
        yield batch()


@cli_errors
def produce_command(args: argparse.Namespace) -> int:
    separator = args.key_separator.encode() if args.key_separator is not None else None
    fixed_key = args.key.encode() if args.key is not None else None
    if separator is not None and fixed_key is not None:
        raise ValueError("give either --key or --key-separator, not both")
    if args.whole_files and separator is not None:
        raise ValueError("--key-separator splits lines; it cannot be used with --whole-files")
    if separator == b"":
        raise ValueError("--key-separator must not be empty")

    names = args.files or ["-"]
    sources: list[_Source] = []
    try:
        for name in names:
            sources.append(_Source(name))
        sizes = [s.size for s in sources]
        total = None if None in sizes else sum(sizes)
        progress = Progress(total)
        counter = [0]
        produced = Produced()
        try:
            with connect(args) as client:
                # An unknown stream fails here, before any input is read.
                client.describe_streams([args.stream_id])
                writer = client.open_stream(args.stream_id)
                pending = []
                records = read_records(sources, separator, args.whole_files, counter)
                for batch in record_batches(records, fixed_key, args.batch_records,
                                            args.batch_bytes):
                    pending.append(batch)
                    if len(pending) >= BATCHES_PER_APPEND:
                        produced.add(writer.append(pending))
                        pending = []
                        progress.update(counter[0], produced.records)
                if pending:
                    produced.add(writer.append(pending))
        finally:
            progress.close()
    finally:
        for source in sources:
            source.close()

    if produced.records == 0:
        print(f"produced 0 records to stream {args.stream_id} (the input was empty)")
    else:
        print(f"produced {produced.records:,} records to stream {args.stream_id}, offsets "
              f"{produced.first_offset:,} .. {produced.last_offset:,}")
    return 0


def add_produce_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp produce``."""
    p = subparsers.add_parser(
        "produce", help="append lines or files to a stream",
        description="Append each input line (without its newline) as one record to STREAM_ID, "
                    "reading the FILEs in order, or stdin when none (or '-') is given. Records "
                    "are sent in payload=records Arrow batches. A progress line is shown on "
                    "stderr when it is a terminal.")
    add_pd_argument(p)
    p.add_argument("stream_id", type=stream_id_arg, metavar="STREAM_ID")
    p.add_argument("files", nargs="*", metavar="FILE", help="input files ('-' = stdin)")
    p.add_argument("--key", help="the same key for every record (default: no key)")
    p.add_argument("--key-separator", metavar="SEP",
                   help="split each line at the first SEP into key and value")
    p.add_argument("--whole-files", action="store_true",
                   help="each input file is one record (instead of one record per line)")
    p.add_argument("--batch-records", type=positive_int, default=DEFAULT_BATCH_RECORDS,
                   metavar="N", help=f"most records per batch (default {DEFAULT_BATCH_RECORDS})")
    p.add_argument("--batch-bytes", type=positive_int, default=DEFAULT_BATCH_BYTES,
                   metavar="N", help=f"bytes per batch before it is sent "
                                     f"(default {DEFAULT_BATCH_BYTES})")
    p.set_defaults(handler=produce_command, command="sbp produce")
