"""TIMESTAMP_NTZ columns written to sbp: a payload=records ``timestamp`` column becomes each
record's instant the way Spark's ``CAST(ntz AS TIMESTAMP)`` makes it (in the session time
zone, across DST changes too); payload=arrow keeps wall-clock values as they are."""

from __future__ import annotations

import datetime as dt

import pytest
from chispa import assert_df_equality
from pyspark.sql.types import TimestampNTZType, TimestampType

from .streaming.helpers import append_values, new_stream

UTC = dt.timezone.utc
ZONE = "America/New_York"

# Wall-clock times in New York: an ordinary winter and summer time, one that does not exist
# (clocks jump from 02:00 to 03:00 on 2026-03-08) and one that happens twice (clocks go back
# from 02:00 to 01:00 on 2026-11-01).
WALL_CLOCK = {
    "winter": "2026-01-01 10:00:00",
    "summer": "2026-07-01 10:00:00.123",
    "gap": "2026-03-08 02:30:00",
    "overlap": "2026-11-01 01:30:00",
}
# What Spark's CAST(ntz AS TIMESTAMP) gives for them in New York (checked below): a time in
# the gap is moved forward by the gap's length, one in the overlap takes the earlier offset.
INSTANTS = {
    "winter": dt.datetime(2026, 1, 1, 15, 0, tzinfo=UTC),
    "summer": dt.datetime(2026, 7, 1, 14, 0, 0, 123_000, tzinfo=UTC),
    "gap": dt.datetime(2026, 3, 8, 7, 30, tzinfo=UTC),
    "overlap": dt.datetime(2026, 11, 1, 5, 30, tzinfo=UTC),
}


def read(spark, pd, stream, **options):
    reader = spark.read.format("sbp").option("pd", pd).option("streams", str(stream))
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


@pytest.fixture
def new_york(spark):
    """The shared session with its time zone set to New York for one test."""
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", ZONE)
    try:
        yield spark
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)


def wall_clock_frame(spark):
    """value (string) and timestamp (TIMESTAMP_NTZ) rows of WALL_CLOCK, and a null time."""
    rows = [(name, text) for name, text in WALL_CLOCK.items()] + [("no-time", None)]
    return spark.createDataFrame(rows, "value string, wall string").selectExpr(
        "value", "to_timestamp_ntz(wall) AS timestamp")


def as_instants(frame):
    """(value, timestamp) with Spark's own CAST of the NTZ column, as epoch microseconds
    (independent of the session zone when compared)."""
    return frame.selectExpr("CAST(value AS STRING) AS value",
                            "unix_micros(CAST(timestamp AS TIMESTAMP)) AS micros")


def micros(when: dt.datetime) -> int:
    return (when - dt.datetime(1970, 1, 1, tzinfo=UTC)) // dt.timedelta(microseconds=1)


def test_spark_cast_of_ntz_in_new_york(new_york):
    """The rule the connector follows, as Spark applies it on this machine."""
    got = {r.value: r.micros for r in as_instants(wall_clock_frame(new_york)).collect()}
    assert got == {**{k: micros(v) for k, v in INSTANTS.items()}, "no-time": None}


def test_ntz_timestamp_column_is_an_instant_in_the_session_zone(new_york, pd, sbp_client):
    spark = new_york
    sid = new_stream(sbp_client)
    source = wall_clock_frame(spark)
    (source.write.format("sbp").option("pd", pd).option("stream", str(sid))
     .mode("append").save())
    back = read(spark, pd, sid)
    assert back.schema["timestamp"].dataType == TimestampType()
    timed = as_instants(source).filter("micros IS NOT NULL")
    timed_back = back.filter("CAST(value AS STRING) != 'no-time'")
    assert_df_equality(as_instants(timed_back), timed,
                       ignore_row_order=True, ignore_nullable=True)
    assert {r.value: r.micros for r in as_instants(back).collect()
            if r.value in INSTANTS} == {k: micros(v) for k, v in INSTANTS.items()}

    # A pushed filter with an NTZ literal means what Spark's CAST of the literal means (the
    # row without a time has its batch's, the time of the write, which passes it).
    after = "timestamp >= TIMESTAMP_NTZ'2026-07-01 10:00:00'"
    assert_df_equality(as_instants(timed_back.filter(after)),
                       as_instants(source.filter(after)),
                       ignore_row_order=True, ignore_nullable=True)
    assert sorted(r.value for r in as_instants(back.filter(after)).collect()) == [
        "no-time", "overlap", "summer"]


def test_streaming_ntz_timestamp_column_is_an_instant_in_the_session_zone(
        new_york, pd, sbp_client, tmp_path):
    spark = new_york
    source, target = new_stream(sbp_client), new_stream(sbp_client)
    append_values(sbp_client, source, list(WALL_CLOCK.values()))
    query = (spark.readStream.format("sbp").option("pd", pd).option("streams", str(source))
             .option("startingOffsets", "earliest").load()
             .selectExpr("value", "to_timestamp_ntz(CAST(value AS STRING)) AS timestamp")
             .writeStream.format("sbp").option("pd", pd).option("stream", str(target))
             .option("checkpointLocation", str(tmp_path / "ntz"))
             .trigger(availableNow=True).start())
    try:
        query.awaitTermination(120)
    finally:
        query.stop()
    back = read(spark, pd, target)
    by_wall = {text: micros(INSTANTS[name]) for name, text in WALL_CLOCK.items()}
    assert {r.value: r.micros for r in as_instants(back).collect()} == by_wall


def test_arrow_payload_keeps_ntz_columns_as_wall_clock(new_york, pd, sbp_client):
    spark = new_york
    sid = new_stream(sbp_client)
    source = wall_clock_frame(spark).selectExpr(
        "value", "timestamp", "timestamp AS at", "CAST(timestamp AS TIMESTAMP) AS instant")
    (source.write.format("sbp").option("pd", pd).option("stream", str(sid))
     .option("payload", "arrow").mode("append").save())
    back = read(spark, pd, sid, payload="arrow")
    types = {f.name: f.dataType for f in back.schema.fields}
    assert types["timestamp"] == TimestampNTZType() and types["at"] == TimestampNTZType()
    assert types["instant"] == TimestampType()
    assert_df_equality(back.select(*source.columns), source, ignore_row_order=True,
                       ignore_nullable=True)


def test_time_zone_option_overrides_the_session_zone(new_york, pd, sbp_client):
    spark = new_york
    sid = new_stream(sbp_client)
    source = wall_clock_frame(spark).filter("value = 'winter'")
    (source.write.format("sbp").option("pd", pd).option("stream", str(sid))
     .option("timeZone", "Asia/Tokyo").mode("append").save())
    [row] = as_instants(read(spark, pd, sid)).collect()
    assert row.micros == micros(dt.datetime(2026, 1, 1, 1, 0, tzinfo=UTC))  # 10:00 in Tokyo
