"""Rows handed to a row writer -> Arrow batches, for pyspark without an Arrow stream writer.

pyspark 4.0 hands a streaming sink its micro-batch as ``Row`` objects (the Arrow stream writer
came in 4.1). The connector writes Arrow, so ``RowBatches`` packs the rows back into Arrow
batches of the write's schema with pyspark's own conversion (the inverse of the one that made
the rows), ``ROWS_PER_BATCH`` rows at a time.

One thing does not survive that round trip: pyspark hands a TIMESTAMP as a naive wall-clock
time of the worker's local time zone, so the two instants of the hour a daylight-saving
change repeats become one wall-clock time, and packing it back takes the first of them. Where
the local zone has such changes, every TIMESTAMP value (also inside structs, arrays and maps)
is checked, and one that stands for two instants fails the write with the advice to run the
workers in UTC, instead of storing an instant one hour off.
"""

from __future__ import annotations

import datetime as dt
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql.types import ArrayType, DataType, MapType, StructType, TimestampType

from .schemas import to_arrow

# Rows packed into one Arrow batch (Spark's own default for Arrow batches).
ROWS_PER_BATCH = 10_000

Check = Callable[[Any], None]


class AmbiguousLocalTimeError(ValueError):
    """A TIMESTAMP handed over as a local wall-clock time that stands for two instants."""


def local_zone_has_transitions() -> bool:
    """Whether this process's local time zone repeats or skips wall-clock times."""
    return bool(time.daylight)


def _check_timestamp(column: str) -> Check:
    def check(value: Any) -> None:
        if value is None or not isinstance(value, dt.datetime) or value.tzinfo is not None:
            return
        if value.replace(fold=0).timestamp() != value.replace(fold=1).timestamp():
            raise AmbiguousLocalTimeError(
                f"column '{column}' holds TIMESTAMP {value.isoformat()}, which this pyspark "
                f"hands a streaming sink as a wall-clock time of the worker's time zone "
                f"({time.tzname[0]}/{time.tzname[1]}), where it stands for two instants (clocks "
                "went back) or none; the write cannot tell which instant it was. Run the "
                "executors in UTC (spark.executorEnv.TZ=UTC, and TZ=UTC for a local master) "
                "or use pyspark 4.1 or newer, whose Arrow stream writer hands instants over "
                "unchanged")
    return check


def _checker(dtype: DataType, column: str) -> Check | None:
    """What checks the TIMESTAMP values inside a value of ``dtype`` (None: it has none)."""
    if isinstance(dtype, TimestampType):
        return _check_timestamp(column)
    if isinstance(dtype, StructType):
        return _struct_checker(dtype, column)
    if isinstance(dtype, ArrayType):
        return _array_checker(dtype, column)
    if isinstance(dtype, MapType):
        return _map_checker(dtype, column)
    return None


def _struct_checker(dtype: StructType, column: str) -> Check | None:
    inner = [(i, c) for i, f in enumerate(dtype.fields)
             if (c := _checker(f.dataType, f"{column}.{f.name}")) is not None]
    if not inner:
        return None

    def check_struct(value: Any) -> None:
        if value is not None:
            for i, check in inner:
                check(value[i])
    return check_struct


def _array_checker(dtype: ArrayType, column: str) -> Check | None:
    element = _checker(dtype.elementType, f"{column}[]")
    if element is None:
        return None

    def check_array(value: Any) -> None:
        for item in value or ():
            element(item)
    return check_array


def _map_checker(dtype: MapType, column: str) -> Check | None:
    key = _checker(dtype.keyType, f"{column} key")
    item = _checker(dtype.valueType, f"{column} value")
    if key is None and item is None:
        return None

    def check_map(value: Any) -> None:
        for k, v in (value or {}).items():
            if key is not None:
                key(k)
            if item is not None:
                item(v)
    return check_map


class RowBatches:
    """Packs rows of ``schema`` into Arrow batches of ``to_arrow(schema)``."""

    def __init__(self, schema: StructType, rows_per_batch: int = ROWS_PER_BATCH,
                 check_local_times: bool | None = None) -> None:
        if rows_per_batch < 1:
            raise ValueError(f"rows_per_batch={rows_per_batch}: must be >= 1")
        self.schema = schema
        self.arrow_schema = to_arrow(schema)
        self.rows_per_batch = rows_per_batch
        if check_local_times is None:
            check_local_times = local_zone_has_transitions()
        self._checks = [] if not check_local_times else [
            (i, c) for i, f in enumerate(schema.fields)
            if (c := _checker(f.dataType, f.name)) is not None]

    def batches(self, rows: Iterable[Any]) -> Iterator[pa.RecordBatch]:
        """The rows as Arrow batches, in order."""
        from pyspark.sql.conversion import LocalDataToArrowConversion

        iterator = iter(rows)
        while chunk := list(itertools.islice(iterator, self.rows_per_batch)):
            for row in chunk:
                for i, check in self._checks:
                    check(row[i])
            table = LocalDataToArrowConversion.convert(chunk, self.schema, False)
            yield from table.cast(self.arrow_schema).to_batches()


__all__ = ["ROWS_PER_BATCH", "AmbiguousLocalTimeError", "RowBatches",
           "local_zone_has_transitions"]
