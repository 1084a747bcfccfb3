"""Stream names in the PD: kept by both stores, unique among live streams even when two PDs
create one name at once, looked up by DESCRIBE_STREAMS, kept across a PD leader change."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.client.connection import Connection
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import (
    ErrorCode,
    InvalidRequestError,
    StreamAlreadyExistsError,
    StreamNotFoundError,
)
from sbp_spark.protocol.names import check_name, parse_stream_ref
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.server.etcd_client import EtcdClient
from sbp_spark.server.pd.etcd_store import EtcdStore
from sbp_spark.server.pd.sqlite_store import PdStore
from sbp_spark.server.range_server import RangeServer, RangeServerConfig
from tests.polling import wait_until
from tests.server.test_pd_cluster import CONFIG, addresses, leader_of, start_node


@pytest.fixture(params=["sqlite", "etcd"])
def stores(request, tmp_path):
    """Two stores over the same metadata, as two PD processes would see it (SQLite: one
    store, since one SQLite file has one PD; etcd: two clients on one prefix)."""
    if request.param == "sqlite":
        with PdStore(tmp_path / "pd.sqlite", fsync=False) as s:
            yield s, s
        return
    endpoints = request.getfixturevalue("etcd_endpoints")
    prefix = request.getfixturevalue("etcd_prefix")
    a, b = EtcdClient(endpoints), EtcdClient(endpoints)
    yield EtcdStore(a, prefix), EtcdStore(b, prefix)
    a.close()
    b.close()


def test_the_name_rule():
    assert check_name("orders") == "orders"
    for good in ("a", "orders-2026.v1", "_x", "9lives", "x" * 200):
        assert check_name(good) == good
    for bad, why in (("", "empty"), ("123", "digits only"), ("x" * 201, "above 200"),
                     ("-orders", "not a valid"), (".hidden", "not a valid"),
                     ("a/b", "not a valid"), ("a b", "not a valid"), ("*", "not a valid"),
                     ("ördérs", "not a valid")):
        with pytest.raises(ValueError, match=why):
            check_name(bad)
    assert parse_stream_ref("42") == 42 and parse_stream_ref(7) == 7
    assert parse_stream_ref(" orders ") == "orders"
    with pytest.raises(ValueError, match=">= 0"):
        parse_stream_ref("-3")
    with pytest.raises(ValueError, match="neither a stream id"):
        parse_stream_ref("a b")


def test_a_name_is_kept_looked_up_and_given_up_on_delete(stores):
    store, _ = stores
    named, _ = store.create_stream(1, -1, [1], name="orders")
    plain, _ = store.create_stream(1, -1, [1])
    assert named.name == "orders" and plain.name == ""
    assert store.stream_named("orders") == named == store.get_stream(named.stream_id)
    assert [s.name for s in store.list_streams()] == ["orders", ""]
    # Settings change, the name stays.
    assert store.update_stream(named.stream_id, 1, 5000).name == "orders"
    with pytest.raises(StreamAlreadyExistsError, match=f"taken by stream {named.stream_id}"):
        store.create_stream(1, -1, [1], name="orders")
    with pytest.raises(StreamAlreadyExistsError, match="taken"):
        store.check_name_free("orders")
    deleted, _ = store.delete_stream(named.stream_id)
    assert deleted.deleted and deleted.name == "orders"
    with pytest.raises(StreamNotFoundError, match="no stream is named 'orders'"):
        store.stream_named("orders")
    again, _ = store.create_stream(1, -1, [1], name="orders")
    assert again.stream_id > plain.stream_id and store.stream_named("orders") == again


def test_invalid_names_are_refused_by_the_store(stores):
    store, _ = stores
    for bad in ("123", "a/b", "x" * 201):
        with pytest.raises(InvalidRequestError):
            store.create_stream(1, -1, [1], name=bad)
    assert store.list_streams() == []


def test_concurrent_creates_of_one_name_make_one_stream(stores):
    outcomes: list[object] = []
    start = threading.Barrier(8)

    def create(store) -> None:
        start.wait()
        try:
            outcomes.append(store.create_stream(1, -1, [1], name="clicks")[0])
        except StreamAlreadyExistsError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=create, args=(stores[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(made) == 1 and len(outcomes) == 8
    assert [s.stream_id for s in stores[1].list_streams()] == [made[0].stream_id]


def test_a_database_from_before_names_opens_and_takes_names(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE streams (stream_id INTEGER PRIMARY KEY AUTOINCREMENT,
            replica_nums INTEGER NOT NULL, retention_period_ms INTEGER NOT NULL,
            start_offset INTEGER NOT NULL DEFAULT 0, deleted INTEGER NOT NULL DEFAULT 0,
            created_ms INTEGER NOT NULL);
        INSERT INTO streams (replica_nums, retention_period_ms, created_ms) VALUES (1, -1, 0);
    """)
    db.commit()
    db.close()
    with PdStore(path, fsync=False) as store:
        assert [(s.stream_id, s.name) for s in store.list_streams()] == [(1, "")]
        named, _ = store.create_stream(1, -1, [1], name="later")
        assert store.stream_named("later") == named


def test_describe_streams_by_name_and_id_in_one_request(tmp_path):
    with EmbeddedCluster(tmp_path, range_servers=1) as cluster:
        client = SbpClient(cluster.pd_address)
        orders, clicks = client.create_streams(names=["orders", "clicks"])
        assert (orders.name, clicks.name) == ("orders", "clicks")
        with Connection(cluster.pd_address) as conn:
            answer, _ = conn.call(m.DescribeStreamsRequest(
                stream_ids=[clicks.stream_id],
                by_name=[m.Stream(name="orders"), m.Stream(name="nothing")]))
        results = answer.describe_responses
        assert [r.status.code for r in results] == [0, 0, ErrorCode.STREAM_NOT_FOUND]
        assert [r.stream.stream_id for r in results[:2]] == [clicks.stream_id,
                                                            orders.stream_id]
        assert results[2].stream.name == "nothing"
        assert "no stream is named 'nothing'" in results[2].status.message
        # The client takes ids and names mixed, digits as ids.
        described = client.describe_streams(["orders", clicks.stream_id, str(orders.stream_id)])
        assert [s.stream_id for s in described] == [orders.stream_id, clicks.stream_id,
                                                    orders.stream_id]
        with pytest.raises(StreamNotFoundError, match="'nothing'"):
            client.describe_stream("nothing")
        with pytest.raises(StreamAlreadyExistsError, match="'orders' is taken"):
            client.create_stream("orders")
        with pytest.raises(ValueError, match="digits only"):
            client.create_stream("2026")
        # Every call that takes a stream takes its name.
        client.append("orders", [batch_bytes(b"hello")])
        assert [bytes(b.data[-5:]) for b in client.read("orders")] == [b"hello"]
        assert client.list_ranges("orders") == client.list_ranges(orders.stream_id)
        assert client.update_stream("orders", retention_ms=60_000).name == "orders"
        assert client.seal_range("orders").range_index == 1
        assert client.trim_stream("orders", 1).start_offset == 1
        assert client.delete_streams(["orders"])[0].deleted
        assert [s.name for s in client.list_streams()] == ["clicks"]


def test_one_name_created_at_once_through_two_pd_clients(etcd_endpoints, etcd_prefix,
                                                          tmp_path):
    nodes = [start_node(etcd_endpoints, etcd_prefix, i) for i in range(3)]
    servers: list[RangeServer] = []
    pool = ConnectionPool(CONFIG)
    try:
        leader = leader_of(nodes)
        servers.append(RangeServer(RangeServerConfig(
            data_dir=str(tmp_path / "rs"), pd_addresses=addresses(nodes).split(","),
            heartbeat_interval_s=0.2)).start())
        wait_until(lambda: servers[0].server_id >= 0
                   and leader.liveness.is_live(servers[0].server_id),
                   "the range server to heartbeat to the leader", timeout=15)
        # Two clients, each entering by another node (the followers redirect to the leader).
        clients = [SbpClient(",".join(n.address for n in nodes[i:] + nodes[:i]), CONFIG,
                             ConnectionPool(CONFIG)) for i in range(2)]
        outcomes: list[object] = []
        start = threading.Barrier(6)

        def create(client: SbpClient) -> None:
            start.wait()
            try:
                outcomes.append(client.create_stream("payments"))
            except StreamAlreadyExistsError as exc:
                outcomes.append(exc)

        threads = [threading.Thread(target=create, args=(clients[i % 2],)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        made = [o for o in outcomes if isinstance(o, m.Stream)]
        assert len(outcomes) == 6 and len(made) == 1, outcomes
        assert [s.stream_id for s in clients[1].list_streams()] == [made[0].stream_id]

        # The name outlives the leader: the next leader finds it, and still refuses it again.
        leader.stop()
        rest = [n for n in nodes if n is not leader]
        new = leader_of(rest)
        assert new.store.stream_named("payments").stream_id == made[0].stream_id
        client = SbpClient(addresses(rest), CONFIG, pool)
        assert client.describe_stream("payments").stream_id == made[0].stream_id
        with pytest.raises(StreamAlreadyExistsError):
            client.create_stream("payments")
    finally:
        pool.close()
        for rs in servers:
            rs.stop()
        for node in nodes:
            node.stop()
