"""Streaming payload=arrow reads of a stream whose schema changes while the query runs."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from pyspark.errors import StreamingQueryException

from ..pyspark_features import requires
from .helpers import append_arrow, drain_to_memory, new_stream, wait_for


def arrow_stream(spark, pd, sid, schema=None, **options):
    reader = (spark.readStream.format("sbp").option("pd", pd).option("streams", str(sid))
              .option("payload", "arrow").option("startingOffsets", "earliest"))
    for key, value in options.items():
        reader = reader.option(key, value)
    if schema is not None:
        reader = reader.schema(schema)
    return reader.load()


def ids(spark, name):
    return sorted(r.id for r in spark.sql(f"SELECT id FROM {name}").collect())


def test_a_running_query_resolves_newer_batches_and_fails_on_one_that_cannot(
        spark, pd, sbp_client, tmp_path):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([1, 2]),
                                                   "name": pa.array(["a", "b"])}))
    # the schema is fixed when the query starts: the newest batch's (id long, name string)
    df = arrow_stream(spark, pd, sid)
    assert [(f.name, f.dataType.simpleString()) for f in df.schema.fields][:2] == [
        ("id", "bigint"), ("name", "string")]
    query = (df.select("id", "name").writeStream.format("memory").queryName("evolving")
             .option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(processingTime="0 seconds").start())
    try:
        wait_for(lambda: ids(spark, "evolving") == [1, 2], what="the first batch")
        # a producer moves on: int ids and a new column; both resolve to the query's schema
        append_arrow(sbp_client, sid, pa.record_batch({
            "id": pa.array([3], pa.int32()), "name": pa.array(["c"]),
            "score": pa.array([0.5])}))
        wait_for(lambda: ids(spark, "evolving") == [1, 2, 3], what="the evolved batch")
        # a batch that cannot be read as the query's schema fails the micro-batch, clearly
        append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array(["x"])}))
        with pytest.raises(StreamingQueryException) as info:
            query.awaitTermination(120)
    finally:
        query.stop()
    assert (f"stream {sid} offset 3: the stored batch does not fit the read schema: column "
            "'id' is string in the stored batch but int64 in the read schema: unrelated types"
            in str(info.value))


@requires("progress_lag")
def test_skip_incompatible_batches_counts_them_in_the_progress(spark, pd, sbp_client,
                                                               tmp_path):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([1, 2])}))
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array(["x", "y", "z"])}))
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([None, 4], pa.int32())}))
    query = (arrow_stream(spark, pd, sid, "id BIGINT NOT NULL",
                          skipIncompatibleBatches="true")
             .writeStream.format("memory").queryName("skipping")
             .option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
    query.awaitTermination(120)
    assert query.exception() is None
    assert ids(spark, "skipping") == [1, 2]  # the strings, and a null id, are skipped
    [progress] = [p for p in query.recentProgress if p["numInputRows"]]
    latest = progress["sources"][0]["latestOffset"]
    report = (json.loads(latest) if isinstance(latest, str) else latest)[str(sid)]
    assert report["incompatibleBatchesSkipped"] == 2
    assert report["incompatibleRecordsSkipped"] == 5
    assert progress["numInputRows"] == 2


def test_metadata_named_data_in_older_batches_reads_as_in_a_batch_read(spark, pd, sbp_client,
                                                                        tmp_path):
    # The older batch was copied with its own 'timestamp' column (2020); the newest has none,
    # so the inferred schema's 'timestamp' is the metadata column. A batch read makes it
    # metadata in every stored batch; the streaming read combined both batches into one and
    # failed with "column 'timestamp' is data in some batches and metadata in others".
    sid = new_stream(sbp_client)
    copied = pa.record_batch({"id": pa.array([1, 2], pa.int64()),
                              "timestamp": pa.array([1_577_836_800_000_000] * 2,
                                                    pa.timestamp("us", tz="UTC"))})
    append_arrow(sbp_client, sid, copied, timestamp_ms=1_000)
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([3], pa.int64())}),
                 timestamp_ms=2_000)
    batch = (spark.read.format("sbp").option("pd", pd).option("streams", str(sid))
             .option("payload", "arrow").load())
    expected = sorted((r.id, r.timestamp) for r in batch.select("id", "timestamp").collect())
    assert [t.year for _, t in expected] == [1970] * 3
    drain_to_memory(arrow_stream(spark, pd, sid).select("id", "timestamp"), f"copied_{sid}",
                    tmp_path / "ck")
    assert sorted((r.id, r.timestamp) for r in spark.table(f"copied_{sid}").collect()
                  ) == expected
