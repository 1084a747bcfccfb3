"""The Spark-side ceilings: a Python data source that yields prebuilt Arrow batches, and an
Arrow writer that drops what it is given.

Nothing in them does I/O, so the time Spark spends on a query over them is Spark's own cost of
moving Arrow batches between the JVM and a Python worker: the best a Python connector can do.
Registered per session under ``sbp_bench_arrow``; imported by Spark's Python workers.

Reader options: ``rows``, ``partitions``, ``batch_rows``, ``record_size`` and ``schema`` (a
``StructType`` as JSON, so the ceiling produces exactly the schema of the query it stands
next to). Each worker builds one batch of ``batch_rows`` rows once and yields it over and over
(sliced for the last batch of a partition): the same number of rows and bytes as the query it
stands next to, with no Python work per batch. Columns are filled by name and type: integers
count up, timestamps are a fixed time plus that count, a binary column named ``value`` holds
``record_size`` random bytes per row, any other column is null.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StructField,
    StructType,
    TimestampType,
)

from sbp_spark.spark.schemas import to_arrow

NAME = "sbp_bench_arrow"
# The connector's default read schema (docs: payload=records).
DEFAULT_SCHEMA = StructType([
    StructField("stream_id", LongType()),
    StructField("range_index", IntegerType()),
    StructField("offset", LongType()),
    StructField("timestamp", TimestampType()),
    StructField("key", BinaryType()),
    StructField("value", BinaryType()),
])
_BASE_TIME_US = 1_763_800_000_000_000  # a fixed instant, so every run yields the same rows

# The batch each Python worker builds once and reuses in later queries (worker reuse is on by
# default), so the timed runs measure handing batches to Spark, not building them.
_TEMPLATES: dict[tuple, pa.RecordBatch] = {}


def _int_option(options: Mapping[str, str], name: str, default: int) -> int:
    raw = options.get(name, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={raw!r}: must be an integer") from None
    if value < 1:
        raise ValueError(f"option {name}={raw!r}: must be >= 1")
    return value


@dataclass(frozen=True)
class _Slice(InputPartition):
    index: int
    start: int
    stop: int


@dataclass
class DroppedRows(WriterCommitMessage):
    rows: int
    batches: int


def _column(field: pa.Field, offsets: pa.Array, record_size: int) -> pa.Array:
    n = len(offsets)
    if pa.types.is_integer(field.type):
        return offsets.cast(field.type)
    if pa.types.is_timestamp(field.type):
        micros = pc.add(offsets, pa.scalar(_BASE_TIME_US, pa.int64()))
        return micros.cast(pa.timestamp("us")).cast(field.type)
    if pa.types.is_binary(field.type) and field.name == "value":
        value_offsets = pa.array(range(0, (n + 1) * record_size, record_size), pa.int32())
        data = pa.py_buffer(os.urandom(n * record_size))
        return pa.BinaryArray.from_buffers(pa.binary(), n, [None, value_offsets.buffers()[1],
                                                           data])
    return pa.nulls(n, field.type)


def build_batch(schema: pa.Schema, rows: int, record_size: int) -> pa.RecordBatch:
    """One batch of ``rows`` rows of the ceiling's data."""
    offsets = pa.array(range(rows), pa.int64())
    columns = [_column(f, offsets, record_size) for f in schema]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def template(schema_json: str, batch_rows: int, record_size: int) -> pa.RecordBatch:
    """This worker's prebuilt batch for these settings (built on first use)."""
    key = (schema_json, batch_rows, record_size)
    batch = _TEMPLATES.get(key)
    if batch is None:
        schema = to_arrow(StructType.fromJson(json.loads(schema_json)))
        batch = _TEMPLATES[key] = build_batch(schema, batch_rows, record_size)
    return batch


class _CeilingReader(DataSourceReader):
    def __init__(self, schema: StructType, options: Mapping[str, str]) -> None:
        self.schema_json = schema.json()
        self.rows = _int_option(options, "rows", 1_000_000)
        self.partitions_count = _int_option(options, "partitions", 4)
        self.batch_rows = _int_option(options, "batch_rows", 65_536)
        self.record_size = _int_option(options, "record_size", 100)

    def partitions(self) -> list[InputPartition]:
        per = -(-self.rows // self.partitions_count)
        return [_Slice(i, lo, min(self.rows, lo + per))
                for i, lo in enumerate(range(0, self.rows, per))]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, _Slice)
        batch = template(self.schema_json, self.batch_rows, self.record_size)
        full, rest = divmod(partition.stop - partition.start, self.batch_rows)
        for _ in range(full):
            yield batch
        if rest:
            yield batch.slice(0, rest)


class _DroppingWriter(DataSourceArrowWriter):
    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        rows = batches = 0
        for batch in iterator:
            rows += batch.num_rows
            batches += 1
        return DroppedRows(rows, batches)


class ArrowCeilingSource(DataSource):
    """Reads prebuilt Arrow batches; writes nowhere (drops every batch)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType | str:
        raw = self.options.get("schema")
        return StructType.fromJson(json.loads(raw)) if raw else DEFAULT_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return _CeilingReader(schema, self.options)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        return _DroppingWriter()
