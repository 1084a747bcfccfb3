"""A Spark batch write appends idempotently: every batch its tasks stored carries their
client's producer and sequence, on every replica (so a resend through a failover stores it
once: tests/client and the fault suite show that part)."""

from __future__ import annotations


def test_a_batch_write_stores_every_batch_under_a_producer(spark, sbp_cluster, sbp_client, pd):
    (stream,) = sbp_client.create_streams(1, replicas=2)
    sid = stream.stream_id
    (spark.range(5000).selectExpr("CAST(id AS STRING) AS value").repartition(2)
     .write.format("sbp").option("pd", pd).option("stream", str(sid))
     .option("batchMaxRecords", "500").mode("append").save())
    batches = list(sbp_client.read(sid))
    assert sum(b.header.record_count for b in batches) == 5000
    holders = [s for s in sbp_cluster.range_servers if s.storage.stream_ranges(sid)]
    assert len(holders) == 2
    for server in holders:
        (rlog,) = server.storage.stream_ranges(sid)
        produced = rlog.produced_since(0)
        assert [b.base_offset for b in produced] == [b.header.base_offset for b in batches]
        # Two tasks: one producer per worker process's client (one worker may run both), each
        # numbering its batches in this new range from 0, every sequence once.
        producers = {b.producer_id for b in produced}
        assert 1 <= len(producers) <= 2
        assert {b.producer_id for b in produced if b.sequence == 0} == producers
        assert len({(b.producer_id, b.sequence) for b in produced}) == len(produced)
