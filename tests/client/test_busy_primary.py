"""A primary that is busy, not stopped: its disk holds its writes, so its connection's reader
stops reading (backpressure) and a PING queued behind the APPENDs goes unanswered, as from a
stopped process. The writer asks the PD, which still lists the server as the primary (its
heartbeats go on), and keeps waiting: sending the batches again would store them twice.
"""

from __future__ import annotations

import threading

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server import EmbeddedCluster
from sbp_spark.server.storage import segment as segment_mod

PROBE_S = 0.2
CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=30, retry_backoff_ms=1,
                      retry_backoff_max_ms=5, probe_interval_s=PROBE_S)
BATCHES = 12
BODY = 1024 * 1024 - 28  # 1 MiB batches: stored on the connection's handler thread


@pytest.fixture
def held_writes(monkeypatch):
    """The second segment write (the first of a writer's pipelined frames: a writer's first
    batch to a range goes alone) waits for the returned event (set by the test, and at the
    end)."""
    release = threading.Event()
    entered = threading.Event()
    calls = [0]
    real = segment_mod.Segment.write

    def held(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            entered.set()
            release.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(segment_mod.Segment, "write", held)
    yield entered, release
    release.set()


def test_a_primary_whose_disk_holds_its_writes_is_waited_for_not_written_twice(
        tmp_path, held_writes):
    entered, release = held_writes
    with EmbeddedCluster(tmp_path, range_servers=2) as cluster, \
            ConnectionPool(CONFIG) as pool:
        client = SbpClient(cluster.pd_address, CONFIG, pool)
        [stream] = client.create_streams(1, replicas=1)
        bodies = [bytes([i]) * BODY for i in range(BATCHES)]
        # Ten probe intervals: long enough for several unanswered PINGs.
        threading.Timer(10 * PROBE_S, release.set).start()
        landed = client.open_stream(stream.stream_id).append([batch_bytes(b) for b in bodies])
        assert entered.is_set()
        assert [a.base_offset for a in landed] == list(range(BATCHES))
        stored = [bytes(b.data[28:29]) for b in client.read(stream.stream_id)]
        assert stored == [bytes([i]) for i in range(BATCHES)]
