"""Batch reading: ``spark.read.format("sbp")``.

The reader is built on the driver (``reader()``, ``pushFilters()`` and ``partitions()`` run in a
driver-side Python worker), pickled, and ``read()`` runs on executors. It holds only options,
the schema and the pushed predicates; connections are opened inside ``read()``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from sbp_spark.protocol.errors import (
    HistoryRewrittenError,
    OffsetOutOfRangeError,
    SbpError,
    StreamNotFoundError,
)

from . import cluster_access, stream_names
from .committed import resolve_committed
from .decode import PartitionDecoder, SkipTally
from .filters import PushedFilters, split_filters
from .options import ReadOptions
from .planning import SbpPartition, named_ends, plan_partitions
from .schemas import METADATA_TYPES
from .settings import case_sensitive
from .times import resolve_time_positions, stored_time_warning, timestamp_bounds

if TYPE_CHECKING:  # Spark's filter classes come with pushdown (pyspark 4.1)
    from pyspark.sql.datasource import Filter

log = logging.getLogger(__name__)


class ReadFailedError(RuntimeError):
    """Reading a partition failed; the message says which records and why."""


def read_partition(options: ReadOptions, schema: StructType, partition: SbpPartition,
                   skipped: SkipTally | None = None,
                   metadata_columns: frozenset[str] | None = None,
                   case_folded: Sequence[str] = ()) -> Iterator[pa.RecordBatch]:
    """The records of ``partition`` as Arrow batches of ``schema`` (used by batch and
    streaming reads). Stored batches that do not fit ``schema`` fail the read, or, when
    ``skipped`` is given, are left out and counted there. ``metadata_columns`` are filled
    from where records are stored in every batch (see ``PartitionDecoder``). ``case_folded``:
    the pairs of column names that differ only by case which ``mergeSchema`` took for one
    column; a session with ``spark.sql.caseSensitive=true`` refuses such a schema."""
    exact = case_sensitive()
    if exact and case_folded:
        raise ValueError(
            f"mergeSchema inferred one column for each of {', '.join(case_folded)}, which differ "
            "only by case (Spark's default, spark.sql.caseSensitive=false, takes them for one "
            "column; the setting is not visible where the schema is inferred), but this session "
            "sets spark.sql.caseSensitive=true: give the schema with .schema(...) (for a "
            "table created with mergeSchema: a temporary view with a column list, CREATE "
            "TEMPORARY VIEW v (...) USING sbp OPTIONS (...)), or unset spark.sql.caseSensitive")
    client = cluster_access.get_client(options.client)
    decoder = PartitionDecoder(schema, options.payload, partition.stream_id,
                               partition.range_index, partition.start_offset,
                               partition.end_offset, partition.row_predicates,
                               skipped=skipped, metadata_columns=metadata_columns,
                               case_sensitive=exact)
    position = partition.start_offset
    while position < partition.end_offset:
        try:
            for fetched in cluster_access.fetch(client, partition, position,
                                                options.fetch_max_bytes,
                                                options.fetch_max_wait_ms):
                yield from decoder.add(fetched.header, fetched.data)
        except OffsetOutOfRangeError as exc:
            position = _after_trim(client, options, partition, position, exc)
            decoder.start_offset = max(decoder.start_offset, position)
            decoder.next_offset = max(decoder.next_offset, position)
            continue
        except HistoryRewrittenError as exc:
            _after_rewrite(options, partition, exc)
            break
        except StreamNotFoundError as exc:
            if not _deleted(client, partition.stream_id):
                raise _unreadable(partition, decoder.next_offset, exc) from exc
            _after_delete(options, partition, decoder.next_offset, exc)
            break
        except SbpError as exc:
            raise _unreadable(partition, decoder.next_offset, exc) from exc
        if decoder.next_offset <= position:
            raise ReadFailedError(
                f"reading {partition.describe()}: the range server returned no records at "
                f"offset {position}, though the range held them when the query was planned")
        position = decoder.next_offset
    yield from decoder.finish()


def _unreadable(partition: SbpPartition, offset: int, exc: SbpError) -> ReadFailedError:
    return ReadFailedError(
        f"reading {partition.describe()} failed at offset {offset}; no replica could serve it "
        f"({cluster_access.describe_replicas(partition.replicas)}): {type(exc).__name__}: {exc}")


def _deleted(client, stream_id: int) -> bool:
    """Whether the PD says the stream is gone (a range server's word alone does not drop
    records)."""
    try:
        return client.describe_streams([stream_id])[0].deleted
    except StreamNotFoundError:
        return True
    except SbpError:
        return False


def _after_delete(options: ReadOptions, partition: SbpPartition, offset: int,
                  exc: StreamNotFoundError) -> None:
    """The stream was deleted after the read was planned: fail, or (failOnDataLoss=false)
    end the partition where the records ran out, as a query drops a deleted stream."""
    message = (f"reading {partition.describe()}: stream {partition.stream_id} was deleted "
               f"after the read was planned; its records [{offset}, {partition.end_offset}) "
               f"are gone ({exc})")
    if options.fail_on_data_loss:
        raise ReadFailedError(f"data loss: {message}. Set failOnDataLoss=false to drop the "
                              "stream and go on with the others.") from exc
    log.warning("sbp data loss (failOnDataLoss=false): %s; the partition ends at %d", message,
                offset)


def _after_trim(client, options: ReadOptions, partition: SbpPartition, position: int,
                exc: OffsetOutOfRangeError) -> int:
    """Where to go on after the records at ``position`` were trimmed away while reading."""
    if options.fail_on_data_loss:
        raise ReadFailedError(
            f"reading {partition.describe()}: records from offset {position} were trimmed "
            f"(or expired by retention) before this task read them ({exc}); set "
            "failOnDataLoss=false to skip them"
        ) from exc
    # The PD's start, or a replica's: retention deletes records on the range servers, which
    # tell the PD only a moment later (or once it is reachable again).
    starts = [cluster_access.replica_start(client, partition)]
    try:
        starts.append(client.describe_streams([partition.stream_id])[0].start_offset)
    except SbpError as pd_error:
        log.debug("stream %d: asking the PD for its start failed: %s", partition.stream_id,
                  pd_error)
    start = max((s for s in starts if s is not None), default=position)
    if start <= position:
        raise ReadFailedError(
            f"reading {partition.describe()} at offset {position}: {exc}") from exc
    resume = min(start, partition.end_offset)
    log.warning("stream %d: records [%d, %d) were trimmed while reading; skipping them",
                partition.stream_id, position, resume)
    return resume


def _after_rewrite(options: ReadOptions, partition: SbpPartition,
                   exc: HistoryRewrittenError) -> None:
    """The range ended below the end planned for ``partition``: fail, or (failOnDataLoss=false)
    end the partition at the range's end with a warning."""
    message = (f"reading {partition.describe()}: range {exc.range_index} of stream "
               f"{exc.stream_id} was sealed at offset {exc.end_offset}, below the end "
               f"{exc.expected} planned for this read; records [{exc.end_offset}, "
               f"{exc.expected}) it was planned with are not part of the stream (the range's "
               "history was rewritten after planning)")
    if options.fail_on_data_loss:
        raise ReadFailedError(f"{message}. Set failOnDataLoss=false to read only what the "
                              "range holds.") from exc
    log.warning("sbp data loss (failOnDataLoss=false): %s; the partition ends at %d", message,
                exc.end_offset)


def metadata_columns_of(schema: StructType, payload: str,
                        data_columns: Sequence[str] | None) -> frozenset[str] | None:
    """The columns of ``schema`` a read (batch or streaming) knows are metadata: all of
    payload=records, and for payload=arrow those that are none of ``data_columns`` (the
    inferred schema's or a table's); None when ``data_columns`` is (a schema the user gave):
    not known, since a column named like a metadata column may be data in some batches."""
    if payload == "records":
        return frozenset(METADATA_TYPES)
    if data_columns is None:
        return None
    return frozenset(n for n in schema.fieldNames() if n not in data_columns)


def known_metadata(schema: StructType, metadata_columns: frozenset[str] | None
                   ) -> frozenset[str] | None:
    """The columns of ``schema`` among ``metadata_columns`` that have a metadata column's type:
    those a read fills from where records are stored in every batch (None: not known)."""
    if metadata_columns is None:
        return None
    return frozenset(f.name for f in schema.fields
                     if f.name in metadata_columns and f.dataType == METADATA_TYPES.get(f.name))


class SbpBatchReader(DataSourceReader):
    """Plans one partition per range (or piece of one) and reads each with one FETCH."""

    def __init__(self, options: ReadOptions, schema: StructType,
                 metadata_columns: frozenset[str] | None = None,
                 case_folded: Sequence[str] = ()) -> None:
        self.options = options
        self.schema = schema
        self.case_folded = tuple(case_folded)  # see read_partition
        # Columns known to be filled from where records are stored (not from record bodies);
        # only filters on these can be pushed. None: not known (a schema the user gave).
        self.metadata_columns = known_metadata(schema, metadata_columns)
        self.pushed = PushedFilters()

    def partitions(self) -> list[SbpPartition]:
        client = cluster_access.get_client(self.options.client)
        # Names, a pattern or '*' name the streams that match now, as the read is planned.
        resolved = stream_names.resolve_read(client, self.options)
        layouts = cluster_access.stream_layouts(client, resolved.streams,
                                                resolved.client.pd, named_ends(resolved))
        warning = stored_time_warning(resolved, self.schema, self.metadata_columns)
        if warning:
            log.warning("%s", warning)
        resolved = resolve_committed(client.consumers, resolved)
        options = resolve_time_positions(client, layouts, resolved)
        bounds = timestamp_bounds(client, layouts, options, self.pushed)
        partitions = plan_partitions(layouts, options, self.pushed, bounds)
        log.info("sbp read of streams %s: %d partitions, %d records, pushed filters: %s%s",
                 ",".join(map(str, resolved.streams)), len(partitions),
                 sum(p.record_count for p in partitions), self.pushed.describe(),
                 f" (offsets by timestamp: {bounds})" if bounds else "")
        return partitions

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SbpPartition):
            # With no partitions planned (nothing to read), Spark still runs one task with a
            # plain InputPartition.
            return iter(())
        return read_partition(self.options, self.schema, partition,
                              metadata_columns=self.metadata_columns,
                              case_folded=self.case_folded)


class SbpPushdownBatchReader(SbpBatchReader):
    """The batch reader with filter pushdown (needs spark.sql.python.filterPushdown.enabled)."""

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        # A payload=arrow schema the user gave pushes nothing (metadata_columns None): its
        # columns named like metadata columns may be data in batches planning never sees.
        handled, unhandled = split_filters(filters, self.metadata_columns or ())
        self.pushed = PushedFilters.from_predicates(handled)
        return iter(unhandled)


__all__ = ["ReadFailedError", "SbpBatchReader", "SbpPushdownBatchReader", "known_metadata",
           "metadata_columns_of", "read_partition"]
