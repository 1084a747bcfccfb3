"""The client's producer identity: one per ``SbpClient``, sequences per range shared by its
writers, so that concurrent calls (whose frames may reach the server in any order) all land,
each batch once."""

from __future__ import annotations

import threading

from sbp_spark.client import ClientConfig, SbpClient
from sbp_spark.client.producer import Producer
from sbp_spark.protocol.records import ENVELOPE_SIZE, encode_batch
from sbp_spark.server.cluster import EmbeddedCluster

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retry_backoff_ms=10,
                      retry_backoff_max_ms=50, retry_deadline_s=20)


def test_sequences_are_per_range_and_given_out_once():
    producer = Producer(7)
    assert producer.take(1, 0, 3) == 0 and producer.take(1, 0, 2) == 3
    assert producer.take(2, 0, 1) == 0 and producer.take(1, 1, 1) == 0
    assert producer.take(1, 0, 1) == 0  # range 0 was left behind when range 1 began
    assert 0 <= Producer().producer_id < 2 ** 63 and Producer().producer_id != \
        Producer().producer_id


def test_concurrent_calls_of_one_client_all_land_once(tmp_path):
    with EmbeddedCluster(str(tmp_path / "cluster"), range_servers=1) as cluster, \
            SbpClient(cluster.pd_address, CONFIG) as client:
        (stream,) = client.create_streams()
        sid = stream.stream_id
        client.append(sid, [encode_batch(b"first")])
        failures: list[BaseException] = []

        def write(t: int) -> None:
            try:
                for i in range(15):
                    client.append(sid, [encode_batch(b"%d-%d-%d" % (t, i, j))
                                        for j in range(3)])
            except BaseException as exc:  # reported below
                failures.append(exc)

        threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not failures
        stored = [bytes(b.data[ENVELOPE_SIZE:]) for b in client.read(sid)]
        assert len(stored) == 1 + 4 * 15 * 3 == len(set(stored))
        assert client.producer is not None
        assert cluster.range_servers[0].metrics.duplicate_appends == 0
