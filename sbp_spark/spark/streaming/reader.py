"""``spark.readStream.format("sbp")``: the micro-batch stream reader.

Offsets are ``{"<stream_id>": next_offset}`` (see ``offsets``): the micro-batch ``(start, end]``
reads records ``[start[s], end[s])`` of each stream ``s``. Everything a micro-batch reads is
fixed by those two offset objects, so Spark's replay of a micro-batch after a restart reads the
same records again.

Where each method runs (pyspark 4.3):

- ``initialOffset``, ``latestOffset``, ``reportLatestOffset``, ``partitions``, ``commit`` and
  ``prepareForTriggerAvailableNow`` run in one long-lived driver-side Python process per query.
  They hand over to a ``MicroBatchPlanner`` (``planner``), which keeps what lives there between
  calls; none of it changes what a micro-batch reads.
- ``read`` runs on executors, on another instance made from the same options: it uses only the
  partition and those options (``sbp_spark.spark.reader.read_partition``, shared with batch
  reads).
- ``commit`` comes one micro-batch late and ``stop`` is not always called: nothing depends on
  them.

This class is only what Spark sees; the rules live in plain modules: ``planner`` (sizing and
planning micro-batches over ``cluster_access.stream_layouts`` and ``planning.plan_partitions``),
``limits`` (admission control), ``data_loss`` (what a trimmed, deleted or rewritten stream
means), ``progress`` (lag reports) and ``long_poll`` (waiting at the streams' tails).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from ..decode import SkipTally
from ..options import StreamReadOptions, parse_stream_read_options
from ..planning import SbpPartition
from ..reader import known_metadata, metadata_columns_of, read_partition
from ..schemas import check_records_read_schema
from .data_loss import DataLossError
from .limits import TriggerLimits
from .planner import MicroBatchPlanner

log = logging.getLogger(__name__)


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
        self._state: MicroBatchPlanner | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The instance Spark pickles for read() carries options only, never driver state.
        state = dict(self.__dict__)
        state["_state"] = None
        return state

    @property
    def state(self) -> MicroBatchPlanner:
        """The driver side: made at the first driver-side call, never pickled."""
        if self._state is None:
            self._state = MicroBatchPlanner(self.options, self.schema, self.metadata_columns)
        return self._state

    # -- offsets ---------------------------------------------------------------------------

    def initialOffset(self) -> dict:
        return self.state.initial_offsets()

    def getDefaultReadLimit(self) -> ReadLimit:
        return self.limits.default_read_limit()

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the end of an availableNow run: what the streams hold now."""
        self.state.fix_target()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the next micro-batch: as far as ``limit`` (and the options) allow."""
        return self.state.next_end(start, self.limits.for_limit(limit))

    def reportLatestOffset(self) -> dict | None:
        """Per stream: the true latest offset, records behind it and ms behind the newest
        record, as of the last ``latestOffset`` (shown by Spark as ``latestOffset``); with
        skipIncompatibleBatches, also the stored batches (and records) the planned
        micro-batch skips."""
        return self.state.report

    # -- planning and reading --------------------------------------------------------------

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return self.state.partitions(start, end)

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


__all__ = ["DataLossError", "RefusedStreamReader", "SbpStreamReader", "stream_reader"]
