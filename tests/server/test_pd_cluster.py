"""A PD cluster on etcd: one leader, followers that redirect, fenced writes, a new leader that
takes over without failing healthy range servers over.

The PD nodes run in this process on the session's etcd (``etcd_endpoints``), each test under
its own key prefix; range servers are real ones that heartbeat to whichever node leads.
"""

from __future__ import annotations

import time

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.client.connection import Connection
from sbp_spark.client.pd import PdClient
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import ErrorCode, PdNotLeaderError
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.etcd_client import EtcdClient, EtcdUnavailable
from sbp_spark.server.pd import PdConfig, PlacementDriver
from sbp_spark.server.range_server import RangeServer, RangeServerConfig
from tests.polling import stays_true, wait_until

# Short lease and liveness timeout: a leader change takes about 2 s here.
LEASE_S = 2
LIVENESS_S = 1.0
CONFIG = ClientConfig(connect_timeout_s=1.0, request_timeout_s=5.0, retries=50,
                      retry_backoff_ms=20, retry_backoff_max_ms=200, retry_deadline_s=20)


def start_node(endpoints: list[str], prefix: str, i: int) -> PlacementDriver:
    return PlacementDriver(PdConfig(
        None, name=f"pd-{i}", etcd=endpoints, etcd_prefix=prefix, lease_ttl_s=LEASE_S,
        heartbeat_timeout_s=LIVENESS_S, range_server_timeout_s=2.0)).start()


def leader_of(nodes: list[PlacementDriver]) -> PlacementDriver:
    wait_until(lambda: sum(n.office.is_leader() for n in nodes if n is not None) == 1,
               "exactly one PD node to lead", timeout=15)
    return next(n for n in nodes if n is not None and n.office.is_leader())


@pytest.fixture
def nodes(etcd_endpoints, etcd_prefix):
    started = [start_node(etcd_endpoints, etcd_prefix, i) for i in range(3)]
    yield started
    for node in started:
        node.stop()


def addresses(nodes: list[PlacementDriver]) -> str:
    return ",".join(n.address for n in nodes)


def test_one_leader_and_every_node_describes_the_cluster(nodes):
    leader = leader_of(nodes)
    for node in nodes:
        # Each node refreshes its view of the membership about once a second.
        wait_until(lambda n=node: len(n.office.cluster().members) == 3
                   and n.office.cluster().leader,
                   f"{node.config.name} to see every member and the leader", timeout=5)
        with Connection(node.address) as conn:
            response, _ = conn.call(m.DescribePdClusterRequest())
        cluster = response.cluster
        assert sorted(x.name for x in cluster.members) == ["pd-0", "pd-1", "pd-2"]
        assert {x.advertise_addr for x in cluster.members} == {n.address for n in nodes}
        assert [x.name for x in cluster.members if x.is_leader] == [leader.config.name]
        # Only the leader reports the range servers it knows.
        assert response.range_servers == [] or node is leader


def test_a_follower_answers_pd_not_leader_naming_the_leader(nodes):
    leader = leader_of(nodes)
    follower = next(n for n in nodes if n is not leader)
    wait_until(lambda: follower.office.cluster().leader is not None
               and len(follower.office.cluster().members) == len(nodes),
               "the follower to see the leader and every member")
    with Connection(follower.address) as conn:
        with pytest.raises(PdNotLeaderError) as err:
            conn.call(m.DescribeStreamsRequest(stream_ids=[]))
    assert err.value.code == ErrorCode.PD_NOT_LEADER
    assert f"the leader is {leader.config.name} at {leader.address}" in err.value.message
    detail = m.PlacementDriverCluster.from_flatbuffers(err.value.detail)
    assert detail.leader.advertise_addr == leader.address and len(detail.members) == 3


def test_clients_given_a_follower_first_are_redirected(nodes):
    leader = leader_of(nodes)
    followers = [n for n in nodes if n is not leader]
    wait_until(lambda: all(f.office.cluster().leader is not None for f in followers),
               "the followers to see the leader")
    pd = PdClient(addresses([*followers, leader]), CONFIG)
    server_id = pd.allocate_id("host")
    assert server_id >= 1 and pd.leader == leader.address
    assert leader.store.get_server(server_id) is not None


def test_a_graceful_stop_hands_over_at_once(nodes):
    leader = leader_of(nodes)
    pd = PdClient(addresses(nodes), CONFIG)
    first = pd.allocate_id()
    stopped_at = time.monotonic()
    leader.stop()
    rest = [n for n in nodes if n is not leader]
    second = pd.allocate_id()  # follows the redirect, or moves past the stopped node
    taken_over = time.monotonic() - stopped_at
    new = leader_of(rest)
    assert second > first and pd.leader == new.address
    # Resigning revokes the lease: no waiting for it to run out.
    assert taken_over < LEASE_S


def test_a_leader_that_cannot_renew_stops_before_another_starts(nodes, monkeypatch):
    leader = leader_of(nodes)
    rest = [n for n in nodes if n is not leader]
    leadership = leader.leadership
    assert leadership is not None

    def cut_off(*args, **kwargs):
        raise EtcdUnavailable("cut off by the test")

    # The node keeps running but can no longer reach etcd: it must go quiet on its own.
    monkeypatch.setattr(leadership.etcd, "lease_keepalive", cut_off)
    wait_until(lambda: not leader.office.is_leader(), "the cut-off leader to stop leading",
               timeout=LEASE_S + 2)
    quiet_at = time.monotonic()
    new = leader_of(rest)
    elected_at = time.monotonic()
    assert elected_at >= quiet_at
    with Connection(leader.address) as conn, pytest.raises(PdNotLeaderError):
        conn.call(m.AllocateIdRequest(host="x"))
    # Its writes are fenced off in etcd too, whatever it believes.
    with pytest.raises(PdNotLeaderError):
        leader.store.allocate_server_id("stale")
    assert new.office.is_leader()


def test_writes_are_fenced_by_the_leader_key(nodes, etcd_endpoints, etcd_prefix):
    leader = leader_of(nodes)
    before = leader.store.list_servers()
    etcd = EtcdClient(etcd_endpoints)
    try:
        # The key vanishes as with an expired lease; the node has not noticed yet.
        etcd.delete(f"{etcd_prefix}leader".encode())
        with pytest.raises(PdNotLeaderError):
            leader.store.allocate_server_id("after the key went")
    finally:
        etcd.close()
    assert not leader.office.is_leader()
    new = leader_of(nodes)
    assert new.store.list_servers() == before


def test_a_new_leader_gives_range_servers_a_grace_period(nodes, tmp_path):
    leader = leader_of(nodes)
    pds = addresses(nodes)
    servers = [RangeServer(RangeServerConfig(
        data_dir=str(tmp_path / f"rs-{i}"), pd_addresses=pds.split(","),
        heartbeat_interval_s=0.2)).start() for i in range(2)]
    pool = ConnectionPool(CONFIG)
    try:
        wait_until(lambda: all(leader.liveness.is_live(s.server_id) for s in servers
                               if s.server_id >= 0) and all(s.server_id >= 0 for s in servers),
                   "both range servers to heartbeat to the leader", timeout=15)
        client = SbpClient(pds, CONFIG, pool)
        stream = client.create_streams(count=1, replicas=2)[0].stream_id
        writer = client.open_stream(stream)
        writer.append([batch_bytes(b"before")])
        leader.stop()
        new = leader_of([n for n in nodes if n is not leader])
        wait_until(lambda: all(new.liveness.is_live(s.server_id) for s in servers),
                   "the range servers to heartbeat to the new leader", timeout=10)
        # Nothing was failed over: the stream's first range stays open on both servers.
        stays_true(lambda: len(new.store.list_ranges(stream)) == 1 and
                   new.store.list_ranges(stream)[0].is_open, "range 0 of the stream open",
                   duration=LIVENESS_S * 1.5)
        appended = writer.append([batch_bytes(b"after")])
        assert appended[0].range_index == 0
        assert [bytes(b.data[-5:]) for b in client.read(stream)] == [b"efore", b"after"]
    finally:
        pool.close()
        for rs in servers:
            rs.stop()


def test_a_lone_pd_still_runs_on_sqlite(tmp_path):
    with PlacementDriver(PdConfig(tmp_path / "pd", fsync=False)) as pd:
        assert pd.office.is_leader() and pd.leadership is None
        assert [x.is_leader for x in pd.office.cluster().members] == [True]
    with pytest.raises(ValueError, match="data_dir"):
        PdConfig(None)
