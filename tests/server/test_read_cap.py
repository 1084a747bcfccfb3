"""Read caps of open replicated ranges, on secondaries and after restarts (issue 9).

A secondary stores what its primary forwards but lets readers see only what every replica
holds: the primary says how far that is in each forward (``committed_offset``) and in a cap
notice once the range goes quiet. A replica that restarts knows nothing settled past the
range's start until the next append settles or, on a primary, its secondaries said how far
they hold the range (test_cap_notice.py has more on notices).
"""

from __future__ import annotations

import threading
import time

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient, SbpClient
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.messages import (
    AppendRequest,
    FetchEntry,
    RangeId,
    RangeReplica,
    RangeServer,
)
from sbp_spark.protocol.records import batch_bytes, parse_header
from sbp_spark.server import EmbeddedCluster
from sbp_spark.server.range_server import RangeServer as Server
from sbp_spark.server.range_server import RangeServerConfig
from sbp_spark.server.range_server.replication import Replicator
from sbp_spark.server.storage import StorageConfig
from tests.polling import wait_until as poll
from tests.server.secondary import HeldAnswers, forward_of, send_append, sync_range

STREAM = 4
CONFIG = ClientConfig(request_timeout_s=20, retries=0)
NEVER = StorageConfig(fsync="never")




def start(path, server_id: int, replicator: Replicator | None = None) -> Server:
    return Server(RangeServerConfig(data_dir=str(path), server_id=server_id, storage=NEVER),
                  replicator=replicator).start()


def sync(server: Server, replicas: list[RangeReplica], end_offset: int = -1) -> None:
    sync_range(server, STREAM, replicas, end_offset)


def forward(server: Server, first: int, count: int, committed: int) -> list:
    """A primary's forward: ``count`` one-record batches at ``first`` with ``committed``."""
    return send_append(server, *forward_of(STREAM, first, count, committed)).append_responses


def offsets(rs: RangeServerClient, start: int = 0, **kw) -> list[int]:
    return [h.base_offset for h, _ in rs.fetch(STREAM, start, **kw)]


def served(rs: RangeServerClient, start: int = 0, max_wait_ms: int = 0
           ) -> tuple[list[int], int]:
    """Base offsets one FETCH from ``start`` returns, and the code that ended it (0: none)."""
    got, code = [], 0
    for chunk in rs.fetch_many([_entry(start)], max_wait_ms=max_wait_ms):
        got += [h.base_offset for h, _ in chunk.batches()]
        code = code or chunk.status.code
    return got, code


def _entry(offset: int) -> FetchEntry:
    return FetchEntry(STREAM, 0, offset, 1 << 20)


def next_offset(rs: RangeServerClient) -> int:
    [described] = rs.describe_ranges([(STREAM, 0)])
    return described.unwrap().next_offset


# ---- a secondary driven directly --------------------------------------------------------


@pytest.fixture
def secondary(tmp_path):
    """Server 2, a secondary of an open range whose primary (server 1) is not running."""
    srv = start(tmp_path / "s", 2)
    replicas = [RangeReplica(RangeServer(1, "127.0.0.1:1"), True),
                RangeReplica(RangeServer(2, srv.advertise_addr), False)]
    sync(srv, replicas)
    try:
        yield srv, replicas
    finally:
        srv.stop()


def test_secondary_serves_only_up_to_the_committed_offset_its_primary_sent(secondary):
    srv, _ = secondary
    with ConnectionPool(CONFIG) as pool:
        rs = RangeServerClient(srv.advertise_addr, CONFIG, pool)
        # Stored (and durable here: fsync never), but the primary knows of nothing settled.
        assert all(r.status.ok for r in forward(srv, 0, 3, committed=0))
        assert srv.storage.get_range(STREAM, 0).next_offset == 3
        assert offsets(rs) == [] and next_offset(rs) == 0
        # The next forward says the first two are on every replica.
        assert all(r.status.ok for r in forward(srv, 3, 1, committed=2))
        assert offsets(rs) == [0, 1] and next_offset(rs) == 2
        # Past the cap but stored here: nothing yet (a reader may have seen it elsewhere);
        # past what is stored: out of range.
        assert [c.status.code for c in rs.fetch_many([_entry(3)])] == [0]
        assert offsets(rs, 3) == []
        [chunk] = list(rs.fetch_many([_entry(5)]))
        assert chunk.status.code == ErrorCode.OFFSET_OUT_OF_RANGE
        # Never lowered, and -1 (no knowledge) leaves it as it is.
        assert all(r.status.ok for r in forward(srv, 4, 1, committed=1))
        assert all(r.status.ok for r in forward(srv, 5, 1, committed=-1))
        assert next_offset(rs) == 2
        # Never above what this replica stored, whatever the primary claims.
        assert all(r.status.ok for r in forward(srv, 6, 1, committed=100))
        assert offsets(rs) == list(range(7)) and next_offset(rs) == 7


def test_a_refused_forward_does_not_raise_the_cap(secondary):
    srv, _ = secondary
    with ConnectionPool(CONFIG) as pool:
        rs = RangeServerClient(srv.advertise_addr, CONFIG, pool)
        assert all(r.status.ok for r in forward(srv, 0, 2, committed=0))
        # A gap: this replica continues at 2, not 5.
        [refused] = forward(srv, 5, 1, committed=2)
        assert refused.status.code == ErrorCode.REPLICATION_FAILED
        assert next_offset(rs) == 0 and offsets(rs) == []


def test_a_forward_of_an_ended_range_never_lands_in_the_next_one(secondary):
    # Found by the partition case "primary cut off from the PD": the cut-off primary went on
    # forwarding range 0 after the PD had ended it and opened range 1 here, at the offset
    # where range 0 ended. Its batch continued range 1's log exactly and was stored there;
    # the new primary's own batch at that offset was then refused, and the replicas of range
    # 1 held different records at the same offsets.
    srv, replicas = secondary
    assert all(r.status.ok for r in send_append(srv, *forward_of(
        STREAM, 0, 2, committed=0, range_index=0)).append_responses)
    sync(srv, replicas, end_offset=2)  # the PD ended range 0 at 2 ...
    new_primary = RangeReplica(RangeServer(3, "127.0.0.1:3"), True)
    sync_range(srv, STREAM, [new_primary, RangeReplica(RangeServer(2, srv.advertise_addr),
                                                       False)],
               range_index=1, start_offset=2)  # ... and opened range 1 with server 2 in it
    [stale] = send_append(srv, *forward_of(STREAM, 2, 1, committed=2,
                                           range_index=0)).append_responses
    assert stale.status.code == ErrorCode.RANGE_SEALED
    assert "range 1 follows it" in stale.status.message
    assert srv.storage.get_range(STREAM, 1).written_offset == 2  # nothing landed
    [ahead] = send_append(srv, *forward_of(STREAM, 2, 1, committed=2,
                                           range_index=2)).append_responses
    assert ahead.status.code == ErrorCode.RANGE_NOT_FOUND
    [fresh] = send_append(srv, *forward_of(STREAM, 2, 1, committed=2,
                                           range_index=1)).append_responses
    assert fresh.status.ok and fresh.base_offset == 2
    # A notice for the ended range does not touch the next one.
    notice = AppendRequest(timeout_ms=5000, committed_offset=3,
                           cap_notice=RangeId(STREAM, 0))
    [answer] = send_append(srv, notice).append_responses
    assert answer.status.code == ErrorCode.INVALID_REQUEST
    assert "for range 4/0: it is sealed" in answer.status.message
    assert srv.storage.get_range(STREAM, 1).read_cap == 2


def test_a_forward_naming_its_range_is_refused_by_that_range_s_primary(tmp_path):
    srv = start(tmp_path / "p", 2)
    try:
        sync(srv, [RangeReplica(RangeServer(2, srv.advertise_addr), True),
                   RangeReplica(RangeServer(3, "127.0.0.1:3"), False)])
        [result] = send_append(srv, *forward_of(STREAM, 0, 1, committed=0,
                                                range_index=0)).append_responses
        assert result.status.code == ErrorCode.INVALID_REQUEST
        assert "server 2 is its primary" in result.status.message
        assert srv.storage.get_range(STREAM, 0).written_offset == 0
    finally:
        srv.stop()


def test_committed_offset_below_minus_one_is_an_invalid_request(secondary):
    srv, _ = secondary
    [result] = forward(srv, 0, 1, committed=-5)
    assert result.status.code == ErrorCode.INVALID_REQUEST
    assert "committed_offset -5" in result.status.message
    assert srv.storage.get_range(STREAM, 0).written_offset == 0


def test_long_poll_on_a_secondary_wakes_when_the_cap_rises(secondary):
    srv, _ = secondary
    with ConnectionPool(CONFIG) as pool:
        rs = RangeServerClient(srv.advertise_addr, CONFIG, pool)
        assert all(r.status.ok for r in forward(srv, 0, 2, committed=0))
        polled: list[int] = []
        began = time.monotonic()
        poller = threading.Thread(target=lambda: polled.extend(
            offsets(rs, max_wait_ms=15_000)))
        poller.start()
        poll(lambda: srv.metrics.fetches >= 1, "the long poll to start")
        assert all(r.status.ok for r in forward(srv, 2, 1, committed=2))
        poller.join(20)
        assert polled == [0, 1] and time.monotonic() - began < 10


def test_sealed_secondary_stays_capped_until_the_pd_records_the_end(secondary):
    # Issue 22: a secondary that stored more than another survivor showed its whole tail the
    # moment the failover sealed it, and the PD then ended the range lower: a tailing reader
    # had seen records that the stream does not contain.
    srv, replicas = secondary
    with ConnectionPool(CONFIG) as pool:
        rs = RangeServerClient(srv.advertise_addr, CONFIG, pool)
        assert all(r.status.ok for r in forward(srv, 0, 4, committed=1))
        assert next_offset(rs) == 1
        [sealed] = rs.seal([(STREAM, 0)])
        # Where it stopped (what a failover compares), and how far its readers see.
        assert (sealed.unwrap().end_offset, sealed.unwrap().next_offset) == (4, 1)
        assert served(rs) == ([0], 0)
        [described] = rs.describe_ranges([(STREAM, 0)])
        assert (described.unwrap().end_offset, described.unwrap().next_offset) == (-1, 1)
        # The PD ended the range lower (another survivor held less): that end rules.
        sync(srv, replicas, end_offset=3)
        assert served(rs) == ([0, 1, 2], ErrorCode.RANGE_SEALED)
        [described] = rs.describe_ranges([(STREAM, 0)])
        assert described.unwrap().end_offset == 3


def fetch_status(rs: RangeServerClient, start: int) -> tuple[int, str]:
    """The code and message that ended one FETCH from ``start`` (after its batches)."""
    [*_, last] = list(rs.fetch_many([_entry(start)]))
    return last.status.code, last.status.message


def test_a_replica_fenced_short_of_the_pd_end_does_not_send_readers_to_the_next_range(
        secondary):
    # A replica cut off while appends were in flight fences below what the other replicas
    # hold, and the PD's failover, counting only those, ends the range further on. Until the
    # PD's end reaches it, this replica's own end is not the range's: it must not tell a
    # reader at that end that the stream continues in the next range (a reader that did
    # would skip the records the other replicas hold). Its readers then get what it holds.
    srv, replicas = secondary
    with ConnectionPool(CONFIG) as pool:
        rs = RangeServerClient(srv.advertise_addr, CONFIG, pool)
        assert all(r.status.ok for r in forward(srv, 0, 4, committed=4))
        [sealed] = rs.seal([(STREAM, 0)])
        assert sealed.unwrap().end_offset == 4
        code, message = fetch_status(rs, 4)
        assert code == ErrorCode.RANGE_SEALED
        assert "next range" not in message
        assert "sealed here at 4" in message and "PD" in message
        # Once the PD's end is known, the end is the range's, and so is the next range.
        sync(srv, replicas, end_offset=4)
        code, message = fetch_status(rs, 4)
        assert code == ErrorCode.RANGE_SEALED and "continues in the next range" in message


def test_a_seal_does_not_wake_a_long_poll_past_the_cap(secondary):
    srv, replicas = secondary
    with ConnectionPool(CONFIG) as pool:
        rs = RangeServerClient(srv.advertise_addr, CONFIG, pool)
        assert all(r.status.ok for r in forward(srv, 0, 3, committed=1))
        polled: list = []
        poller = threading.Thread(target=lambda: polled.append(
            served(rs, 1, max_wait_ms=15_000)))
        poller.start()
        poll(lambda: srv.metrics.fetches >= 1, "the long poll to start")
        rs.seal([(STREAM, 0)])  # wakes the poll, which must go on waiting at the cap
        poll(lambda: srv.storage.get_range(STREAM, 0).sealed, "the seal")
        assert poller.is_alive()
        sync(srv, replicas, end_offset=2)  # the PD's end: everything below it is readable
        poller.join(20)
        assert polled == [([1], ErrorCode.RANGE_SEALED)]


def test_a_fenced_range_stays_fenced_across_a_restart(tmp_path, secondary):
    srv, replicas = secondary
    assert all(r.status.ok for r in forward(srv, 0, 3, committed=2))
    with ConnectionPool(CONFIG) as pool:
        RangeServerClient(srv.advertise_addr, CONFIG, pool).seal([(STREAM, 0)])
    srv.stop()
    again = start(tmp_path / "s", 2)
    try:
        with ConnectionPool(CONFIG) as pool:
            rs = RangeServerClient(again.advertise_addr, CONFIG, pool)
            assert served(rs) == ([], 0)  # nothing is known to be on every replica
            sync(again, replicas, end_offset=3)
            assert served(rs) == ([0, 1, 2], ErrorCode.RANGE_SEALED)
        again.stop()
        again = start(tmp_path / "s", 2)  # the PD's end is kept on disk
        with ConnectionPool(CONFIG) as pool:
            rs = RangeServerClient(again.advertise_addr, CONFIG, pool)
            assert served(rs) == ([0, 1, 2], ErrorCode.RANGE_SEALED)
    finally:
        again.stop()


def test_restarted_secondary_starts_capped_at_the_range_start(tmp_path, secondary):
    srv, replicas = secondary
    assert all(r.status.ok for r in forward(srv, 0, 3, committed=3))
    srv.stop()
    again = start(tmp_path / "s", 2)
    try:
        with ConnectionPool(CONFIG) as pool:
            rs = RangeServerClient(again.advertise_addr, CONFIG, pool)
            assert again.storage.get_range(STREAM, 0).next_offset == 3
            assert offsets(rs) == [] and next_offset(rs) == 0
            assert all(r.status.ok for r in forward(again, 3, 1, committed=4))
            assert offsets(rs) == [0, 1, 2, 3]
    finally:
        again.stop()


def test_single_replica_ranges_are_not_capped(tmp_path):
    srv = start(tmp_path / "one", 1)
    try:
        sync(srv, [RangeReplica(RangeServer(1, srv.advertise_addr), True)])
        with ConnectionPool(CONFIG) as pool:
            rs = RangeServerClient(srv.advertise_addr, CONFIG, pool)
            rs.append([(STREAM, batch_bytes(b"a")), (STREAM, batch_bytes(b"b"))])
            srv.stop()
            srv = start(tmp_path / "one", 1)
            rs = RangeServerClient(srv.advertise_addr, CONFIG, pool)
            assert offsets(rs) == [0, 1] and next_offset(rs) == 2
    finally:
        srv.stop()


# ---- a primary and its secondaries in this process ----------------------------------------


class Trio:
    """A primary (server 1) and two secondaries (2, 3) of one open range, synced by hand."""

    def __init__(self, root) -> None:
        self.root = root
        # Held secondaries: what the primary hears from them waits for their event.
        self.gates: dict[int, threading.Event] = {}
        self.servers = {sid: self.start(sid) for sid in (1, 2, 3)}
        self.sync_all()

    def start(self, sid: int) -> Server:
        replicator = HeldAnswers(self.gates) if sid == 1 else None
        return start(self.root / str(sid), sid, replicator)

    def replicas(self) -> list[RangeReplica]:
        return [RangeReplica(RangeServer(sid, s.advertise_addr), sid == 1)
                for sid, s in self.servers.items()]

    def sync_all(self) -> None:
        for server in self.servers.values():
            sync(server, self.replicas())

    def restart(self, sid: int) -> None:
        self.servers[sid].stop()
        self.servers[sid] = self.start(sid)
        self.sync_all()  # its address changed

    def hold(self, sid: int) -> threading.Event:
        """The primary hears nothing from secondary ``sid`` (no answer to a forward or a cap
        notice) until the returned event is set."""
        gate = self.gates[sid] = threading.Event()
        return gate

    def client(self, sid: int, pool: ConnectionPool) -> RangeServerClient:
        return RangeServerClient(self.servers[sid].advertise_addr, CONFIG, pool)

    def close(self) -> None:
        for gate in self.gates.values():
            gate.set()
        for server in self.servers.values():
            server.stop()


@pytest.fixture
def trio(tmp_path):
    t = Trio(tmp_path)
    try:
        yield t
    finally:
        t.close()


def _append(rs: RangeServerClient, *bodies: bytes) -> list[int]:
    return [r.unwrap().base_offset for r in rs.append([(STREAM, batch_bytes(b))
                                                       for b in bodies])]


def test_restarted_primary_serves_its_tail_once_every_secondary_said_it_holds_it(trio):
    with ConnectionPool(CONFIG) as pool:
        assert _append(trio.client(1, pool), b"a", b"b", b"c") == [0, 1, 2]
        # Nothing of secondary 3 reaches the restarted primary (neither its answer to the cap
        # probe nor to the next forward) until the gate opens.
        gate = trio.hold(3)
        trio.restart(1)
        primary = trio.client(1, pool)
        assert trio.servers[1].storage.get_range(STREAM, 0).next_offset == 3
        assert offsets(primary) == [] and next_offset(primary) == 0
        # A reader that got to 3 before the restart waits there instead of failing.
        polled: list[int] = []
        poller = threading.Thread(target=lambda: polled.extend(
            offsets(primary, 3, max_wait_ms=15_000)))
        poller.start()
        # While the first append after the restart waits for a secondary, the tail it found
        # on disk is still not known to be on every replica.
        acked: list[int] = []
        writer = threading.Thread(target=lambda: acked.extend(_append(primary, b"d")))
        writer.start()
        rlog = trio.servers[1].storage.get_range(STREAM, 0)
        poll(lambda: rlog.next_offset == 4, "the primary to store the new batch")
        assert offsets(primary) == [] and next_offset(primary) == 0
        gate.set()
        writer.join(20)
        assert acked == [3]
        # Settled: every secondary continued its log exactly at 3, so all of it is everywhere.
        assert offsets(primary) == [0, 1, 2, 3] and next_offset(primary) == 4
        poller.join(20)
        assert polled == [3]
        for sid in (2, 3):  # the cap notice after the append settled
            poll(lambda s=sid: offsets(trio.client(s, pool)) == [0, 1, 2, 3],
                 f"secondary {sid} to serve every record")


def test_restarted_secondary_catches_up_with_the_next_forward(trio):
    with ConnectionPool(CONFIG) as pool:
        assert _append(trio.client(1, pool), b"a", b"b") == [0, 1]
        assert _append(trio.client(1, pool), b"c") == [2]
        poll(lambda: offsets(trio.client(2, pool)) == [0, 1, 2], "the cap notice")
        trio.restart(2)
        # Its primary already sent cap 3: a restarted secondary waits for the next append.
        assert offsets(trio.client(2, pool)) == [] and next_offset(trio.client(2, pool)) == 0
        assert _append(trio.client(1, pool), b"d") == [3]
        # That forward carried the primary's cap (3) and the cap notice after it 4.
        poll(lambda: offsets(trio.client(2, pool)) == [0, 1, 2, 3], "the restarted secondary")
        assert offsets(trio.client(1, pool)) == [0, 1, 2, 3]


# ---- end to end on an embedded cluster ---------------------------------------------------


def test_secondaries_of_a_three_replica_range_serve_every_settled_record(tmp_path):
    cluster_config = ClientConfig(request_timeout_s=20, retry_deadline_s=20)
    with EmbeddedCluster(tmp_path, range_servers=3, fsync="never") as cluster, \
            ConnectionPool(cluster_config) as pool:
        client = SbpClient(cluster.pd_address, cluster_config, pool)
        [stream] = client.create_streams(1, replicas=3)
        sid = stream.stream_id
        writer = client.open_stream(sid)
        first = writer.append([batch_bytes(b"a%d" % i) for i in range(3)])
        second = writer.append([batch_bytes(b"b%d" % i) for i in range(2)])
        assert [a.base_offset for a in first + second] == [0, 1, 2, 3, 4]
        rng = client.list_ranges(sid)[-1]
        secondaries = [r.server.advertise_addr for r in rng.servers if not r.is_primary]
        assert len(secondaries) == 2
        expected = [(0, b"a0"), (1, b"a1"), (2, b"a2"), (3, b"b0"), (4, b"b1")]
        for addr in secondaries:
            rs = client.range_server(addr)

            def fetched(rs=rs) -> list[tuple[int, bytes]]:
                return [(h.base_offset, bytes(d[28:])) for h, d in rs.fetch(sid, 0)]

            # The second append's forward said the first one (0-2) settled; the cap notice
            # sent once the range went quiet says the second one did.
            assert fetched() in (expected[:3], expected)
            poll(lambda f=fetched: f() == expected, f"{addr} to serve every record")
            [described] = rs.describe_ranges([(sid, rng.range_index)])
            assert described.unwrap().next_offset == 5
        assert client.open_range_end(rng) == 5  # the primary serves every settled record
        # A long poll on a secondary at its cap wakes when the next append settles.
        rs = client.range_server(secondaries[0])
        polled: list[int] = []
        poller = threading.Thread(target=lambda: polled.extend(
            parse_header(d).base_offset for _, d in rs.fetch(sid, 5, max_wait_ms=15_000)))
        poller.start()
        began = time.monotonic()
        writer.append([batch_bytes(b"c0")])
        poller.join(20)
        assert polled == [5] and time.monotonic() - began < 10
