"""Named consumers in the PD: generations that fence, positions that only move forward, kept
alike by SQLite and etcd, answered on every PD node (followers redirect) and kept across a PD
leader change."""

from __future__ import annotations

import threading

import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.errors import ConsumerFencedError, ErrorCode, InvalidRequestError
from sbp_spark.server.etcd_client import EtcdClient
from sbp_spark.server.pd.etcd_consumers import EtcdConsumers
from sbp_spark.server.pd.etcd_store import EtcdStore
from sbp_spark.server.pd.sqlite_consumers import SqliteConsumers
from sbp_spark.server.pd.sqlite_store import PdStore
from tests.server.test_pd_cluster import CONFIG, addresses, leader_of, start_node


@pytest.fixture(params=["sqlite", "etcd"])
def consumers(request, tmp_path):
    """Two handles on one record of consumers, as two PD processes would see it (SQLite: the
    PD's metadata store and the consumers on one file; etcd: two clients on one prefix)."""
    if request.param == "sqlite":
        with PdStore(tmp_path / "pd.sqlite", fsync=False):
            a = SqliteConsumers(tmp_path / "pd.sqlite", fsync=False)
            b = SqliteConsumers(tmp_path / "pd.sqlite", fsync=False)
            yield a, b
            a.close()
            b.close()
        return
    endpoints = request.getfixturevalue("etcd_endpoints")
    prefix = request.getfixturevalue("etcd_prefix")
    ea, eb = EtcdClient(endpoints), EtcdClient(endpoints)
    yield EtcdConsumers(EtcdStore(ea, prefix)), EtcdConsumers(EtcdStore(eb, prefix))
    ea.close()
    eb.close()


def test_generations_fence_and_positions_only_move_forward(consumers):
    store, other = consumers
    first = store.join("etl")
    assert (first.name, first.generation, dict(first.positions)) == ("etl", 1, {})
    moved = store.commit("etl", 1, {7: 10, 8: 3})
    assert {s: p.committed_offset for s, p in moved.positions.items()} == {7: 10, 8: 3}
    # Backwards is no move: the record keeps 10 (and its time); forwards moves.
    back = other.commit("etl", 1, {7: 4, 8: 5})
    assert back.positions[7] == moved.positions[7]
    assert back.positions[8].committed_offset == 5
    # A second reader joins: the first is fenced, whatever it sends.
    second = other.join("etl")
    assert second.generation == 2
    assert {s: p.committed_offset for s, p in second.positions.items()} == {7: 10, 8: 5}
    with pytest.raises(ConsumerFencedError, match="at generation 2"):
        store.commit("etl", 1, {7: 100})
    assert store.get("etl").positions[7].committed_offset == 10
    store.commit("etl", 2, {7: 11})
    assert [c.name for c in store.list_all()] == ["etl"]
    # Deleted: its running generation is fenced, a describe names it missing.
    assert other.delete("etl").positions[7].committed_offset == 11
    with pytest.raises(ConsumerFencedError, match="no longer exists"):
        store.commit("etl", 2, {7: 12})
    with pytest.raises(InvalidRequestError, match="no consumer is named 'etl'"):
        store.get("etl")
    assert store.join("etl").generation == 1  # a new consumer of the old name


def test_bad_names_and_offsets_are_refused(consumers):
    store, _ = consumers
    for bad in ("", "a/b", "x" * 201, "-x"):
        with pytest.raises(InvalidRequestError, match="consumer name"):
            store.join(bad)
    store.join("ok")
    with pytest.raises(InvalidRequestError, match=">= 0"):
        store.commit("ok", 1, {3: -1})


def test_joins_at_once_hand_out_distinct_generations(consumers):
    a, b = consumers
    got: list[int] = []
    lock = threading.Lock()

    def join(store):
        for _ in range(5):
            generation = store.join("race").generation
            with lock:
                got.append(generation)

    threads = [threading.Thread(target=join, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 11))


def test_the_requests_over_the_wire_on_a_lone_pd(tmp_path):
    from sbp_spark.server.cluster import EmbeddedCluster

    with EmbeddedCluster(tmp_path / "c", range_servers=1) as cluster, \
            SbpClient(cluster.pd_address, CONFIG, ConnectionPool()) as client:
        joined = client.consumers.join("q")
        assert joined.generation == 1
        stream = client.create_stream("orders")
        recorded = client.consumers.commit("q", 1, {stream.stream_id: 0})
        assert recorded.positions[0].stream_id == stream.stream_id
        assert recorded.positions[0].commit_time_ms > 0
        client.consumers.join("q")
        with pytest.raises(ConsumerFencedError):
            client.consumers.commit("q", 1, {stream.stream_id: 1})
        [missing] = client.consumers.describe(["nobody"])
        assert missing.status.code == ErrorCode.INVALID_REQUEST
        assert [c.name for c in client.consumers.list_all()] == ["q"]
        [deleted] = client.consumers.delete(["q"])
        assert deleted.ok and deleted.value.generation == 2
        assert client.consumers.list_all() == []


def test_a_lone_pd_keeps_consumers_across_a_restart(tmp_path):
    from sbp_spark.server.cluster import EmbeddedCluster

    with EmbeddedCluster(tmp_path / "c", range_servers=1) as cluster, \
            SbpClient(cluster.pd_address, CONFIG, ConnectionPool()) as client:
        client.consumers.join("kept")
        client.consumers.commit("kept", 1, {5: 42})
    with EmbeddedCluster(tmp_path / "c", range_servers=1) as cluster, \
            SbpClient(cluster.pd_address, CONFIG, ConnectionPool()) as client:
        kept = client.consumers.get("kept")
        assert (kept.generation, kept.positions[0].committed_offset) == (1, 42)


def test_every_node_answers_and_the_record_outlives_the_leader(etcd_endpoints, etcd_prefix):
    nodes = [start_node(etcd_endpoints, etcd_prefix, i) for i in range(3)]
    try:
        leader = leader_of(nodes)
        # Each client enters by another node: followers redirect to the leader.
        clients = [SbpClient(",".join(n.address for n in nodes[i:] + nodes[:i]), CONFIG,
                             ConnectionPool()) for i in range(3)]
        assert [c.consumers.join("shared").generation for c in clients] == [1, 2, 3]
        clients[0].consumers.commit("shared", 3, {1: 10})
        leader.stop()
        rest = [n for n in nodes if n is not leader]
        leader_of(rest)
        survivor = SbpClient(addresses(rest), CONFIG, ConnectionPool())
        kept = survivor.consumers.get("shared")
        assert (kept.generation, kept.positions[0].committed_offset) == (3, 10)
        with pytest.raises(ConsumerFencedError):
            survivor.consumers.commit("shared", 2, {1: 20})
    finally:
        for node in nodes:
            node.stop()
