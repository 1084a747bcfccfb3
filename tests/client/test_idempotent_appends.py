"""The client's producer identity: one per ``SbpClient``, sequences per range shared by its
writers, so that concurrent calls (whose frames may reach the server in any order) all land,
each batch once."""

from __future__ import annotations

import os
import threading

from sbp_spark.client import ClientConfig, SbpClient
from sbp_spark.client.producer import Producer
from sbp_spark.protocol.records import ENVELOPE_SIZE, encode_batch
from sbp_spark.server.cluster import EmbeddedCluster

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retry_backoff_ms=10,
                      retry_backoff_max_ms=50, retry_deadline_s=20)


def test_sequences_are_per_range_and_given_out_once():
    producer = Producer(7)
    assert producer.take(1, 0, 3) == (7, 0) and producer.take(1, 0, 2) == (7, 3)
    assert producer.take(2, 0, 1) == (7, 0) and producer.take(1, 1, 1) == (7, 0)
    # A writer that has not heard of range 1 yet still gets new sequences in range 0: one
    # given out twice would be answered as the other batch there.
    assert producer.take(1, 0, 1) == (7, 5)
    assert 0 <= Producer().producer_id < 2 ** 63 and Producer().producer_id != \
        Producer().producer_id


def test_a_forked_child_is_a_producer_of_its_own():
    producer = Producer()
    parent_id, _ = producer.take(1, 0, 4)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its id and first sequence, then out without cleanup
        try:
            os.write(write, b"%d %d" % producer.take(1, 0, 1))
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    child_id, child_first = map(int, os.read(read, 100).split())
    os.close(read)
    assert child_id != parent_id and child_first == 0
    assert producer.take(1, 0, 1) == (parent_id, 4)  # the parent goes on as it was


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
