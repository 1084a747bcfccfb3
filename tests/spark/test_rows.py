"""Rows a row writer gets (pyspark 4.0's streaming sink) packed back into Arrow batches,
without Spark: the batches, and the TIMESTAMPs a local time zone makes ambiguous."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from pyspark.sql import Row
from pyspark.sql.types import (
    ArrayType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from sbp_spark.spark.rows import AmbiguousLocalTimeError, RowBatches, local_zone_has_transitions
from sbp_spark.spark.schemas import to_arrow

SCHEMA = StructType([
    StructField("id", LongType()),
    StructField("at", TimestampType()),
    StructField("detail", StructType([StructField("seen", ArrayType(TimestampType()))])),
    StructField("by", MapType(StringType(), TimestampType())),
])


@pytest.fixture
def berlin(monkeypatch):
    """This process in a zone whose clocks go back an hour on 2026-10-25 at 03:00."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def rows(n: int, at: dt.datetime) -> list[Row]:
    return [Row(id=i, at=at, detail=Row(seen=[at, None]), by={"x": at}) for i in range(n)]


def test_rows_come_back_as_batches_of_the_write_schema():
    at = dt.datetime(2026, 1, 2, 3, 4, 5)
    batches = list(RowBatches(SCHEMA, rows_per_batch=4).batches(iter(rows(10, at))))
    assert [b.num_rows for b in batches] == [4, 4, 2]
    assert all(b.schema == to_arrow(SCHEMA) for b in batches)
    assert [r["id"] for b in batches for r in b.to_pylist()] == list(range(10))
    assert list(RowBatches(SCHEMA).batches(iter([]))) == []


def test_a_wall_clock_time_that_stands_for_two_instants_is_refused(berlin):
    assert local_zone_has_transitions()
    twice = dt.datetime(2026, 10, 25, 2, 30)   # 00:30 and 01:30 UTC
    with pytest.raises(AmbiguousLocalTimeError, match=(
            r"column 'at' holds TIMESTAMP 2026-10-25T02:30:00, .*two instants.*"
            r"spark\.executorEnv\.TZ=UTC")):
        list(RowBatches(SCHEMA).batches(iter(rows(1, twice))))
    # Inside structs, arrays and maps too (each column named by its path).
    once = dt.datetime(2026, 10, 25, 4, 30)
    for row, where in ((Row(id=1, at=once, detail=Row(seen=[once, twice]), by={}),
                        r"detail\.seen\[\]"),
                       (Row(id=1, at=once, detail=None, by={"x": twice}), "by value")):
        with pytest.raises(AmbiguousLocalTimeError, match=f"column '{where}'"):
            list(RowBatches(SCHEMA).batches(iter([row])))
    # Times that stand for one instant pass, the hour after the change included.
    [batch] = RowBatches(SCHEMA).batches(iter(rows(2, once)))
    assert batch.column("at").to_pylist()[0] == dt.datetime(2026, 10, 25, 3, 30,
                                                            tzinfo=dt.timezone.utc)


def test_a_zone_without_transitions_is_not_checked(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        assert not local_zone_has_transitions()
        at = dt.datetime(2026, 10, 25, 2, 30)
        [batch] = RowBatches(SCHEMA).batches(iter(rows(1, at)))
        assert batch.column("at").to_pylist() == [at.replace(tzinfo=dt.timezone.utc)]
    finally:
        monkeypatch.undo()
        time.tzset()
