"""The client against the embedded cluster: admin calls, writes, reads, seals, redirects."""

from __future__ import annotations

import dataclasses
import threading
import time

import pyarrow as pa
import pytest

from sbp_spark.client import (
    ClientConfig,
    Connection,
    ConnectionPool,
    PdClient,
    RangeServerClient,
    SbpClient,
)
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import (
    ErrorCode,
    InvalidRequestError,
    OffsetOutOfRangeError,
    SbpError,
    StreamNotFoundError,
)
from sbp_spark.protocol.records import (
    body_to_arrow,
    encode_arrow_batch,
    encode_batch,
    make_records_batch,
)
from tests.polling import wait_until

from .conftest import TEST_CONFIG
from .fakes import FakeServer, Peer


def opaque(i: int, size: int = 0) -> list:
    body = b"record-%06d|" % i
    return encode_batch(body + b"." * max(0, size - len(body)))


def read_values(client: SbpClient, stream_id: int, start: int = 0, end: int = -1) -> list:
    out = []
    for batch in client.read(stream_id, start, end):
        out.append((batch.header.base_offset, bytes(batch.data[28:])))
    return out




def _outstanding(client: SbpClient, address: str) -> int:
    conn = client.pool.connections().get(address)
    return conn.outstanding if conn is not None else 0


def test_create_describe_delete_streams(client):
    created = client.create_streams(count=3, replicas=1, retention_ms=-1)
    ids = [s.stream_id for s in created]
    assert len(set(ids)) == 3
    described = client.describe_streams(ids)
    assert [s.stream_id for s in described] == ids
    assert all(s.replica_nums == 1 and not s.deleted for s in described)
    client.delete_streams(ids[:1])
    with pytest.raises(StreamNotFoundError, match=f"stream {ids[0]}"):
        client.describe_streams(ids[:1])
    assert client.describe_stream(ids[1]).stream_id == ids[1]


def test_per_item_results_keep_good_items(client):
    (stream,) = client.create_streams()
    results = client.pd.describe_streams([stream.stream_id, 987_654_321])
    assert results[0].ok and results[0].unwrap().stream_id == stream.stream_id
    assert results[1].status.code == ErrorCode.STREAM_NOT_FOUND
    with pytest.raises(StreamNotFoundError):
        results[1].unwrap()


def test_bad_arguments_name_the_problem(client):
    with pytest.raises(ValueError, match="replicas"):
        client.create_streams(replicas=0)
    with pytest.raises(ValueError, match="count"):
        client.create_streams(count=0)
    with pytest.raises(ValueError, match="start"):
        next(client.read(1, start=-5))


def test_append_then_read_round_trip(client):
    (stream,) = client.create_streams()
    writer = client.open_stream(stream.stream_id)
    appended = writer.append([opaque(i) for i in range(50)])
    assert [a.base_offset for a in appended] == list(range(50))
    assert all(a.record_count == 1 and a.range_index == 0 for a in appended)
    more = writer.append([opaque(i) for i in range(50, 60)])
    assert [a.base_offset for a in more] == list(range(50, 60))
    values = read_values(client, stream.stream_id)
    assert [o for o, _ in values] == list(range(60))
    assert values[7][1] == b"record-000007|"
    # A window: whole batches covering [10, 20).
    assert [o for o, _ in read_values(client, stream.stream_id, 10, 20)] == list(range(10, 20))
    (rng,) = client.list_ranges(stream.stream_id)
    assert rng.is_open and client.open_range_end(rng) == 60


def test_fetched_batches_are_zero_copy_views(client):
    (stream,) = client.create_streams()
    client.append(stream.stream_id, [opaque(i, 5000) for i in range(5)])
    (rng,) = client.list_ranges(stream.stream_id)
    batches = list(client.fetch(rng, 0))
    assert len(batches) == 5
    assert all(isinstance(b.data, memoryview) for b in batches)
    # Batches of one frame share the frame's buffer.
    assert len({id(b.data.obj) for b in batches}) < len(batches)
    assert batches[0].stream_id == stream.stream_id and batches[0].range_index == 0


def test_arrow_records_round_trip(client):
    (stream,) = client.create_streams()
    values = pa.array([b"v%d" % i for i in range(1000)], pa.binary())
    batch = make_records_batch(values)
    appended = client.append(stream.stream_id, [encode_arrow_batch(batch)] * 3)
    assert [(a.base_offset, a.record_count) for a in appended] == [(0, 1000), (1000, 1000),
                                                                   (2000, 1000)]
    fetched = list(client.read(stream.stream_id, 1500))
    assert [f.header.base_offset for f in fetched] == [1000, 2000]
    table = body_to_arrow(fetched[0].data[28:])
    assert table.column("value").to_pylist()[:2] == [b"v0", b"v1"]


def test_writer_follows_a_seal_to_the_next_range(client):
    (stream,) = client.create_streams()
    writer = client.open_stream(stream.stream_id)
    first = writer.append([opaque(i) for i in range(10)])
    assert {a.range_index for a in first} == {0}
    new_range = client.seal_range(stream.stream_id)
    assert new_range.range_index == 1 and new_range.start_offset == 10
    # The writer still holds range 0: its server answers RANGE_SEALED, the writer asks the
    # PD again and lands in range 1.
    second = writer.append([opaque(i) for i in range(10, 25)])
    assert {a.range_index for a in second} == {1}
    assert [a.base_offset for a in second] == list(range(10, 25))
    ranges = client.list_ranges(stream.stream_id)
    assert [(r.range_index, r.start_offset, r.end_offset) for r in ranges] == [
        (0, 0, 10), (1, 10, -1)]
    values = read_values(client, stream.stream_id)
    assert [o for o, _ in values] == list(range(25))
    assert values[12][1] == b"record-000012|"
    assert [o for o, _ in read_values(client, stream.stream_id, 8, 13)] == list(range(8, 13))


def test_large_append_split_into_frames_against_the_server(cluster, pool):
    config = ClientConfig(max_frame_bytes=4 * 1024 * 1024, max_inflight_frames=3,
                          request_timeout_s=20)
    client = SbpClient(cluster.pd_address, config, pool)
    (stream,) = client.create_streams()
    batches = [opaque(i, 1024 * 1024 - 28) for i in range(20)]  # 20 MiB, 3 per frame
    appended = client.append(stream.stream_id, batches)
    assert [a.base_offset for a in appended] == list(range(20))
    assert all(a.batch_length == 1024 * 1024 for a in appended)
    got = read_values(client, stream.stream_id)
    assert [o for o, _ in got] == list(range(20))
    assert got[19][1].startswith(b"record-000019|")


def test_concurrent_writers_share_one_connection(client, pool):
    (stream,) = client.create_streams()
    writer = client.open_stream(stream.stream_id)
    errors = []

    def write(t: int) -> None:
        try:
            for round_ in range(5):
                writer.append([opaque(t * 1000 + round_ * 10 + i) for i in range(10)])
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    offsets = [o for o, _ in read_values(client, stream.stream_id)]
    assert offsets == list(range(200))
    primary = client.list_ranges(stream.stream_id)[0].primary.advertise_addr
    assert primary in pool.connections()


def test_tailing_fetch_waits_for_new_data(client):
    (stream,) = client.create_streams()
    client.append(stream.stream_id, [opaque(0)])
    (rng,) = client.list_ranges(stream.stream_id)
    got = []

    def tail() -> None:
        for batch in client.fetch(rng, 1, max_wait_ms=5000, min_bytes=1):
            got.append(batch.header.base_offset)

    reader = threading.Thread(target=tail)
    began = time.monotonic()
    reader.start()
    wait_until(lambda: _outstanding(client, rng.primary.advertise_addr) == 1)
    client.append(stream.stream_id, [opaque(1)])
    reader.join(10)
    assert got == [1]
    assert time.monotonic() - began < 5


def test_trim_then_read_starts_at_the_trim_point(client):
    (stream,) = client.create_streams()
    client.append(stream.stream_id, [opaque(i) for i in range(20)])
    trimmed = client.trim_stream(stream.stream_id, 10)
    assert trimmed.start_offset == 10
    offsets = [o for o, _ in read_values(client, stream.stream_id)]
    assert offsets[0] == 10 and offsets[-1] == 19
    (rng,) = client.list_ranges(stream.stream_id)
    with pytest.raises(OffsetOutOfRangeError):
        list(client.fetch(rng, 2))


def test_range_server_client_seal_and_describe(client):
    (stream,) = client.create_streams()
    client.append(stream.stream_id, [opaque(i) for i in range(3)])
    (rng,) = client.list_ranges(stream.stream_id)
    rs = RangeServerClient(rng.primary.advertise_addr, TEST_CONFIG, client.pool)
    (described,) = rs.describe_ranges([rng])
    assert described.unwrap().next_offset == 3
    (sealed,) = rs.seal([(stream.stream_id, 0)])
    assert sealed.unwrap().end_offset == 3
    assert rs.ping() >= 0


def test_fetch_falls_back_to_another_replica(cluster, client):
    (stream,) = client.create_streams(replicas=2)
    client.append(stream.stream_id, [opaque(i) for i in range(5)])
    (rng,) = client.list_ranges(stream.stream_id)
    assert len(rng.servers) == 2
    # Point the "primary" at a dead address: the read must come from the other replica.
    with FakeServer(lambda peer: None) as gone:
        dead = gone.address
    replicas = [m.RangeReplica(m.RangeServer(-1, dead), True)] + [
        m.RangeReplica(r.server, False) for r in rng.servers]
    moved = m.Range(rng.stream_id, rng.range_index, rng.start_offset, rng.next_offset,
                    rng.end_offset, replicas)
    assert [b.header.base_offset for b in client.fetch(moved, 0, 5)] == list(range(5))


def test_pd_leader_redirect_from_a_scripted_follower(cluster, pool):
    cluster_msg = m.PlacementDriverCluster([
        m.PlacementDriverNode("follower", "127.0.0.1:9", False),
        m.PlacementDriverNode("leader", cluster.pd_address, True),
    ])
    asked = []

    def follower(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            asked.append(frame.opcode)
            request = m.decode_request(frame)
            response_cls = m.RESPONSES[frame.opcode]
            status = m.Status(ErrorCode.PD_NOT_LEADER, "not the leader",
                              cluster_msg.to_flatbuffers())
            peer.send(m.response_frame(frame.stream_id, response_cls(status=status)))
            assert request is not None

    with FakeServer(follower) as fake:
        client = SbpClient(fake.address, TEST_CONFIG, pool)
        (stream,) = client.create_streams()
        assert client.describe_stream(stream.stream_id).stream_id == stream.stream_id
        assert client.pd.leader == cluster.pd_address
        assert len(asked) == 1  # only the first call went to the follower


def test_pd_admin_calls(cluster, pool):
    pd = PdClient(cluster.pd_address, TEST_CONFIG, pool)
    members = pd.describe_pd_cluster().members
    assert any(node.is_leader and node.advertise_addr == cluster.pd_address for node in members)
    first, second = pd.allocate_id("host-a"), pd.allocate_id("host-b")
    assert first != second
    (created,) = pd.create_streams([m.Stream(replica_nums=1)])
    stream_id = created.unwrap().stream_id
    (updated,) = pd.update_streams([m.Stream(stream_id=stream_id, replica_nums=1,
                                             retention_period_ms=60_000)])
    assert updated.unwrap().retention_period_ms == 60_000
    (listed,) = pd.list_ranges([stream_id])
    (rng,) = listed.unwrap()
    by_server = pd.list_ranges_by_server([rng.primary])
    assert any(r.stream_id == stream_id for r in by_server[0].unwrap())
    (bad,) = pd.update_streams([m.Stream(stream_id=stream_id, replica_nums=0)])
    with pytest.raises(InvalidRequestError):
        bad.unwrap()


def test_heartbeat_thread_beats_the_pd(cluster, pool):
    pd = PdClient(cluster.pd_address, TEST_CONFIG, pool)
    responses = []
    beat = pd.start_heartbeat(lambda: m.HeartbeatRequest(client_id="client-test",
                                                         client_role=m.ClientRole.CLIENT), 0.05,
                              responses.append)
    try:
        wait_until(lambda: len(responses) >= 3)
    finally:
        beat.stop()
    assert len(responses) >= 3 and beat.last_error is None
    assert responses[0].client_id == "client-test"


def test_connection_heartbeat_on_one_connection(cluster):
    responses = []
    with Connection(cluster.pd_address, TEST_CONFIG) as conn:
        beat = conn.start_heartbeat(lambda: m.HeartbeatRequest(
            client_id="conn-test", client_role=m.ClientRole.CLIENT), 0.05,
                                    responses.append)
        wait_until(lambda: len(responses) >= 2)
        beat.stop()
    assert len(responses) >= 2


def test_pool_reuses_connections_across_clients(cluster):
    with ConnectionPool(TEST_CONFIG) as pool:
        a = SbpClient(cluster.pd_address, TEST_CONFIG, pool)
        b = SbpClient(cluster.pd_address, TEST_CONFIG, pool)
        a.create_streams()
        conn = pool.get(cluster.pd_address)
        b.create_streams()
        assert pool.get(cluster.pd_address) is conn


def test_report_metrics_reaches_the_pd(cluster, pool):
    pd = PdClient(cluster.pd_address, TEST_CONFIG, pool)
    (stream,) = pd.create_streams([m.Stream()])
    (listed,) = pd.list_ranges([stream.unwrap().stream_id])
    server = listed.unwrap()[0].primary
    response = pd.report_metrics(m.ReportMetricsRequest(range_server=server, disk_in_rate=1))
    assert response.status.ok


def test_writer_rides_through_a_range_server_restart(tmp_path):
    """GOAWAY and a closed connection mid-traffic: the writer retries and nothing is lost."""
    from sbp_spark.server.cluster import EmbeddedCluster

    config = ClientConfig(request_timeout_s=10, retries=200, retry_backoff_ms=10,
                          retry_backoff_max_ms=100, retry_deadline_s=60)
    with EmbeddedCluster(str(tmp_path / "restart"), range_servers=1) as small, \
            ConnectionPool(config) as private:
        client = SbpClient(small.pd_address, config, private)
        (stream,) = client.create_streams()
        writer = client.open_stream(stream.stream_id)
        written: list[int] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def write() -> None:
            i = 0
            try:
                while not stop.is_set():
                    writer.append([opaque(i + k) for k in range(20)])
                    written.extend(range(i, i + 20))
                    i += 20
            except BaseException as exc:  # surfaced by the assertions below
                errors.append(exc)

        thread = threading.Thread(target=write)
        thread.start()
        wait_until(lambda: len(written) >= 100)
        address = small.range_server_addresses[0]
        before = private.connections()[address]
        small.stop_range_server(0)
        assert before.goaway_received or before.closed
        small.start_range_server(0)
        mark = len(written)
        wait_until(lambda: len(written) >= mark + 100 or errors, timeout=60)
        stop.set()
        thread.join(60)
        assert not errors
        assert all(conn is not before for conn in private.connections().values())
        values = [v for _, v in read_values(client, stream.stream_id)]
        stored = {int(v[7:13]) for v in values}
        assert stored >= set(written)
        offsets = [o for o, _ in read_values(client, stream.stream_id)]
        assert offsets == list(range(len(offsets)))


def test_a_closed_pool_fails_at_once_and_says_so(cluster):
    # Nothing can succeed through a closed pool: retrying until the deadline only delays
    # the error.
    config = dataclasses.replace(TEST_CONFIG, retries=100, retry_backoff_max_ms=1000)
    pool = ConnectionPool(config)
    client = SbpClient(cluster.pd_address, config, pool)
    (stream,) = client.create_streams()
    client.append(stream.stream_id, [encode_batch(b"before")])
    pool.close()
    began = time.monotonic()
    for act in (lambda: client.append(stream.stream_id, [encode_batch(b"after")]),
                lambda: client.open_stream(stream.stream_id).append([encode_batch(b"after")]),
                lambda: list(client.read(stream.stream_id)), client.list_streams):
        with pytest.raises(SbpError, match="connection pool is closed") as info:
            act()
        assert not info.value.retriable
    assert time.monotonic() - began < 2
