"""A streaming query over a stream whose only replica restarts: the query waits for it (up to
the retry deadline, a minute) instead of failing at the first triggers that cannot reach it."""

from __future__ import annotations

import time

from sbp_spark.client import SbpClient
from sbp_spark.server.cluster import EmbeddedCluster

from .helpers import append_values, memory_values, new_stream, wait_for

# Longer than five retries' backoff (1.55 s in all), what a call gave up after before retries
# were bounded by time.
OUTAGE_S = 4.0


def test_a_streaming_query_rides_out_a_restart_of_its_streams_only_server(spark, tmp_path):
    with EmbeddedCluster(tmp_path / "cluster", range_servers=1) as cluster:
        client = SbpClient(cluster.pd_address)
        sid = new_stream(client)
        append_values(client, sid, ["before"])
        name = f"restart_{sid}"
        query = (spark.readStream.format("sbp").option("pd", cluster.pd_address)
                 .option("streams", str(sid)).option("startingOffsets", "earliest").load()
                 .writeStream.format("memory").queryName(name)
                 .option("checkpointLocation", str(tmp_path / "checkpoint"))
                 .trigger(processingTime="100 milliseconds").start())
        try:
            wait_for(lambda: memory_values(spark, name) == ["before"], what="the first record")
            cluster.stop_range_server(0)
            time.sleep(OUTAGE_S)  # the outage itself: triggers keep failing to reach it
            assert query.isActive, query.exception()
            cluster.start_range_server(0)
            append_values(SbpClient(cluster.pd_address), sid, ["after"])
            wait_for(lambda: memory_values(spark, name) == ["before", "after"] or
                     not query.isActive, what="the record appended after the restart")
            assert query.isActive, query.exception()
            assert memory_values(spark, name) == ["before", "after"]
        finally:
            query.stop()
