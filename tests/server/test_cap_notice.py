"""Read cap notices between the replicas of an open range (issue 9).

A cap notice is an APPEND whose ``cap_notice`` names a range, with no entries and no payload,
that a primary sends its secondaries: once a range goes quiet it carries the new cap (so a
secondary's readers see the end of a burst without another append), and after a restart the
primary asks with it how far every secondary stored the range (so acknowledged records become
readable again without an append). Anything but a secondary of that open range refuses it.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient, SbpClient
from sbp_spark.client.connection import Connection
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResult,
    Range,
    RangeId,
    RangeReplica,
    RangeServer,
    StreamRanges,
    SyncRangesRequest,
)
from sbp_spark.protocol.records import ENVELOPE_SIZE, batch_bytes
from sbp_spark.server import EmbeddedCluster
from sbp_spark.server.range_server import RangeServer as Server
from sbp_spark.server.range_server import RangeServerConfig
from sbp_spark.server.range_server.cap_notices import DelayedCalls
from sbp_spark.server.range_server.replication import (
    NOTICE_TIMEOUT_S,
    NoticeAnswer,
    Replicator,
)
from sbp_spark.server.storage import StorageConfig
from sbp_spark.server.storage.range_log import RangeLog
from tests.polling import wait_until as poll
from tests.server.secondary import forward_of, send_append, sync_range

STREAM = 6
CONFIG = ClientConfig(request_timeout_s=20, retries=0)
CLUSTER_CONFIG = ClientConfig(request_timeout_s=20, retry_deadline_s=20)




def make(path, server_id: int, replicator: Replicator | None = None) -> Server:
    return Server(RangeServerConfig(data_dir=str(path), server_id=server_id,
                                    storage=StorageConfig(fsync="never"),
                                    cap_probe_interval_s=0.1), replicator=replicator)


def start(path, server_id: int) -> Server:
    return make(path, server_id).start()


def sync(server: Server, replicas: list[RangeReplica], end_offset: int = -1) -> None:
    sync_range(server, STREAM, replicas, end_offset)


def call(server: Server, request: AppendRequest, payload: list[bytes] | None = None
         ) -> list[AppendResult]:
    response = send_append(server, request, payload)
    assert response.status.ok
    return response.append_responses


def forward(server: Server, first: int, count: int, committed: int) -> list[AppendResult]:
    """What a primary forwards: ``count`` one-record batches at ``first``."""
    return call(server, *forward_of(STREAM, first, count, committed))


def notice(server: Server, committed: int, stream_id: int = STREAM, range_index: int = 0
           ) -> AppendResult:
    """Send ``server`` a cap notice for one range; its one result."""
    [result] = call(server, AppendRequest(timeout_ms=5000, committed_offset=committed,
                                          cap_notice=RangeId(stream_id, range_index)))
    assert result.stream_id == stream_id and result.request_index == 0
    return result


def offsets(server: Server, start_at: int = 0) -> list[int]:
    with ConnectionPool(CONFIG) as pool:
        rs = RangeServerClient(server.advertise_addr, CONFIG, pool)
        return [h.base_offset for h, _ in rs.fetch(STREAM, start_at)]


def replicas_of(primary: Server | None, *secondaries: Server) -> list[RangeReplica]:
    first = RangeReplica(RangeServer(1, primary.advertise_addr if primary else "127.0.0.1:1"),
                         True)
    return [first] + [RangeReplica(RangeServer(s.server_id, s.advertise_addr), False)
                      for s in secondaries]


# ---- a secondary answering notices --------------------------------------------------------


@pytest.fixture
def secondary(tmp_path):
    """Server 2, a secondary (of a primary that is not running) holding records 0-3, cap 1."""
    srv = start(tmp_path / "s", 2)
    sync(srv, replicas_of(None, srv))
    assert all(r.status.ok for r in forward(srv, 0, 4, committed=1))
    try:
        yield srv
    finally:
        srv.stop()


def test_secondary_answers_a_notice_with_its_stored_end_and_raises_its_cap(secondary):
    assert offsets(secondary) == [0]
    # Only asked: the stored end (not the readable one), and the cap stays.
    asked = notice(secondary, -1)
    assert asked.status.ok and (asked.stream_id, asked.base_offset) == (STREAM, 4)
    assert offsets(secondary) == [0]
    told = notice(secondary, 3)
    assert told.status.ok and told.base_offset == 4
    assert offsets(secondary) == [0, 1, 2]
    # Never above what is stored here, never lowered.
    assert notice(secondary, 99).base_offset == 4
    assert offsets(secondary) == [0, 1, 2, 3]
    assert notice(secondary, 2).status.ok
    assert offsets(secondary) == [0, 1, 2, 3]


def test_notices_are_refused_clearly_where_they_mean_nothing(secondary):
    # A range not held here, or invalid ids: INVALID_REQUEST naming the range and why.
    for (sid, index), why in {(99, 0): "server 2 holds no such range",
                              (STREAM, 1): "server 2 holds no such range",
                              (-3, 0): "stream_id and range_index must be >= 0"}.items():
        refused = notice(secondary, 4, sid, index)
        assert refused.status.code == ErrorCode.INVALID_REQUEST and refused.base_offset == -1
        assert f"read cap notice for range {sid}/{index}: {why}" in refused.status.message
    assert offsets(secondary) == [0]
    # A notice with entries or a payload is malformed as a whole.
    bad = send_append(secondary, AppendRequest(
        timeout_ms=5000, committed_offset=4, cap_notice=RangeId(STREAM, 0),
        append_requests=[AppendEntry(STREAM, 0, 5)]), [b"12345"])
    assert bad.status.code == ErrorCode.INVALID_REQUEST and not bad.append_responses
    assert "carries no entries and no payload" in bad.status.message
    assert offsets(secondary) == [0]
    # A sealed range has no cap to raise.
    sync(secondary, replicas_of(None, secondary), end_offset=4)
    sealed = notice(secondary, 4)
    assert sealed.status.code == ErrorCode.INVALID_REQUEST
    assert "sealed at 4" in sealed.status.message


def test_a_notice_raises_the_cap_of_the_range_it_names(secondary):
    # Range 1 of the stream arrives while range 0 is still open here (its seal has not come
    # yet): a notice for range 0 must not move range 1, nor the other way round.
    later = Range(STREAM, 1, 4, 0, -1, replicas_of(None, secondary))
    with Connection(secondary.advertise_addr) as conn:
        response, _ = conn.call(SyncRangesRequest(stream_ranges=[StreamRanges(STREAM, [later])]))
    assert response.sync_responses[0].status.ok
    range0, range1 = (secondary.storage.get_range(STREAM, i) for i in (0, 1))
    assert notice(secondary, 3, STREAM, 0).base_offset == 4
    assert (range0.read_cap, range1.read_cap) == (3, 4)
    assert notice(secondary, -1, STREAM, 1).base_offset == 4  # range 1's own stored end
    assert (range0.read_cap, range1.read_cap) == (3, 4)


def test_zero_length_entries_without_cap_notice_are_not_notices(secondary):
    # What notices looked like before they had their own field: entries of batch_length 0
    # and no payload. Each is refused as an entry that holds no batch; the cap stays.
    [result] = call(secondary, AppendRequest(timeout_ms=5000, committed_offset=4,
                                             append_requests=[AppendEntry(STREAM, 0, 0)]))
    assert result.status.code == ErrorCode.INVALID_REQUEST
    assert "batch_length 0 holds no record batch" in result.status.message
    assert offsets(secondary) == [0]


def test_notices_and_zero_length_client_entries_are_refused_by_a_primary(tmp_path):
    srv = start(tmp_path / "p", 1)
    try:
        sync(srv, replicas_of(srv))
        for committed in (-1, 0, 5):
            refused = notice(srv, committed)
            assert refused.status.code == ErrorCode.INVALID_REQUEST
            assert "range 6/0: server 1 is its primary" in refused.status.message
            assert refused.base_offset == -1
        # A client's append with a zero-length entry beside a real batch: the batch is
        # stored, the empty entry refused as before notices existed.
        real = batch_bytes(b"x")
        results = call(srv, AppendRequest(timeout_ms=5000, append_requests=[
            AppendEntry(STREAM, 0, 0), AppendEntry(STREAM, 1, len(real))]), [real])
        assert [r.status.code for r in results] == [ErrorCode.INVALID_REQUEST, 0]
        assert results[1].base_offset == 0 and offsets(srv) == [0]
        assert srv.storage.get_range(STREAM, 0).written_offset == 1
    finally:
        srv.stop()


# ---- the restart probe of a primary --------------------------------------------------------


class AskingReplicator(Replicator):
    """A primary's calls to its secondaries, noting the ``committed_offset`` of every cap
    notice it sends (-1: it only asks how far they stored the range)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def notify(self, rlog: RangeLog, secondaries, committed: int,
               timeout_s: float = NOTICE_TIMEOUT_S) -> list[NoticeAnswer]:
        self.asked.append(committed)
        return super().notify(rlog, secondaries, committed, timeout_s)


def test_restarted_primary_raises_its_cap_to_what_every_secondary_stored(tmp_path):
    """The primary holds 0-4, its secondaries only 0-2: after a restart its readers (and theirs)
    see 0-2, the prefix on every replica, with no append; one unreachable secondary holds
    the cap down until it answers."""
    s2, s3 = start(tmp_path / "2", 2), start(tmp_path / "3", 3)
    primary = start(tmp_path / "1", 1)
    try:
        sync(primary, replicas_of(primary))  # alone first: it takes 5 records by itself
        with ConnectionPool(CONFIG) as pool:
            RangeServerClient(primary.advertise_addr, CONFIG, pool).append(
                [(STREAM, batch_bytes(b"r%d" % i)) for i in range(5)])
        for s in (s2, s3):
            sync(s, replicas_of(primary, s2, s3))
            assert all(r.status.ok for r in forward(s, 0, 3, committed=0))
        sync(primary, replicas_of(primary, s2, s3))
        s3.stop()
        primary.stop()
        replicator = AskingReplicator()
        asked = replicator.asked
        primary = make(tmp_path / "1", 1, replicator).start()
        rlog = primary.storage.get_range(STREAM, 0)
        assert rlog.next_offset == 5
        # Secondary 3 is down: no answer from it, so nothing past the start is readable, and
        # the primary keeps asking.
        poll(lambda: asked.count(-1) >= 2, "the primary to ask twice")
        assert offsets(primary) == [] and offsets(s2) == []
        s3 = start(tmp_path / "3", 3)
        sync(primary, replicas_of(primary, s2, s3))  # its new address
        poll(lambda: offsets(primary) == [0, 1, 2], "the primary's readers to see 0-2")
        for s in (s2, s3):
            poll(lambda s=s: offsets(s) == [0, 1, 2], f"secondary {s.server_id}'s readers")
        assert rlog.read_cap == 3  # not 5: records 3-4 are on the primary alone
        poll(lambda: not primary.cap_notices.prober.is_alive(), "the probe thread to finish")
    finally:
        for s in (primary, s2, s3):
            s.stop()


# ---- end to end on an embedded cluster ------------------------------------------------------


def _secondaries(client: SbpClient, sid: int) -> list[str]:
    rng = client.list_ranges(sid)[-1]
    return [r.server.advertise_addr for r in rng.servers if not r.is_primary]


def _served(client: SbpClient, addr: str, sid: int) -> list[bytes]:
    return [bytes(d[ENVELOPE_SIZE:]) for _, d in client.range_server(addr).fetch(sid, 0)]


@contextlib.contextmanager
def _replicated_stream(tmp_path, fsync: str):
    """A 3-server cluster with ``fsync``, a client, and a new stream with 3 replicas:
    (cluster, client, stream id, its writer)."""
    with EmbeddedCluster(tmp_path, range_servers=3, fsync=fsync) as cluster, \
            ConnectionPool(CLUSTER_CONFIG) as pool:
        client = SbpClient(cluster.pd_address, CLUSTER_CONFIG, pool)
        [stream] = client.create_streams(1, replicas=3)
        yield cluster, client, stream.stream_id, client.open_stream(stream.stream_id)


def test_secondaries_serve_the_last_append_of_a_burst_without_another_append(tmp_path):
    n = 6
    with _replicated_stream(tmp_path, "never") as (_, client, sid, writer):
        for i in range(n):  # one APPEND each
            [ack] = writer.append([batch_bytes(b"v%d" % i)])
            assert ack.base_offset == i
        expected = [b"v%d" % i for i in range(n)]
        for addr in _secondaries(client, sid):
            poll(lambda a=addr: _served(client, a, sid) == expected,
                 f"secondary {addr} to serve all {n} records")


def test_restarted_primary_and_its_secondaries_serve_every_acknowledged_record(tmp_path):
    with _replicated_stream(tmp_path, "always") as (cluster, client, sid, writer):
        writer.append([batch_bytes(b"a%d" % i) for i in range(3)])
        writer.append([batch_bytes(b"b%d" % i) for i in range(2)])
        expected = [b"a0", b"a1", b"a2", b"b0", b"b1"]
        rng = client.list_ranges(sid)[-1]
        primary = next(r.server for r in rng.servers if r.is_primary)
        index = next(i for i, rs in enumerate(cluster.range_servers)
                     if rs is not None and rs.server_id == primary.server_id)
        cluster.stop_range_server(index)
        restarted = cluster.start_range_server(index)
        assert restarted.storage.get_range(sid, rng.range_index).next_offset == 5
        addresses = [restarted.advertise_addr, *_secondaries(client, sid)]
        for addr in addresses:
            poll(lambda a=addr: _served(client, a, sid) == expected,
                 f"{addr} to serve every acknowledged record")
        # The range is still open and the primary's: appends continue where it ended.
        assert [a.base_offset for a in client.open_stream(sid).append(
            [batch_bytes(b"c0")])] == [5]


def test_delayed_calls_coalesce_per_key_and_wait_for_quiet():
    calls: list[str] = []
    done = threading.Event()

    def record(value: object) -> None:
        calls.append(str(value))
        if len(calls) == 2:
            done.set()

    delayed = DelayedCalls(0.05, record, name="test-delayed")
    try:
        started = time.monotonic()
        for i in range(5):  # one key rescheduled: one call, with the last value
            delayed.schedule("a", f"a{i}")
        delayed.schedule("b", "b0")
        assert done.wait(10)
        assert time.monotonic() - started >= 0.05
        assert sorted(calls) == ["a4", "b0"]
    finally:
        delayed.close()
    delayed.schedule("a", "late")  # closed: ignored
    assert sorted(calls) == ["a4", "b0"]
