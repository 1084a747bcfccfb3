"""Reads of a replicated range see only what every replica stored.

A primary stores a batch and commits it locally at once (fsync "never"), but does not hear
from its secondary: until the secondary's answer says it stored the batch, the append is not
acknowledged and readers of the primary (FETCH, DESCRIBE_RANGES) must not see it, since a
failover would seal the range below it. Once the answer comes, the append is acknowledged
and readers see it (a waiting long poll wakes up).
"""

from __future__ import annotations

import threading

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient
from sbp_spark.client.connection import Connection
from sbp_spark.protocol.messages import (
    Range,
    RangeReplica,
    RangeServer,
    StreamRanges,
    SyncRangesRequest,
)
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.range_server import RangeServer as Server
from sbp_spark.server.range_server import RangeServerConfig
from sbp_spark.server.storage import StorageConfig
from tests.polling import wait_until as poll
from tests.server.secondary import HeldAnswers

STREAM = 9
CONFIG = ClientConfig(request_timeout_s=20, retries=0)




@pytest.fixture
def pair(tmp_path):
    never = StorageConfig(fsync="never")
    # The primary hears nothing from its secondary until the test lets it.
    gate = threading.Event()
    primary = Server(RangeServerConfig(data_dir=str(tmp_path / "p"), server_id=1,
                                       storage=never),
                     replicator=HeldAnswers({2: gate})).start()
    secondary = Server(RangeServerConfig(data_dir=str(tmp_path / "s"), server_id=2,
                                         storage=never)).start()
    replicas = [RangeReplica(RangeServer(1, primary.advertise_addr), True),
                RangeReplica(RangeServer(2, secondary.advertise_addr), False)]
    request = SyncRangesRequest(stream_ranges=[StreamRanges(STREAM, [
        Range(STREAM, 0, 0, 0, -1, replicas)])])
    for server in (primary, secondary):
        with Connection(server.advertise_addr) as conn:
            response, _ = conn.call(request)
            assert response.sync_responses[0].status.ok
    try:
        yield primary, secondary, gate
    finally:
        gate.set()
        primary.stop()
        secondary.stop()


def test_primary_readers_wait_for_the_secondary(pair):
    primary, _secondary, gate = pair
    with ConnectionPool(CONFIG) as pool:
        rs = RangeServerClient(primary.advertise_addr, CONFIG, pool)
        acked: list = []
        writer = threading.Thread(target=lambda: acked.extend(rs.append(
            [(STREAM, batch_bytes(b"one")), (STREAM, batch_bytes(b"two"))])))
        writer.start()
        rlog = primary.storage.get_range(STREAM, 0)
        poll(lambda: rlog.next_offset == 2, "the primary to commit the batches locally")

        # Stored and committed on the primary, not yet on the secondary: invisible.
        assert list(rs.fetch(STREAM, 0)) == []
        [described] = rs.describe_ranges([(STREAM, 0)])
        assert described.unwrap().next_offset == 0
        assert not acked

        # A long poll waiting meanwhile wakes up once the secondary has stored them.
        polled: list = []
        poller = threading.Thread(target=lambda: polled.extend(
            h.base_offset for h, _ in rs.fetch(STREAM, 0, max_wait_ms=10_000)))
        poller.start()
        gate.set()
        writer.join(20)
        poller.join(20)
        assert [r.unwrap().base_offset for r in acked] == [0, 1]
        assert polled == [0, 1]
        assert [h.base_offset for h, _ in rs.fetch(STREAM, 0)] == [0, 1]
        [described] = rs.describe_ranges([(STREAM, 0)])
        assert described.unwrap().next_offset == 2
