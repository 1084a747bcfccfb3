"""Clients of a PD cluster whose leader crashes: with their default retry policy, and the
``sbp`` command's shorter one, calls wait for the new leader instead of failing while the
cluster elects it.

The PD nodes run in this process on the session's etcd, with the default 3 s lease. A crash
is a stop that does not revoke the node's lease: the listening socket closes at once (clients
get connection refused) and the leader key stays until etcd expires it, as after a kill -9.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import NoReturn

import pytest

from sbp_spark.cli import main
from sbp_spark.client import ClientConfig, ConnectionPool
from sbp_spark.client.pd import PD_ELECTION_BACKOFF_MAX_MS, PD_ELECTION_WAIT_S, PdClient
from sbp_spark.protocol.errors import ErrorCode, PdNotLeaderError
from sbp_spark.protocol.messages import Stream
from sbp_spark.server.etcd_client import EtcdClient, EtcdUnavailable
from sbp_spark.server.pd import PdConfig, PlacementDriver
from sbp_spark.server.range_server import RangeServer, RangeServerConfig
from tests.polling import wait_until


@pytest.fixture
def nodes(etcd_endpoints, etcd_prefix) -> Iterator[list[PlacementDriver]]:
    started = [PlacementDriver(PdConfig(None, name=f"pd-{i}", etcd=etcd_endpoints,
                                        etcd_prefix=etcd_prefix)).start() for i in range(3)]
    yield started
    for node in started:
        node.stop()


def leader_of(nodes: list[PlacementDriver]) -> PlacementDriver:
    wait_until(lambda: sum(n.office.is_leader() for n in nodes) == 1,
               "exactly one PD node to lead", timeout=15)
    leader = next(n for n in nodes if n.office.is_leader())
    wait_until(lambda: all(_leader_address(n) == leader.address for n in nodes),
               "every node to know the leader")
    return leader


def _leader_address(node: PlacementDriver) -> str | None:
    """The leader's address as ``node`` sees it, if it knows one."""
    known = node.office.cluster().leader
    return None if known is None else known.advertise_addr


def crash(node: PlacementDriver, monkeypatch) -> None:
    assert node.leadership is not None
    monkeypatch.setattr(node.leadership.etcd, "lease_revoke", lambda lease: None)
    node.stop()


def addresses(nodes: list[PlacementDriver]) -> str:
    return ",".join(n.address for n in nodes)


def test_a_call_during_the_election_waits_for_the_new_leader(nodes, monkeypatch):
    leader = leader_of(nodes)
    rest = [n for n in nodes if n is not leader]
    # When a node of the rest first leads (looked at every 20 ms).
    elected: list[float] = []
    watching = threading.Event()

    def watch() -> None:
        # One more look after the call is done: it may have been served by a leader elected
        # within the last 20 ms, between two looks.
        while not elected:
            if any(n.office.is_leader() for n in rest):
                elected.append(time.monotonic())
            elif watching.is_set():
                return
            time.sleep(0.02)

    with ConnectionPool(ClientConfig()) as pool:
        pd = PdClient(addresses(nodes), pool=pool)
        assert pd.list_streams() == []
        crashed_at = time.monotonic()
        crash(leader, monkeypatch)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # Five retries take about 1.5 s; the old leader's lease alone lasts 3 s.
        assert pd.allocate_id("after the crash") >= 1
        done = time.monotonic()
        watching.set()
        watcher.join()
    assert pd.leader == leader_of(rest).address
    assert done - crashed_at < PD_ELECTION_WAIT_S
    # The call went on soon after the new leader served: the election's tries back off at
    # most PD_ELECTION_BACKOFF_MAX_MS (they grew to 2 s before, and writers waited that).
    assert elected and done - elected[0] < PD_ELECTION_BACKOFF_MAX_MS / 1000 + 0.75


def test_a_redirect_is_followed_with_no_retries_left(nodes):
    leader = leader_of(nodes)
    followers = [n for n in nodes if n is not leader]
    with ConnectionPool(ClientConfig(retries=0)) as pool:
        pd = PdClient(addresses([*followers, leader]), ClientConfig(retries=0), pool)
        assert pd.list_streams() == []
    assert pd.leader == leader.address


def test_sbp_commands_during_the_election_wait_for_the_new_leader(nodes, monkeypatch, capsys):
    leader = leader_of(nodes)
    pd = addresses(nodes)
    assert main(["streams", "list", "--pd", pd]) == 0
    capsys.readouterr()
    crash(leader, monkeypatch)
    # Three retries take about 0.3 s.
    assert main(["streams", "list", "--pd", pd]) == 0, capsys.readouterr().err


def test_sbp_cluster_during_the_election_shows_the_new_leader_and_its_range_server(
        nodes, monkeypatch, capsys, tmp_path):
    leader = leader_of(nodes)
    pd = addresses(nodes)
    rs = RangeServer(RangeServerConfig(data_dir=str(tmp_path / "rs"), pd_addresses=pd.split(","),
                                       heartbeat_interval_s=0.2)).start()
    try:
        wait_until(lambda: rs.server_id >= 0 and leader.liveness.is_live(rs.server_id),
                   "the range server to heartbeat to the leader")
        crash(leader, monkeypatch)
        # A follower answers DESCRIBE_PD_CLUSTER too, but knows no range server: its answer
        # used to be reported as "no range server has registered". (The exit status may be 1:
        # the new leader may not have heard the server's heartbeat yet.)
        main(["cluster", "--json", "--pd", pd])
        out, err = capsys.readouterr()
        assert "no range server has registered" not in err
    finally:
        rs.stop()
    facts = json.loads(out)
    new = leader_of([n for n in nodes if n is not leader])
    assert [m["address"] for m in facts["members"] if m["leader"]] == [new.address]
    assert [s["address"] for s in facts["range_servers"]] == [rs.advertise_addr]


@pytest.fixture
def range_server(nodes, tmp_path) -> Iterator[RangeServer]:
    leader = leader_of(nodes)
    rs = RangeServer(RangeServerConfig(data_dir=str(tmp_path / "rs"),
                                       pd_addresses=[n.address for n in nodes],
                                       heartbeat_interval_s=0.2)).start()
    try:
        wait_until(lambda: rs.server_id >= 0 and leader.liveness.is_live(rs.server_id),
                   "the range server to heartbeat to the leader")
        yield rs
    finally:
        rs.stop()


def lose_office_after(leader: PlacementDriver, method: str, etcd_endpoints, etcd_prefix,
                      monkeypatch) -> None:
    """Make ``leader``'s stream operation ``method`` (``StreamOperations``, what its handler
    calls per item) end its office once it has carried out one item."""
    done = getattr(leader.streams, method)

    def then_lose_office(*args):
        result = done(*args)
        # The leader key vanishes as with an expired lease: the next write is fenced off.
        etcd = EtcdClient(etcd_endpoints)
        try:
            etcd.delete(f"{etcd_prefix}leader".encode())
        finally:
            etcd.close()
        return result

    monkeypatch.setattr(leader.streams, method, then_lose_office)


def test_a_create_batch_cut_by_the_end_of_office_makes_no_stream_twice(
        nodes, range_server, monkeypatch, etcd_endpoints, etcd_prefix):
    lose_office_after(leader_of(nodes), "create", etcd_endpoints, etcd_prefix,
                      monkeypatch)
    with ConnectionPool(ClientConfig()) as pool:
        client = PdClient(addresses(nodes), pool=pool)
        results = client.create_streams([Stream(), Stream()])
        made = [r.value.stream_id for r in results if r.ok and r.value is not None]
        listed = [s.stream_id for s in client.list_streams()]
    # The first stream was made before the office ended; the whole batch used to be refused
    # with PD_NOT_LEADER and sent again to the next leader, which made it a second time.
    assert listed == made and len(made) == 1
    assert results[1].status.code == ErrorCode.PD_NOT_LEADER


def test_a_delete_batch_cut_by_the_end_of_office_reports_what_it_deleted(
        nodes, range_server, monkeypatch, etcd_endpoints, etcd_prefix):
    with ConnectionPool(ClientConfig()) as pool:
        client = PdClient(addresses(nodes), pool=pool)
        ids = [r.unwrap().stream_id for r in client.create_streams([Stream(), Stream()])]
        lose_office_after(leader_of(nodes), "delete", etcd_endpoints, etcd_prefix,
                          monkeypatch)
        results = client.delete_streams(ids)
        left = [s.stream_id for s in client.list_streams()]
    # The first delete used to be sent again with the whole batch and fail as "not found".
    assert results[0].ok, results[0].status
    assert results[1].status.code == ErrorCode.PD_NOT_LEADER and left == ids[1:]


class UnreachableEtcd:
    """What a node's election asks of etcd (``EtcdClient``), every call failing as when the
    node cannot reach any etcd member."""

    def _fail(self, *args: object, **kwargs: object) -> NoReturn:
        raise EtcdUnavailable("no etcd member answered (cut off by the test)")

    lease_grant = lease_keepalive = lease_revoke = put = txn = range = get = _fail


def test_a_cluster_without_a_leader_is_reported_as_such(nodes, monkeypatch, capsys):
    leader_of(nodes)
    # Every node stops leading and no election ends, as while etcd does not answer: the
    # leader steps down when its lease can no longer be renewed; the followers still name the
    # last leader they saw, for as long as its lease could have lasted.
    for node in nodes:
        assert node.leadership is not None
        monkeypatch.setattr(node.leadership, "etcd", UnreachableEtcd())
    wait_until(lambda: not any(n.office.is_leader() for n in nodes),
               "the leader to step down", timeout=15)
    config = ClientConfig(retry_deadline_s=2.0)
    with ConnectionPool(config) as pool:
        pd = PdClient(addresses(nodes), config, pool)
        with pytest.raises(PdNotLeaderError) as err:
            pd.list_streams()
    message = str(err.value)
    assert "no PD node served as leader for" in message
    assert all(n.address in message for n in nodes)
    assert "the last answer: PD pd-" in message and "reach etcd" in message
