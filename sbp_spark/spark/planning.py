"""Planning a batch read: from the streams' ranges to Spark input partitions (pure functions).

The driver describes each stream as a ``StreamLayout`` (its ranges, with the open range's end
already fixed to a snapshot, so the whole job reads one consistent cut) and ``plan_partitions``
turns the layouts, the offset options and the pushed filters into small picklable partitions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pyspark.sql.datasource import InputPartition

from sbp_spark.client import ReplicaLocation

from .filters import Interval, Predicate, PushedFilters, intersect_intervals
from .options import EARLIEST, LATEST, OptionError, ReadOptions

# A range cut by an IN filter on offset into more pieces than this is read as one partition
# over the pieces' hull, with the IN applied to the rows instead (each task costs ~27 ms).
MAX_PIECES_PER_RANGE = 64


@dataclass(frozen=True)
class RangeLayout:
    """One range as planning sees it; ``end_offset`` is fixed (a snapshot for the open range)."""

    range_index: int
    start_offset: int
    end_offset: int
    replicas: tuple[ReplicaLocation, ...]
    is_open: bool = False


@dataclass(frozen=True)
class StreamLayout:
    """A stream's ranges in offset order; ``start_offset`` is the first offset still stored."""

    stream_id: int
    start_offset: int
    ranges: tuple[RangeLayout, ...]

    @property
    def end_offset(self) -> int:
        return self.ranges[-1].end_offset if self.ranges else self.start_offset


@dataclass(frozen=True)
class SbpPartition(InputPartition):
    """One Spark task: records [start_offset, end_offset) of one range.

    Carries the range's replicas (primary first) so executors need no PD round trip, and the
    row predicates reading must apply.
    """

    stream_id: int
    range_index: int
    start_offset: int
    end_offset: int
    range_start: int
    range_end: int
    replicas: tuple[ReplicaLocation, ...]
    range_is_open: bool = False
    row_predicates: tuple[Predicate, ...] = ()

    @property
    def record_count(self) -> int:
        return self.end_offset - self.start_offset

    def describe(self) -> str:
        return (f"stream {self.stream_id} range {self.range_index} "
                f"offsets [{self.start_offset}, {self.end_offset})")


def named_ends(options: ReadOptions) -> dict[int, int]:
    """The offsets a batch read ends its streams at, for the streams whose end it names as an
    offset (``endingOffsets``, and no time option that could move either end)."""
    out = {}
    for sid in options.streams:
        end = options.ending.for_stream(sid)
        timed = any(spec is not None and spec.for_stream(sid) is not None
                    for spec in (options.starting_time, options.ending_time))
        if end >= 0 and not timed:
            out[sid] = end
    return out


def resolve_bounds(layout: StreamLayout, options: ReadOptions) -> tuple[int, int]:
    """The offsets [lo, hi) of ``layout`` the read asks for, after checking them."""
    sid = layout.stream_id
    first, last = layout.start_offset, layout.end_offset
    start = options.starting.for_stream(sid)
    end = options.ending.for_stream(sid)
    if start == EARLIEST:
        lo = first
    elif start == LATEST:
        lo = last
    elif start < first:
        if options.fail_on_data_loss:
            raise OptionError(
                f"startingOffsets asks for stream {sid} from offset {start}, but offsets below "
                f"{first} were trimmed away; start at {first} or later, or set "
                "failOnDataLoss=false to read from the first stored offset")
        lo = first
    elif start > last:
        raise OptionError(
            f"startingOffsets asks for stream {sid} from offset {start}, but the stream ends "
            f"at offset {last}")
    else:
        lo = start
    if end == LATEST:
        hi = last
    elif end > last:
        raise OptionError(
            f"endingOffsets asks for stream {sid} up to offset {end}, but the stream ends at "
            f"offset {last}")
    elif end < first:
        if options.fail_on_data_loss:
            raise OptionError(
                f"endingOffsets asks for stream {sid} up to offset {end}, but offsets below "
                f"{first} were trimmed away, so none of the records asked for is left; set "
                "failOnDataLoss=false to read nothing from this stream")
        hi = lo  # every record asked for was trimmed away
    else:
        hi = end
    if hi < lo:
        raise OptionError(
            f"endingOffsets ({hi}) is before startingOffsets ({lo}) for stream {sid}")
    return lo, hi


def split_evenly(lo: int, hi: int, parts: int) -> list[Interval]:
    """[lo, hi) cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    parts = max(1, min(parts, hi - lo))
    size, extra = divmod(hi - lo, parts)
    out, pos = [], lo
    for i in range(parts):
        step = size + (1 if i < extra else 0)
        out.append((pos, pos + step))
        pos += step
    return out


def _split_sizes(pieces: list[SbpPartition], options: ReadOptions) -> list[int]:
    """How many partitions each piece becomes (maxRecordsPerPartition, then minPartitions)."""
    counts = [1] * len(pieces)
    if options.max_records_per_partition:
        counts = [max(1, math.ceil(p.record_count / options.max_records_per_partition))
                  for p in pieces]
    if options.min_partitions and sum(counts) < options.min_partitions:
        total = sum(p.record_count for p in pieces)
        if total:
            # As Spark's Kafka source: each piece gets a share of minPartitions in proportion
            # to its size (at least what it had).
            counts = [max(c, round(p.record_count / total * options.min_partitions))
                      for c, p in zip(counts, pieces, strict=True)]
    return counts


def plan_partitions(layouts: Sequence[StreamLayout], options: ReadOptions,
                    pushed: PushedFilters | None = None,
                    stream_bounds: Mapping[int, Interval] | None = None) -> list[SbpPartition]:
    """The input partitions of a batch read, in (stream, range, offset) order.

    ``stream_bounds`` narrows streams further to offsets ``[lo, hi)`` (from the timestamp
    filters, see ``times.timestamp_bounds``)."""
    pushed = pushed or PushedFilters()
    row_predicates = pushed.row_predicates
    offset_filter = pushed.offset_intervals()
    in_offsets = [p for p in pushed.predicates if p.column == "offset" and p.op == "in"]
    pieces: list[SbpPartition] = []
    for layout in layouts:
        lo, hi = resolve_bounds(layout, options)
        if stream_bounds and layout.stream_id in stream_bounds:
            narrow_lo, narrow_hi = stream_bounds[layout.stream_id]
            lo, hi = max(lo, narrow_lo), min(hi, narrow_hi)
        if not pushed.allows("stream_id", layout.stream_id):
            continue
        for rng in layout.ranges:
            if not pushed.allows("range_index", rng.range_index):
                continue
            wanted = intersect_intervals(
                [(max(lo, rng.start_offset), min(hi, rng.end_offset))], offset_filter)
            extra: tuple[Predicate, ...] = ()
            if len(wanted) > MAX_PIECES_PER_RANGE:
                wanted = [(wanted[0][0], wanted[-1][1])]
                extra = tuple(in_offsets)
            for start, end in wanted:
                if start >= end:
                    continue
                pieces.append(SbpPartition(
                    stream_id=layout.stream_id, range_index=rng.range_index,
                    start_offset=start, end_offset=end,
                    range_start=rng.start_offset, range_end=rng.end_offset,
                    replicas=rng.replicas, range_is_open=rng.is_open,
                    row_predicates=row_predicates + extra))
    partitions: list[SbpPartition] = []
    for piece, count in zip(pieces, _split_sizes(pieces, options), strict=True):
        if count == 1:
            partitions.append(piece)
            continue
        for start, end in split_evenly(piece.start_offset, piece.end_offset, count):
            partitions.append(_with_bounds(piece, start, end))
    return partitions


def _with_bounds(piece: SbpPartition, start: int, end: int) -> SbpPartition:
    return SbpPartition(
        stream_id=piece.stream_id, range_index=piece.range_index, start_offset=start,
        end_offset=end, range_start=piece.range_start, range_end=piece.range_end,
        replicas=piece.replicas, range_is_open=piece.range_is_open,
        row_predicates=piece.row_predicates)
