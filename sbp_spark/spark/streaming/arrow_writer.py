"""The Arrow stream writer, for a pyspark that has one (4.1 and later; ``pyspark_api``).

A module of its own because its base class exists only there: ``sink.stream_writer`` imports
it only when ``pyspark_api.found().stream_arrow_writer`` says so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamArrowWriter

from ..writer import SbpCommitMessage
from .writer import MicroBatchWriter


class SbpStreamWriter(MicroBatchWriter, DataSourceStreamArrowWriter):
    """The stream writer Spark hands each task's rows as Arrow batches."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SbpCommitMessage:
        return self.write_batches(iterator)


__all__ = ["SbpStreamWriter"]
