"""``spark.readStream.format("sbp")``: the micro-batch stream reader.

Offsets are ``{"<stream_id>": next_offset}`` (see ``offsets``): the micro-batch ``(start, end]``
reads records ``[start[s], end[s])`` of each stream ``s``. Everything a micro-batch reads is
fixed by those two offset objects, so Spark's replay of a micro-batch after a restart reads the
same records again.

Where each method runs (pyspark 4.3):

- ``initialOffset``, ``latestOffset``, ``reportLatestOffset``, ``partitions``, ``commit`` and
  ``prepareForTriggerAvailableNow`` run in one long-lived driver-side Python process per query.
  Only things that never change what a micro-batch reads live there between calls (the
  availableNow target, the ``minRecordsPerTrigger`` clock, the lag report, warn-once sets).
- ``read`` runs on executors, on another instance made from the same options: it uses only the
  partition and those options (``sbp_spark.spark.reader.read_partition``, shared with batch
  reads).
- ``commit`` comes one micro-batch late and ``stop`` is not always called: nothing depends on
  them.

Planning reuses the batch reader's: ``cluster.stream_layouts`` describes the streams (ranges,
open range end) and ``planning.plan_partitions`` cuts ``[start, end)`` of each stream into one
partition per range it crosses (ranges sealed and opened between or during micro-batches are
just more ranges), split by ``maxRecordsPerPartition``/``minPartitions`` as in batch reads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from fractions import Fraction
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from sbp_spark.client import SbpClient
from sbp_spark.protocol.errors import SbpError, StreamNotFoundError

from .. import cluster
from ..decode import SkipTally
from ..options import EARLIEST, LATEST, OffsetSpec, StreamReadOptions, parse_stream_read_options
from ..planning import RangeLayout, SbpPartition, StreamLayout, plan_partitions
from ..reader import ReadFailedError, known_metadata, metadata_columns_of, read_partition
from ..schemas import check_records_read_schema
from ..times import resolve_time_positions, stored_time_warning
from .limits import TriggerDelay, TriggerLimits, admit
from .offsets import parse_spark, resolve_starting, to_spark

log = logging.getLogger(__name__)

# Long polls of one latestOffset call run on at most this many range servers at once.
MAX_POLL_THREADS = 8

# One stream's entry in the lag report: counts, and the rewritten history it went on from.
StreamReport = dict[str, int | dict[str, int]]


class DataLossError(RuntimeError):
    """Records a streaming query still had to read are gone (trimmed, or the stream deleted),
    or records it already read are no longer part of the stream (history rewritten)."""


class SbpStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reads of SBP streams with admission control and data-loss checks."""

    def __init__(self, options: StreamReadOptions, schema: StructType,
                 metadata_columns: frozenset[str] | None = None,
                 case_folded: Sequence[str] = ()) -> None:
        self.options = options
        self.schema = schema
        self.case_folded = tuple(case_folded)  # see read_partition
        # Filled from where records are stored in every batch, as in a batch read (a stored
        # column of such a name is dropped).
        self.metadata_columns = known_metadata(schema, metadata_columns)
        self.limits = TriggerLimits.from_options(options)
        self._state: _DriverState | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The instance Spark pickles for read() carries options only, never driver state.
        state = dict(self.__dict__)
        state["_state"] = None
        return state

    @property
    def state(self) -> _DriverState:
        if self._state is None:
            self._state = _DriverState()
        return self._state

    @property
    def client(self) -> SbpClient:
        return cluster.get_client(self.options.read.client)

    # -- offsets ---------------------------------------------------------------------------

    def initialOffset(self) -> dict:
        read = self.options.read
        layouts = cluster.stream_layouts(self.client, read.streams, read.client.pd)
        warning = stored_time_warning(read, self.schema, self.metadata_columns)
        if warning:
            log.warning("%s", warning)
        read = resolve_time_positions(self.client, layouts, read)
        bounds = {lay.stream_id: (lay.start_offset, lay.end_offset) for lay in layouts}
        first = resolve_starting(read.starting, read.streams, bounds)
        log.info("sbp stream read of streams %s starts at %s", _ids(read.streams), first)
        return to_spark(first, _ranges_before({lay.stream_id: lay for lay in layouts}, first))

    def getDefaultReadLimit(self) -> ReadLimit:
        return self.limits.default_read_limit()

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the end of an availableNow run: what the streams hold now."""
        layouts = self._layouts(self.options.read.streams)
        self.state.target = _end_offsets(layouts, layouts)
        log.info("sbp availableNow: reading up to %s", self.state.target)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the next micro-batch: as far as ``limit`` (and the options) allow."""
        state = self.state
        begin_given, ranges_given = parse_spark(start, "start offset")
        layouts = self._layouts(self.options.read.streams)
        begin, entering = self._effective_starts(begin_given, ranges_given, layouts)
        latest = _end_offsets(layouts, begin)  # every stream in begin exists
        if state.target is None and not entering and all(
                latest[sid] <= begin[sid] for sid in begin):
            woken = self._long_poll({sid: layouts[sid] for sid in begin})
            if woken:
                layouts.update(self._layouts(woken))
                latest.update(_end_offsets(layouts, woken))
        cap = dict(latest)
        if state.target is not None:
            cap = {sid: max(begin[sid], min(latest[sid], state.target.get(sid, begin[sid])))
                   for sid in begin}
        limits = self.limits.for_limit(limit)
        if state.target is not None:
            limits = replace(limits, min_records=None)  # availableNow must reach its target
        backlog = sum(max(0, cap[sid] - begin[sid]) for sid in begin)
        if limits.min_records is not None and state.delay.should_wait(
                backlog, limits.min_records, limits.max_trigger_delay_ms):
            log.debug("sbp: %d records wait, fewer than minRecordsPerTrigger=%d; next "
                      "micro-batch at the latest in %.0f ms", backlog, limits.min_records,
                      state.delay.remaining_ms(limits.max_trigger_delay_ms))
            self._update_report(layouts, latest, begin, False, self._no_skips())
            # Held back: wait at the tails for more records rather than let Spark ask again
            # every few milliseconds.
            self._long_poll({sid: layouts[sid] for sid in begin},
                            state.delay.remaining_ms(limits.max_trigger_delay_ms))
            return to_spark(begin_given, ranges_given)
        sizes = (self._bytes_per_record(layouts, begin, cap)
                 if limits.max_bytes is not None else None)
        end = admit(begin, cap, limits, sizes)
        end.update(entering)
        admitted = end != dict(begin_given)
        skipped = self._count_skipped(layouts, begin, end) if admitted else self._no_skips()
        self._update_report(layouts, latest, end, admitted, skipped)
        return to_spark(end, _ranges_before(layouts, end))

    def reportLatestOffset(self) -> dict | None:
        """Per stream: the true latest offset, records behind it and ms behind the newest
        record, as of the last ``latestOffset`` (shown by Spark as ``latestOffset``); with
        skipIncompatibleBatches, also the stored batches (and records) the planned
        micro-batch skips."""
        return self.state.report

    # -- planning and reading --------------------------------------------------------------

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
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
                self._stream_lost(sid, lo)
                continue
            cut = _sealed_end(layout, finish_ranges.get(sid))
            if cut is not None and cut < hi:
                self._ends_below(sid, hi, cut, "the range that held its last record")
                hi = cut
            elif layout.end_offset < hi and (
                    (stream_end := cluster.authoritative_end(self.client, layout)) is not None
                    and stream_end < hi):
                self._ends_below(sid, hi, stream_end, "the stream")
                hi = stream_end
            if layout.start_offset > lo:
                self._trimmed(sid, lo, layout.start_offset)
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

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SbpPartition), type(partition)
        if not self.options.skip_incompatible_batches:
            return read_partition(self.options.read, self.schema, partition,
                                  metadata_columns=self.metadata_columns,
                                  case_folded=self.case_folded)
        return self._read_skipping(partition)

    def _read_skipping(self, partition: SbpPartition) -> Iterator[pa.RecordBatch]:
        skipped = SkipTally()
        yield from read_partition(self.options.read, self.schema, partition, skipped,
                                  self.metadata_columns, self.case_folded)
        if skipped.batches:
            log.warning("sbp %s: skipped %d stored batches (%d records) that do not fit the "
                        "read schema (skipIncompatibleBatches=true); the first: %s",
                        partition.describe(), skipped.batches, skipped.records,
                        skipped.first_problem)

    def commit(self, end: dict) -> None:
        log.debug("sbp stream read committed through %s", end)

    def stop(self) -> None:
        if self._state is not None:
            self._state.close()

    # -- helpers ---------------------------------------------------------------------------

    def _layouts(self, stream_ids: Sequence[int]) -> dict[int, StreamLayout | None]:
        """Each stream's layout now; None for a stream that is deleted or does not exist."""
        out: dict[int, StreamLayout | None] = {}
        pd = self.options.read.client.pd
        for sid in stream_ids:
            try:
                (out[sid],) = cluster.stream_layouts(self.client, [sid], pd)
            except (StreamNotFoundError, cluster.StreamMissingError):
                out[sid] = None
        return out

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
                    self._stream_lost(sid, given[sid])
                continue
            if sid not in given:
                # Named in 'streams' but not in the checkpointed offsets (added when the query
                # was restarted): it enters at its first offset and is read from there on.
                self.state.warn_once(("enter", sid), logging.INFO,
                                     "sbp: stream %d joins the query at offset %d", sid,
                                     layout.start_offset)
                entering[sid] = layout.start_offset
                continue
            position = self._rewound(sid, given[sid], ranges.get(sid), layout)
            if layout.start_offset > position:
                self._trimmed(sid, position, layout.start_offset)
                begin[sid] = layout.start_offset
            else:
                begin[sid] = position
        for sid in given:
            if sid not in layouts:
                self.state.warn_once(("leave", sid), logging.INFO,
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
        rng = next((r for r in layout.ranges if r.range_index == range_index), None)
        if rng is not None and not rng.is_open and rng.end_offset < position:
            back_to = rng.end_offset
            seen: dict[str, int] = {"range": rng.range_index, "sealedAt": back_to}
            message = (f"stream {sid}: range {range_index} was sealed at offset {back_to}, "
                       f"but this query had already read it up to offset {position}; the "
                       f"records [{back_to}, {position}) it read are not part of the stream "
                       "any more (the range's history was rewritten, e.g. by a failover that "
                       "ended it below them)")
        elif layout.end_offset < position and (
                (end := cluster.authoritative_end(self.client, layout)) is not None
                and end < position):
            # No range says so (an open range, or offsets checkpointed without ranges), but
            # the stream ends below where the query read: without this the query would wait
            # for the stream to pass that offset, then skip the records below it. Only the
            # primary's word counts: a secondary may not know yet how far the query read.
            back_to = end
            seen = {"endsAt": back_to}
            message = (f"stream {sid}: it now ends at offset {back_to}, but this query had "
                       f"already read it up to offset {position}; the records [{back_to}, "
                       f"{position}) it read are not part of the stream any more (were they "
                       "lost, or the stream made anew, e.g. on a rebuilt cluster?)")
        else:
            return position
        if self.options.read.fail_on_data_loss:
            raise DataLossError(
                f"history rewritten in {message}. Set failOnDataLoss=false to go on from "
                f"offset {back_to}, reading the records that stand there now.")
        self.state.rewound[sid] = {**seen, "hadReadTo": position}
        self.state.warn_once(("rewound", sid, range_index, position), logging.WARNING,
                             "sbp data loss (failOnDataLoss=false): %s; going on from offset "
                             "%d", message, back_to)
        return back_to

    def _trimmed(self, sid: int, wanted: int, first: int) -> None:
        message = (f"stream {sid}: offsets [{wanted}, {first}) were trimmed before the query "
                   f"read them; the stream now starts at offset {first}")
        if self.options.read.fail_on_data_loss:
            raise DataLossError(
                f"data loss in {message}. Set failOnDataLoss=false to skip the missing "
                f"records and continue from offset {first}.")
        self.state.warn_once(("trim", sid, wanted, first), logging.WARNING,
                             "sbp data loss (failOnDataLoss=false): %s; continuing from there",
                             message)

    def _ends_below(self, sid: int, planned_end: int, end: int, what: str) -> None:
        """``what`` (the range that held the last record of the micro-batch as
        ``latestOffset`` planned it, perhaps before a restart, or the whole stream) now ends
        below that end: below records the query saw. Fail (failOnDataLoss), or read up to
        there; the next micro-batch then goes on from there (``_rewound``)."""
        message = (f"stream {sid}: this micro-batch was planned to read up to offset "
                   f"{planned_end}, but {what} now ends at offset {end}; the records [{end}, "
                   f"{planned_end}) it was planned with are not part of the stream any more "
                   "(its history was rewritten: a failover that ended a range below them, "
                   "records lost, or the stream made anew)")
        if self.options.read.fail_on_data_loss:
            raise DataLossError(
                f"history rewritten in {message}. Set failOnDataLoss=false to read only what "
                "the stream holds.")
        self.state.warn_once(("ends below", sid, planned_end, end), logging.WARNING,
                             "sbp data loss (failOnDataLoss=false): %s; reading up to offset "
                             "%d", message, end)

    def _stream_lost(self, sid: int, wanted: int) -> None:
        message = (f"stream {sid} was deleted (or no longer exists) while the query still had "
                   f"to read it from offset {wanted}")
        if self.options.read.fail_on_data_loss:
            raise DataLossError(
                f"data loss: {message}. Set failOnDataLoss=false to drop the stream from the "
                "query and go on with the others.")
        self.state.warn_once(("lost", sid), logging.WARNING,
                             "sbp data loss (failOnDataLoss=false): %s; dropping it", message)

    def _long_poll(self, layouts: Mapping[int, StreamLayout | None],
                   at_most_ms: float | None = None) -> list[int]:
        """Wait (FETCH long poll, up to fetchMaxWaitMs and ``at_most_ms``) until a record
        arrives at the tail of an open range; returns the streams that got one."""
        wait_ms = self.options.read.fetch_max_wait_ms
        if at_most_ms is not None:
            wait_ms = min(wait_ms, int(at_most_ms))
        by_server: dict[str, list[tuple[int, RangeLayout, int]]] = {}
        for sid, layout in layouts.items():
            if layout is None or not layout.ranges or not layout.ranges[-1].is_open:
                continue
            tail = layout.ranges[-1]
            if tail.replicas:
                by_server.setdefault(tail.replicas[0].address, []).append(
                    (sid, tail, layout.end_offset))
        if wait_ms <= 0 or not by_server:
            return []
        client = self.client
        if len(by_server) == 1:
            ((address, entries),) = by_server.items()
            return _poll_server(client, address, entries, wait_ms)
        pool = self.state.pool()
        futures: set[Future] = {pool.submit(_poll_server, client, address, entries, wait_ms)
                                for address, entries in by_server.items()}
        woken: list[int] = []
        pending = futures
        while pending and not woken:
            done, pending = wait(pending, timeout=wait_ms / 1000.0 + 5.0,
                                 return_when=FIRST_COMPLETED)
            if not done:
                break
            for future in done:
                woken.extend(future.result())
        return woken

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
            cached = self.state.sizes.get(sid)
            if cached is not None and cached[0] == lo:
                sizes[sid] = cached[1]
                continue
            batch = cluster.batch_at(self.client, layout, lo)
            if batch is not None:
                sizes[sid] = Fraction(batch.header.batch_length, batch.header.record_count)
                self.state.sizes[sid] = (lo, sizes[sid])
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
        state = self.state
        if state.skipped is not None and state.skipped[0] == key:
            return state.skipped[1]
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
                log.warning("sbp stream %d: micro-batch %s -> %s skips %d stored batches (%d "
                            "records) that do not fit the read schema "
                            "(skipIncompatibleBatches=true); the first: %s", sid,
                            to_spark(begin), to_spark(end), tally.batches, tally.records,
                            tally.first_problem)
        state.skipped = (key, tallies)
        return tallies

    def _update_report(self, layouts: Mapping[int, StreamLayout | None],
                       latest: Mapping[int, int], end: Mapping[int, int],
                       admitted: bool, skipped: Mapping[int, SkipTally] | None = None) -> None:
        """Lag per stream after this micro-batch (and what it skips, when ``skipped`` is
        given); kept for reportLatestOffset and logged (at INFO when a micro-batch was
        admitted, else DEBUG)."""
        report: dict[str, StreamReport] = {}
        for sid in sorted(end):
            layout = layouts.get(sid)
            if layout is None or sid not in latest:
                continue
            behind = max(0, latest[sid] - end[sid])
            ms = self._ms_behind(layout, end[sid], latest[sid]) if behind else 0
            report[str(sid)] = {"latestOffset": latest[sid], "recordsBehind": behind,
                                "msBehindLatest": ms}
            if sid in self.state.rewound:
                report[str(sid)]["historyRewritten"] = self.state.rewound[sid]
            if skipped is not None:
                tally = skipped.get(sid, SkipTally())
                report[str(sid)].update(incompatibleBatchesSkipped=tally.batches,
                                        incompatibleRecordsSkipped=tally.records)
            log.log(logging.INFO if admitted else logging.DEBUG,
                    "sbp stream %d: micro-batch ends at offset %d; latest %d; %d records and "
                    "%d ms behind the newest record", sid, end[sid], latest[sid], behind, ms)
        self.state.report = report or None

    def _ms_behind(self, layout: StreamLayout, position: int, latest: int) -> int:
        """Envelope time of the newest record minus that of the record at ``position``."""
        state = self.state
        stamps = []
        for offset in (latest - 1, position):
            key = (layout.stream_id, offset)
            if key not in state.stamps:
                try:
                    batch = cluster.batch_at(self.client, layout, offset)
                except SbpError as exc:
                    log.debug("sbp: no timestamp at stream %d offset %d: %s",
                              layout.stream_id, offset, exc)
                    return 0
                if batch is None:
                    return 0
                state.remember_stamp(key, batch.header.base_timestamp_ms)
            stamps.append(state.stamps[key])
        return max(0, stamps[0] - stamps[1])


class _DriverState:
    """What the driver-side reader keeps between calls; none of it decides what is read."""

    def __init__(self) -> None:
        self.target: dict[int, int] | None = None
        self.delay = TriggerDelay()
        self.report: dict[str, StreamReport] | None = None
        self.sizes: dict[int, tuple[int, Fraction]] = {}
        self.stamps: dict[tuple[int, int], int] = {}
        # stream -> the last rewritten history the query went on from (failOnDataLoss=false)
        self.rewound: dict[int, dict[str, int]] = {}
        # The last micro-batch span counted for skipIncompatibleBatches, and its counts.
        self.skipped: tuple[tuple, dict[int, SkipTally]] | None = None
        self._warned: set[tuple] = set()
        self._pool: ThreadPoolExecutor | None = None

    def warn_once(self, key: tuple, level: int, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.log(level, msg, *args)

    def remember_stamp(self, key: tuple[int, int], stamp: int) -> None:
        if len(self.stamps) > 4096:
            self.stamps.clear()
        self.stamps[key] = stamp

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(MAX_POLL_THREADS, thread_name_prefix="sbp-poll")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _poll_server(client: SbpClient, address: str, entries: list[tuple[int, RangeLayout, int]],
                 wait_ms: int) -> list[int]:
    """One FETCH long poll at the tails of ``entries`` on one range server; the streams that
    got a record. Errors end the poll quietly: the next latestOffset looks again."""
    try:
        found = client.range_server(address).wait_for_records(
            [(sid, offset) for sid, _, offset in entries], wait_ms)
    except SbpError as exc:
        log.debug("sbp: long poll on %s ended: %s", address, exc)
        return []
    return sorted({entries[index][0] for index in found})


def _end_offsets(layouts: Mapping[int, StreamLayout | None], stream_ids: Iterable[int]
                 ) -> dict[int, int]:
    """The end offset of each of ``stream_ids`` whose stream exists (has a layout)."""
    return {sid: layout.end_offset for sid in stream_ids
            if (layout := layouts.get(sid)) is not None}


def _sealed_end(layout: StreamLayout, range_index: int | None) -> int | None:
    """Where range ``range_index`` was sealed (None: still open, or not known). Only a seal
    is authoritative: an open range's end is a snapshot, which a secondary may give lower
    than what the primary acknowledged."""
    rng = next((r for r in layout.ranges if r.range_index == range_index), None)
    return None if rng is None or rng.is_open else rng.end_offset


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


class RefusedStreamReader(DataSourceStreamReader):
    """The reader of a query whose options or schema were refused: each call Spark makes
    raises that error.

    When creating a stream reader raises, pyspark's streaming runner (4.x) follows the error
    with an ``UnboundLocalError`` of its own (it stops a reader it never got), and that is the
    error the query fails with. Raised from the first call instead (the query's start), the
    connector's error reaches the user alone. Signatures match ``SbpStreamReader``'s, so
    Spark plans the query the same way up to that call."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def _refuse(self) -> Any:
        raise self.error

    def initialOffset(self) -> dict:
        return self._refuse()

    def getDefaultReadLimit(self) -> ReadLimit:
        return self._refuse()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        return self._refuse()

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return self._refuse()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return self._refuse()

    def commit(self, end: dict) -> None:
        pass

    def stop(self) -> None:
        pass


def stream_reader(options: Mapping[str, str], schema: StructType,
                  data_columns: Sequence[str] | None = None,
                  case_folded: Sequence[str] = ()) -> SbpStreamReader:
    """The stream reader of a query (``DataSource.streamReader``), options checked;
    ``data_columns`` as for a batch read (see ``metadata_columns_of``)."""
    parsed = parse_stream_read_options(options)
    if parsed.read.payload == "records":
        check_records_read_schema(schema)
    return SbpStreamReader(parsed, schema, metadata_columns_of(
        schema, parsed.read.payload, data_columns), case_folded)
