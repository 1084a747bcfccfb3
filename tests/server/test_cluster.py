"""EmbeddedCluster: start, stop and restart a PD with range servers in this process."""

from __future__ import annotations

import socket

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.errors import ErrorCode, NotEnoughServersError
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server import EmbeddedCluster
from sbp_spark.server.cluster import accepts_connections
from tests.polling import wait_until as poll

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retry_backoff_ms=5,
                      retry_backoff_max_ms=100, retry_deadline_s=20)


@pytest.fixture
def pool():
    with ConnectionPool(CONFIG) as p:
        yield p


def client_of(cluster: EmbeddedCluster, pool: ConnectionPool) -> SbpClient:
    return SbpClient(cluster.pd_address, CONFIG, pool)


def values(client: SbpClient, stream_id: int) -> list[tuple[int, bytes]]:
    return [(b.header.base_offset, bytes(b.data[28:])) for b in client.read(stream_id)]


def append(client: SbpClient, stream_id: int, *bodies: bytes) -> list[int]:
    done = client.open_stream(stream_id).append([batch_bytes(b) for b in bodies])
    return [a.base_offset for a in done]




def test_start_serves_and_stop_closes(tmp_path, pool):
    with EmbeddedCluster(tmp_path, range_servers=2) as cluster:
        assert accepts_connections(cluster.pd_address)
        addrs = cluster.range_server_addresses
        assert len(addrs) == 2 and all(accepts_connections(a) for a in addrs)
        assert len({cluster.server_id(0), cluster.server_id(1)}) == 2
        client = client_of(cluster, pool)
        stream = client.create_streams(1, replicas=2)[0]
        assert append(client, stream.stream_id, b"a", b"b") == [0, 1]
        assert values(client, stream.stream_id) == [(0, b"a"), (1, b"b")]
        pd = cluster.pd_address
    assert not accepts_connections(pd)
    assert not any(accepts_connections(a) for a in addrs)
    assert (tmp_path / "pd").is_dir() and (tmp_path / "rs-0").is_dir()


def test_restart_brings_back_streams_and_records(tmp_path, pool):
    with EmbeddedCluster(tmp_path, range_servers=2, fsync="always") as cluster:
        client = client_of(cluster, pool)
        a, b = client.create_streams(2)
        append(client, a.stream_id, b"a0", b"a1")
        append(client, b.stream_id, b"b0")
        new = client.seal_range(a.stream_id)
        assert new.start_offset == 2
        append(client, a.stream_id, b"a2")
        ids = [cluster.server_id(i) for i in range(2)]
        pd_address = cluster.pd_address

        cluster.restart()

        assert cluster.pd_address == pd_address
        assert [cluster.server_id(i) for i in range(2)] == ids
        client = client_of(cluster, pool)
        assert {s.stream_id for s in client.list_streams()} == {a.stream_id, b.stream_id}
        assert values(client, a.stream_id) == [(0, b"a0"), (1, b"a1"), (2, b"a2")]
        assert values(client, b.stream_id) == [(0, b"b0")]
        assert append(client, a.stream_id, b"a3") == [3]
        assert append(client, b.stream_id, b"b1") == [1]


def test_new_cluster_object_on_same_dir(tmp_path, pool):
    with EmbeddedCluster(tmp_path) as cluster:
        client = client_of(cluster, pool)
        sid = client.create_streams(1)[0].stream_id
        append(client, sid, b"x")
    with EmbeddedCluster(tmp_path) as cluster:
        assert values(client_of(cluster, pool), sid) == [(0, b"x")]


def test_stop_and_start_one_range_server(tmp_path, pool):
    with EmbeddedCluster(tmp_path, range_servers=2, heartbeat_interval_s=0.1) as cluster:
        client = client_of(cluster, pool)
        sid = client.create_streams(1, replicas=2)[0].stream_id
        append(client, sid, b"one")
        server_id = cluster.server_id(1)
        cluster.stop_range_server(1)
        assert len(cluster.range_server_addresses) == 1
        pd = cluster.pd
        assert pd is not None
        poll(lambda: not pd.liveness.is_live(server_id), what="the PD to notice the stop")
        with pytest.raises(NotEnoughServersError, match="2 replicas requested but only 1"):
            client.create_streams(1, replicas=2)

        cluster.start_range_server(1)
        assert cluster.server_id(1) == server_id
        # The PD hands out the server's current address.
        [rng] = client.list_ranges(sid)
        addresses = {r.server.server_id: r.server.advertise_addr for r in rng.servers}
        assert addresses[server_id] == cluster.range_server_addresses[1]
        assert client.create_streams(1, replicas=2)
        # A restarted replica of the open range serves past its start only once an append
        # settles (docs/reliability.md, read cap).
        assert append(client, sid, b"two") == [1]
        assert values(client, sid) == [(0, b"one"), (1, b"two")]
        with pytest.raises(RuntimeError, match="already running"):
            cluster.start_range_server(1)


def test_range_server_takes_a_free_port_when_its_old_one_is_taken(tmp_path, pool):
    with EmbeddedCluster(tmp_path) as cluster:
        client = client_of(cluster, pool)
        sid = client.create_streams(1)[0].stream_id
        append(client, sid, b"kept")
        old = cluster.range_server_addresses[0]
        cluster.stop_range_server(0)
        host, port = old.rsplit(":", 1)
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        try:
            squatter.bind((host, int(port)))
            squatter.listen()
            cluster.start_range_server(0)
        finally:
            squatter.close()
        assert cluster.range_server_addresses[0] != old
        assert values(client, sid) == [(0, b"kept")]
        assert append(client, sid, b"more") == [1]


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="range_servers"):
        EmbeddedCluster(tmp_path, range_servers=-1)
    with pytest.raises(ValueError, match="fsync='sometimes' is not one of"):
        EmbeddedCluster(tmp_path, fsync="sometimes")
    with pytest.raises(ValueError, match="pd_port"):
        EmbeddedCluster(tmp_path, pd_port=70000)
    cluster = EmbeddedCluster(tmp_path, range_servers=1)
    with pytest.raises(RuntimeError, match="not running"):
        _ = cluster.pd_address
    with pytest.raises(IndexError, match="not in 0..0"):
        cluster.stop_range_server(3)
    with pytest.raises(RuntimeError, match="start the cluster"):
        cluster.start_range_server(0)


def test_a_range_pushed_after_its_stream_was_deleted_takes_no_appends(tmp_path, pool,
                                                                      monkeypatch):
    # The PD pushed the range a seal opened after releasing the stream (a new stream's range
    # still is), so a DELETE_STREAMS could reach the new range's server first, while it held
    # no range of the stream: nothing there recorded the deletion, the push then created the
    # range open, and appends to the deleted stream were acknowledged there that no reader
    # could ever read.
    from sbp_spark.client.connection import Connection
    from sbp_spark.protocol import messages as m
    from tests.pd_link import hook_syncs

    with EmbeddedCluster(tmp_path, range_servers=1) as cluster:
        client = client_of(cluster, pool)
        pd = cluster.pd
        assert pd is not None
        deleted = []

        def delete_first(server_id, ranges):
            if not deleted:
                deleted.append(pd.streams.delete(ranges[0].stream_id))  # overtakes the push

        hook_syncs(pd, delete_first, monkeypatch)
        [a] = client.create_streams(1)
        assert [s.stream_id for s in deleted] == [a.stream_id]
        batch = batch_bytes(b"lost")
        with Connection(cluster.range_server_addresses[0]) as conn:
            resp, _ = conn.call(m.AppendRequest(timeout_ms=5000, append_requests=[
                m.AppendEntry(a.stream_id, 0, len(batch))]), batch)
        [result] = resp.append_responses
        assert result.status.code == ErrorCode.STREAM_NOT_FOUND and result.base_offset == -1


def test_the_pd_tells_deleted_streams_apart_by_lookup_or_by_listing(tmp_path, pool):
    # A push of a few streams' ranges looks each up; a resync of many lists the streams once.
    from sbp_spark.server.pd import pushes as pd_pushes

    with EmbeddedCluster(tmp_path, range_servers=1) as cluster:
        client = client_of(cluster, pool)
        ids = [s.stream_id
               for s in client.create_streams(pd_pushes._LOOKUPS_BEFORE_LISTING + 4)]
        client.delete_streams(ids[::3])
        never = max(ids) + 100
        assert cluster.pd is not None
        pushes = cluster.pd.pushes
        assert pushes.deleted(ids) == set(ids[::3])
        assert pushes.deleted([*ids, never]) == {*ids[::3], never}
        assert pushes.deleted(ids[:4]) == set(ids[:4:3])
        assert pushes.deleted([ids[1], never]) == {never}


def test_a_gracefully_stopped_range_server_is_not_live_at_once(tmp_path, pool):
    # Heartbeats every 5 s: the PD would take 15 s to notice a silent server. A graceful stop
    # says goodbye (GOAWAY on the heartbeat connection), so no new range is placed on the
    # stopped server meanwhile (its streams could not be written until it came back).
    with EmbeddedCluster(tmp_path, range_servers=2, heartbeat_interval_s=5.0) as cluster:
        client = client_of(cluster, pool)
        stopped, running = cluster.server_id(0), cluster.server_id(1)
        cluster.stop_range_server(0)
        live = {s.server.server_id: s.live for s in client.pd.range_servers()}
        assert live == {stopped: False, running: True}
        for stream in client.create_streams(4, replicas=1):
            [rng] = client.list_ranges(stream.stream_id)
            assert [r.server.server_id for r in rng.servers] == [running]
        with pytest.raises(NotEnoughServersError, match="2 replicas requested but only 1"):
            client.create_streams(1, replicas=2)
        # Back: its first heartbeat makes it live again, and ranges go to it again.
        cluster.start_range_server(0)
        [stream] = client.create_streams(1, replicas=2)
        [rng] = client.list_ranges(stream.stream_id)
        assert {r.server.server_id for r in rng.servers} == {stopped, running}


def test_a_stopped_server_s_single_replica_ranges_are_one_line_not_a_warning_each(
        tmp_path, pool, caplog):
    # A server stopped on purpose (a rolling restart, or the whole cluster's stop, as at the
    # end of `sbp demo`) leaves its R = 1 ranges waiting for it: expected, so one line of
    # information for all of them; a server gone silent is still a warning.
    caplog.set_level("INFO", logger="sbp_spark.server.pd")
    with EmbeddedCluster(tmp_path, range_servers=2) as cluster:
        client = client_of(cluster, pool)
        stopped = cluster.server_id(0)
        streams = [s.stream_id for s in client.create_streams(12, replicas=1)]
        on_it = sorted(sid for sid in streams
                       if client.list_ranges(sid)[0].servers[0].server.server_id == stopped)
        assert on_it, "placement put no stream on server 0"
        cluster.stop_range_server(0)

        def lines():
            return [r for r in caplog.records if f"range server {stopped} stopped:" in r.message]

        poll(lines, what="the failover's line for the stopped server")
        [line] = lines()
        assert line.levelname == "INFO"
        assert f"{len(on_it)} open range(s) on it have no other live replica" in line.message
        assert f"{on_it[0]}/0" in line.message
        assert not [r for r in caplog.records if r.levelname == "WARNING"
                    and r.name == "sbp_spark.server.pd"]


def test_a_stopped_server_s_replicated_ranges_fail_over_with_information_not_warnings(
        tmp_path, pool, caplog):
    caplog.set_level("INFO", logger="sbp_spark.server.pd")
    with EmbeddedCluster(tmp_path, range_servers=3) as cluster:
        client = client_of(cluster, pool)
        stopped = cluster.server_id(0)
        streams = [s.stream_id for s in client.create_streams(6, replicas=2)]
        on_it = [sid for sid in streams if stopped in
                 {r.server.server_id for r in client.list_ranges(sid)[0].servers}]
        assert on_it, "placement put no stream on server 0"
        cluster.stop_range_server(0)

        def moved():
            return all(len(client.list_ranges(sid)) == 2 for sid in on_it)

        poll(moved, what="the stopped server's ranges to fail over")
        lines = [r for r in caplog.records if r.message.startswith("failover: range")]
        assert len(lines) == len(on_it)
        assert {r.levelname for r in lines} == {"INFO"}
        assert all(f"(server {stopped} stopped)" in r.message for r in lines)
        assert not [r for r in caplog.records if r.levelname == "WARNING"
                    and r.name == "sbp_spark.server.pd"]
