"""Wall-clock times as instants (``zones``), without Spark: the Spark tests in
test_timestamp_ntz.py check the same answers against Spark's own CAST."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    BinaryType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from sbp_spark.spark.encode import RowEncoder
from sbp_spark.spark.options import OptionError, parse_write_options
from sbp_spark.spark.zones import arrow_zone, local_time_zone, wall_clock_to_instants

UTC = dt.timezone.utc


@pytest.mark.parametrize(("spark_name", "arrow_name"), [
    ("America/New_York", "America/New_York"), ("UTC", "UTC"), ("Z", "UTC"), ("GMT", "UTC"),
    ("+05:30", "+05:30"), ("-5", "-05:00"), ("+0530", "+05:30"), ("GMT+8", "+08:00"),
    ("UTC-03:00", "-03:00"), ("PST", "America/Los_Angeles"), ("EST", "-05:00"),
])
def test_spark_zone_names_become_arrow_ones(spark_name, arrow_name):
    assert arrow_zone(spark_name) == arrow_name


@pytest.mark.parametrize("name", ["Mars/Olympus", "+19:00", "+05:30:15", ""])
def test_unknown_zones_are_refused(name):
    with pytest.raises(ValueError, match="time zone"):
        arrow_zone(name)
    with pytest.raises(OptionError, match="option 'timeZone'"):
        parse_write_options({"pd": "h:1", "stream": "1", "timeZone": name})


def test_time_zone_option_is_checked_and_kept():
    assert parse_write_options({"pd": "h:1", "stream": "1"}).time_zone is None
    assert parse_write_options(
        {"pd": "h:1", "stream": "1", "timezone": "Europe/Paris"}).time_zone == "Europe/Paris"


def test_wall_clock_times_become_the_instants_spark_gives_them():
    wall = [dt.datetime(2026, 1, 1, 10), dt.datetime(2026, 3, 8, 2, 30),
            dt.datetime(2026, 11, 1, 1, 30), None, dt.datetime(2026, 3, 8, 3, 0)]
    expected = [dt.datetime(2026, 1, 1, 15, tzinfo=UTC), dt.datetime(2026, 3, 8, 7, 30, tzinfo=UTC),
                dt.datetime(2026, 11, 1, 5, 30, tzinfo=UTC), None,
                dt.datetime(2026, 3, 8, 7, 0, tzinfo=UTC)]
    for unit in ("ms", "us"):
        got = wall_clock_to_instants(pa.array(wall, pa.timestamp(unit)), "America/New_York")
        assert got.type == pa.timestamp(unit, tz="UTC")
        assert got.to_pylist() == expected
    utc = wall_clock_to_instants(pa.array(wall, pa.timestamp("us")), "UTC")
    assert utc.to_pylist() == [None if w is None else w.replace(tzinfo=UTC) for w in wall]
    fixed = wall_clock_to_instants(pa.array(wall[:1], pa.timestamp("us")), "+05:30")
    assert fixed.to_pylist() == [dt.datetime(2026, 1, 1, 4, 30, tzinfo=UTC)]


def test_local_zone_is_found_as_the_jvm_finds_it(monkeypatch):
    monkeypatch.setenv("TZ", ":Asia/Tokyo")
    assert local_time_zone() == "Asia/Tokyo"
    monkeypatch.delenv("TZ")
    assert arrow_zone(local_time_zone())  # whatever this machine says, pyarrow knows it


def test_records_encoder_stores_ntz_timestamps_as_instants_of_its_zone():
    schema = StructType([StructField("value", BinaryType()),
                         StructField("timestamp", TimestampNTZType())])
    encoder = RowEncoder.for_schema(schema, "records", 5)
    assert encoder.wall_clock_timestamp
    batch = pa.record_batch({"value": pa.array([b"a", b"b"]),
                             "timestamp": pa.array([dt.datetime(2026, 1, 1, 10), None],
                                                   pa.timestamp("us"))})
    with pytest.raises(ValueError, match="needs the time zone"):
        list(encoder.bodies(batch, 5))
    [(_, body)] = list(encoder.with_time_zone("America/New_York").bodies(batch, 5))
    assert body.column("timestamp").type == pa.timestamp("ms")
    assert body.column("timestamp").to_pylist() == [dt.datetime(2026, 1, 1, 15), None]
    # a TIMESTAMP column is an instant already; payload=arrow stores NTZ columns as they are
    instants = StructType([schema.fields[0], StructField("timestamp", TimestampType())])
    assert not RowEncoder.for_schema(instants, "records", 5).wall_clock_timestamp
    assert not RowEncoder.for_schema(schema, "arrow", 5).wall_clock_timestamp
