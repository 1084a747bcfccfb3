"""A range server with a PD: server id allocation, heartbeats, metrics, retention reported as
trims, and data written through the PD's ranges."""

from __future__ import annotations

import pytest

from sbp_spark.client.pd import PdClient
from sbp_spark.client.pool import ConnectionPool
from sbp_spark.protocol.messages import (
    AppendEntry,
    AppendRequest,
    FetchEntry,
    FetchRequest,
    Stream,
)
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.pd import PdConfig, PlacementDriver
from sbp_spark.server.range_server import RangeServer, RangeServerConfig
from sbp_spark.server.range_server.registration import LinkedServer, LoadSample, PdLink
from sbp_spark.server.storage import StorageConfig
from tests.polling import wait_until

from .wire import RawPeer


@pytest.fixture
def pd(tmp_path):
    node = PlacementDriver(PdConfig(data_dir=tmp_path / "pd", heartbeat_timeout_s=2.0,
                                    fsync=False)).start()
    yield node
    node.stop()


@pytest.fixture
def client(pd):
    pool = ConnectionPool()
    yield PdClient(pd.address, pool=pool)
    pool.close()


def _rs_config(tmp_path, pd, **kw) -> RangeServerConfig:
    return RangeServerConfig(
        data_dir=str(tmp_path / "rs"), pd_addresses=[pd.address],
        storage=StorageConfig(fsync="never", segment_bytes=4096),
        heartbeat_interval_s=0.1, metrics_interval_s=0.1, **kw)


def test_registers_heartbeats_and_keeps_its_id(tmp_path, pd):
    with RangeServer(_rs_config(tmp_path, pd)) as rs:
        wait_until(lambda: rs.server_id >= 0 and pd.liveness.is_live(rs.server_id),
                   "the range server to register", timeout=20)
        first_id = rs.server_id
        assert pd.liveness.address(first_id) == rs.advertise_addr
        wait_until(lambda: rs.pd_link.heartbeats >= 2, "two heartbeats", timeout=20)
        metrics = rs.pd_link.metrics_request()
        assert metrics.range_server.server_id == first_id
        assert metrics.memory_used > 0 and metrics.disk_free_space > 0
    # A restart (on another port) keeps the id and announces the new address.
    with RangeServer(_rs_config(tmp_path, pd)) as rs:
        assert rs.server_id == first_id
        wait_until(lambda: pd.liveness.address(first_id) == rs.advertise_addr,
                   "the PD to learn the new address", timeout=20)


def test_ranges_from_the_pd_take_appends_and_retention_trims_reach_the_pd(tmp_path, pd,
                                                                          client):
    cfg = _rs_config(tmp_path, pd, retention_check_interval_s=0.1)
    with RangeServer(cfg) as rs:
        wait_until(lambda: rs.server_id >= 0 and pd.liveness.is_live(rs.server_id),
                   "the range server to register", timeout=20)
        stream = client.create_streams([Stream(retention_period_ms=1000)])[0].unwrap()
        sid = stream.stream_id
        wait_until(lambda: rs.storage.stream_ranges(sid), "the PD to sync the range",
                   timeout=20)
        batch = batch_bytes(b"x" * 3000)
        with RawPeer(rs.address) as peer:
            for _ in range(3):
                msg, _ = peer.call(AppendRequest(append_requests=[
                    AppendEntry(sid, 0, len(batch))]), batch)
                assert msg.append_responses[0].status.ok
            # Retention (1 s) expires all three batches; the PD hears the new start.
            wait_until(lambda: client.describe_streams([sid])[0].unwrap().start_offset == 3,
                       "the PD to hear of the retention trim", timeout=20)
            rid = peer.request(FetchRequest(0, 0, [FetchEntry(sid, 0, 0, 1 << 20)]))
            [frame] = peer.response(rid)
        assert rs.storage.stream_ranges(sid)[0].start_offset == 3
        assert frame.is_end


def _unregistered(tmp_path, server_id: int = -1) -> LinkedServer:
    """A range server as its PD link sees it, before the PD gave it an id (or with
    ``server_id``, after)."""
    return LinkedServer(
        data_dir=str(tmp_path), server_file=str(tmp_path / "server.json"),
        heartbeat_interval_s=1.0, metrics_interval_s=5.0, streams_interval_s=30.0,
        server_id=lambda: server_id, set_server_id=lambda server_id: None,
        advertise_addr=lambda: "127.0.0.1:1", stream_ids=list,
        stream_settings=lambda stream_id, retention_ms, deleted: None,
        load=lambda: LoadSample(0, 0, 0, 0, 0, 0, 0.0, 0.0, 0, 0))


def test_registration_backs_off_while_the_pd_is_unreachable(tmp_path):
    # A range server started before its PD tried (and logged a warning) every 0.2 s, for as
    # long as the PD stayed down: 18,000 lines an hour.
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once it closes
    waits: list[float] = []
    done = threading.Event()

    class CountedStop(threading.Event):
        def wait(self, timeout=None):
            if timeout is not None and not self.is_set():
                waits.append(timeout)
                if len(waits) == 8:
                    done.set()
                    return True  # as if stopped: the link gives up registering
                return False
            return super().wait(timeout)

    link = PdLink(_unregistered(tmp_path), [nowhere], stop=CountedStop())
    link.start()
    try:
        assert done.wait(60)
    finally:
        link.stop()
    assert waits == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]


def test_a_failed_heartbeat_is_sent_again_within_a_quarter_second(tmp_path, monkeypatch):
    # While a PD cluster elects a leader every heartbeat fails, and the new leader places no
    # range on a server (nor resyncs it) before one reaches it: a server that waited its whole
    # interval after each failure left the new leader without it for up to a second.
    from sbp_spark.protocol.errors import PdNotLeaderError
    from sbp_spark.server.range_server import registration

    now = [0.0]
    beats: list[float] = []

    class LinkTime:  # the link's clock (only its module's: other threads keep the real one)
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(registration, "time", LinkTime)

    class FakeTimeStop(registration.threading.Event):
        def wait(self, timeout=None):
            if len(beats) >= 7:
                self.set()
            if timeout is not None and not self.is_set():
                now[0] += timeout  # the pause passes at once, on the link's clock
                return False
            return self.is_set()

    link = PdLink(_unregistered(tmp_path, server_id=5), ["127.0.0.1:1"], stop=FakeTimeStop())

    def heartbeat() -> None:
        beats.append(round(now[0], 3))
        if len(beats) <= 3:  # three fail (an election), then the new leader answers
            raise PdNotLeaderError("no leader yet")

    monkeypatch.setattr(link, "_heartbeat", heartbeat)
    monkeypatch.setattr(link, "_report_metrics", lambda: None)
    monkeypatch.setattr(link, "_refresh_streams", lambda: None)
    link._run()
    link.pool.close()
    assert beats == [0.0, 0.25, 0.5, 0.75, 1.75, 2.75, 3.75]
