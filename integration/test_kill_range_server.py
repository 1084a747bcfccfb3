"""Crash a range server under load (kill -9) and restart it: nothing acknowledged is lost.

A multi-process cluster (``sbp pd`` and ``sbp range-server`` processes) takes appends from
writer threads while the range server is killed with SIGKILL and started again on its data
directory, a few times over (its port may change; the PD hands out the new one). Afterwards,
in every stream:

* every batch whose append was acknowledged is there, byte for byte, at the offset the
  acknowledgement named;
* offsets have no holes: each batch starts where the previous one ended, from 0;
* the next append continues right after the recovered end.

Appends in flight at the kill may or may not have been stored (delivery is at least once);
they may show up, but never as a hole or a torn batch.
"""

from __future__ import annotations

import threading
import time

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.errors import SbpError
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import ProcessCluster

STREAMS = 2
KILLS = 3
BATCHES_PER_APPEND = 8
# Enough retrying to ride out a range server restart (a new interpreter: about a second).
CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retries=100,
                      retry_backoff_ms=20, retry_backoff_max_ms=200, retry_deadline_s=60)


class Writer(threading.Thread):
    """Appends numbered batches to one stream until stopped; keeps what was acknowledged."""

    def __init__(self, client: SbpClient, stream_id: int) -> None:
        super().__init__(name=f"writer-{stream_id}", daemon=True)
        self.client = client
        self.stream_id = stream_id
        self.acked: dict[int, bytes] = {}  # base_offset -> body
        self.failures: list[SbpError] = []
        self.stop = threading.Event()
        self._seq = 0

    def run(self) -> None:
        writer = self.client.open_stream(self.stream_id)
        while not self.stop.is_set():
            bodies = []
            for _ in range(BATCHES_PER_APPEND):
                self._seq += 1
                bodies.append(f"stream {self.stream_id} batch {self._seq:08d}".encode() * 4)
            try:
                done = writer.append([batch_bytes(b) for b in bodies])
            except SbpError as exc:  # gave up on these: unacknowledged, may or may not exist
                self.failures.append(exc)
                continue
            for appended, body in zip(done, bodies, strict=True):
                self.acked[appended.base_offset] = body

    def wait_for_more(self, count: int, timeout: float = 60.0) -> None:
        """Block until ``count`` more batches were acknowledged."""
        target = len(self.acked) + count
        deadline = time.monotonic() + timeout
        while len(self.acked) < target:
            if time.monotonic() > deadline or not self.is_alive():
                raise AssertionError(
                    f"stream {self.stream_id}: only {len(self.acked)} of {target} batches "
                    f"acknowledged; failures: {self.failures[-3:]}")
            time.sleep(0.01)


@pytest.mark.parametrize("fsync", ["group", "interval", "always"])
def test_kill_range_server_under_load(tmp_path, fsync):
    with ProcessCluster(tmp_path, range_servers=1, fsync=fsync) as cluster, \
            ConnectionPool(CONFIG) as pool:
        client = SbpClient(cluster.pd_address, CONFIG, pool)
        streams = [s.stream_id for s in client.create_streams(STREAMS)]
        writers = [Writer(client, sid) for sid in streams]
        for w in writers:
            w.start()
        try:
            for _ in range(KILLS):
                for w in writers:
                    w.wait_for_more(50)
                cluster.kill_range_server(0)
                time.sleep(0.2)  # writers keep trying against the dead server meanwhile
                cluster.start_range_server(0)
            for w in writers:
                w.wait_for_more(50)
        finally:
            for w in writers:
                w.stop.set()
            for w in writers:
                w.join(60)
        assert not any(w.is_alive() for w in writers)

        for w in writers:
            stored = {b.header.base_offset: (b.header.record_count, bytes(b.data[28:]))
                      for b in client.read(w.stream_id)}
            # No holes: batches follow each other from offset 0.
            expected = 0
            for base in sorted(stored):
                assert base == expected, f"stream {w.stream_id}: hole before offset {base}"
                expected += stored[base][0]
            # Every acknowledged batch is where its acknowledgement said.
            missing = [o for o, body in w.acked.items() if stored.get(o, (0, b""))[1] != body]
            assert not missing, f"stream {w.stream_id}: acknowledged batches lost at {missing[:5]}"
            # The next append continues after the recovered end.
            [appended] = client.open_stream(w.stream_id).append([batch_bytes(b"after")])
            assert appended.base_offset == expected
