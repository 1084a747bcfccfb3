"""Retention that waits for named consumers: a stream told to keep what its consumers have not
read (`sbp streams update --retain-for-consumers`) keeps it past its retention period (the
range servers' pass) and past TRIM_STREAMS (the PD), until a cap in bytes or time wins and the
consumer is reported as having lost data."""

from __future__ import annotations

import json
import time

import pytest

from sbp_spark.cli import main
from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.client.consumers import consumer_lag
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.server.storage import StorageConfig
from sbp_spark.server.storage.range_log import ConsumerHold
from sbp_spark.server.storage.store import Storage
from tests.server.test_storage import _batch
from tests.server.test_stream_names import stores  # noqa: F401 (fixture)


def _old_segments(tmp_path, count=4, now=1_800_000_000_000):
    """A range with ``count`` expired one-batch segments (offsets 0..count-1) and two
    fresh ones."""
    storage = Storage(str(tmp_path), StorageConfig(fsync="never", segment_bytes=4096))
    rlog = storage.create_range(1, 0, 0)
    for i in range(count):
        rlog.append([_batch(b"o" * 3000)], now_ms=now - 100_000 + i * 10_000)
    for _ in range(2):
        rlog.append([_batch(b"n" * 3000)], now_ms=now)
    return storage, rlog


def test_the_retention_pass_keeps_what_consumers_have_not_read_up_to_the_caps(tmp_path):
    now = 1_800_000_000_000
    storage, rlog = _old_segments(tmp_path / "a")
    with storage:
        # Consumers are at offset 1: segment 0 goes, 1..3 (unread, expired) stay.
        assert rlog.expire(10_000, now, ConsumerHold(low_offset=1)) == 1
        assert rlog.expire(10_000, now, ConsumerHold(low_offset=1)) is None
        # They read on to 3: 1 and 2 go.
        assert rlog.expire(10_000, now, ConsumerHold(low_offset=3)) == 3
    storage, rlog = _old_segments(tmp_path / "b")
    with storage:
        # Time cap: records older than 75 s go whatever was read (offsets 0 and 1: written
        # 100 s and 90 s ago; 2 at 80 s ago too; 3 at 70 s ago stays).
        assert rlog.expire(10_000, now, ConsumerHold(low_offset=0, cap_ms=75_000)) == 3
    storage, rlog = _old_segments(tmp_path / "c")
    with storage:
        # Byte cap: at most two held segments' bytes (about 6 KB) stay for the consumers.
        size = rlog.segments[0].size
        assert rlog.expire(10_000, now, ConsumerHold(low_offset=0, cap_bytes=2 * size)) == 2


def _append(client, stream_id, count, ts):
    client.append(stream_id, [batch_bytes(b"r", base_timestamp_ms=ts + i) for i in range(count)])


def test_trims_stop_at_the_lowest_consumer_until_the_time_cap_and_report_the_loss(tmp_path,
                                                                                  capsys):
    with EmbeddedCluster(tmp_path / "c", range_servers=1) as cluster, \
            SbpClient(cluster.pd_address, pool=ConnectionPool()) as client:
        stream = client.create_stream("held")
        sid = stream.stream_id
        old = int(time.time() * 1000) - 3_600_000  # an hour ago, by the records' clocks
        _append(client, sid, 5, old)
        _append(client, sid, 5, int(time.time() * 1000))
        assert main(["streams", "update", "held", "--retain-for-consumers", "--json",
                     "--pd", cluster.pd_address]) == 0
        facts = json.loads(capsys.readouterr().out)
        assert facts["retain_for_consumers"] and facts["retain_cap_ms"] == -1
        client.consumers.join("slow")
        client.consumers.commit("slow", 1, {sid: 2})
        client.consumers.join("fast")
        client.consumers.commit("fast", 1, {sid: 9})
        # The range server learns the consumers' lowest position for its retention pass.
        assert client.describe_stream(sid).consumers_low_offset == 2
        # TRIM_STREAMS to 8 stops at the slowest consumer.
        assert client.trim_stream(sid, 8).start_offset == 2
        # A time cap of 10 minutes: the hour-old records (0..4) may go, not the new ones.
        client.update_stream(sid, retain_cap_ms=600_000)
        assert client.trim_stream(sid, 8).start_offset == 5
        lag = {c: consumer_lag(client, client.consumers.get(c))[0] for c in ("slow", "fast")}
        assert lag["slow"].lost == 3 and lag["fast"].lost == 0
        assert main(["consumers", "list", "--pd", cluster.pd_address]) == 0
        out = capsys.readouterr().out
        assert any(line.startswith("slow") and "lost 3" in line for line in out.splitlines())
        # Without the setting, trims ignore consumers again.
        client.update_stream(sid, retain_for_consumers=False)
        assert client.describe_stream(sid).consumers_low_offset == -1
        assert client.trim_stream(sid, 8).start_offset == 8


def test_bad_retention_updates_are_refused(capsys):
    assert main(["streams", "update", "7", "--no-retain-for-consumers", "--retain-cap-ms", "5",
                 "--pd", "127.0.0.1:1"]) == 2
    assert "not with --no-retain-for-consumers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["streams", "update", "7", "--retain-cap-bytes", "0", "--pd", "127.0.0.1:1"])
    assert "must be between 1" in capsys.readouterr().err


def test_both_stores_keep_the_setting_and_its_caps(stores):  # noqa: F811 (the fixture)
    from sbp_spark.protocol.errors import InvalidRequestError
    from sbp_spark.server.pd.meta import RetentionHold

    store, other = stores
    stream, _ = store.create_stream(1, -1, [1])
    assert not stream.retain_for_consumers and stream.retain_cap_bytes == -1
    held = store.update_stream(stream.stream_id, 1, 60_000, RetentionHold(True, 1 << 20, -1))
    assert (held.retain_for_consumers, held.retain_cap_bytes, held.retain_cap_ms) == (
        True, 1 << 20, -1)
    assert other.get_stream(stream.stream_id) == held
    # An update that says nothing of it keeps it.
    assert store.update_stream(stream.stream_id, 1, 5_000).retain_for_consumers
    with pytest.raises(InvalidRequestError, match="retain_cap_ms must be -1"):
        RetentionHold(True, -1, 0).check()


def test_a_range_server_holds_its_retention_for_the_consumers_it_learns_of(tmp_path):
    from sbp_spark.server.pd import PdConfig, PlacementDriver
    from sbp_spark.server.range_server import RangeServer, RangeServerConfig
    from tests.polling import wait_until

    with PlacementDriver(PdConfig(tmp_path / "pd", fsync=False)) as pd:
        rs = RangeServer(RangeServerConfig(
            data_dir=str(tmp_path / "rs"), pd_addresses=[pd.address], heartbeat_interval_s=0.2,
            retention_check_interval_s=0.2,
            storage=StorageConfig(fsync="never", segment_bytes=4096))).start()
        try:
            client = SbpClient(pd.address, pool=ConnectionPool())
            wait_until(lambda: pd.liveness.is_live(rs.server_id), "the range server to join")
            sid = client.create_stream("kept").stream_id
            for _ in range(5):  # a segment each
                client.append(sid, [batch_bytes(b"o" * 3000)])
            client.consumers.join("reader")
            client.consumers.commit("reader", 1, {sid: 1})
            client.update_stream(sid, retention_ms=1_000, retain_for_consumers=True)
            # Once a second old, the pass deletes the segment the consumer read, no further.
            wait_until(lambda: client.describe_stream(sid).start_offset == 1,
                       "retention to trim up to the consumer", timeout=20)
            client.consumers.commit("reader", 1, {sid: 3})
            wait_until(lambda: client.describe_stream(sid).start_offset == 3,
                       "retention to follow the consumer", timeout=20)
            assert [b.header.base_offset for b in client.read(sid)] == [3, 4]
            # A byte cap smaller than what is held: the pass drops the unread records too,
            # the PD's start follows, and the consumer is reported as having lost them.
            client.update_stream(sid, retain_cap_bytes=1)
            wait_until(lambda: client.describe_stream(sid).start_offset == 5,
                       "the byte cap to win", timeout=20)
            [lag] = consumer_lag(client, client.consumers.get("reader"))
            assert (lag.committed_offset, lag.lost) == (3, 2)
        finally:
            rs.stop()
