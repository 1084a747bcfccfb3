"""Time positions: the time options and the filters on ``timestamp`` turned into offsets.

Both search each stream's ranges as planning sees them (the open range cut at the planned
snapshot) with the client's ``TimeSearch``: O(log n) FETCHes of one batch each per searched
time and stream, so a read positioned by time plans in milliseconds per stream and is as
repeatable as one positioned by offsets.

Options (``startingTimestamp``, ``endingOffsetsByTimestamp``, ...) mean what they mean in Spark's
Kafka source: a stream starts (or ends, exclusive) at its first record whose timestamp is at or
after the time. A record's timestamp is the connector's: with payload=records the record's own
(its ``timestamp`` column when written with one, else its batch's stored time), with
payload=arrow its batch's stored time (the writer's clock when it stored the batch). A
payload=arrow column the data itself calls ``timestamp`` is data: time options never look at
it (``stored_time_warning`` says so when a read has one), and filters on it are Spark's,
applied to its values, never pushed.

Filters must keep their exact meaning, so their ends are searched with the
``maxOutOfOrderness`` margin: with records never more than that behind one stored before them,
no record the filter keeps lies outside the narrowed offsets, and reading still applies the
filter to every row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from pyspark.sql.types import StructType

from sbp_spark.client import SbpClient
from sbp_spark.client.timesearch import TimeSearch

from .cluster_access import layout_ranges
from .filters import UNBOUNDED, Interval, PushedFilters
from .options import (
    EARLIEST,
    LATEST,
    OffsetSpec,
    OptionError,
    ReadOptions,
    TimeSpec,
    describe_time,
)
from .planning import StreamLayout, resolve_bounds

log = logging.getLogger(__name__)


def _search(client: SbpClient, layout: StreamLayout) -> TimeSearch:
    return TimeSearch(client, layout_ranges(layout))


def _option_name(spec: TimeSpec, one: str, by_stream: str) -> str:
    return one if spec.default is not None else by_stream


def resolve_time_positions(client: SbpClient, layouts: Sequence[StreamLayout],
                           options: ReadOptions) -> ReadOptions:
    """``options`` with the streams positioned by time positioned by the offsets the times
    fall at (unchanged when no time option is set)."""
    starting_time, ending_time = options.starting_time, options.ending_time
    if starting_time is None and ending_time is None:
        return options
    starting = dict(options.starting.per_stream)
    ending = dict(options.ending.per_stream)
    for layout in layouts:
        sid, first, last = layout.stream_id, layout.start_offset, layout.end_offset
        search = _search(client, layout)
        if starting_time is not None and (start_ms := starting_time.for_stream(sid)) is not None:
            name = _option_name(starting_time, "startingTimestamp", "startingOffsetsByTimestamp")
            found = search.first_at_or_after(start_ms, first, last).offset
            why = f"its first record at or after {describe_time(start_ms)}"
            if found is None:
                if options.time_strategy != "latest":
                    raise OptionError(
                        f"option '{name}': stream {sid} holds no record at or after "
                        f"{describe_time(start_ms)} (its records are [{first}, {last})); set "
                        "startingOffsetsByTimestampStrategy=latest to start it at its end")
                found = last
                why = (f"its end, holding no record at or after {describe_time(start_ms)}, "
                       "as startingOffsetsByTimestampStrategy=latest says")
            end = options.ending.for_stream(sid)
            if 0 <= end < found:
                raise OptionError(
                    f"option '{name}' starts stream {sid} at offset {found} ({why}), past "
                    f"option 'endingOffsets', which ends it at offset {end}")
            starting[sid] = found
        if ending_time is not None and (end_ms := ending_time.for_stream(sid)) is not None:
            begin = starting.get(sid, options.starting.default)
            begin = first if begin == EARLIEST else last if begin == LATEST else begin
            found = search.first_at_or_after(end_ms, max(first, begin), last).offset
            by_offset = starting_time is None or starting_time.for_stream(sid) is None
            if by_offset and found is not None and found == begin > first:
                # The time may fall before the starting offset: an empty read nobody asked
                # for (the mirror of a starting time past the ending offset, refused above).
                earlier = search.first_at_or_after(end_ms, first, begin).offset
                if earlier is not None:
                    name = _option_name(ending_time, "endingTimestamp",
                                        "endingOffsetsByTimestamp")
                    raise OptionError(
                        f"option '{name}' ends stream {sid} at offset {earlier} (its first "
                        f"record at or after {describe_time(end_ms)}), before option "
                        f"'startingOffsets', which starts it at offset {begin}")
            ending[sid] = last if found is None else found
    return replace(options, starting=OffsetSpec(options.starting.default,
                                                tuple(sorted(starting.items()))),
                   ending=OffsetSpec(options.ending.default, tuple(sorted(ending.items()))),
                   starting_time=None, ending_time=None)


def stored_time_warning(options: ReadOptions, schema: StructType,
                        metadata_columns: frozenset[str] | None) -> str | None:
    """The warning for a payload=arrow read positioned by time whose ``timestamp`` column is
    the data's own (None when there is nothing to say): the time options position by each
    batch's stored time, not by that column. ``metadata_columns``: the read's columns known to
    be metadata (None: a schema the user gave, whose ``timestamp`` is data where stored)."""
    if options.payload != "arrow":
        return None
    names = [_option_name(spec, one, by_stream) for spec, one, by_stream in (
        (options.starting_time, "startingTimestamp", "startingOffsetsByTimestamp"),
        (options.ending_time, "endingTimestamp", "endingOffsetsByTimestamp"))
        if spec is not None]
    known = metadata_columns or frozenset()
    column = next((f.name for f in schema.fields
                   if f.name.lower() == "timestamp" and f.name not in known), None)
    if not names or column is None:
        return None
    return (f"sbp: {' and '.join(repr(n) for n in names)} position payload=arrow streams "
            f"{','.join(map(str, options.streams))} by the time each batch was stored (its "
            f"writer's clock at the write), not by the data's own column '{column}'; to read "
            f"the rows whose '{column}' is in a span, filter on it (WHERE {column} >= ...), "
            "which Spark applies to that column's values")


def timestamp_bounds(client: SbpClient, layouts: Sequence[StreamLayout], options: ReadOptions,
                     pushed: PushedFilters) -> dict[int, Interval]:
    """Per stream, the offsets ``[lo, hi)`` outside which no record passes the pushed filters
    on ``timestamp`` (empty when there are none, or with ``maxOutOfOrderness=unbounded``)."""
    low_us, high_us = pushed.hull("timestamp")
    margin = options.max_out_of_orderness_ms
    if (low_us, high_us) == UNBOUNDED or margin is None:
        return {}
    bounds: dict[int, Interval] = {}
    for layout in layouts:
        lo, hi = resolve_bounds(layout, options)
        if low_us >= high_us:
            bounds[layout.stream_id] = (lo, lo)
            continue
        search = _search(client, layout)
        narrowed = (lo, hi)
        disorder = 0
        if low_us != UNBOUNDED[0]:
            # Every record before the first one at or after (low - margin) is before low.
            result = search.first_at_or_after(low_us // 1000 - margin, lo, hi, anchor=True)
            disorder = max(disorder, result.disorder_ms)
            narrowed = (hi if result.offset is None else result.offset, hi)
        if high_us != UNBOUNDED[1]:
            # From the first record at or after (high + margin) on, every record is at or
            # after high.
            result = search.first_at_or_after(-(-high_us // 1000) + margin, narrowed[0], hi,
                                              anchor=True)
            disorder = max(disorder, result.disorder_ms)
            narrowed = (narrowed[0], hi if result.offset is None else result.offset)
        if disorder > margin:
            # The probes themselves met records further out of order than the margin allows:
            # narrowing could drop rows the filter keeps. Read the whole span instead.
            log.warning("sbp: stream %d holds records %d ms behind ones stored before them, "
                        "more than maxOutOfOrderness (%d ms): its timestamp filters are applied "
                        "to every record instead of narrowing what is fetched",
                        layout.stream_id, disorder, margin)
            narrowed = (lo, hi)
        bounds[layout.stream_id] = narrowed
    return bounds


__all__ = ["describe_time", "resolve_time_positions", "stored_time_warning",
           "timestamp_bounds"]
