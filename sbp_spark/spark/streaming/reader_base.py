"""What the stream reader of every pyspark 4.x does (``reader`` picks the one a query gets):
offsets and planning through the driver-side ``MicroBatchPlanner``, and reading on executors;
and the reader of a query whose options were refused."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from ..decode import SkipTally
from ..options import StreamReadOptions
from ..planning import SbpPartition
from ..reader import known_metadata, read_partition
from .limits import TriggerLimits
from .planner import MicroBatchPlanner

# What the stream reader reports goes to one logger, the one docs/streaming.md names.
log = logging.getLogger("sbp_spark.spark.streaming.reader")


class SbpStreamReaderBase(DataSourceStreamReader):
    """What every pyspark's stream reader does: offsets, planning and reading."""

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

    def initialOffset(self) -> dict:
        return self.state.initial_offsets()

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
        self.state.committed(end)

    def stop(self) -> None:
        if self._state is not None:
            self._state.close()


class RefusedStreamReader(DataSourceStreamReader):
    """The reader of a query whose options or schema were refused: each call Spark makes
    raises that error.

    When creating a stream reader raises, pyspark's streaming runner (4.x) follows the error
    with an ``UnboundLocalError`` of its own (it stops a reader it never got), and that is the
    error the query fails with. Raised from the first call instead (the query's start), the
    connector's error reaches the user alone. Signatures match those of the reader the query
    would have had (``refused_stream_reader``), so Spark plans the query the same way up to
    that call."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def _refuse(self) -> Any:
        raise self.error

    def initialOffset(self) -> dict:
        return self._refuse()

    def latestOffset(self) -> dict:  # type: ignore[override]  # as SbpSelfLimitingStreamReader
        return self._refuse()

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return self._refuse()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return self._refuse()

    def commit(self, end: dict) -> None:
        pass

    def stop(self) -> None:
        pass


__all__ = ["RefusedStreamReader", "SbpStreamReaderBase"]
