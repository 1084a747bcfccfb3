"""Offsets by time: the first record at or after a timestamp, found without a time index.

SBP stores no time index, so the search probes the stream: a FETCH at an offset with a one-byte
budget returns exactly the stored batch holding that offset (a server always sends the first
batch whole), so one probe costs one batch. A binary search over offsets, keyed on the latest
record timestamp of each probed batch, ends in the batch holding the answer, and the answer is
the first record of that batch at or after the time, exact per record.

A record's timestamp is its ``timestamp`` column when its batch is a payload=records Arrow body
that has one (a null falls back to the batch's), else the batch's ``base_timestamp_ms``: what a
reader shows in its ``timestamp`` column.

What the search returns is Kafka's answer (the earliest offset whose timestamp is at or after
the time, which is where the running maximum of the timestamps reaches it) whenever the latest
timestamp of each batch is no earlier than that of the batches stored before it; records inside
a batch may be in any order and before or after its base timestamp. Where batches run back in
time across the asked time, no search short of reading every batch can know of an earlier
record at or after it: the search then returns one of the places where the timestamps cross
the time (a record at or after it whose earlier records in its batch, and whose preceding
probed batch, are all before it).

Records a range server no longer holds (trimmed, or expired by retention, which range servers
report to the PD a moment after deleting them) are not there: a probe that lands below a range's
retained start goes on from that start, learnt from the range's replicas.
"""

from __future__ import annotations

import bisect
from collections.abc import Generator, Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc

from sbp_spark.protocol.errors import OffsetOutOfRangeError, ReplicaBehindError
from sbp_spark.protocol.messages import Range
from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    PAYLOAD_RECORDS,
    BatchHeader,
    BodyFormat,
    body_to_arrow,
    floor_timestamps,
    payload_kind,
)

from .types import FetchedBatch

_MS = pa.timestamp("ms")


def record_timestamps_ms(header: BatchHeader, batch: memoryview) -> pa.Array:
    """The timestamps (int64 ms since the epoch) of the records of one stored batch
    (``batch`` = envelope + body), in offset order."""
    base = header.base_timestamp_ms
    if header.body_format == BodyFormat.ARROW:
        body = body_to_arrow(batch[ENVELOPE_SIZE:ENVELOPE_SIZE + header.body_length])
        if (payload_kind(body.schema) == PAYLOAD_RECORDS
                and "timestamp" in body.schema.names):
            column = body.column(body.schema.get_field_index("timestamp"))
            if pa.types.is_timestamp(column.type):
                # Floored to whole ms (as readers floor ns to us): comparing the floor with a
                # time in whole ms gives the same answer as comparing the value itself (a cut
                # toward zero would not before 1970: -0.5 ms is before 0 ms).
                millis = floor_timestamps(column, "ms").cast(_MS)
                return millis.cast(pa.int64()).fill_null(base)
    return pa.repeat(pa.scalar(base, pa.int64()), header.record_count)


@dataclass(frozen=True)
class TimeSearchResult:
    """Where a time falls in a stream: ``offset`` is the first record at or after it (None when
    no record in the searched offsets is); ``fetches`` counts the batches probed;
    ``disorder_ms`` is how far, at most, a probed record's timestamp lies behind one stored
    before it, in its own batch or an earlier probed one (0: the probes saw time only move
    forward). It is a sample, not a bound: records never probed may lie further back."""

    offset: int | None
    fetches: int
    disorder_ms: int = 0


@dataclass(frozen=True)
class _Span:
    range: Range
    start: int
    end: int


def range_end(rng: Range) -> int:
    """The offset after a range's last record: its end once sealed, else its ``next_offset``
    (which the caller fixed to the snapshot it reads)."""
    return rng.next_offset if rng.is_open else rng.end_offset


class BatchSource(Protocol):
    """What the search reads through (an ``SbpClient``): one range's batches from an offset,
    and where a range's replicas still hold records."""

    def fetch(self, range: Range, start_offset: int, end_offset: int = -1,
              max_bytes: int = ...) -> Generator[FetchedBatch, None, None]: ...

    def retained_start(self, stream_id: int, range_index: int, addresses: Iterable[str]
                       ) -> int | None: ...


class TimeSearch:
    """Searches one stream's ranges (in offset order; an open one with ``next_offset`` set to
    where the caller reads up to) through ``client`` (an ``SbpClient``)."""

    def __init__(self, client: BatchSource, ranges: Sequence[Range]) -> None:
        self.client = client
        self.spans = [_Span(r, r.start_offset, range_end(r)) for r in ranges
                      if range_end(r) > r.start_offset]
        self._starts = [s.start for s in self.spans]

    def first_at_or_after(self, timestamp_ms: int, start: int, end: int,
                          anchor: bool = False) -> TimeSearchResult:
        """The first record in offsets ``[start, end)`` whose timestamp is at or after
        ``timestamp_ms``. ``anchor`` also probes the span's first batch, so that
        ``disorder_ms`` sees records stored after later ones (a backfill) even when the
        search itself never goes back to the start."""
        # Ranges follow each other without gaps: only offsets below the first one (trimmed)
        # or past the last one are held by none.
        left = max(start, self.spans[0].start) if self.spans else end
        right = min(end, self.spans[-1].end) if self.spans else end
        found: int | None = None
        fetches = 0
        threshold = pa.scalar(timestamp_ms, pa.int64())
        probes: list[tuple[int, int, int, int]] = []  # see _probe
        while anchor and left < right:
            fetches += 1
            try:
                batch = self._batch_at(left)
            except _Expired as expired:
                left = expired.start
                continue
            probes.append(_probe(batch, record_timestamps_ms(batch.header, batch.data)))
            break
        while left < right:
            fetches += 1
            try:
                batch = self._batch_at(left + (right - left) // 2)
            except _Expired as expired:
                left = expired.start  # the records below it are gone: the answer is not there
                continue
            first = max(batch.header.base_offset, left)
            last = min(batch.header.end_offset, right)
            every = record_timestamps_ms(batch.header, batch.data)
            probes.append(_probe(batch, every))
            stamps = every.slice(first - batch.header.base_offset, last - first)
            index = pc.index(pc.greater_equal(stamps, threshold), True).as_py()
            if index >= 0:
                found = first + index
                right = first  # the batch's earlier records are before the time
            else:
                left = last
        return TimeSearchResult(found, fetches, _disorder_ms(probes))

    def _batch_at(self, offset: int) -> FetchedBatch:
        """The stored batch holding ``offset``; raises ``_Expired`` when its range's replicas
        no longer hold it."""
        span = self.spans[bisect.bisect_right(self._starts, offset) - 1]
        try:
            with closing(self.client.fetch(span.range, offset, span.end, max_bytes=1)
                         ) as batches:
                for batch in batches:
                    return batch
        except OffsetOutOfRangeError:
            rng = span.range
            start = self.client.retained_start(
                rng.stream_id, rng.range_index,
                [replica.server.advertise_addr for replica in rng.servers])
            if start is None or start <= offset:
                raise
            raise _Expired(start) from None
        raise ReplicaBehindError(
            f"range {span.range.range_index} of stream {span.range.stream_id} returned no "
            f"batch at offset {offset}, though it holds records up to {span.end}")


class _Expired(Exception):
    """The probed offset lies below ``start``, the first its range still holds."""

    def __init__(self, start: int) -> None:
        super().__init__(start)
        self.start = start


def _probe(batch: FetchedBatch, stamps: pa.Array) -> tuple[int, int, int, int]:
    """(base offset, earliest and latest timestamp, how far a record lies behind the latest
    one before it in the batch) of a probed batch."""
    bounds = pc.min_max(stamps)
    behind = pc.max(pc.subtract(pc.cumulative_max(stamps), stamps)).as_py() or 0
    return batch.header.base_offset, bounds["min"].as_py(), bounds["max"].as_py(), behind


def _disorder_ms(probes: list[tuple[int, int, int, int]]) -> int:
    """How far the probes saw a timestamp lie behind the latest one stored before it: in its
    own batch, or in an earlier probed batch."""
    worst, latest = 0, None
    for _, earliest, last, behind in sorted(set(probes)):  # a batch may be probed twice
        worst = max(worst, behind)
        if latest is not None:
            worst = max(worst, latest - earliest)
        latest = last if latest is None else max(latest, last)
    return worst


__all__ = ["BatchSource", "TimeSearch", "TimeSearchResult", "range_end", "record_timestamps_ms"]
