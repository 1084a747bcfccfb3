"""writeStream.format("sbp") end to end, including the idempotent mode under a failed
micro-batch that Spark replays."""

from __future__ import annotations

import os

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, StructField, StructType

from sbp_spark.spark.options import OptionError
from sbp_spark.spark.streaming.idempotent import WriteTag
from sbp_spark.spark.streaming.sink import stream_writer

from .helpers import append_values, new_stream, stored_schemas, stored_values, wait_for


def stream_df(spark, pd, stream, **options):
    reader = spark.readStream.format("sbp").option("pd", pd).option("streams", str(stream))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load()


def test_stream_to_sbp_to_stream(spark, pd, sbp_client, tmp_path):
    source, middle = new_stream(sbp_client), new_stream(sbp_client)
    append_values(sbp_client, source, [f"v{i}" for i in range(5)])
    relay = (stream_df(spark, pd, source, startingOffsets="earliest")
             .selectExpr("key", "value")
             .writeStream.format("sbp").option("pd", pd).option("stream", str(middle))
             .option("checkpointLocation", str(tmp_path / "relay"))
             .trigger(processingTime="0 seconds").start())
    try:
        wait_for(lambda: len(stored_values(sbp_client, middle)) == 5, what="the first relay")
        append_values(sbp_client, source, [f"v{i}" for i in range(5, 8)])
        wait_for(lambda: len(stored_values(sbp_client, middle)) == 8, what="the next records")
    finally:
        relay.stop()
    assert sorted(stored_values(sbp_client, middle), key=lambda v: int(v[1:])) == [
        f"v{i}" for i in range(8)]

    tail = (stream_df(spark, pd, middle, startingOffsets="earliest")
            .selectExpr("CAST(value AS STRING) AS v", "offset")
            .writeStream.format("memory").queryName("relayed")
            .option("checkpointLocation", str(tmp_path / "tail"))
            .trigger(availableNow=True).start())
    tail.awaitTermination(120)
    rows = spark.sql("SELECT v, offset FROM relayed ORDER BY offset").collect()
    assert [r.offset for r in rows] == list(range(8))
    assert sorted(r.v for r in rows) == sorted(f"v{i}" for i in range(8))


def _fail_partition_while(pd: str, target: int, switch: str, wait_for_records: int):
    """A Python UDF passing values through; while the file ``switch`` exists, in partition 1,
    it waits until the target stream holds ``wait_for_records`` records (partition 0's
    output), then fails the task: every attempt of it, so the query fails also on a session
    whose tasks are retried (the fault suite's local[2,4], when both run in one process)."""

    def check(value):
        # self-contained: runs in an executor's Python worker
        import time

        from pyspark import TaskContext

        from sbp_spark.client import SbpClient

        if TaskContext.get().partitionId() != 1 or not os.path.exists(switch):
            return value
        client = SbpClient(pd)
        deadline = time.monotonic() + 120
        while sum(b.header.record_count for b in client.read(target)) < wait_for_records:
            if time.monotonic() > deadline:
                raise TimeoutError("partition 0's records never landed")
            time.sleep(0.05)
        raise RuntimeError("injected failure after partition 0 wrote its records")

    return F.udf(check, BinaryType(), useArrow=False)


def test_idempotent_sink_replays_a_failed_micro_batch_without_duplicates(
        spark, pd, sbp_client, tmp_path):
    source, target = new_stream(sbp_client), new_stream(sbp_client)
    append_values(sbp_client, source, [f"v{i}" for i in range(40)])
    switch = str(tmp_path / "fail-partition-1")

    def run():
        # two partitions of 20 records: partition 1 fails (once) after partition 0 landed
        query = (stream_df(spark, pd, source, startingOffsets="earliest",
                           maxRecordsPerPartition=20)
                 .select("key", _fail_partition_while(pd, target, switch, 20)("value")
                         .alias("value"))
                 .writeStream.format("sbp").option("pd", pd).option("stream", str(target))
                 .option("idempotent", "true").option("batchMaxRecords", "7")
                 .option("checkpointLocation", str(tmp_path / "ck"))
                 .trigger(availableNow=True).start())
        query.awaitTermination(120)
        return query

    open(switch, "w").close()
    with pytest.raises(StreamingQueryException, match="injected failure"):
        run()
    os.remove(switch)
    landed = stored_values(sbp_client, target)
    assert sorted(landed) == sorted(f"v{i}" for i in range(20))

    query = run()  # Spark replays micro-batch 0 from the checkpoint: both partitions again
    values = stored_values(sbp_client, target)
    assert len(values) == 40
    assert sorted(values) == sorted(f"v{i}" for i in range(40))

    tags = [WriteTag.from_metadata(s.metadata) for s in stored_schemas(sbp_client, target)]
    assert {t.query_id for t in tags} == {query.id}
    assert {t.batch_id for t in tags} == {0}
    # 20 records per partition in batches of at most 7: sequence numbers 0, 1, 2 each
    assert sorted((t.partition_id, t.seq) for t in tags) == [
        (p, s) for p in (0, 1) for s in range(3)]


def test_stream_writer_refuses_what_a_stream_cannot_do(pd, sbp_client):
    schema = StructType([StructField("value", BinaryType())])
    sid = new_stream(sbp_client)
    with pytest.raises(OptionError, match="createIfMissing"):
        stream_writer({"pd": pd, "createIfMissing": "true"}, schema, False)
    with pytest.raises(OptionError, match="complete"):
        stream_writer({"pd": pd, "stream": str(sid)}, schema, True)
    with pytest.raises(OptionError, match="idempotent"):
        stream_writer({"pd": pd, "stream": str(sid), "idempotent": "maybe"}, schema, False)
    assert stream_writer({"pd": pd, "stream": str(sid), "idempotent": "true"}, schema,
                         False).options.idempotent


def test_a_batch_write_refuses_idempotent(spark, pd, sbp_client):
    # idempotent=true on df.write was taken and ignored: a batch write that a user was told
    # is written once is at least once (a retried task appends its records again).
    sid = new_stream(sbp_client)
    df = spark.createDataFrame([("v",)], "value string")
    with pytest.raises(Exception, match="option 'idempotent' = 'true' is for streaming writes"):
        (df.write.format("sbp").option("pd", pd).option("stream", str(sid))
         .option("idempotent", "true").mode("append").save())
    df.write.format("sbp").option("pd", pd).option("stream", str(sid)).option(
        "idempotent", "false").mode("append").save()
    assert stored_values(sbp_client, sid) == ["v"]


def test_output_modes_of_an_aggregation(spark, pd, sbp_client, tmp_path):
    # The docs said 'update' works and the refusal of 'complete' advised it, but pyspark's
    # Python sinks cannot take update mode: Spark refuses it before the sink is asked.
    source, target = new_stream(sbp_client), new_stream(sbp_client)
    append_values(sbp_client, source, ["k1", "k2", "k1"])
    counts = (stream_df(spark, pd, source, startingOffsets="earliest").groupBy("value").count()
              .selectExpr("value AS key", "CAST(count AS STRING) AS value"))
    messages = {}
    for mode in ("update", "complete"):
        query = (counts.writeStream.format("sbp").outputMode(mode).option("pd", pd)
                 .option("stream", str(target))
                 .option("checkpointLocation", str(tmp_path / mode))
                 .trigger(availableNow=True).start())
        with pytest.raises(StreamingQueryException) as info:
            query.awaitTermination(120)
        messages[mode] = str(info.value)
    assert "sbp does not support Update mode" in messages["update"]
    assert "use outputMode('append')" in messages["complete"]
    assert "or 'update'" not in messages["complete"]
    assert stored_values(sbp_client, target) == []
