"""``sbp produce``: lines (or whole files) from stdin or files into a stream.

Records are sent as payload=records Arrow batches, the format the Spark connector reads by
default, so ``spark.read.format("sbp")`` shows them as ``key``/``value`` rows.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from .common import (
    CommandError,
    add_pd_argument,
    cli_errors,
    connect,
    more_positionals,
    positive_int,
    stream_arg,
    stream_text,
)
from .progress import Progress

DEFAULT_BATCH_RECORDS = 10_000
DEFAULT_BATCH_BYTES = 1 << 20
# Record batches handed to the stream writer at once: it keeps several APPEND frames in flight,
# so reading the input overlaps with the server storing the previous batches.
BATCHES_PER_APPEND = 8
# From a pipe or terminal, input arriving within this long of a chunk's first bytes joins it
# (up to --batch-bytes); what arrives later goes in the next chunk, sent without waiting.
GATHER_S = 0.05


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
        if name == "-" and sys.stdin is None:
            # Started with stdin closed (`sbp produce 1 <&-`, a daemon without one).
            raise CommandError("stdin is closed: give the input FILEs, or pipe the lines in")
        self.stream: IO[bytes] = sys.stdin.buffer if name == "-" else open(name, "rb")
        self.size = None if name == "-" else os.fstat(self.stream.fileno()).st_size
        self.finished = False  # read to its end

    def ready(self, wait_s: float = 0.0) -> bool:
        """False when a read would wait: a pipe or terminal with nothing in it now (or
        within ``wait_s``)."""
        if self.size is not None:
            return True
        try:
            readable, _, _ = select.select([self.stream], [], [], wait_s)
        except (OSError, ValueError):  # no descriptor to ask (a test's in-memory stdin)
            return True
        return bool(readable)

    def read_chunk(self, size: int) -> bytes:
        """Up to ``size`` bytes (b"" at the end). From a pipe or terminal, what has arrived,
        without waiting for the rest of ``size``: lines typed or piped in as they come are
        sent as they come, not once ``size`` bytes have gathered or the input ended. What
        follows within ``GATHER_S`` joins the chunk, so a fast pipe still fills whole ones."""
        if self.size is not None:
            return self.stream.read(size)
        read_some = getattr(self.stream, "read1", self.stream.read)  # one read of what is there
        parts = [read_some(size)]  # waits for something (or the end)
        got = len(parts[0])
        until = time.monotonic() + GATHER_S
        while parts[-1] and got < size and self.ready(max(until - time.monotonic(), 0.0)):
            parts.append(read_some(size - got))
            got += len(parts[-1])
        return b"".join(parts)

    def close(self) -> None:
        if self.name != "-":
            self.stream.close()


def read_lines(sources: list[_Source], chunk_bytes: int, whole_files: bool,
               counter: list[int]) -> Iterator[tuple[str, int, list[bytes]]]:
    """(input name, number of its first line, lines) for each chunk of about ``chunk_bytes``
    read; newlines are dropped (CR LF too). With ``whole_files`` each input is one "line".
    ``counter[0]`` counts the bytes read so far.

    Reading in chunks and splitting them with ``bytes.split`` keeps Python's per-line work to
    a minimum: a per-line loop was the bottleneck of a multi-million-line input.
    """
    for source in sources:
        label = "stdin" if source.name == "-" else source.name
        if whole_files:
            data = source.stream.read()
            counter[0] += len(data)
            source.finished = True
            yield label, 1, [data]
            continue
        number, rest = 1, b""
        while chunk := source.read_chunk(chunk_bytes):
            counter[0] += len(chunk)
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            if lines:
                yield label, number, _drop_cr(lines)
                number += len(lines)
        source.finished = True
        if rest:
            yield label, number, _drop_cr([rest])


def _drop_cr(lines: list[bytes]) -> list[bytes]:
    if not any(line.endswith(b"\r") for line in lines):
        return lines
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def split_keys(lines: list[bytes], separator: bytes, label: str,
               first: int) -> tuple[list[bytes], list[bytes]]:
    """(keys, values) of lines "KEY<separator>VALUE"; a line without separator is an error."""
    keys, values = [], []
    for number, line in enumerate(lines, start=first):
        key, found, value = line.partition(separator)
        if not found:
            raise ValueError(f"line {number} of {label} has no key separator "
                             f"{separator.decode(errors='replace')!r}")
        keys.append(key)
        values.append(value)
    return keys, values


def record_batches(chunks: Iterable[tuple[str, int, list[bytes]]], separator: bytes | None,
                   fixed_key: bytes | None, batch_records: int) -> Iterator[Any]:
    """Encoded payload=records Arrow batches (envelope + IPC body, ready to append), one or
    more per chunk, each of at most ``batch_records`` records."""
    import pyarrow as pa

    from sbp_spark.protocol.records import encode_arrow_batch, make_records_batch

    for label, first, lines in chunks:
        keys = None
        if separator is not None:
            keys, lines = split_keys(lines, separator, label, first)
        for start in range(0, len(lines), batch_records):
            values = pa.array(lines[start:start + batch_records], pa.binary())
            key_array = None
            if keys is not None:
                key_array = pa.array(keys[start:start + batch_records], pa.binary())
            elif fixed_key is not None:
                key_array = pa.array([fixed_key] * len(values), pa.binary())
            yield encode_arrow_batch(make_records_batch(values, key=key_array))


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
        sizes = [s.size for s in sources if s.size is not None]
        total = sum(sizes) if len(sizes) == len(sources) else None  # None: stdin
        progress = Progress(total)
        counter = [0]
        produced = Produced()
        try:
            with connect(args) as client:
                # An unknown stream (id or name) fails here, before any input is read.
                (stream,) = client.describe_streams([args.stream_id])
                writer = client.open_stream(stream.stream_id)
                pending = []
                chunks = read_lines(sources, args.batch_bytes, args.whole_files, counter)
                for batch in record_batches(chunks, separator, fixed_key, args.batch_records):
                    pending.append(batch)
                    # Send what was read once the input makes us wait (a live pipe), not only
                    # once enough batches gathered.
                    reading = next((s for s in sources if not s.finished), None)
                    if len(pending) >= BATCHES_PER_APPEND or (
                            reading is not None and not reading.ready()):
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
        print(f"produced 0 records to {stream_text(args.stream_id)} (the input was empty)")
    else:
        print(f"produced {produced.records:,} records to {stream_text(args.stream_id)}, offsets "
              f"{produced.first_offset:,} .. {produced.last_offset:,}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp produce``."""
    p = subparsers.add_parser(
        "produce", help="append lines or files to a stream",
        description="Append each input line (without its newline) as one record to STREAM "
                    "(its id or name), reading the FILEs in order, or stdin when none (or '-') "
                    "is given. Records are sent in payload=records Arrow batches. A progress "
                    "line is shown on stderr when it is a terminal.")
    add_pd_argument(p)
    p.add_argument("stream_id", type=stream_arg, metavar="STREAM",
                   help="the stream's id or name")
    p.add_argument("files", nargs="*", metavar="FILE", help="input files ('-' = stdin)")
    more_positionals(p, "files")
    p.add_argument("--key", help="the same key for every record (default: no key)")
    p.add_argument("--key-separator", metavar="SEP",
                   help="split each line at the first SEP into key and value")
    p.add_argument("--whole-files", action="store_true",
                   help="each input file is one record (instead of one record per line)")
    p.add_argument("--batch-records", type=positive_int, default=DEFAULT_BATCH_RECORDS,
                   metavar="N", help=f"most records per batch (default {DEFAULT_BATCH_RECORDS})")
    p.add_argument("--batch-bytes", type=positive_int, default=DEFAULT_BATCH_BYTES,
                   metavar="N", help=f"input bytes read per batch, about the most a batch "
                                     f"holds (default {DEFAULT_BATCH_BYTES})")
    p.set_defaults(handler=produce_command, command="sbp produce")
