"""A streaming query on a pattern over stream names: it finds streams created while it runs,
handles a matching stream deleted under it by failOnDataLoss, and resumes exactly from its
checkpoint after both."""

from __future__ import annotations

import uuid

import pytest
from pyspark.errors import StreamingQueryException

from .helpers import append_values, memory_values, wait_for


def pattern_df(spark, pd, pattern, **options):
    reader = (spark.readStream.format("sbp").option("pd", pd)
              .option("streamPattern", pattern).option("startingOffsets", "earliest")
              .option("discoveryIntervalMs", "0"))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load()


def test_a_pattern_query_finds_new_streams_survives_a_deleted_one_and_resumes(
        spark, pd, sbp_client, tmp_path):
    p = f"d{uuid.uuid4().hex[:8]}"
    a = sbp_client.create_stream(f"{p}-a").stream_id
    b = sbp_client.create_stream(f"{p}-b").stream_id
    unmatched = sbp_client.create_stream(f"x{p}-a").stream_id
    append_values(sbp_client, a, ["a0"])
    append_values(sbp_client, b, ["b0"])
    append_values(sbp_client, unmatched, ["never"])
    out, checkpoint = tmp_path / "out", tmp_path / "ck"

    def start():
        return (pattern_df(spark, pd, f"{p}-.*", failOnDataLoss="false")
                .selectExpr("CAST(value AS STRING) AS v", "stream_id", "offset")
                .writeStream.format("parquet").option("path", str(out))
                .option("checkpointLocation", str(checkpoint))
                .trigger(processingTime="0 seconds").start())

    def rows():
        if not list(out.glob("*.parquet")):
            return []
        return sorted((r.v, r.stream_id, r.offset) for r in spark.read.schema(
            "v string, stream_id bigint, offset bigint").parquet(str(out)).collect())

    def seen(*values):
        return lambda: {v for v, _, _ in rows()} >= set(values)

    query = start()
    try:
        wait_for(seen("a0", "b0"), what="the streams matching at the start")
        c = sbp_client.create_stream(f"{p}-c").stream_id
        append_values(sbp_client, c, ["c0", "c1"])
        wait_for(seen("c0", "c1"), what="a stream created while the query runs")
        sbp_client.delete_streams([b])
        append_values(sbp_client, a, ["a1"])
        wait_for(seen("a1"), what="the query going on past a deleted stream")
        assert query.isActive and query.exception() is None
    finally:
        query.stop()

    # Both changes are in the checkpoint; the restarted query resumes exactly.
    append_values(sbp_client, a, ["a2"])
    append_values(sbp_client, c, ["c2"])
    d = sbp_client.create_stream(f"{p}-d").stream_id
    append_values(sbp_client, d, ["d0"])
    query = start()
    try:
        wait_for(seen("a2", "c2", "d0"), what="the records after the restart")
    finally:
        query.stop()
    assert rows() == sorted([("a0", a, 0), ("a1", a, 1), ("a2", a, 2), ("b0", b, 0),
                             ("c0", c, 0), ("c1", c, 1), ("c2", c, 2), ("d0", d, 0)])


def test_a_deleted_matching_stream_fails_the_query_by_default(spark, pd, sbp_client, tmp_path):
    p = f"f{uuid.uuid4().hex[:8]}"
    kept = sbp_client.create_stream(f"{p}-kept").stream_id
    doomed = sbp_client.create_stream(f"{p}-doomed").stream_id
    append_values(sbp_client, kept, ["k0"])
    append_values(sbp_client, doomed, ["d0"])
    query = (pattern_df(spark, pd, f"{p}-.*").writeStream.format("memory").queryName(p)
             .option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(processingTime="0 seconds").start())
    try:
        wait_for(lambda: len(memory_values(spark, p)) == 2, what="the first records")
        sbp_client.delete_streams([doomed])
        append_values(sbp_client, kept, ["k1"])
        with pytest.raises(StreamingQueryException) as info:
            query.awaitTermination(120)
    finally:
        query.stop()
    assert f"stream {doomed} was deleted" in str(info.value)
