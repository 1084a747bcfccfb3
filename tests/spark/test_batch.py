"""format("sbp") end to end: a real local[2] Spark session against an embedded cluster.

Few, meaty tests: each Spark query costs ~0.3 s.
"""

from __future__ import annotations

import datetime as dt
import json
import time

import pyarrow as pa
import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as F
from pyspark.sql.types import IntegerType, MapType, StringType

from sbp_spark.protocol.records import (
    PAYLOAD_ARROW,
    PAYLOAD_RECORDS,
    encode_arrow_batch,
    encode_batch,
    make_records_batch,
    with_payload_kind,
)

from .pyspark_features import requires

UTC = dt.timezone.utc


def append_values(client, stream_id, values, timestamp_ms=1_000):
    """Append one payload=records batch straight through the client."""
    batch = make_records_batch(pa.array(values, pa.binary()))
    return client.open_stream(stream_id).append([encode_arrow_batch(batch, timestamp_ms)])


def new_stream(client, **kwargs) -> int:
    return client.create_streams(1, **kwargs)[0].stream_id


def read(session, pd, streams, **options):
    reader = session.read.format("sbp").option("pd", pd).option("streams", str(streams))
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def offsets_summary(df):
    row = df.agg(F.count("*").alias("n"), F.min("offset").alias("lo"),
                 F.max("offset").alias("hi")).collect()[0]
    return row.n, row.lo, row.hi


@pytest.fixture(scope="module")
def three_ranges(sbp_client):
    """A stream of 300 records in three ranges (100 each), batch timestamps 1 s, 2 s, 3 s."""
    sid = new_stream(sbp_client)
    for i in range(3):
        append_values(sbp_client, sid, [f"r{i}-{j}".encode() for j in range(100)],
                      timestamp_ms=(i + 1) * 1000)
        if i < 2:
            sbp_client.seal_range(sid)
    assert [r.range_index for r in sbp_client.list_ranges(sid)] == [0, 1, 2]
    return sid


def test_records_round_trip_across_ranges_and_servers(spark, plain_spark, pd, sbp_client):
    s1, s2 = new_stream(sbp_client), new_stream(sbp_client)
    n = 120_000
    source = spark.range(n).select(
        F.col("id"),
        F.when(F.col("id") % 7 == 0, F.lit(None).cast("binary"))
         .otherwise(F.col("id").cast("string").cast("binary")).alias("key"),
        F.concat(F.lit("value-"), F.col("id").cast("string")).alias("value"),
        F.when(F.col("id") % 3 == 0, F.array(F.struct(
            F.lit("h").alias("key"), F.col("id").cast("string").alias("value"))))
         .alias("headers"),
        F.timestamp_millis(F.lit(1_700_000_000_000) + F.col("id")).alias("timestamp"),
        F.when(F.col("id") % 2 == 0, F.lit(s1)).otherwise(F.lit(s2)).alias("stream_id"),
    )
    first, second = source.filter("id < 60000"), source.filter("id >= 60000")
    (first.drop("stream_id").write.format("sbp").option("pd", pd).option("stream", str(s1))
     .option("batchMaxRecords", "7000").mode("append").save())
    sbp_client.seal_range(s1)  # the rest of s1 goes to a new range, on another server
    # the second half routes itself: even ids to s1, odd ids to s2
    second.write.format("sbp").option("pd", pd).option("compression", "lz4").mode("append").save()

    ranges = sbp_client.list_ranges(s1)
    assert len(ranges) == 2
    assert ranges[0].primary.advertise_addr != ranges[1].primary.advertise_addr

    df = read(spark, pd, f"{s1},{s2}", includeHeaders="true")
    assert df.columns == ["stream_id", "range_index", "offset", "timestamp", "key", "value",
                          "headers"]
    assert df.rdd.getNumPartitions() == 3
    stats = {r.stream_id: r for r in df.groupBy("stream_id").agg(
        F.count("*").alias("n"), F.min("offset").alias("lo"), F.max("offset").alias("hi"),
        F.collect_set("range_index").alias("ranges")).collect()}
    assert (stats[s1].n, stats[s1].lo, stats[s1].hi) == (90_000, 0, 89_999)
    assert sorted(stats[s1].ranges) == [0, 1]
    assert (stats[s2].n, stats[s2].lo, stats[s2].hi) == (30_000, 0, 29_999)

    expected = source.select(
        F.when(F.col("id") < 60000, F.lit(s1)).otherwise(F.col("stream_id"))
         .cast("long").alias("stream_id"),
        "timestamp", "key", F.col("value").cast("binary").alias("value"),
        F.transform("headers", lambda h: F.struct(
            h["key"].alias("key"), h["value"].cast("binary").alias("value"))).alias("headers"))
    got = df.drop("range_index", "offset")
    # 120k rows, compared inside Spark (chispa would compare them row by row in Python): the
    # counts agree (above), so an empty difference one way means equal multisets
    assert got.exceptAll(expected).count() == 0
    assert_df_equality(got.filter(F.col("timestamp") < F.lit(dt.datetime(2023, 11, 14, 22, 13,
                                                                          20, 100_000))),
                       expected.filter("timestamp < TIMESTAMP'2023-11-14 22:13:20.100'"),
                       ignore_row_order=True, ignore_nullable=True)

    # the same data through the automatically discovered source (no pushdown setting)
    plain = read(plain_spark, pd, f"{s1},{s2}")
    assert plain.columns == ["stream_id", "range_index", "offset", "timestamp", "key", "value"]
    assert plain.filter(F.col("offset") < 10).count() == 20


def test_typed_arrow_payload_round_trip(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    source = spark.range(5000).selectExpr(
        "id",
        "CAST(id * 1.25 AS DECIMAL(20, 4)) AS price",
        "IF(id % 5 = 0, NULL, array(CAST(id AS STRING), 'x')) AS tags",
        "IF(id % 4 = 0, NULL, map('k', CAST(id AS INT))) AS attrs",
        "named_struct('x', CAST(id AS DOUBLE), 'label', IF(id % 2 = 0, NULL, 'odd')) AS point",
        "IF(id % 3 = 0, NULL, timestamp_micros(1700000000000000 + id * 1001)) AS ts",
        "date_add(DATE'2024-01-01', CAST(id % 400 AS INT)) AS day",
        "IF(id % 10 = 0, 'rare', NULL) AS mostly_null",
        "CAST(CAST(id AS STRING) AS BINARY) AS blob",
        "array(named_struct('a', CAST(id AS INT), 'b', array(id, id + 1))) AS nested",
    )
    (source.write.format("sbp").option("pd", pd).option("stream", str(sid))
     .option("payload", "arrow").option("compression", "zstd").option("batchMaxRecords", "1500")
     .mode("append").save())

    df = read(spark, pd, sid, payload="arrow")
    assert df.columns == source.columns + ["stream_id", "offset", "timestamp"]
    # the same map type, its values nullable as every inferred nested field is
    assert df.schema["attrs"].dataType == MapType(StringType(), IntegerType(), True)

    def sortable(frame):  # Spark cannot sort rows by a map column
        return frame.withColumn("attrs", F.map_entries("attrs"))

    assert_df_equality(sortable(df.drop("stream_id", "offset", "timestamp")), sortable(source),
                       ignore_row_order=True, ignore_nullable=True)
    assert offsets_summary(df) == (5000, 0, 4999)

    # the schema given by the user: a subset, reordered, with a metadata column
    typed = (spark.read.format("sbp").option("pd", pd).option("streams", str(sid))
             .option("payload", "arrow").schema("offset BIGINT, tags ARRAY<STRING>, id BIGINT")
             .load())
    assert_df_equality(typed.drop("offset"), source.select("tags", "id"),
                       ignore_row_order=True, ignore_nullable=True)
    # a column no batch has: nulls (nullable), an error naming it (NOT NULL)
    missing = (spark.read.format("sbp").option("pd", pd).option("streams", str(sid))
               .option("payload", "arrow").schema("id BIGINT, missing INT").load())
    assert missing.where("missing IS NOT NULL").count() == 0 and missing.count() == 5000
    with pytest.raises(Exception, match=r"offset 0: .*column 'missing' is missing from the "
                                        "stored batch and the read schema says it cannot be"):
        (spark.read.format("sbp").option("pd", pd).option("streams", str(sid))
         .option("payload", "arrow").schema("id BIGINT, missing INT NOT NULL").load().collect())
    with pytest.raises(Exception, match="holds payload=arrow.*read it with payload=arrow"):
        read(spark, pd, sid).collect()


def test_starting_and_ending_offsets(spark, pd, three_ranges):
    sid = three_ranges
    assert offsets_summary(read(spark, pd, sid)) == (300, 0, 299)
    assert offsets_summary(read(spark, pd, sid, startingOffsets="earliest",
                                endingOffsets="latest")) == (300, 0, 299)
    assert offsets_summary(read(spark, pd, sid, startingOffsets=json.dumps({str(sid): 150}),
                                endingOffsets=json.dumps({str(sid): 250}))) == (100, 150, 249)
    assert offsets_summary(read(spark, pd, sid, startingOffsets=json.dumps({str(sid): -2}),
                                endingOffsets=json.dumps({str(sid): 5}))) == (5, 0, 4)
    split = read(spark, pd, sid, maxRecordsPerPartition="40")
    assert split.rdd.getNumPartitions() == 9
    assert offsets_summary(split) == (300, 0, 299)
    assert read(spark, pd, sid, minPartitions="6").rdd.getNumPartitions() == 6
    with pytest.raises(Exception, match="from offset 400, but the stream ends at offset 300"):
        read(spark, pd, sid, startingOffsets=json.dumps({str(sid): 400})).collect()


def test_trimmed_streams_and_fail_on_data_loss(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    for i in range(3):
        append_values(sbp_client, sid, [b"v"] * 100, timestamp_ms=1000 * (i + 1))
    assert sbp_client.trim_stream(sid, 100).start_offset == 100
    assert offsets_summary(read(spark, pd, sid)) == (200, 100, 299)
    below = json.dumps({str(sid): 50})
    with pytest.raises(Exception, match="offsets below 100 were trimmed away.*failOnDataLoss"):
        read(spark, pd, sid, startingOffsets=below).collect()
    assert offsets_summary(read(spark, pd, sid, startingOffsets=below,
                                failOnDataLoss="false")) == (200, 100, 299)


def test_records_expired_before_the_pd_heard_of_it(spark, pd, sbp_cluster, sbp_client):
    """Retention deletes records on a range server, which tells the PD a moment later: a read
    planned in between asks for records the server no longer has. failOnDataLoss=false skips
    them as it skips any trimmed records; true fails saying so."""
    sid = new_stream(sbp_client, retention_ms=60_000)
    for i in range(3):
        append_values(sbp_client, sid, [b"v"] * 100, timestamp_ms=1000 * (i + 1))
    holder = sbp_client.list_ranges(sid)[0].primary.advertise_addr
    server = next(rs for rs in sbp_cluster.range_servers
                  if rs is not None and rs.advertise_addr == holder)
    (range_log,) = server.storage.stream_ranges(sid)
    # what the server's retention pass does, before it reports the new start to the PD
    assert range_log.expire(60_000, now_ms=int(time.time() * 1000) + 3_600_000) == 300
    assert sbp_client.describe_stream(sid).start_offset == 0  # the PD has not heard yet
    assert read(spark, pd, sid, failOnDataLoss="false").count() == 0
    with pytest.raises(Exception, match=r"records from offset 0 were trimmed.*"
                                        "below the start 300.*failOnDataLoss=false"):
        read(spark, pd, sid).collect()
    sbp_client.trim_stream(sid, 300)  # the report arrives


@requires("filter_pushdown")
def test_filter_pushdown_prunes_and_stays_correct(spark, plain_spark, pd, sbp_client,
                                                  three_ranges):
    sid = three_ranges
    other = new_stream(sbp_client)
    append_values(sbp_client, other, [b"o"] * 10, timestamp_ms=5000)
    streams = f"{sid},{other}"
    where = (f"offset >= 120 AND offset < 130 AND stream_id IN ({sid}, 424242)")
    pushed = read(spark, pd, streams).filter(where)
    plan = pushed._jdf.queryExecution().explainString(
        spark._jvm.org.apache.spark.sql.execution.ExplainMode.fromString("formatted"))
    assert "PushedFilters: [" in plan and "GreaterThanOrEqual(offset,120)" in plan
    assert pushed.rdd.getNumPartitions() == 1  # only range 1 of stream sid is read
    assert offsets_summary(pushed) == (10, 120, 129)
    assert offsets_summary(read(plain_spark, pd, streams).filter(where)) == (10, 120, 129)

    after = dt.datetime(1970, 1, 1, 0, 0, 2, tzinfo=UTC)
    by_time = read(spark, pd, streams).filter(F.col("timestamp") >= F.lit(after))
    assert by_time.groupBy("stream_id").count().orderBy("stream_id").collect() == [
        (sid, 200), (other, 10)]
    # IN on offsets with many values, plus a timestamp bound: rows filtered exactly
    many = list(range(0, 300, 3))
    exact = read(spark, pd, streams).filter(F.col("offset").isin(many)
                                            & (F.col("timestamp") < F.lit(after)))
    rows = sorted((r.stream_id, r.offset) for r in exact.select("stream_id", "offset").collect())
    assert rows == [(sid, o) for o in many if o < 100]
    plain_plan = read(plain_spark, pd, streams).filter(where)._jdf.queryExecution() \
        .explainString(spark._jvm.org.apache.spark.sql.execution.ExplainMode.fromString(
            "formatted"))
    assert "PushedFilters" not in plain_plan


def test_opaque_records_and_create_if_missing(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    sbp_client.open_stream(sid).append(
        [encode_batch(f"line {i}".encode(), 1, 10_000 + i) for i in range(25)])
    df = read(spark, pd, sid)
    rows = df.orderBy("offset").select("offset", "timestamp", "key", "value").collect()
    assert [r.value for r in rows] == [f"line {i}".encode() for i in range(25)]
    assert rows[3].timestamp == dt.datetime(1970, 1, 1, 0, 0, 10, 3000)  # session time zone UTC
    assert all(r.key is None for r in rows)

    # createIfMissing without a target: the rows go to a new stream (the next id)
    (spark.range(1000).selectExpr("CAST(id AS STRING) AS value").write.format("sbp")
     .option("pd", pd).option("createIfMissing", "true").option("replicas", "1")
     .option("retentionMs", "3600000").mode("append").save())
    created = sbp_client.describe_streams([sid + 1])[0]
    assert created.retention_period_ms == 3_600_000
    assert offsets_summary(read(spark, pd, sid + 1)) == (1000, 0, 999)

    # A write refused for its columns creates no stream: each attempt used to leave an empty
    # one behind.
    before = [s.stream_id for s in sbp_client.list_streams()]
    for _ in range(2):
        with pytest.raises(Exception, match="a 'value' column"):
            (spark.range(3).write.format("sbp").option("pd", pd)
             .option("createIfMissing", "true").mode("append").save())
    assert [s.stream_id for s in sbp_client.list_streams()] == before


def test_errors_name_the_problem(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    def base():  # DataFrameReader.option() changes the reader: start afresh every time
        return spark.read.format("sbp").option("pd", pd)

    with pytest.raises(Exception, match="unknown option 'fetchmaxbyte'.*did you mean "
                                        "'fetchMaxBytes'"):
        base().option("streams", str(sid)).option("fetchMaxByte", "1").load()
    with pytest.raises(Exception, match="option 'fetchMaxBytes' = 'lots' is not valid"):
        base().option("streams", str(sid)).option("fetchMaxBytes", "lots").load()
    with pytest.raises(Exception, match="option 'streams' is required"):
        base().load()
    with pytest.raises(Exception, match="stream 987654 does not exist"):
        base().option("streams", f"{sid},987654").load().collect()
    # an id the wire cannot carry is refused as a value of the option, not as a request
    with pytest.raises(Exception, match="option 'streams' = '99999999999999999999' is not valid"):
        base().option("streams", "99999999999999999999").load().collect()

    rows = spark.range(3).selectExpr("CAST(id AS STRING) AS value")

    def writer():
        return rows.write.format("sbp").option("pd", pd)

    with pytest.raises(Exception, match="cannot overwrite.*append-only"):
        writer().option("stream", str(sid)).mode("overwrite").save()
    with pytest.raises(Exception, match="stream 987654 does not exist"):
        writer().option("stream", "987654").mode("append").save()
    with pytest.raises(Exception, match="needs a target stream"):
        writer().mode("append").save()
    with pytest.raises(Exception, match="a 'value' column"):
        (spark.range(3).write.format("sbp").option("pd", pd).option("stream", str(sid))
         .mode("append").save())
    with pytest.raises(Exception, match="ErrorIfExists"):  # Spark refuses the default mode
        writer().option("stream", str(sid)).save()
    assert read(spark, pd, sid).count() == 0



def test_empty_array_and_map_columns_are_refused_naming_them(spark, pd, sbp_client):
    # Spark types array() and map() with void elements that are never null, which pyarrow
    # cannot build: such a write went through and every read of the stream then failed with a
    # bare "A null type field may not be non-nullable". The write is refused, naming the
    # column; data a foreign writer stored that way is read with its elements nullable, as
    # every inferred nested field is.
    sid = new_stream(sbp_client)
    for column in ("array() AS none", "map() AS none"):
        with pytest.raises(Exception, match="column 'none' is .*no read could give it back"):
            (spark.range(3).selectExpr("id", column).write.format("sbp").option("pd", pd)
             .option("stream", str(sid)).option("payload", "arrow").mode("append").save())
    # The type Spark writes for array(), stored by another writer through the IPC format.
    void = pa.list_(pa.field("element", pa.null()).with_nullable(False))
    stored = pa.record_batch([pa.array([1]), pa.array([[]], pa.list_(pa.null())).cast(void)],
                             names=["id", "none"])
    sbp_client.append(sid, [encode_arrow_batch(with_payload_kind(stored, PAYLOAD_ARROW))])
    assert [tuple(r) for r in read(spark, pd, sid, payload="arrow").select("id", "none")
            .collect()] == [(1, [])]


def test_record_times_before_1970_keep_their_millisecond(spark, pd, sbp_client):
    """Record times are stored in whole ms, finer digits dropped toward the past as Spark's own
    conversions do. Before, a time before 1970 was cut toward zero: 1969-12-31 23:59:59.9995
    came back as 1970-01-01 00:00:00, a day and a year later, and left a filter on the year."""
    sid = new_stream(sbp_client)
    written = spark.sql(
        "SELECT 'a' AS value, TIMESTAMP'1969-12-31 23:59:59.9995' AS timestamp UNION ALL "
        "SELECT 'b', TIMESTAMP'1969-07-20 20:17:40.000999' UNION ALL "
        "SELECT 'c', TIMESTAMP'1970-01-01 00:00:00.0015'")
    (written.coalesce(1).write.format("sbp").option("pd", pd).option("stream", str(sid))
     .mode("append").save())
    # ns times of another writer are floored to Spark's microseconds the same way
    other = with_payload_kind(pa.record_batch({
        "value": pa.array([b"d"]), "timestamp": pa.array([-1_000_500], pa.timestamp("ns"))}),
        PAYLOAD_RECORDS)
    sbp_client.open_stream(sid).append([encode_arrow_batch(other, 1_000)])
    got = read(spark, pd, sid).orderBy("offset").select(
        F.col("value").cast("string").alias("value"), "timestamp")
    expected = spark.sql(
        "SELECT 'a' AS value, TIMESTAMP'1969-12-31 23:59:59.999' AS timestamp UNION ALL "
        "SELECT 'b', TIMESTAMP'1969-07-20 20:17:40' UNION ALL "
        "SELECT 'c', TIMESTAMP'1970-01-01 00:00:00.001' UNION ALL "
        "SELECT 'd', TIMESTAMP'1969-12-31 23:59:59.998999'")
    assert_df_equality(got, expected, ignore_nullable=True)
    # positions by time and pushed filters on timestamp see the same times
    before = read(spark, pd, sid).where("timestamp < TIMESTAMP'1970-01-01 00:00:00'")
    assert sorted(r.value for r in before.collect()) == [b"a", b"b", b"d"]
    assert [r.value for r in read(spark, pd, sid, endingTimestamp="0").collect()] == [b"a", b"b"]


def test_a_failing_task_says_what_it_had_appended(spark, pd, sbp_client):
    # A task that fails after some of its appends landed leaves them in the stream, but Spark's
    # abort hears only from the tasks that succeeded: the user was told "records the
    # successful tasks appended stay: nothing" while the stream held 10,000 records. The
    # task's error now says what it had appended. Here the first 10,000 rows (one Arrow batch
    # from Spark, 20 MB: one append) land, then a value too large for any record batch fails
    # the task.
    sid = new_stream(sbp_client)
    rows = spark.range(10_001, numPartitions=1).selectExpr(
        "IF(id = 10000, repeat('x', 17000000), repeat('y', 2000)) AS value")
    with pytest.raises(Exception) as failure:
        (rows.write.format("sbp").option("pd", pd).option("stream", str(sid))
         .mode("append").save())
    message = str(failure.value)
    assert "one record needs" in message
    stored = sum(b.header.record_count for b in sbp_client.read(sid))
    assert stored == 10_000
    assert (f"before it failed, this task had appended to stream {sid}: {stored} records"
            in message), message[-3000:]
    assert "a retry of the task appends them again" in message
