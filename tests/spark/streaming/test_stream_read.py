"""readStream.format("sbp") end to end: local[2] Spark against the embedded cluster.

Each streaming query costs a second or more, so tests are few and each checks several things.
"""

from __future__ import annotations

import ast
import json

import pytest
from pyspark.errors import StreamingQueryException

from sbp_spark.client import SbpClient
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.spark.pyspark_api import found
from sbp_spark.spark.streaming.offsets import from_spark
from tests.rewrite import rewrite_history

from ..pyspark_features import requires
from .helpers import append_values, memory_values, new_stream, wait_for


def stream_df(spark, pd, streams, **options):
    reader = (spark.readStream.format("sbp").option("pd", pd)
              .option("streams", ",".join(str(s) for s in streams)))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load()


def to_memory(df, name, checkpoint, **trigger):
    return (df.writeStream.format("memory").queryName(name)
            .option("checkpointLocation", str(checkpoint)).trigger(**trigger).start())


def values_to_parquet(spark, pd, streams, tmp_path, **options) -> None:
    """One availableNow run of a query writing the streams' values (as strings) to
    ``tmp_path/out``, checkpointed in ``tmp_path/ck``; raises what the query failed with."""
    query = (stream_df(spark, pd, streams, startingOffsets="earliest", **options)
             .selectExpr("CAST(value AS STRING) AS v")
             .writeStream.format("parquet").option("path", str(tmp_path / "out"))
             .option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
    query.awaitTermination(120)


def source_progress(query):
    """(numInputRows, endOffset, latestOffset) of each micro-batch that read rows."""
    out = []
    for progress in query.recentProgress:
        source = progress["sources"][0]
        if progress["numInputRows"]:
            out.append((progress["numInputRows"], _json(source["endOffset"]),
                        _json(source["latestOffset"])))
    return out


def _json(value):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        # pyspark 4.0 and 4.1 show a source's offsets in the progress as Python's text of
        # the dict instead of JSON.
        return ast.literal_eval(value)


@requires("admission_control")
def test_available_now_spreads_a_row_limit_over_skewed_streams(spark, pd, sbp_client, tmp_path):
    big, small = new_stream(sbp_client), new_stream(sbp_client)
    append_values(sbp_client, big, [f"big-{i}" for i in range(50)], timestamp_ms=1_000)
    append_values(sbp_client, big, [f"big-{i}" for i in range(50, 100)], timestamp_ms=4_000)
    append_values(sbp_client, small, [f"small-{i}" for i in range(20)], timestamp_ms=5_000)
    query = to_memory(
        stream_df(spark, pd, [big, small], startingOffsets="earliest", maxRecordsPerTrigger=30),
        "skewed", tmp_path / "ck", availableNow=True)
    # written after availableNow fixed its target: not read by this run
    query.awaitTermination(120)
    append_values(sbp_client, big, ["late"])

    batches = source_progress(query)
    assert [rows for rows, _, _ in batches] == [30, 30, 30, 30]
    # the first micro-batch shares 30 rows by backlog (100:20), keys in numeric order
    rows, end, latest = batches[0]
    streams = [key for key in end if key != "ranges"]
    assert streams == sorted(streams, key=int) and list(end)[-1] == "ranges"
    assert end == {str(big): 25, str(small): 5, "ranges": {str(big): 0, str(small): 0}}
    # lag is reported, never part of the offsets: the next record of 'big' (offset 25) was
    # written at 1 s, its newest at 4 s
    assert latest[str(big)] == {"latestOffset": 100, "recordsBehind": 75,
                                "msBehindLatest": 3_000}
    assert latest[str(small)] == {"latestOffset": 20, "recordsBehind": 15,
                                  "msBehindLatest": 0}
    assert from_spark(batches[-1][1]) == {big: 100, small: 20}
    values = memory_values(spark, "skewed")
    assert sorted(values) == sorted([f"big-{i}" for i in range(100)]
                                    + [f"small-{i}" for i in range(20)])


@requires("admission_control")
def test_available_now_with_a_byte_limit(spark, pd, sbp_client, tmp_path):
    sid = new_stream(sbp_client)
    lengths = {append_values(sbp_client, sid, [f"{i}-{j:04d}" for j in range(10)])[0]
               .batch_length for i in range(9)}
    (batch_length,) = lengths  # every stored batch has the same size
    # 90 records in batches of 10; a budget of two stored batches admits 20 records
    query = to_memory(stream_df(spark, pd, [sid], startingOffsets="earliest",
                                maxBytesPerTrigger=2 * batch_length),
                      "bytes", tmp_path / "ck", availableNow=True)
    query.awaitTermination(120)
    assert [rows for rows, _, _ in source_progress(query)] == [20, 20, 20, 20, 10]
    assert len(memory_values(spark, "bytes")) == 90


def test_processing_time_follows_new_records_and_seals(spark, pd, sbp_client, tmp_path):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["before-start"])
    query = to_memory(stream_df(spark, pd, [sid]), "live", tmp_path / "ck",
                      processingTime="0 seconds")
    try:
        # startingOffsets defaults to latest: the record written before the start is not read
        wait_for(lambda: query.lastProgress is not None, what="the first trigger")
        append_values(sbp_client, sid, ["a1", "a2"])
        wait_for(lambda: len(memory_values(spark, "live")) == 2, what="the first records")
        sbp_client.seal_range(sid)  # between micro-batches: the next records go to range 1
        append_values(sbp_client, sid, ["b1"])
        sbp_client.seal_range(sid)
        append_values(sbp_client, sid, ["c1", "c2"])
        wait_for(lambda: len(memory_values(spark, "live")) == 5, what="records after seals")
    finally:
        query.stop()
    rows = spark.sql("SELECT CAST(value AS STRING) v, range_index, offset FROM live "
                     "ORDER BY offset").collect()
    assert [(r.v, r.range_index, r.offset) for r in rows] == [
        ("a1", 0, 1), ("a2", 0, 2), ("b1", 1, 3), ("c1", 2, 4), ("c2", 2, 5)]


def test_max_records_per_trigger_holds_under_every_trigger(spark, pd, sbp_client, tmp_path):
    # On every pyspark: Spark passes the limit where it has admission control (4.2+), and the
    # source applies it itself before (docs/streaming.md, "Triggers on each pyspark").
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, [f"r{i}" for i in range(25)])
    limited = stream_df(spark, pd, [sid], startingOffsets="earliest", maxRecordsPerTrigger=10)
    query = to_memory(limited, "limited", tmp_path / "ck", processingTime="0 seconds")
    try:
        wait_for(lambda: len(memory_values(spark, "limited")) == 25, what="every record")
    finally:
        query.stop()
    assert [rows for rows, _, _ in source_progress(query)] == [10, 10, 5]
    # Trigger.Once reads everything there in one micro-batch where Spark passes "all
    # available"; before, one micro-batch within the limit (the rest waits for the next run).
    once = to_memory(limited, "limited_once", tmp_path / "ck-once", once=True)
    once.awaitTermination(120)
    assert [rows for rows, _, _ in source_progress(once)] == (
        [25] if found().admission_control else [10])


def test_starting_offsets_latest_named_explicitly(spark, pd, sbp_client, tmp_path):
    # "latest" (and -1 for one stream) is a streaming read's own starting point; load() runs
    # the source's schema(), which cannot tell a streaming read from a batch one, and refused
    # it as a batch read would.
    at_end, by_offset = new_stream(sbp_client), new_stream(sbp_client)
    append_values(sbp_client, at_end, ["end-old"])
    append_values(sbp_client, by_offset, ["offset-0", "offset-1"])
    df = stream_df(spark, pd, [at_end, by_offset], startingOffsets="latest")
    assert df.isStreaming
    query = to_memory(
        stream_df(spark, pd, [at_end, by_offset],
                  startingOffsets=json.dumps({str(at_end): -1, str(by_offset): 1})),
        "explicit", tmp_path / "ck", processingTime="0 seconds")
    try:
        wait_for(lambda: "offset-1" in memory_values(spark, "explicit"),
                 what="the record at the given offset")
        append_values(sbp_client, at_end, ["end-new"])
        wait_for(lambda: len(memory_values(spark, "explicit")) == 2, what="the new record")
    finally:
        query.stop()
    assert sorted(memory_values(spark, "explicit")) == ["end-new", "offset-1"]
    # a batch read still refuses "latest", when it is planned
    with pytest.raises(Exception, match="option 'startingOffsets' = 'latest'"):
        (spark.read.format("sbp").option("pd", pd).option("streams", str(at_end))
         .option("startingOffsets", "latest").load().collect())


def test_restart_from_checkpoint_reads_exactly_the_new_records(spark, pd, sbp_client, tmp_path):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, [f"old-{i}" for i in range(50)])
    out, checkpoint = tmp_path / "out", tmp_path / "ck"

    def run():
        query = (stream_df(spark, pd, [sid], startingOffsets="earliest",
                           maxRecordsPerTrigger=20)
                 .selectExpr("CAST(value AS STRING) AS v", "offset")
                 .writeStream.format("parquet").option("path", str(out))
                 .option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        query.awaitTermination(120)
        return query

    def read_in_runs():
        """The rows each availableNow run reads: everything in one run where pyspark has
        admission control; without it one micro-batch of at most maxRecordsPerTrigger records
        per run (docs/streaming.md), so it runs again until a run finds nothing."""
        runs = [sum(rows for rows, _, _ in source_progress(run()))]
        if not found().admission_control:
            while runs[-1]:
                runs.append(sum(rows for rows, _, _ in source_progress(run())))
            runs.pop()  # the run that found nothing
        return runs

    one_run = found().admission_control
    assert read_in_runs() == ([50] if one_run else [20, 20, 10])
    append_values(sbp_client, sid, [f"new-{i}" for i in range(30)])
    sbp_client.seal_range(sid)
    append_values(sbp_client, sid, [f"newer-{i}" for i in range(5)])
    assert read_in_runs() == ([35] if one_run else [20, 15])
    rows = spark.read.parquet(str(out)).collect()
    assert sorted(r.offset for r in rows) == list(range(85))
    assert len({r.v for r in rows}) == 85


def _trim_under_held_back_query(spark, pd, sbp_client, tmp_path, name, fail_on_data_loss):
    """A query that read 10 records and holds back (minRecordsPerTrigger) while 30 of the next
    50 are trimmed away; then 1000 more records release the next micro-batch."""
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, [f"r{i}" for i in range(10)])
    query = to_memory(
        stream_df(spark, pd, [sid], startingOffsets="earliest", minRecordsPerTrigger=1000,
                  maxTriggerDelay="1h", failOnDataLoss=str(fail_on_data_loss).lower()),
        name, tmp_path / name, processingTime="0 seconds")
    wait_for(lambda: len(memory_values(spark, name)) == 10, what="the first micro-batch")
    append_values(sbp_client, sid, [f"r{i}" for i in range(10, 60)])
    assert sbp_client.trim_stream(sid, 40).start_offset == 40
    append_values(sbp_client, sid, [f"r{i}" for i in range(60, 1060)])
    return sid, query


def test_trim_under_a_running_query_fails_it(spark, pd, sbp_client, tmp_path):
    sid, query = _trim_under_held_back_query(spark, pd, sbp_client, tmp_path, "trimfail", True)
    try:
        with pytest.raises(StreamingQueryException) as info:
            query.awaitTermination(120)
    finally:
        query.stop()
    message = str(info.value)
    assert f"stream {sid}: offsets [10, 40) were trimmed" in message
    assert "now starts at offset 40" in message and "failOnDataLoss=false" in message


def test_trim_under_a_running_query_skips_with_fail_on_data_loss_false(
        spark, pd, sbp_client, tmp_path):
    _, query = _trim_under_held_back_query(spark, pd, sbp_client, tmp_path, "trimskip", False)
    try:
        wait_for(lambda: len(memory_values(spark, "trimskip")) == 10 + 1020,
                 what="the records after the trim")
    finally:
        query.stop()
    values = memory_values(spark, "trimskip")
    assert sorted(values, key=lambda v: int(v[1:])) == (
        [f"r{i}" for i in range(10)] + [f"r{i}" for i in range(40, 1060)])


def test_deleted_stream(spark, pd, sbp_client, tmp_path):
    kept, doomed = new_stream(sbp_client), new_stream(sbp_client)
    for sid in (kept, doomed):
        append_values(sbp_client, sid, ["x"])
    out = tmp_path / "out"

    def run(**options):
        values_to_parquet(spark, pd, [kept, doomed], tmp_path, **options)

    run()
    sbp_client.delete_streams([doomed])
    append_values(sbp_client, kept, ["after"])
    with pytest.raises(StreamingQueryException) as info:
        run()
    assert f"stream {doomed} was deleted" in str(info.value)
    assert "from offset 1" in str(info.value)
    # failOnDataLoss=false drops the deleted stream and goes on with the other
    run(failOnDataLoss="false")
    assert sorted(r.v for r in spark.read.parquet(str(out)).collect()) == ["after", "x", "x"]


def test_a_query_notices_history_rewritten_under_its_checkpoint(
        spark, pd, sbp_cluster, sbp_client, tmp_path):
    # Issue 22: a query read range 0 to its end; the range was then sealed lower and the stream
    # went on with other records at those offsets. Restarted from its checkpoint, the query
    # fails naming stream, range and both offsets, or (failOnDataLoss=false) reads what
    # stands there now.
    sid = new_stream(sbp_client)
    for i in range(8):  # a range ends between batches
        append_values(sbp_client, sid, [f"old-{i}"])
    out = tmp_path / "out"

    def run(**options):
        values_to_parquet(spark, pd, [sid], tmp_path, **options)

    run()
    rewrite_history(sbp_cluster, sid, 5)
    append_values(sbp_client, sid, [f"new-{i}" for i in range(5, 9)])
    with pytest.raises(StreamingQueryException) as info:
        run()
    message = str(info.value)
    assert (f"stream {sid}: range 0 was sealed at offset 5, but this query had already read "
            "it up to offset 8") in message and "failOnDataLoss=false" in message
    run(failOnDataLoss="false")
    values = sorted(r.v for r in spark.read.parquet(str(out)).collect())
    assert values == sorted([f"old-{i}" for i in range(8)] + [f"new-{i}" for i in range(5, 9)])


def test_a_stream_that_ends_below_the_checkpoint_is_data_loss(spark, tmp_path):
    # The query read stream 1 of a cluster up to offset 10; the cluster was then rebuilt and
    # its new stream 1 holds 3 records. The restarted query waited silently for the stream to
    # pass offset 10, then read from there on, skipping the new records below it.
    def run(pd, sid, **options):
        values_to_parquet(spark, pd, [sid], tmp_path, **options)

    with EmbeddedCluster(str(tmp_path / "old"), range_servers=1) as old:
        client = SbpClient(old.pd_address)
        sid = new_stream(client)
        append_values(client, sid, [f"old-{i}" for i in range(10)])
        run(old.pd_address, sid)
    with EmbeddedCluster(str(tmp_path / "rebuilt"), range_servers=1) as rebuilt:
        client = SbpClient(rebuilt.pd_address)
        assert new_stream(client) == sid
        append_values(client, sid, [f"new-{i}" for i in range(3)])
        with pytest.raises(StreamingQueryException) as info:
            run(rebuilt.pd_address, sid)
        assert (f"history rewritten in stream {sid}: it now ends at offset 3, but this query "
                "had already read it up to offset 10; the records [3, 10)") in str(info.value)
        # failOnDataLoss=false goes on from the stream's end, as from a seal
        run(rebuilt.pd_address, sid, failOnDataLoss="false")
        append_values(client, sid, [f"new-{i}" for i in range(3, 12)])
        run(rebuilt.pd_address, sid, failOnDataLoss="false")
    values = sorted(r.v for r in spark.read.parquet(str(tmp_path / "out")).collect())
    assert values == sorted([f"old-{i}" for i in range(10)] + [f"new-{i}" for i in range(3, 12)])


def test_options_refused_at_the_query_start_fail_it_with_their_own_error(
        spark, pd, sbp_client, tmp_path):
    # With .schema(...) Spark asks the source for no schema, so the options are first checked
    # when the query creates its stream reader; pyspark used to bury that error under an
    # UnboundLocalError of its own.
    sid = new_stream(sbp_client)
    df = (spark.readStream.format("sbp").schema("value binary").option("pd", pd)
          .option("streams", str(sid)).option("maxRecordsPerTrigger", "abc").load())
    query = to_memory(df, "refused_options", tmp_path / "ck", availableNow=True)
    with pytest.raises(StreamingQueryException) as info:
        query.awaitTermination(120)
    message = str(info.value)
    assert "option 'maxRecordsPerTrigger' = 'abc' is not valid" in message
    assert "UnboundLocalError" not in message
