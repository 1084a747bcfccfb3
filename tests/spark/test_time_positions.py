"""Reads positioned by time (Kafka's option names) and filters on ``timestamp`` that narrow what
is fetched, through a real local Spark session against the embedded cluster."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
import pytest
from pyspark.sql import functions as F

from sbp_spark.protocol.records import encode_arrow_batch, make_records_batch
from sbp_spark.spark.options import parse_read_options
from sbp_spark.spark.pyspark_api import found
from sbp_spark.spark.reader import SbpPushdownBatchReader
from sbp_spark.spark.schemas import records_schema

from .pyspark_features import requires
from .streaming.helpers import drain_to_memory
from .test_batch import new_stream, offsets_summary, read

if found().filter_pushdown:  # Spark's filter classes came with pushdown (pyspark 4.1)
    from pyspark.sql.datasource import GreaterThanOrEqual, LessThan, LessThanOrEqual

UTC = dt.timezone.utc
T0 = 1_700_000_000_000  # ms
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)


def at(ms: int) -> dt.datetime:
    return EPOCH + dt.timedelta(milliseconds=ms)


def append_timed(client, sid: int, stamps: list[int], base_ms: int = 42) -> None:
    """One payload=records batch whose records carry ``stamps`` (their batch's base timestamp
    is far away, so only per-record timestamps can give the right answers)."""
    batch = make_records_batch(pa.array([b"v"] * len(stamps), pa.binary()),
                               timestamp=pa.array(stamps, pa.timestamp("ms")))
    client.append(sid, [encode_arrow_batch(batch, base_ms)])


@pytest.fixture(scope="module")
def timed(sbp_client):
    """A stream of 300 records, one second apart from T0, in 3 ranges of 10 batches each."""
    sid = new_stream(sbp_client)
    for r in range(3):
        for b in range(10):
            first = r * 100 + b * 10
            append_timed(sbp_client, sid, [T0 + 1000 * o for o in range(first, first + 10)])
        if r < 2:
            sbp_client.seal_range(sid)
    return sid


def test_batch_read_between_two_times(spark, pd, timed):
    df = read(spark, pd, timed, startingTimestamp=str(T0 + 124_500),
              endingTimestamp=str(T0 + 260_000))
    assert offsets_summary(df) == (135, 125, 259)
    first = df.orderBy("offset").first()
    assert first.timestamp == at(T0 + 125_000).replace(tzinfo=None)  # session time zone UTC


def test_per_stream_times_and_streams_left_unnamed(spark, pd, sbp_client, timed):
    other = new_stream(sbp_client)
    append_timed(sbp_client, other, [T0 + 5, T0 + 6, T0 + 7])
    df = read(spark, pd, f"{timed},{other}",
              startingOffsetsByTimestamp=json.dumps({str(timed): T0 + 290_000}),
              endingOffsetsByTimestamp=json.dumps({str(other): T0 + 7}))
    counts = df.groupBy("stream_id").agg(F.min("offset"), F.max("offset"), F.count("*"))
    assert sorted(tuple(r) for r in counts.collect()) == sorted(
        [(timed, 290, 299, 10), (other, 0, 1, 2)])


def test_a_time_past_every_record(spark, pd, timed):
    late = str(T0 + 300_000)
    with pytest.raises(Exception, match=(
            f"option 'startingTimestamp': stream {timed} holds no record at or after "
            rf"{late} \(2023-11-14T22:18:20.000Z\).*startingOffsetsByTimestampStrategy=latest")):
        read(spark, pd, timed, startingTimestamp=late).collect()
    assert read(spark, pd, timed, startingTimestamp=late,
                startingOffsetsByTimestampStrategy="latest").count() == 0
    # An ending time past every record ends at the stream's end, as in Kafka.
    assert offsets_summary(read(spark, pd, timed, endingTimestamp=late)) == (300, 0, 299)


def test_a_starting_time_past_the_ending_offset_names_both_options(spark, pd, timed):
    # The time resolves to offset 125; the error must say that the user's starting time, not
    # a 'startingOffsets' they never gave, lies past their ending offset.
    with pytest.raises(Exception, match=(
            rf"option 'startingTimestamp' starts stream {timed} at offset 125 \(its first "
            rf"record at or after {T0 + 124_500} .*\), past option 'endingOffsets', which "
            r"ends it at offset 100")):
        read(spark, pd, timed, startingTimestamp=str(T0 + 124_500),
             endingOffsets=json.dumps({str(timed): 100})).collect()
    # A starting time on or before the ending offset reads up to it.
    assert offsets_summary(read(spark, pd, timed, startingTimestamp=str(T0 + 95_000),
                                endingOffsets=json.dumps({str(timed): 100}))) == (5, 95, 99)


def test_a_per_stream_ending_time_before_its_starting_time_is_refused(spark, pd, sbp_client,
                                                                      timed):
    """Before, the per-stream forms read nothing for such a stream without a word, while
    endingTimestamp < startingTimestamp was refused."""
    other = new_stream(sbp_client)
    append_timed(sbp_client, other, [T0 + 5, T0 + 6, T0 + 7])
    streams = f"{timed},{other}"
    with pytest.raises(Exception, match=(
            rf"option 'endingOffsetsByTimestamp' ends stream {other} at {T0 + 6} "
            r"\(2023-11-14T22:13:20.006Z\), before option 'startingOffsetsByTimestamp' starts "
            rf"it at {T0 + 7} \(2023-11-14T22:13:20.007Z\)")):
        read(spark, pd, streams,
             startingOffsetsByTimestamp=json.dumps({str(timed): T0, str(other): T0 + 7}),
             endingOffsetsByTimestamp=json.dumps({str(other): T0 + 6})).collect()
    # one form for all streams, the other per stream
    with pytest.raises(Exception, match=(
            rf"option 'endingOffsetsByTimestamp' ends stream {timed} at {T0 + 100_000} .*, "
            rf"before option 'startingTimestamp' starts it at {T0 + 200_000}")):
        read(spark, pd, streams, startingTimestamp=str(T0 + 200_000),
             endingOffsetsByTimestamp=json.dumps({str(timed): T0 + 100_000})).collect()
    # an end equal to the start is an empty read of that stream, as with the single options
    df = read(spark, pd, streams,
              startingOffsetsByTimestamp=json.dumps({str(other): T0 + 6}),
              endingOffsetsByTimestamp=json.dumps({str(other): T0 + 6, str(timed): T0 + 2000}))
    assert sorted(tuple(r) for r in df.groupBy("stream_id").count().collect()) == [(timed, 2)]


def test_an_ending_time_before_the_starting_offset_names_both_options(spark, pd, timed):
    # The mirror of the case above: the ending time falls at offset 50, before the starting
    # offset 100. Before, the read was silently empty; Kafka's source refuses such a range.
    with pytest.raises(Exception, match=(
            rf"option 'endingTimestamp' ends stream {timed} at offset 50 \(its first record at "
            rf"or after {T0 + 50_000} .*\), before option 'startingOffsets', which starts it at "
            r"offset 100")):
        read(spark, pd, timed, startingOffsets=json.dumps({str(timed): 100}),
             endingTimestamp=str(T0 + 50_000)).collect()
    # an ending time at the starting offset's record reads nothing, past it reads up to it
    start = json.dumps({str(timed): 100})
    assert read(spark, pd, timed, startingOffsets=start,
                endingTimestamp=str(T0 + 100_000)).count() == 0
    assert offsets_summary(read(spark, pd, timed, startingOffsets=start,
                                endingTimestamp=str(T0 + 105_000))) == (5, 100, 104)


def test_streaming_query_starts_at_a_time(spark, pd, sbp_client, timed, tmp_path):
    def run(name: str, **options: str) -> list[int]:
        reader = spark.readStream.format("sbp").option("pd", pd).option("streams", str(timed))
        for key, value in options.items():
            reader = reader.option(key, value)
        drain_to_memory(reader.load(), name, tmp_path / name)
        rows = spark.sql(f"SELECT min(offset), max(offset), count(*) FROM {name}").first()
        return list(rows)

    # availableNow reads up to its end in micro-batches of 40 where pyspark has admission
    # control; before, one micro-batch of 40 (docs/streaming.md).
    assert run("from_time", startingTimestamp=str(T0 + 200_000),
               maxRecordsPerTrigger="40") == (
        [200, 299, 100] if found().admission_control else [200, 239, 40])
    assert run("from_future", startingTimestamp=str(T0 + 999_000),
               startingOffsetsByTimestampStrategy="latest") == [None, None, 0]


def planned(pd: str, sid: int, filters: list, **options: str) -> list[tuple[int, int]]:
    """The (start, end) offsets the pushdown reader plans for ``filters``."""
    opts = parse_read_options({"pd": pd, "streams": str(sid), **options})
    reader = SbpPushdownBatchReader(opts, records_schema(), frozenset({"timestamp"}))
    assert list(reader.pushFilters(filters)) == []
    return [(p.start_offset, p.end_offset) for p in reader.partitions()]


@requires("filter_pushdown")
def test_timestamp_filters_narrow_the_planned_offsets(pd, timed):
    between = [GreaterThanOrEqual(("timestamp",), at(T0 + 124_500)),
               LessThan(("timestamp",), at(T0 + 210_000))]
    assert planned(pd, timed, between, maxOutOfOrderness="0") == [(125, 200), (200, 210)]
    # The default margin (1 minute of records a second apart) keeps 60 records more per end.
    assert planned(pd, timed, between) == [(65, 100), (100, 200), (200, 270)]
    assert planned(pd, timed, between, maxOutOfOrderness="unbounded") == [
        (0, 100), (100, 200), (200, 300)]
    at_most = [LessThanOrEqual(("timestamp",), at(T0 + 5_000))]
    assert planned(pd, timed, at_most, maxOutOfOrderness="0") == [(0, 6)]
    nothing = [GreaterThanOrEqual(("timestamp",), at(T0 + 400_000))]
    assert planned(pd, timed, nothing, maxOutOfOrderness="0") == []


@requires("filter_pushdown")
def test_timestamp_pushdown_in_spark_is_exact_and_shown(spark, plain_spark, pd, sbp_client):
    # Batches out of order by up to 39 s (several writers), records one second apart inside.
    sid = new_stream(sbp_client)
    for first in (0, 40, 20, 60, 100, 80, 120):
        append_timed(sbp_client, sid, [T0 + 1000 * o for o in range(first, first + 20)])
        if first == 60:
            sbp_client.seal_range(sid)
    low, high = at(T0 + 50_000), at(T0 + 90_500)
    where = (F.col("timestamp") >= F.lit(low)) & (F.col("timestamp") <= F.lit(high))
    pushed = read(spark, pd, sid, maxOutOfOrderness="40s").filter(where)
    plan = pushed._jdf.queryExecution().explainString(
        spark._jvm.org.apache.spark.sql.execution.ExplainMode.fromString("formatted"))
    assert "GreaterThanOrEqual(timestamp,2023-11-14 22:14:10.0)" in plan
    assert "LessThanOrEqual(timestamp,2023-11-14 22:14:50.5)" in plan
    expected = sorted(r.offset for r in read(plain_spark, pd, sid).filter(where).collect())
    assert len(expected) == 41
    assert sorted(r.offset for r in pushed.select("offset").collect()) == expected
    # Narrowed to the records within 40 s of the bounds: fewer records fetched than stored.
    opts = {"maxOutOfOrderness": "40s"}
    spans = planned(pd, sid, [GreaterThanOrEqual(("timestamp",), low),
                              LessThanOrEqual(("timestamp",), high)], **opts)
    assert spans == [(10, 80), (80, 131)]


@requires("filter_pushdown")
def test_a_backfill_older_than_the_margin_stops_the_narrowing(pd, sbp_client):
    # Live records, then a backfill of records an hour older: a search that only looked at the
    # backfill would place 'timestamp >= X' past every live record and drop those that match.
    sid = new_stream(sbp_client)
    for first in range(0, 40, 10):
        append_timed(sbp_client, sid, [T0 + 1000 * o for o in range(first, first + 10)])
    for first in range(0, 80, 10):
        append_timed(sbp_client, sid, [T0 - 3_600_000 + o for o in range(first, first + 10)])
    newest = [GreaterThanOrEqual(("timestamp",), at(T0 + 35_000))]
    assert planned(pd, sid, newest) == [(0, 120)]  # the whole span: nothing dropped
    # Told the data can be that far out of order, the margin covers it just the same.
    assert planned(pd, sid, newest, maxOutOfOrderness="2h") == [(0, 120)]


@requires("filter_pushdown")
def test_timestamp_filters_on_arrow_data_whose_older_batches_have_a_timestamp_column(
        pd, sbp_client):
    # The older batch was copied from another stream with its 'timestamp' column (2020); the
    # newest batch has none, so the inferred read schema's 'timestamp' is the metadata column,
    # and the filter on it is pushed. Every row must then carry the metadata timestamp the
    # filter was applied to, not the older batch's own column.
    from sbp_spark.protocol.records import PAYLOAD_ARROW, with_payload_kind
    from sbp_spark.spark.schemas import arrow_payload_schema

    sid = new_stream(sbp_client)
    copied = pa.record_batch({"id": pa.array([1, 2], pa.int64()),
                              "timestamp": pa.array([1_577_836_800_000_000] * 2,
                                                    pa.timestamp("us", tz="UTC"))})
    newest = pa.record_batch({"id": pa.array([3], pa.int64())})
    for body, base_ms in ((copied, T0), (newest, T0 + 1000)):
        sbp_client.append(sid, [encode_arrow_batch(with_payload_kind(body, PAYLOAD_ARROW),
                                                   base_ms)])
    schema = arrow_payload_schema(newest.schema)
    assert schema.fieldNames() == ["id", "stream_id", "offset", "timestamp"]

    def rows(**options: str) -> list[tuple]:
        opts = parse_read_options({"pd": pd, "streams": str(sid), "payload": "arrow",
                                   **options})
        reader = SbpPushdownBatchReader(opts, schema, frozenset({"stream_id", "offset",
                                                                 "timestamp"}))
        assert list(reader.pushFilters([GreaterThanOrEqual(("timestamp",), at(T0))])) == []
        return [(row["id"], row["timestamp"]) for p in reader.partitions()
                for batch in reader.read(p) for row in batch.to_pylist()]

    # the copied batch alone (2020 is not >= T0: a row shown with it breaks the filter)
    assert rows(endingOffsets=f'{{"{sid}": 2}}') == [(1, at(T0)), (2, at(T0))]
    # with the newest batch, combined into one output batch
    assert rows() == [(1, at(T0)), (2, at(T0)), (3, at(T0 + 1000))]


@requires("filter_pushdown")
def test_records_out_of_order_inside_a_batch_stop_the_narrowing_too(pd, sbp_client):
    # One batch holds a record 150 s behind one stored before it in the same batch (events
    # collected late and sent together). The search for 'timestamp < 200 s' (+ the 1 minute
    # margin) lands on the 300 s record and ended the read there, dropping the 150 s record the
    # filter keeps: the guard compared only whole batches (each one's earliest record with the
    # latest of those before it), so the disorder it had read in that very batch went unseen.
    sid = new_stream(sbp_client)
    for stamps in ([0, 1, 2, 3], [100, 300, 150, 310], [400, 401, 402, 403]):
        append_timed(sbp_client, sid, [T0 + 1000 * s for s in stamps])
    below = [LessThan(("timestamp",), at(T0 + 200_000))]
    assert planned(pd, sid, below) == [(0, 12)]  # the whole span: nothing dropped
    # Told the data can be that far out of order, the margin covers it: narrowed, exactly.
    assert planned(pd, sid, below, maxOutOfOrderness="3m") == [(0, 8)]


@requires("filter_pushdown")
def test_a_read_by_time_while_retention_expires_the_oldest_records(pd, sbp_client, sbp_cluster):
    # Range servers delete expired records first and tell the PD a moment later. A read by
    # time planned in between failed with OFFSET_OUT_OF_RANGE ("offset 25 of stream 1 is below
    # the start 35"); it now starts at the first record still stored.
    from tests.client.test_timesearch import _expire_on_range_servers

    sid = new_stream(sbp_client)
    for b in range(10):
        append_timed(sbp_client, sid, [T0 + 10 * b + i for i in range(10)])
    _expire_on_range_servers(sbp_cluster, sid, 35)
    assert planned(pd, sid, [], startingTimestamp=str(T0)) == [(35, 100)]
    assert planned(pd, sid, [GreaterThanOrEqual(("timestamp",), at(T0))]) == [(35, 100)]
    assert planned(pd, sid, [], startingTimestamp=str(T0 + 50)) == [(50, 100)]


def test_arrow_data_with_its_own_timestamp_column(spark, pd, sbp_client, caplog):
    # payload=arrow rows with an event-time column of their own named 'timestamp' (2020),
    # stored in 2023 (T0 on): a filter on the column selects by its values (Spark's, never
    # pushed), while the time options position by the stored time, and say so.
    from sbp_spark.spark.reader import metadata_columns_of
    from sbp_spark.spark.schemas import arrow_payload_schema

    from .streaming.helpers import append_arrow

    sid = new_stream(sbp_client)
    events = [dt.datetime(2020, 1, 1, tzinfo=UTC), dt.datetime(2020, 6, 1, tzinfo=UTC),
              dt.datetime(2020, 12, 1, tzinfo=UTC)]
    for i, event in enumerate(events):
        batch = pa.record_batch({"id": pa.array([i], pa.int64()),
                                 "timestamp": pa.array([event], pa.timestamp("us", tz="UTC"))})
        append_arrow(sbp_client, sid, batch, timestamp_ms=T0 + 1000 * i)

    def ids(df) -> list[int]:
        return [r.id for r in df.orderBy("offset").collect()]

    arrow = {"payload": "arrow"}
    since = "timestamp >= '2020-05-01'"
    filtered = read(spark, pd, sid, **arrow).where(since)
    assert ids(filtered) == [1, 2]  # by the column's values
    plan = filtered._jdf.queryExecution().explainString(
        spark._jvm.org.apache.spark.sql.execution.ExplainMode.fromString("formatted"))
    assert "GreaterThanOrEqual(timestamp" not in plan
    assert [r.timestamp for r in filtered.orderBy("offset").collect()] == [
        e.replace(tzinfo=None) for e in events[1:]]  # the session runs in UTC
    # Positions are stored times: every batch was stored after the event time asked for...
    event_ms = int(dt.datetime(2020, 5, 1, tzinfo=UTC).timestamp() * 1000)
    assert ids(read(spark, pd, sid, startingTimestamp=str(event_ms), **arrow)) == [0, 1, 2]
    # ... and a stored time starts at the batch stored then.
    assert ids(read(spark, pd, sid, startingTimestamp=str(T0 + 1000), **arrow)) == [1, 2]

    # Which the planning driver says in a warning (it read by stored time silently).
    schema = arrow_payload_schema(pa.schema([("id", pa.int64()),
                                             ("timestamp", pa.timestamp("us", tz="UTC"))]))
    metadata = metadata_columns_of(schema, "arrow", ("id", "timestamp"))
    options = parse_read_options({"pd": pd, "streams": str(sid), "payload": "arrow",
                                  "startingTimestamp": str(event_ms)})
    with caplog.at_level("WARNING", logger="sbp_spark.spark.reader"):
        SbpPushdownBatchReader(options, schema, metadata).partitions()
    assert (f"'startingTimestamp' position payload=arrow streams {sid} by the time each batch "
            "was stored (its writer's clock at the write), not by the data's own column "
            "'timestamp'; to read the rows whose 'timestamp' is in a span, filter on it") \
        in caplog.text
    caplog.clear()
    plain = parse_read_options({"pd": pd, "streams": str(sid), "payload": "arrow"})
    with caplog.at_level("WARNING", logger="sbp_spark.spark.reader"):
        SbpPushdownBatchReader(plain, schema, metadata).partitions()
    assert "stored" not in caplog.text
