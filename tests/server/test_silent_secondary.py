"""A primary whose secondary goes silent (a link that drops everything: no reset, no answer)
fails the append within the time the writer asked for, not the whole replication timeout, and
seals the range so writers move on (found by the partition case "primary cut off from its
secondaries", where every writer waited 30 s)."""

from __future__ import annotations

import time

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.messages import RangeReplica, RangeServer
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.range_server import RangeServer as Server
from sbp_spark.server.range_server import RangeServerConfig
from sbp_spark.server.range_server.replication import DEFAULT_REPLICATION_TIMEOUT_S
from sbp_spark.server.storage import StorageConfig
from tests.client.fakes import FakeServer, Peer
from tests.server.secondary import sync_range

STREAM = 6


def silent(peer: Peer) -> None:
    """Reads every frame and never answers (what a dropped link looks like from the sender)."""
    while peer.read_frame(timeout=60) is not None:
        pass


def test_a_silent_secondary_fails_the_append_within_the_writer_s_timeout(tmp_path):
    config = ClientConfig(request_timeout_s=DEFAULT_REPLICATION_TIMEOUT_S, retries=0)
    with FakeServer(silent) as secondary, ConnectionPool(config) as pool:
        primary = Server(RangeServerConfig(data_dir=str(tmp_path), server_id=1,
                                           storage=StorageConfig(fsync="never"))).start()
        try:
            sync_range(primary, STREAM, [
                RangeReplica(RangeServer(1, primary.advertise_addr), True),
                RangeReplica(RangeServer(2, secondary.address), False)])
            client = RangeServerClient(primary.advertise_addr, config, pool)
            began = time.monotonic()
            [result] = client.append([(STREAM, batch_bytes(b"x"))], timeout_ms=1500)
            waited = time.monotonic() - began
            assert result.status.code == ErrorCode.REPLICATION_FAILED, result.status
            assert "ReadTimeoutError" in result.status.message
            # The writer's 1.5 s, not the 30 s replication timeout (and no client timeout).
            assert waited < DEFAULT_REPLICATION_TIMEOUT_S / 2
            assert primary.storage.get_range(STREAM, 0).sealed
        finally:
            primary.stop()
