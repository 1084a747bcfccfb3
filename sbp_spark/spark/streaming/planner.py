"""The driver side of a streaming read: which offsets each micro-batch covers.

``MicroBatchPlanner`` is what the stream reader's driver-side calls (``initialOffset``,
``latestOffset``, ``partitions``...) do, without Spark: it asks the cluster where the streams
stand (``cluster_access.stream_layouts``), sizes the next micro-batch under the trigger limits
(``limits``), waits at the streams' tails when nothing is new (``long_poll``), applies the
data-loss rules (``data_loss``), keeps the lag report (``progress``), and cuts a micro-batch's
offsets into partitions as a batch read does (``planning.plan_partitions``).

It lives in the one long-lived driver-side Python process of a query; only things that never
change what a micro-batch reads stay in it between calls (the availableNow target, the
``minRecordsPerTrigger`` clock, the lag report, warn-once sets, caches).

Streams named by name are looked up once; a ``streamPattern`` or ``streams '*'`` is matched
again at a micro-batch at most every ``discoveryIntervalMs`` (``stream_names.Discovery``). The
offsets stay keyed by stream id, so a stream that starts matching enters them at its first
offset (as one named in 'streams' on a restart does), and one that was deleted is data loss
under ``failOnDataLoss`` as for a stream named by id; a checkpoint stays valid either way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from pyspark.sql.types import StructType

from sbp_spark.client import SbpClient
from sbp_spark.protocol.errors import SbpError, StreamNotFoundError

from .. import cluster_access, stream_names
from ..committed import resolve_committed
from ..decode import SkipTally
from ..options import EARLIEST, LATEST, OffsetSpec, StreamReadOptions, check_positions
from ..planning import SbpPartition, StreamLayout, plan_partitions
from ..reader import ReadFailedError, read_partition
from ..times import resolve_time_positions, stored_time_warning
from . import data_loss
from .consumer_record import ConsumerRecord
from .data_loss import Loss
from .limits import TriggerDelay, TriggerLimits, admit
from .long_poll import LongPoller
from .offsets import parse_spark, resolve_starting, to_spark
from .progress import StampCache, StreamLag, StreamReport, lag_report, ms_between, skip_warning

if TYPE_CHECKING:
    from sbp_spark.protocol.messages import Consumer

# What the stream reader reports goes to one logger, the one docs/streaming.md names.
log = logging.getLogger("sbp_spark.spark.streaming.reader")


class MicroBatchPlanner:
    """Sizes and plans the micro-batches of one streaming read (see the module docstring)."""

    def __init__(self, options: StreamReadOptions, schema: StructType,
                 metadata_columns: frozenset[str] | None) -> None:
        self.options = options
        self.schema = schema
        self.metadata_columns = metadata_columns
        # The end of an availableNow run, once fixed (``fix_target``).
        self.target: dict[int, int] | None = None
        self.delay = TriggerDelay()
        # The lag report of the last sized micro-batch, and the records it leaves behind.
        self.report: dict[str, StreamReport] | None = None
        self.records_behind = 0
        # Where the next micro-batch starts as far as Spark said: the end of the last one it
        # planned (None before it planned one). A pyspark without admission control passes no
        # start to latestOffset().
        self.next_start: dict | None = None
        # The end a latestOffset() gave before Spark said where the query starts, and whether
        # Spark asked initialOffset (a new query) (see ``reader.SbpSelfLimitingStreamReader``).
        self.ended_before_start: dict | None = None
        self.started_new = False
        # The first offsets of a new query, fixed at the first ask: Spark may ask more than
        # once, and "latest" moves.
        self._initial: dict | None = None
        self.sizes: dict[int, tuple[int, Fraction]] = {}
        self.stamps = StampCache()
        # stream -> the last rewritten history the query went on from (failOnDataLoss=false)
        self.rewound: dict[int, dict[str, int]] = {}
        # The last micro-batch span counted for skipIncompatibleBatches, and its counts.
        self.skipped: tuple[tuple, dict[int, SkipTally]] | None = None
        self._warned: set[tuple] = set()
        self._poller = LongPoller(self._wait_at_tails)
        # The ids of streams named by name (looked up once), or the discovery of a pattern's.
        self._named: list[int] | None = None
        # The cluster's record of the committed offsets (option 'consumer'), or None.
        self._consumer = (None if options.read.consumer is None else
                          ConsumerRecord(options.read.consumer, _Consumers(self)))
        selection = options.read.selection
        self._discovery = (stream_names.Discovery(selection, options.discovery_interval_ms)
                           if selection is not None and selection.dynamic else None)

    @property
    def client(self) -> SbpClient:
        return cluster_access.get_client(self.options.read.client)

    def committed(self, offsets: dict | str | None) -> None:
        """Spark committed the micro-batches up to ``offsets`` (its offset form): record them
        under option 'consumer', if given (``consumer_record``)."""
        if self._consumer is not None and offsets is not None:
            self._consumer.record(parse_spark(offsets, "committed offset")[0])

    # -- offsets ---------------------------------------------------------------------------

    def initial_offsets(self) -> dict:
        """Where a new query starts (``startingOffsets`` and the time options), in Spark's
        offset form; the same answer every time it is asked."""
        if self._initial is None:
            self._initial = self._first_offsets()
        return self._initial

    def read_streams(self) -> list[int]:
        """The ids of the streams the query reads now: those of option 'streams', its names
        looked up at the first call, or the streams a pattern matched at the last discovery."""
        read = self.options.read
        if read.selection is None:
            return list(read.streams)
        if self._discovery is not None:
            return self._discovery.streams(self.client, read.client.pd)
        if self._named is None:
            self._named = stream_names.matching(self.client, read.selection, read.client.pd)
            check_positions(replace(read, streams=tuple(self._named)))
        return list(self._named)

    def _first_offsets(self) -> dict:
        read = replace(self.options.read, streams=tuple(self.read_streams()))
        layouts = cluster_access.stream_layouts(self.client, read.streams, read.client.pd)
        warning = stored_time_warning(read, self.schema, self.metadata_columns)
        if warning:
            log.warning("%s", warning)
        read = resolve_committed(self.client.consumers, read)
        read = resolve_time_positions(self.client, layouts, read)
        bounds = {lay.stream_id: (lay.start_offset, lay.end_offset) for lay in layouts}
        first = resolve_starting(read.starting, read.streams, bounds)
        log.info("sbp stream read of streams %s starts at %s", _ids(read.streams), first)
        return to_spark(first, _ranges_before({lay.stream_id: lay for lay in layouts}, first))

    def fix_target(self) -> None:
        """Fix the end of an availableNow run: what the streams hold now."""
        layouts = self._layouts(self.read_streams())
        self.target = _end_offsets(layouts, layouts)
        log.info("sbp availableNow: reading up to %s", self.target)

    def next_end(self, start: dict, limits: TriggerLimits) -> dict:
        """The end of the micro-batch that starts at ``start``: as far as ``limits`` (and the
        availableNow target) allow; ``start`` itself while ``minRecordsPerTrigger`` holds it
        back."""
        begin_given, ranges_given = parse_spark(start, "start offset")
        layouts = self._layouts_to_read(begin_given)
        begin, entering = self._effective_starts(begin_given, ranges_given, layouts)
        latest = _end_offsets(layouts, begin)  # every stream in begin exists
        if self.target is None and not entering and all(
                latest[sid] <= begin[sid] for sid in begin):
            woken = self._wait_for_records({sid: layouts[sid] for sid in begin})
            if woken:
                layouts.update(self._layouts(woken))
                latest.update(_end_offsets(layouts, woken))
        cap = dict(latest)
        if self.target is not None:
            cap = {sid: max(begin[sid], min(latest[sid], self.target.get(sid, begin[sid])))
                   for sid in begin}
            limits = replace(limits, min_records=None)  # availableNow must reach its target
        backlog = sum(max(0, cap[sid] - begin[sid]) for sid in begin)
        if limits.min_records is not None and self.delay.should_wait(
                backlog, limits.min_records, limits.max_trigger_delay_ms):
            log.debug("sbp: %d records wait, fewer than minRecordsPerTrigger=%d; next "
                      "micro-batch at the latest in %.0f ms", backlog, limits.min_records,
                      self.delay.remaining_ms(limits.max_trigger_delay_ms))
            self._update_report(layouts, latest, begin, False, self._no_skips())
            # Held back: wait at the tails for more records rather than let Spark ask again
            # every few milliseconds.
            self._wait_for_records({sid: layouts[sid] for sid in begin},
                                   self.delay.remaining_ms(limits.max_trigger_delay_ms))
            return to_spark(begin_given, ranges_given)
        sizes = (self._bytes_per_record(layouts, begin, cap)
                 if limits.max_bytes is not None else None)
        end = admit(begin, cap, limits, sizes)
        end.update(entering)
        admitted = end != dict(begin_given)
        skipped = self._count_skipped(layouts, begin, end) if admitted else self._no_skips()
        self._update_report(layouts, latest, end, admitted, skipped)
        return to_spark(end, _ranges_before(layouts, end))

    # -- planning --------------------------------------------------------------------------

    def partitions(self, start: dict, end: dict) -> list[SbpPartition]:
        """The partitions of the micro-batch ``start`` -> ``end``, after the data-loss rules
        (a stream trimmed, deleted or rewritten since the offsets were fixed)."""
        # Spark plans a micro-batch from where the last committed one ended.
        self.committed(start)
        self.next_start = end
        begin, begin_ranges = parse_spark(start, "start offset")
        finish, finish_ranges = parse_spark(end, "end offset")
        # A stream whose offset did not move may still have records to read: when its range
        # was sealed below where the query had read (failOnDataLoss=false), latestOffset goes
        # on from the seal, and the records standing there now may end right at the old
        # offset; its end then names another range than its start.
        layouts = self._layouts(sorted(
            sid for sid, hi in finish.items()
            if hi != begin.get(sid, hi) or finish_ranges.get(sid) != begin_ranges.get(sid)))
        for sid, layout in layouts.items():
            if sid in begin and layout is not None:
                begin[sid] = self._rewound(sid, begin[sid], begin_ranges.get(sid), layout)
        spans = {sid: (begin.get(sid, hi), hi) for sid, hi in finish.items()
                 if hi > begin.get(sid, hi)}
        if not spans:
            return []
        planned: dict[int, tuple[StreamLayout, int, int]] = {}
        for sid, (lo, hi) in sorted(spans.items()):
            layout = layouts[sid]
            if layout is None:
                self._lost(data_loss.stream_lost(sid, lo))
                continue
            cut = data_loss.sealed_end(layout, finish_ranges.get(sid))
            if cut is not None and cut < hi:
                self._lost(data_loss.planned_end_cut(
                    sid, hi, cut, "the range that held its last record"))
                hi = cut
            elif data_loss.needs_stream_end(layout, hi) and (
                    (stream_end := cluster_access.authoritative_end(self.client, layout, hi))
                    is not None and stream_end < hi):
                self._lost(data_loss.planned_end_cut(sid, hi, stream_end, "the stream"))
                hi = stream_end
            if layout.start_offset > lo:
                self._lost(data_loss.trimmed(sid, lo, layout.start_offset))
                lo = min(layout.start_offset, hi)
            if lo < hi:
                planned[sid] = (layout, lo, hi)
        parts = self._plan(planned)
        log.info("sbp micro-batch %s -> %s: %d partitions, %d records", to_spark(begin),
                 to_spark(finish), len(parts), sum(p.record_count for p in parts))
        return parts

    def _plan(self, spans: Mapping[int, tuple[StreamLayout, int, int]]) -> list[SbpPartition]:
        """The partitions reading offsets [lo, hi) of each stream (``spans``: stream id ->
        (layout, lo, hi)), in stream order."""
        ordered = sorted(spans.items())
        read = replace(self.options.read,
                       starting=OffsetSpec(EARLIEST, tuple((s, lo) for s, (_, lo, _) in ordered)),
                       ending=OffsetSpec(LATEST, tuple((s, hi) for s, (_, _, hi) in ordered)))
        return plan_partitions([layout for _, (layout, _, _) in ordered], read)

    def _layouts(self, stream_ids: Sequence[int]) -> dict[int, StreamLayout | None]:
        """Each stream's layout now; None for a stream that is deleted or does not exist."""
        out: dict[int, StreamLayout | None] = {}
        pd = self.options.read.client.pd
        for sid in stream_ids:
            try:
                (out[sid],) = cluster_access.stream_layouts(self.client, [sid], pd)
            except (StreamNotFoundError, cluster_access.StreamMissingError):
                out[sid] = None
        return out

    def _layouts_to_read(self, given: Mapping[int, int]) -> dict[int, StreamLayout | None]:
        """The layouts of the streams the query reads now, and, when streams are named by name
        or pattern, None for each stream of the offsets ``given`` that is deleted: it is data
        loss (failOnDataLoss), not a stream that left the options."""
        layouts = self._layouts(self.read_streams())
        if self.options.read.selection is not None:
            gone = [sid for sid in given if sid not in layouts]
            layouts.update((sid, None) for sid, layout in self._layouts(gone).items()
                           if layout is None)
        return layouts

    def _effective_starts(
        self, given: Mapping[int, int], ranges: Mapping[int, int],
        layouts: Mapping[int, StreamLayout | None]
    ) -> tuple[dict[int, int], dict[int, int]]:
        """(where each stream's next micro-batch starts, streams entering the offsets)."""
        begin: dict[int, int] = {}
        entering: dict[int, int] = {}
        for sid, layout in layouts.items():
            if layout is None:
                if sid in given:
                    self._lost(data_loss.stream_lost(sid, given[sid]))
                continue
            if sid not in given:
                # Named in 'streams' but not in the checkpointed offsets (added when the query
                # was restarted): it enters at its first offset and is read from there on.
                self.warn_once(("enter", sid), logging.INFO,
                               "sbp: stream %d joins the query at offset %d", sid,
                               layout.start_offset)
                entering[sid] = layout.start_offset
                continue
            position = self._rewound(sid, given[sid], ranges.get(sid), layout)
            if layout.start_offset > position:
                self._lost(data_loss.trimmed(sid, position, layout.start_offset))
                begin[sid] = layout.start_offset
            else:
                begin[sid] = position
        for sid in given:
            if sid not in layouts:
                self.warn_once(("leave", sid), logging.INFO,
                               "sbp: stream %d is no longer in option 'streams'; the query "
                               "stops reading it at offset %d", sid, given[sid])
        return begin, entering

    def _rewound(self, sid: int, position: int, range_index: int | None,
                 layout: StreamLayout) -> int:
        """Where the stream's next micro-batch really starts, given that the query read it up
        to ``position``, the last record read being in range ``range_index``: ``position``,
        unless that range was since sealed below it, or the stream now ends below it. Then the
        records the query read past that point are not part of the stream any more (other
        records stand, or will stand, at their offsets): fail (failOnDataLoss), or go on from
        there and report it."""
        loss = data_loss.range_sealed_below(sid, position, range_index, layout)
        if loss is None and data_loss.needs_stream_end(layout, position):
            loss = data_loss.stream_ends_below_read(
                sid, position, range_index,
                cluster_access.authoritative_end(self.client, layout, position))
        if loss is None:
            return position
        self._lost(loss)
        assert loss.resume_at is not None and loss.rewritten is not None
        self.rewound[sid] = loss.rewritten
        return loss.resume_at

    def _lost(self, loss: Loss) -> None:
        """Fail the query with ``loss`` (failOnDataLoss), or warn once that it goes on."""
        data_loss.judge(loss, self.options.read.fail_on_data_loss)
        self.warn_once(loss.key, logging.WARNING, "%s", loss.warning)

    def _wait_for_records(self, layouts: Mapping[int, StreamLayout | None],
                          at_most_ms: float | None = None) -> list[int]:
        """Wait (FETCH long poll, up to fetchMaxWaitMs and ``at_most_ms``) until a record
        arrives at the tail of an open range; returns the streams that got one."""
        wait_ms = self.options.read.fetch_max_wait_ms
        if at_most_ms is not None:
            wait_ms = min(wait_ms, int(at_most_ms))
        return self._poller.wait(layouts, wait_ms)

    def _wait_at_tails(self, address: str, positions: Sequence[tuple[int, int]],
                       wait_ms: int) -> list[int]:
        return self.client.range_server(address).wait_for_records(positions, wait_ms)

    def _bytes_per_record(self, layouts: Mapping[int, StreamLayout | None],
                          begin: Mapping[int, int], cap: Mapping[int, int]
                          ) -> dict[int, Fraction]:
        """Stored bytes per record of each stream with a backlog, from the batch holding its
        next offset (``batch_length / record_count``, envelope included)."""
        sizes: dict[int, Fraction] = {}
        for sid, lo in begin.items():
            layout = layouts.get(sid)
            if layout is None or cap[sid] <= lo:
                continue
            cached = self.sizes.get(sid)
            if cached is not None and cached[0] == lo:
                sizes[sid] = cached[1]
                continue
            batch = cluster_access.batch_at(self.client, layout, lo)
            if batch is not None:
                sizes[sid] = Fraction(batch.header.batch_length, batch.header.record_count)
                self.sizes[sid] = (lo, sizes[sid])
        return sizes

    def _no_skips(self) -> dict[int, SkipTally] | None:
        """What an empty micro-batch skips: nothing (None: skipping is off)."""
        return {} if self.options.skip_incompatible_batches else None

    def _count_skipped(self, layouts: Mapping[int, StreamLayout | None],
                       begin: Mapping[int, int], end: Mapping[int, int]
                       ) -> dict[int, SkipTally] | None:
        """Per stream, the stored batches of the micro-batch ``begin`` -> ``end`` that do not
        fit the read schema (what its tasks will skip), found by reading the micro-batch here
        with the tasks' own code: pyspark offers a Python source no channel from its tasks to
        the query's progress. None when skipping is off or the count failed (it is only
        reported)."""
        if not self.options.skip_incompatible_batches:
            return None
        spans: dict[int, tuple[StreamLayout, int, int]] = {}
        for sid, lo in begin.items():
            layout = layouts.get(sid)
            if layout is not None and end.get(sid, lo) > lo:
                spans[sid] = (layout, lo, end[sid])
        key = tuple(sorted((sid, lo, hi) for sid, (_, lo, hi) in spans.items()))
        if self.skipped is not None and self.skipped[0] == key:
            return self.skipped[1]
        tallies = {sid: SkipTally() for sid in spans}
        try:
            for part in self._plan(spans):
                for _ in read_partition(self.options.read, self.schema, part,
                                        tallies[part.stream_id], self.metadata_columns):
                    pass
        except (SbpError, ReadFailedError) as exc:
            log.warning("sbp: could not count the stored batches micro-batch %s -> %s skips "
                        "(skipIncompatibleBatches=true): %s", to_spark(begin), to_spark(end),
                        exc)
            return None
        for sid, tally in sorted(tallies.items()):
            if tally.batches:
                log.warning("%s", skip_warning(sid, f"{to_spark(begin)} -> {to_spark(end)}",
                                               tally))
        self.skipped = (key, tallies)
        return tallies

    def _update_report(self, layouts: Mapping[int, StreamLayout | None],
                       latest: Mapping[int, int], end: Mapping[int, int],
                       admitted: bool, skipped: Mapping[int, SkipTally] | None = None) -> None:
        """Lag per stream after this micro-batch (and what it skips, when ``skipped`` is
        given); kept for reportLatestOffset and logged (at INFO when a micro-batch was
        admitted, else DEBUG)."""
        lags = []
        for sid in sorted(end):
            layout = layouts.get(sid)
            if layout is None or sid not in latest:
                continue
            lag = StreamLag(sid, end[sid], latest[sid])
            if lag.records_behind:
                lag = replace(lag, ms_behind=self._ms_behind(layout, end[sid], latest[sid]))
            lags.append(lag)
            log.log(logging.INFO if admitted else logging.DEBUG, "%s", lag.describe())
        self.report = lag_report(lags, self.rewound, skipped)
        self.records_behind = sum(lag.records_behind for lag in lags)

    def _ms_behind(self, layout: StreamLayout, position: int, latest: int) -> int:
        """Envelope time of the newest record minus that of the record at ``position``."""
        stamps = []
        for offset in (latest - 1, position):
            stamp = self.stamps.get(layout.stream_id, offset)
            if stamp is None:
                try:
                    batch = cluster_access.batch_at(self.client, layout, offset)
                except SbpError as exc:
                    log.debug("sbp: no timestamp at stream %d offset %d: %s",
                              layout.stream_id, offset, exc)
                    return 0
                if batch is None:
                    return 0
                stamp = batch.header.base_timestamp_ms
                self.stamps.put(layout.stream_id, offset, stamp)
            stamps.append(stamp)
        return ms_between(stamps[0], stamps[1])

    def warn_once(self, key: tuple, level: int, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.log(level, msg, *args)

    def close(self) -> None:
        """End the long polls' pool (the planner's other state needs no closing)."""
        self._poller.close()


def _end_offsets(layouts: Mapping[int, StreamLayout | None], stream_ids: Iterable[int]
                 ) -> dict[int, int]:
    """The end offset of each of ``stream_ids`` whose stream exists (has a layout)."""
    return {sid: layout.end_offset for sid in stream_ids
            if (layout := layouts.get(sid)) is not None}


def _ranges_before(layouts: Mapping[int, StreamLayout | None], offsets: Mapping[int, int]
                   ) -> dict[int, int]:
    """For each stream, the range holding the record just before its offset (where known)."""
    out: dict[int, int] = {}
    for sid, offset in offsets.items():
        layout = layouts.get(sid)
        if layout is None or offset <= 0:
            continue
        for rng in layout.ranges:
            if rng.start_offset < offset <= rng.end_offset:
                out[sid] = rng.range_index
                break
    return out


def _ids(streams: Sequence[int]) -> str:
    return ",".join(str(s) for s in streams)


__all__ = ["MicroBatchPlanner"]


class _Consumers:
    """``SbpClient.consumers`` of the planner's client, looked up at each call (the client is
    cached per process and options)."""

    def __init__(self, planner: MicroBatchPlanner) -> None:
        self._planner = planner

    def join(self, name: str) -> Consumer:
        return self._planner.client.consumers.join(name)

    def commit(self, name: str, generation: int, positions: Mapping[int, int]) -> Consumer:
        return self._planner.client.consumers.commit(name, generation, positions)
