"""PD failover: a range server stops heartbeating, the PD seals its open ranges on the live
replicas and opens their successors elsewhere.

The PD is real; range servers are the stand-ins of test_pd (they seal where the test says), so
the end offset the PD picks can be checked exactly. The last test runs real range servers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.client.connection import Connection
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.records import batch_body, batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster, ProcessCluster
from sbp_spark.server.pd import PdConfig, PlacementDriver
from sbp_spark.server.pd.failover import ABSENT_GRACE_S, QUIET_PART, Failover
from sbp_spark.server.pd.listening import refuses_connections
from sbp_spark.server.pd.placement import Liveness

from .test_pd import FakeRangeServer, beat, create, list_ranges, poll, register
from .test_pd_store import FakeClock

# Liveness timeout of the test PD: short for speed, long enough that a loaded machine does not
# make a beating server look dead.
TIMEOUT_S = 1.0


class Beater(threading.Thread):
    """Heartbeats for the servers in ``live`` every 50 ms, like their PD links would."""

    def __init__(self, address: str, servers: list[FakeRangeServer]) -> None:
        super().__init__(daemon=True)
        self.conn = Connection(address)
        self.live = list(servers)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.05):
            for rs in list(self.live):
                beat(self.conn, rs)

    def stop(self) -> None:
        self.halt.set()
        self.join(5)
        self.conn.close()


@pytest.fixture
def cluster(tmp_path):
    pd = PlacementDriver(PdConfig(tmp_path / "pd", fsync=False, heartbeat_timeout_s=TIMEOUT_S,
                                  range_server_timeout_s=2.0)).start()
    servers = [FakeRangeServer() for _ in range(4)]
    conn = Connection(pd.address)
    for rs in servers:
        register(conn, rs)
    beater = Beater(pd.address, servers)
    beater.start()
    yield pd, conn, servers, beater
    beater.stop()
    conn.close()
    for rs in servers:
        rs.stop()
    pd.stop()


def by_id(servers: list[FakeRangeServer], ids: list[int]) -> list[FakeRangeServer]:
    return [next(rs for rs in servers if rs.server_id == sid) for sid in ids]


def new_stream(conn: Connection, replicas: int) -> tuple[int, list[int]]:
    [res] = create(conn, m.Stream(replica_nums=replicas))
    assert res.status.ok, res.status
    [rng] = list_ranges(conn, res.stream.stream_id)
    primary = [r.server.server_id for r in rng.servers if r.is_primary]
    others = [r.server.server_id for r in rng.servers if not r.is_primary]
    return res.stream.stream_id, primary + others


def test_dead_primary_range_is_sealed_at_what_every_survivor_holds(cluster):
    pd, conn, servers, beater = cluster
    sid, ids = new_stream(conn, 3)
    primary, second, third = by_id(servers, ids)
    second.next_offsets[(sid, 0)] = 12
    third.next_offsets[(sid, 0)] = 9  # lags: records 9..11 were never acknowledged
    beater.live.remove(primary)

    poll(lambda: len(list_ranges(conn, sid)) == 2, what="the failover")
    sealed, opened = list_ranges(conn, sid)
    assert (sealed.end_offset, opened.start_offset, opened.end_offset) == (9, 9, -1)
    placed = {r.server.server_id for r in opened.servers}
    assert len(placed) == 3 and primary.server_id not in placed
    # Survivors were told where the range ended, and the new range's servers know it.
    poll(lambda: third.ranges[(sid, 0)].end_offset == 9, what="the seal to reach a survivor")
    for rs in by_id(servers, sorted(placed)):
        poll(lambda rs=rs: (sid, 1) in rs.ranges, what="the new range to be pushed")


def test_dead_secondary_also_moves_the_range(cluster):
    pd, conn, servers, beater = cluster
    sid, ids = new_stream(conn, 2)
    primary, secondary = by_id(servers, ids)
    primary.next_offsets[(sid, 0)] = 5
    beater.live.remove(secondary)
    poll(lambda: len(list_ranges(conn, sid)) == 2, what="the failover")
    sealed, opened = list_ranges(conn, sid)
    assert sealed.end_offset == 5 and opened.start_offset == 5
    assert secondary.server_id not in {r.server.server_id for r in opened.servers}


def test_single_replica_range_waits_for_its_server(cluster):
    pd, conn, servers, beater = cluster
    sid, [only] = new_stream(conn, 1)
    [rs] = by_id(servers, [only])
    rs.next_offsets[(sid, 0)] = 4
    beater.live.remove(rs)
    poll(lambda: not pd.liveness.is_live(only), what="the server to be declared dead")
    pd.failover.run_failovers()  # what the liveness thread does: nothing may change
    [rng] = list_ranges(conn, sid)
    assert rng.is_open and [r.server.server_id for r in rng.servers] == [only]
    beater.live.append(rs)
    poll(lambda: pd.liveness.is_live(only), what="the server to come back")
    [rng] = list_ranges(conn, sid)
    assert rng.is_open


def test_too_few_live_servers_seal_without_a_successor(cluster):
    pd, conn, servers, beater = cluster
    sid, ids = new_stream(conn, 4)
    dead = by_id(servers, ids)[0]
    for rs in servers:
        rs.next_offsets[(sid, 0)] = 3
    beater.live.remove(dead)
    poll(lambda: not list_ranges(conn, sid)[-1].is_open, what="the seal")
    assert [r.end_offset for r in list_ranges(conn, sid)] == [3]
    resp, _ = conn.call(m.CreateRangeRequest(ranges=[m.RangeId(sid, 1)]))
    assert resp.create_responses[0].status.code == ErrorCode.NOT_ENOUGH_SERVERS
    beater.live.append(dead)
    poll(lambda: pd.liveness.is_live(dead.server_id), what="the server to come back")
    resp, _ = conn.call(m.CreateRangeRequest(ranges=[m.RangeId(sid, 1)]))
    assert resp.create_responses[0].status.ok


def test_unreachable_survivor_is_retried(cluster):
    pd, conn, servers, beater = cluster
    sid, ids = new_stream(conn, 2)
    primary, secondary = by_id(servers, ids)
    secondary.next_offsets[(sid, 0)] = 2
    saved = secondary.ranges.pop((sid, 0))  # the survivor answers "unknown range" for now
    beater.live.remove(primary)
    poll(lambda: not pd.liveness.is_live(primary.server_id), what="the primary to be dead")
    pd.failover.run_failovers()
    assert list_ranges(conn, sid)[-1].is_open
    secondary.ranges[(sid, 0)] = saved
    poll(lambda: len(list_ranges(conn, sid)) == 2, what="the retried failover")
    assert list_ranges(conn, sid)[0].end_offset == 2


def seal(conn: Connection, sid: int, range_index: int, timeout_ms: int) -> m.Range:
    """SEAL_RANGES as a writer asks it (short calls to the replicas): the open range after."""
    resp, _ = conn.call(m.SealRangesRequest(timeout_ms=timeout_ms,
                                            ranges=[m.RangeId(sid, range_index)]), timeout=30)
    [res] = resp.seal_responses
    res.status.raise_for_status()
    assert res.range is not None
    return res.range


def test_a_seal_does_not_ask_a_secondary_the_pd_no_longer_hears(cluster):
    """A writer's seal (its primary gave up on a stopped secondary) skips a secondary that
    went silent, as the failover would: asking it would hold the seal, and the stream's lock,
    for the whole timeout. It is not pushed the end either, but owed a resync."""
    pd, conn, servers, beater = cluster
    sid, ids = new_stream(conn, 3)
    primary, other, stopped = by_id(servers, ids)
    primary.next_offsets[(sid, 0)] = 7
    other.next_offsets[(sid, 0)] = 6
    pushes_before = stopped.syncs
    stopped.answering.clear()
    try:
        beater.live.remove(stopped)
        poll(lambda: pd.liveness.went_silent(stopped.server_id), what="the silence")
        opened = seal(conn, sid, 0, timeout_ms=10_000)
        sealed = list_ranges(conn, sid)[0]
        assert sealed.end_offset == 6 and opened.start_offset == 6
        assert stopped.server_id not in {r.server.server_id for r in opened.servers}
        assert stopped.seals == 0 and stopped.syncs == pushes_before
        assert pd.pushes.resync_owed(stopped.server_id)
    finally:
        stopped.answering.set()


def test_stopped_secondaries_the_pd_still_hears_cost_a_seal_one_timeout(cluster):
    """Secondaries that still heartbeat but answer nothing (stopped a moment ago) are asked
    all at once, each for one bounded try: the seal takes about one timeout, not one per
    secondary, nor two tries each. The range ends where the primary ended it."""
    pd, conn, servers, beater = cluster
    sid, ids = new_stream(conn, 3)
    primary, *stopped = by_id(servers, ids)
    primary.next_offsets[(sid, 0)] = 4
    for rs in stopped:
        rs.answering.clear()
    try:
        began = time.monotonic()
        opened = seal(conn, sid, 0, timeout_ms=1500)
        took = time.monotonic() - began
        assert list_ranges(conn, sid)[0].end_offset == 4 and opened.start_offset == 4
        # Asked in turn, or twice each, or pushed the end afterwards (they still heartbeat,
        # so their resync comes later, off the seal's path), it would take 3 s or more.
        assert took < 2.9, took
        assert [rs.seals for rs in stopped] == [1, 1]
    finally:
        for rs in stopped:
            rs.answering.set()


def test_servers_silent_since_a_pd_restart_are_failed_over(tmp_path):
    servers = [FakeRangeServer() for _ in range(3)]
    config = PdConfig(tmp_path / "pd", fsync=False, heartbeat_timeout_s=TIMEOUT_S)
    try:
        with PlacementDriver(config) as pd, Connection(pd.address) as conn:
            for rs in servers:
                register(conn, rs)
            sid, ids = new_stream(conn, 2)
        primary, secondary = by_id(servers, ids)
        secondary.next_offsets[(sid, 0)] = 7
        with PlacementDriver(config) as pd, Connection(pd.address) as conn:
            beater = Beater(pd.address, [rs for rs in servers if rs is not primary])
            beater.start()
            try:
                poll(lambda: len(list_ranges(conn, sid)) == 2, what="the failover")
            finally:
                beater.stop()
            assert list_ranges(conn, sid)[0].end_offset == 7
    finally:
        for rs in servers:
            rs.stop()


def recording_failover(liveness: Liveness, registered: list,
                       refuses=lambda address: False) -> tuple[Failover, list[int]]:
    """The sweep's decisions, without ranges to act on: who is failed over. ``refuses``: the
    probe of a quiet server's port (by default every port takes connections: no process is
    known dead)."""
    failed_over: list[int] = []

    def fail_over(server_id: int, stopped: bool) -> bool:
        failed_over.append(server_id)
        return True

    return Failover(liveness, lambda: registered, fail_over, lambda: True, 3.0,
                    "test", refuses=refuses), failed_over


def recording_probe(*refusing: str) -> tuple[list[str], Callable[[str], bool]]:
    """A port probe that refuses the connections of ``refusing`` addresses only, and the
    addresses it was asked about, in order."""
    asked: list[str] = []

    def refuses(address: str) -> bool:
        asked.append(address)
        return address in refusing

    return asked, refuses


def servers_on_record(*ids: int) -> list:
    return [SimpleNamespace(server_id=sid, advertise_addr=f"s:{sid}", registered=True,
                            last_heartbeat_ms=0) for sid in ids]


def sweep_for(failover, liveness, clock, beating, limit_s, until=lambda: False):
    """Sweep every 0.25 s (the fake clock) for ``limit_s`` while ``beating`` servers
    heartbeat; the seconds until ``until()`` held, or None if it did not."""
    waited = 0.0
    while waited < limit_s:
        clock.now += 0.25
        waited += 0.25
        for sid in beating:
            liveness.beat(sid, f"s:{sid}")
        failover.sweep_once()
        if until():
            return waited
    return None


def sweep_until_failed_over(failover, failed_over, liveness, clock, beating, limit_s):
    """``sweep_for`` until the first failover: the seconds it took, or None."""
    return sweep_for(failover, liveness, clock, beating, limit_s, lambda: bool(failed_over))


def test_a_quiet_server_whose_port_refuses_connections_is_failed_over_at_once():
    """Killed: its port refuses connections, the evidence that no process is there. It is
    failed over after one missed heartbeat, not the liveness timeout, and is not live until
    it heartbeats again (a restart)."""
    clock = FakeClock()
    liveness = Liveness(3.0, clock=clock)
    asked, refuses = recording_probe("s:2")

    failover, failed_over = recording_failover(liveness, servers_on_record(1, 2, 3), refuses)
    failover.took_office()
    for sid in (1, 2, 3):
        liveness.beat(sid, f"s:{sid}")
    took = sweep_until_failed_over(failover, failed_over, liveness, clock, (1, 3), 3.0)
    assert failed_over == [2] and asked == ["s:2"]
    assert took is not None and QUIET_PART * 3.0 < took <= QUIET_PART * 3.0 + 0.25
    assert not liveness.is_live(2)
    # Dead and failed over: not asked again, nor failed over again.
    sweep_for(failover, liveness, clock, (1, 3), 4.0)
    assert failed_over == [2] and asked == ["s:2"]
    liveness.beat(2, "s:2")  # restarted
    assert liveness.is_live(2)


def test_a_quiet_server_whose_port_takes_connections_gets_the_whole_timeout():
    """Stopped (SIGSTOP) or slow: its kernel still takes connections, which is no evidence;
    it is failed over when its heartbeats have been missing for the liveness timeout."""
    clock = FakeClock()
    liveness = Liveness(3.0, clock=clock)
    asked, refuses = recording_probe()

    failover, failed_over = recording_failover(liveness, servers_on_record(1, 2, 3), refuses)
    failover.took_office()
    for sid in (1, 2, 3):
        liveness.beat(sid, f"s:{sid}")
    took = sweep_until_failed_over(failover, failed_over, liveness, clock, (1, 3), 5.0)
    assert failed_over == [2] and "s:2" in asked
    assert took is not None and took > 3.0


def test_a_new_leader_fails_over_a_dead_server_without_its_grace():
    """A primary and the PD leader killed together: the old leader's heartbeats show no
    silence, so the dead server used to get the whole timeout after the election. Its port
    refuses connections: the new leader fails it over once it has heard the others for
    ``ABSENT_GRACE_S`` (not before: the failover seals the dead server's ranges on the
    replicas it hears, and with none heard yet it left them open). A server that is alive and
    slow to find the new leader (its port takes connections) still gets the grace."""
    clock = FakeClock()
    liveness = Liveness(3.0, clock=clock)
    asked, refuses = recording_probe("s:2")

    failover, failed_over = recording_failover(liveness, servers_on_record(1, 2, 3, 4),
                                               refuses)
    failover.took_office()
    failover.sweep_once()  # nobody heard yet: nobody is asked
    assert asked == []
    took = sweep_until_failed_over(failover, failed_over, liveness, clock, (1, 3), 3.0)
    assert failed_over == [2] and sorted(set(asked)) == ["s:2", "s:4"]
    # One second of hearing the others and a sweep; not the three of the grace.
    assert took is not None and ABSENT_GRACE_S < took <= ABSENT_GRACE_S + 0.5
    sweep_for(failover, liveness, clock, (1, 3), 1.0)
    assert failed_over == [2]  # 4 is waited for: its port takes connections


def test_a_server_heard_while_its_port_was_asked_is_not_failed_over():
    """It restarted between the probe and the decision: it heartbeats again, live."""
    clock = FakeClock()
    liveness = Liveness(3.0, clock=clock)

    def refuses(address: str) -> bool:
        liveness.beat(2, "s:2")  # the restarted server's first heartbeat arrives meanwhile
        return True

    failover, failed_over = recording_failover(liveness, servers_on_record(1, 2), refuses)
    failover.took_office()
    liveness.beat(1, "s:1")
    liveness.beat(2, "s:2")
    clock.now += 2.0
    liveness.beat(1, "s:1")
    failover.sweep_once()
    assert failed_over == [] and liveness.is_live(2)


def test_a_port_refuses_connections_only_when_nothing_listens_there():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        assert not refuses_connections(address)  # a process listens (even one that is stopped)
    assert refuses_connections(address)  # closed: the kernel refuses
    assert not refuses_connections("not an address")
    assert not refuses_connections("")


def test_servers_slow_to_find_a_new_pd_are_not_failed_over():
    """After a PD takes office, servers reach it at their own pace (a call to the old leader,
    cut off, may hang for its whole timeout first). A server that never heartbeats to the new
    PD is gone only once the others were heard for a full timeout, not one timeout after the
    PD took office."""
    clock = FakeClock()
    registered = [SimpleNamespace(server_id=sid, advertise_addr=f"s:{sid}", registered=True,
                                  last_heartbeat_ms=0) for sid in (1, 2, 3)]
    liveness = Liveness(3.0, clock=clock)
    failover, failed_over = recording_failover(liveness, registered)
    failover.took_office()
    clock.now += 2.7  # servers 1 and 3 find the new leader first
    for sid in (1, 3):
        liveness.beat(sid, f"s:{sid}")
    clock.now += 0.5  # one timeout after taking office, but not after the first heartbeat
    failover.sweep_once()
    liveness.beat(2, "s:2")  # 2 arrives
    for _ in range(4):
        clock.now += 1.0
        for sid in (1, 2, 3):
            liveness.beat(sid, f"s:{sid}")
        failover.sweep_once()
    assert failed_over == []
    # One that never arrives is gone once the others were heard for the timeout.
    late, late_failed_over = recording_failover(liveness, registered)
    late.took_office()
    liveness.clear()
    for _ in range(5):
        clock.now += 1.0
        for sid in (1, 3):
            liveness.beat(sid, f"s:{sid}")
        late.sweep_once()
    assert late_failed_over == [2]


def test_writer_carries_on_after_its_primary_dies(tmp_path):
    """Real range servers: R=2 on 3 servers, the primary stops; the PD moves the stream."""
    config = ClientConfig(connect_timeout_s=1, request_timeout_s=5, retries=100,
                          retry_backoff_ms=20, retry_backoff_max_ms=200, retry_deadline_s=30)
    with EmbeddedCluster(tmp_path, range_servers=3, heartbeat_interval_s=0.4) as cluster, \
            ConnectionPool(config) as pool:
        client = SbpClient(cluster.pd_address, config, pool)
        [stream] = client.create_streams(1, replicas=2)
        writer = client.open_stream(stream.stream_id)
        acked = {a.base_offset for a in writer.append([batch_bytes(b"x%d" % i)
                                                       for i in range(10)])}
        [rng] = client.list_ranges(stream.stream_id)
        primary = rng.primary.server_id
        index = next(i for i in range(3) if cluster.server_id(i) == primary)
        cluster.stop_range_server(index)
        acked |= {a.base_offset for a in writer.append([batch_bytes(b"y%d" % i)
                                                        for i in range(10)])}
        ranges = client.list_ranges(stream.stream_id)
        assert len(ranges) >= 2 and ranges[0].end_offset == 10
        assert primary not in {r.server.server_id for r in ranges[-1].servers}
        stored = [b.header.base_offset for b in client.read(stream.stream_id)]
        assert stored == list(range(20)) and acked == set(range(20))


def test_a_server_the_old_leader_no_longer_heard_is_failed_over_sooner():
    """A primary killed shortly before the PD leader: the old leader had heard nothing from it
    for a while, as the heartbeats it recorded show, and that silence counts toward the new
    leader's timeout (down to ``ABSENT_GRACE_S`` of hearing others). A server the old leader
    heard up to the end gets the whole timeout, as before."""
    clock = FakeClock()
    last = 50_000  # when the old leader recorded its last heartbeat (its clock, ms)
    registered = [SimpleNamespace(server_id=sid, advertise_addr=f"s:{sid}", registered=True,
                                  last_heartbeat_ms=last - lag_ms)
                  for sid, lag_ms in ((1, 0), (2, 2_500), (3, 300), (4, 200))]
    liveness = Liveness(3.0, clock=clock)
    failover, failed_over = recording_failover(liveness, registered)
    failover.took_office()
    heard, gone_after = 0.0, None
    while heard < 3.5:
        for sid in (1, 3):  # 2 died before the old leader; 4 is alive, slow to find this PD
            liveness.beat(sid, f"s:{sid}")
        if heard >= 2.0:
            liveness.beat(4, "s:4")
        failover.sweep_once()
        if failed_over and gone_after is None:
            gone_after = heard
        clock.now += 0.25
        heard += 0.25
    assert failed_over == [2]
    # Silent for long under the old leader: gone once the grace ran out, not the timeout.
    assert gone_after is not None and ABSENT_GRACE_S < gone_after <= ABSENT_GRACE_S + 0.25


# -- real processes: a range server killed (SIGKILL), with and without a restart -------------

def _primary_index(cluster: ProcessCluster, client: SbpClient, stream_id: int) -> int:
    primary = client.list_ranges(stream_id)[-1].primary
    return next(i for i, proc in enumerate(cluster.range_servers)
                if proc is not None and proc.info["range_server"] == primary.advertise_addr)


def _killed_primary_cluster(tmp_path):
    """A process cluster with the PD's default liveness (heartbeats every second, 3 s
    timeout), a 2-replica stream holding five batches, a writer, and its primary's index."""
    cluster = ProcessCluster(tmp_path / "cluster", range_servers=3).start()
    config = ClientConfig(retry_deadline_s=30)
    pool = ConnectionPool(config)
    client = SbpClient(cluster.pd_address, config, pool)
    (stream,) = client.create_streams(1, replicas=2)
    writer = client.open_stream(stream.stream_id)
    writer.append([batch_bytes(b"before-%d" % i) for i in range(5)])
    return cluster, pool, client, writer, stream.stream_id


@pytest.mark.slow
def test_a_killed_primary_is_failed_over_before_the_liveness_timeout(tmp_path):
    cluster, pool, client, writer, sid = _killed_primary_cluster(tmp_path)
    try:
        cluster.kill_range_server(_primary_index(cluster, client, sid))
        killed = time.monotonic()
        poll(lambda: len(client.list_ranges(sid)) == 2, what="the failover", timeout=10)
        took = time.monotonic() - killed
        writer.append([batch_bytes(b"after")])
        bodies = [bytes(batch_body(b.data)) for b in client.read(sid)]
        log = (tmp_path / "cluster" / "pd.log").read_text()
    finally:
        pool.close()
        cluster.stop()
    assert bodies == [b"before-%d" % i for i in range(5)] + [b"after"]
    assert "refuses connections after" in log and "no process listens there" in log
    # One missed heartbeat and a sweep (about 2 s), not the 3 s timeout and a sweep.
    assert took < 3.0, took


@pytest.mark.slow
def test_a_primary_killed_and_restarted_at_once_is_sealed_once_at_most(tmp_path):
    """Killed and started again on the same port within a heartbeat or two: whether or not
    the PD saw the port refuse connections in between (and failed it over), the stream ends
    up with one open range, everything written before and after is there once, and nothing
    is sealed again once the server is back."""
    cluster, pool, client, writer, sid = _killed_primary_cluster(tmp_path)
    try:
        index = _primary_index(cluster, client, sid)
        port = cluster.range_server_addresses  # before the kill
        cluster.kill_range_server(index)
        cluster.start_range_server(index)
        writer.append([batch_bytes(b"after-%d" % i) for i in range(5)])
        time.sleep(4.0)  # past the liveness timeout: any failover owed has happened
        ranges = client.list_ranges(sid)
        writer.append([batch_bytes(b"later")])
        bodies = [bytes(batch_body(b.data)) for b in client.read(sid)]
        again = cluster.range_server_addresses
    finally:
        pool.close()
        cluster.stop()
    assert sorted(port) == sorted(again)  # it came back on its port
    assert len(ranges) <= 2 and ranges[-1].is_open
    assert bodies == ([b"before-%d" % i for i in range(5)] +
                      [b"after-%d" % i for i in range(5)] + [b"later"])
