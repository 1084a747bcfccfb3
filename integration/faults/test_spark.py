"""A Spark batch read (``format("sbp")``) while its range server is killed and restarted.

Slow: it starts Spark (the ``spark`` fixture of this suite's conftest). Run with
``pytest integration/faults -m slow -k spark``.
"""

from __future__ import annotations

import threading

import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import ProcessCluster

from .helpers import RIDE_OUT, check_body, make_body, wait_until

BATCHES = 4000
BODY = 8 * 1024


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.fault_case(
    "range server killed during Spark batch reads (R=1)",
    f"a {BATCHES * BODY >> 20} MiB stream read by spark.read.format('sbp') (4 partitions, "
    "retries=50) in a loop; kill -9 the range server during a query, restart it",
    "every query that finishes returns each offset once with its exact value; a query that "
    "fails says why")
def test_spark_batch_read_while_range_server_is_killed(tmp_path, spark, figures):
    with ProcessCluster(tmp_path, range_servers=1) as cluster, ConnectionPool(RIDE_OUT) as pool:
        client = SbpClient(cluster.pd_address, RIDE_OUT, pool)
        [stream] = client.create_streams(1)
        sid = stream.stream_id
        writer = client.open_stream(sid)
        for start in range(0, BATCHES, 100):
            writer.append([batch_bytes(make_body(sid, i, BODY))
                           for i in range(start, start + 100)])
        df = (spark.read.format("sbp").option("pd", cluster.pd_address)
              .option("streams", str(sid)).option("retries", "50")
              .option("minPartitions", "4").load().select("offset", "value"))

        finished: list[int] = []
        failed: list[str] = []
        running = threading.Event()
        stop = threading.Event()

        def queries() -> None:
            while not stop.is_set():
                running.set()
                try:
                    rows = df.collect()
                except Exception as exc:  # Py4J wraps the executor's error: keep its text
                    failed.append(str(exc).splitlines()[0][:300])
                    continue
                offsets = sorted(r.offset for r in rows)
                assert offsets == list(range(BATCHES)), "offsets missing or repeated"
                for r in rows:
                    assert check_body(bytes(r.value)) == (sid, r.offset)
                finished.append(len(rows))

        t = threading.Thread(target=queries, daemon=True)
        t.start()
        try:
            wait_until(lambda: len(finished) + len(failed) >= 1, 120, "a first query")
            before = len(finished) + len(failed)
            wait_until(running.is_set, 10, "a query to run")
            cluster.kill_range_server(0)
            cluster.start_range_server(0)
            wait_until(lambda: len(finished) + len(failed) >= before + 2 or not t.is_alive(),
                       180, "two queries after the kill")
        finally:
            stop.set()
            t.join(180)
        assert not t.is_alive()
        figures["queries finished"] = len(finished)
        figures["queries failed"] = len(failed)
        if failed:
            figures["failure"] = failed[0]
        assert len(finished) >= 2
        for message in failed:
            assert "SBP" in message or "range" in message or "127.0.0.1" in message, message
