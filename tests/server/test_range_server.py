"""The range server over raw frames: SYNC/APPEND/FETCH/SEAL/DESCRIBE/DELETE/TRIM, field
validation, streaming fetches, long polls and restarts."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from sbp_spark.protocol.constants import Flags, Opcode
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.frame import frame_bytes
from sbp_spark.protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResponse,
    ClientRole,
    DeleteStreamsRequest,
    DescribeRangesRequest,
    FetchEntry,
    FetchRequest,
    FetchResponse,
    HeartbeatRequest,
    Range,
    RangeId,
    RangeReplica,
    RangeServer,
    SealRangesRequest,
    Stream,
    StreamRanges,
    SyncRangesRequest,
    SystemError,
    TrimmedStream,
    TrimStreamsRequest,
    decode_response,
)
from sbp_spark.protocol.records import ENVELOPE_SIZE, batch_bytes, iter_batches, parse_header
from sbp_spark.server import net
from sbp_spark.server.range_server import RangeServer as Server
from sbp_spark.server.range_server import RangeServerConfig
from sbp_spark.server.storage import StorageConfig
from sbp_spark.server.storage.disk import Disk
from tests.polling import wait_until

from .wire import RawPeer

ME = 1


def _config(tmp_path, **kw) -> RangeServerConfig:
    kw.setdefault("storage", StorageConfig(fsync="interval", fsync_interval_ms=2))
    return RangeServerConfig(data_dir=str(tmp_path), server_id=ME, **kw)


@pytest.fixture
def server(tmp_path):
    srv = Server(_config(tmp_path, fetch_frame_bytes=64 * 1024)).start()
    yield srv
    srv.stop()


@pytest.fixture
def peer(server):
    with RawPeer(server.address) as p:
        yield p


def _range(stream_id, index=0, start=0, end=-1, servers=((ME, True),)) -> Range:
    return Range(stream_id, index, start, start, end, [
        RangeReplica(RangeServer(sid, f"127.0.0.1:{1000 + sid}"), primary)
        for sid, primary in servers])


def _sync(peer, *ranges: Range):
    by_stream: dict[int, list[Range]] = {}
    for r in ranges:
        by_stream.setdefault(r.stream_id, []).append(r)
    msg, _ = peer.call(SyncRangesRequest(stream_ranges=[
        StreamRanges(sid, rs) for sid, rs in by_stream.items()]))
    return msg.sync_responses


def _append(peer, items) -> AppendResponse:
    """items: (stream_id, body or raw batch bytes); request_index = position."""
    entries, payload = [], []
    for i, (sid, data) in enumerate(items):
        batch = data if data[:1] == b"\x42" else batch_bytes(data)
        entries.append(AppendEntry(sid, i, len(batch)))
        payload.append(batch)
    msg, _ = peer.call(AppendRequest(timeout_ms=5000, append_requests=entries),
                       b"".join(payload))
    assert isinstance(msg, AppendResponse), msg
    return msg


def _fetch(peer, entries, max_wait_ms=0, min_bytes=0, timeout=None):
    """Returns (frames, {request_index: [statuses]}, {request_index: [batch bytes]})."""
    sid = peer.request(FetchRequest(max_wait_ms, min_bytes, entries))
    frames = peer.response(sid, timeout)
    statuses: dict[int, list] = {}
    batches: dict[int, list[bytes]] = {}
    for f in frames:
        msg = decode_response(f)
        assert isinstance(msg, FetchResponse), msg
        payload = memoryview(f.payload)
        pos = 0
        for r in msg.fetch_responses:
            statuses.setdefault(r.request_index, []).append(r.status)
            part = payload[pos:pos + r.batch_length]
            pos += r.batch_length
            batches.setdefault(r.request_index, []).extend(
                bytes(b) for _, b in iter_batches(part))
        assert pos == payload.nbytes
    return frames, statuses, batches


def _entry(stream_id, offset=0, max_bytes=1 << 30, end=-1, index=0) -> FetchEntry:
    return FetchEntry(stream_id, index, offset, max_bytes, end)


def _codes(results) -> list[int]:
    return [r.status.code for r in results]


def test_sync_ranges_creates_local_ranges_idempotently(peer):
    [res] = _sync(peer, _range(7))
    assert res.status.ok and [(r.stream_id, r.range_index, r.next_offset) for r in res.ranges] \
        == [(7, 0, 0)]
    [res] = _sync(peer, _range(7))
    assert res.status.ok and len(res.ranges) == 1
    [res] = _sync(peer, _range(8, servers=((2, True), (3, False))))
    assert res.status.ok and res.ranges == []  # not a replica here: nothing created
    [res] = _sync(peer, _range(9, index=-2))
    assert res.status.code == ErrorCode.INVALID_REQUEST and ">= 0" in res.status.message
    [res] = _sync(peer, _range(7, start=5))
    assert res.status.code == ErrorCode.INVALID_REQUEST and "already exists" in res.status.message


def test_append_then_fetch_returns_the_batches_with_assigned_offsets(peer):
    _sync(peer, _range(1), _range(2, start=100))
    resp = _append(peer, [(1, b"a1"), (2, b"b1"), (1, b"a2")])
    assert resp.status.ok
    got = {(r.stream_id, r.request_index): r.base_offset for r in resp.append_responses}
    assert got == {(1, 0): 0, (2, 1): 100, (1, 2): 1}
    assert all(r.stream_append_time_ms > 0 for r in resp.append_responses)
    frames, statuses, batches = _fetch(peer, [_entry(1, index=10), _entry(2, 100, index=20)])
    assert frames[-1].flags & Flags.END
    assert [parse_header(b).base_offset for b in batches[10]] == [0, 1]
    assert [b[ENVELOPE_SIZE:] for b in batches[10]] == [b"a1", b"a2"]
    assert [b[ENVELOPE_SIZE:] for b in batches[20]] == [b"b1"]
    # Only base_offset differs from what was appended.
    sent = batch_bytes(b"a2", base_timestamp_ms=parse_header(batches[10][1]).base_timestamp_ms)
    assert batches[10][1][:4] == sent[:4] and batches[10][1][12:] == sent[12:]


def test_a_malformed_batch_fails_only_its_own_entry(peer):
    _sync(peer, _range(1))
    bad = bytearray(batch_bytes(b"zzz"))
    bad[0] = 0x43
    resp = _append(peer, [(1, b"good"), (1, bytes([0x42]) + bytes(bad[1:])[:3] + b"\x00" * 24),
                          (1, b"also good")])
    codes = _codes(resp.append_responses)
    assert codes[0] == codes[2] == 0 and codes[1] == ErrorCode.INVALID_REQUEST
    assert [r.base_offset for r in resp.append_responses] == [0, -1, 1]


def test_append_reports_what_is_wrong_per_entry(tmp_path):
    with Server(_config(tmp_path, max_batch_bytes=1000)).start() as srv, \
            RawPeer(srv.address) as peer:
        _sync(peer, _range(1), _range(2, servers=((ME, False), (5, True))),
              _range(3, end=0), _range(4))
        _delete = peer.call(DeleteStreamsRequest(streams=[Stream(stream_id=4)]))[0]
        assert _delete.delete_responses[0].status.ok
        resp = _append(peer, [(99, b"x"), (2, b"x"), (3, b"x"), (4, b"x"), (-1, b"x"),
                              (1, b"y" * 2000), (1, b"fine")])
        assert _codes(resp.append_responses) == [
            ErrorCode.RANGE_NOT_FOUND, ErrorCode.NOT_PRIMARY, ErrorCode.RANGE_SEALED,
            ErrorCode.STREAM_NOT_FOUND, ErrorCode.INVALID_REQUEST,
            ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.NONE]
        assert "127.0.0.1:1005" in resp.append_responses[1].status.message


def test_append_whose_lengths_do_not_match_the_payload_is_refused_whole(peer):
    _sync(peer, _range(1))
    batch = batch_bytes(b"abc")
    msg, _ = peer.call(AppendRequest(append_requests=[AppendEntry(1, 0, len(batch) + 5)]), batch)
    assert msg.status.code == ErrorCode.INVALID_REQUEST
    assert _codes(msg.append_responses) == [ErrorCode.INVALID_REQUEST]
    [res] = peer.call(DescribeRangesRequest(ranges=[RangeId(1, 0)]))[0].describe_responses
    assert res.range.next_offset == 0  # nothing stored


def test_unparsable_header_is_a_system_error(peer):
    peer.send(frame_bytes(Opcode.APPEND, 0, 4, b"\x01\x02\x03", b""))
    f = peer.next_frame(4)
    assert f.flags & Flags.SYSTEM_ERROR
    assert decode_response(f).status.code == ErrorCode.INVALID_REQUEST


def test_fetch_streams_whole_batches_over_several_frames(peer):
    _sync(peer, _range(1))
    bodies = [bytes([i]) * 20_000 for i in range(20)]  # 400 KB in 64 KiB frames
    for i in range(0, 20, 5):
        assert _append(peer, [(1, b) for b in bodies[i:i + 5]]).status.ok
    frames, statuses, batches = _fetch(peer, [_entry(1)])
    assert len(frames) >= 6
    assert [bool(f.flags & Flags.END) for f in frames] == [False] * (len(frames) - 1) + [True]
    assert [b[ENVELOPE_SIZE:] for b in batches[0]] == bodies
    assert all(s.ok for s in statuses[0])
    # The entry's byte budget and end_offset bound the whole response.
    _, _, batches = _fetch(peer, [_entry(1, offset=3, max_bytes=3 * 20_028)])
    assert [parse_header(b).base_offset for b in batches[0]] == [3, 4, 5]
    _, _, batches = _fetch(peer, [_entry(1, offset=5, end=8)])
    assert [parse_header(b).base_offset for b in batches[0]] == [5, 6, 7]
    # A first batch larger than the budget still comes (alone).
    _, _, batches = _fetch(peer, [_entry(1, offset=2, max_bytes=10)])
    assert [parse_header(b).base_offset for b in batches[0]] == [2]


def test_fetch_of_many_small_batches(peer):
    _sync(peer, _range(1))
    for _ in range(4):
        assert _append(peer, [(1, b"r" * 100)] * 500).status.ok
    frames, _, batches = _fetch(peer, [_entry(1, offset=17)])
    assert [parse_header(b).base_offset for b in batches[0]] == list(range(17, 2000))
    assert len(frames) > 1


def test_an_entry_gets_its_first_batch_past_its_budget_next_to_other_entries(peer):
    # Alone, an entry whose first batch is larger than its batch_max_bytes gets that batch;
    # sharing the answer with another entry's batches, it got none, and asking again got none
    # again.
    _sync(peer, _range(1), _range(2))
    _append(peer, [(1, b"a" * 100), (2, b"b" * 500)])
    _, statuses, batches = _fetch(peer, [_entry(1, index=0), _entry(2, max_bytes=200, index=1)])
    assert [s.code for s in statuses[0] + statuses[1]] == [ErrorCode.NONE] * \
        (len(statuses[0]) + len(statuses[1]))
    assert [parse_header(b).body_length for b in batches[0]] == [100]
    assert [parse_header(b).body_length for b in batches[1]] == [500]


def test_fetch_long_poll_is_woken_by_an_append(server, peer):
    _sync(peer, _range(1))
    _append(peer, [(1, b"old")])
    result = {}

    def wait():
        with RawPeer(server.address) as reader:
            began = time.monotonic()
            result["out"] = _fetch(reader, [_entry(1, offset=1)], max_wait_ms=20_000,
                                   min_bytes=1)
            result["took"] = time.monotonic() - began

    t = threading.Thread(target=wait)
    t.start()
    # Let the fetch start waiting (its outcome does not depend on this).
    wait_until(lambda: server.metrics.fetches >= 1, "the FETCH to start long-polling")
    _append(peer, [(1, b"new")])
    t.join(30)
    _, _, batches = result["out"]
    assert [b[ENVELOPE_SIZE:] for b in batches[0]] == [b"new"]
    assert result["took"] < 15


def test_fetch_long_poll_times_out_with_an_empty_ok_answer(peer):
    _sync(peer, _range(1))
    began = time.monotonic()
    frames, statuses, batches = _fetch(peer, [_entry(1)], max_wait_ms=300, min_bytes=1)
    assert time.monotonic() - began >= 0.25
    assert len(frames) == 1 and statuses[0][0].ok and batches[0] == []


def test_a_long_poll_ends_at_once_when_its_stream_is_deleted_or_trimmed_past_it(server, peer):
    # Both answers are final the moment it happens; the long poll waited out max_wait_ms (up
    # to 60 s) before giving them.
    _sync(peer, _range(1), _range(2))
    _append(peer, [(1, b"a"), (2, b"a" * 100), (2, b"b")])
    with RawPeer(server.address) as other:
        for stream_id, change, code in (
                (1, DeleteStreamsRequest(streams=[Stream(stream_id=1)]),
                 ErrorCode.STREAM_NOT_FOUND),
                (2, TrimStreamsRequest(trimmed_streams=[TrimmedStream(2, 2)]),
                 ErrorCode.OFFSET_OUT_OF_RANGE)):
            later = threading.Timer(0.2, other.call, (change,))
            later.start()
            began = time.monotonic()
            _, statuses, _ = _fetch(peer, [_entry(stream_id, offset=1)], max_wait_ms=10_000,
                                    min_bytes=1 << 20)
            later.join()
            assert statuses[0][-1].code == code
            assert time.monotonic() - began < 5


def test_fetch_validates_its_fields(peer):
    _sync(peer, _range(1))
    _append(peer, [(1, b"x")])
    _, statuses, _ = _fetch(peer, [
        _entry(-1, index=0), _entry(1, offset=-5, index=1), _entry(1, max_bytes=0, index=2),
        _entry(1, offset=3, end=1, index=3), _entry(42, index=4), _entry(1, offset=9, index=5)])
    codes = {i: s[0].code for i, s in statuses.items()}
    assert codes == {0: ErrorCode.INVALID_REQUEST, 1: ErrorCode.INVALID_REQUEST,
                     2: ErrorCode.INVALID_REQUEST, 3: ErrorCode.INVALID_REQUEST,
                     4: ErrorCode.RANGE_NOT_FOUND, 5: ErrorCode.OFFSET_OUT_OF_RANGE}
    msg, _ = peer.call(FetchRequest(max_wait_ms=-1, fetch_requests=[_entry(1)]))
    assert msg.status.code == ErrorCode.INVALID_REQUEST
    # Offsets held by ranges on other servers: the client must ask the PD.
    _sync(peer, _range(2, index=1, start=100), _range(3, end=4))
    _, statuses, _ = _fetch(peer, [_entry(2, offset=50, index=0), _entry(3, offset=9, index=1)])
    assert [statuses[i][0].code for i in (0, 1)] == [ErrorCode.RANGE_NOT_FOUND] * 2


def test_a_new_range_of_a_deleted_stream_is_refused(peer):
    # The PD opened range 1 (a seal) just before the stream was deleted, and its push arrived
    # after the DELETE_STREAMS: the range was created, open and not deleted, so appends to the
    # deleted stream were acknowledged, and no reader could ever read them.
    _sync(peer, _range(1))
    _append(peer, [(1, b"a")])
    msg, _ = peer.call(DeleteStreamsRequest(streams=[Stream(stream_id=1)]))
    assert msg.delete_responses[0].status.ok
    [refused] = _sync(peer, _range(1, index=1, start=1))
    assert refused.status.code == ErrorCode.STREAM_NOT_FOUND
    [result] = _append(peer, [(1, b"b")]).append_responses
    assert result.status.code == ErrorCode.STREAM_NOT_FOUND and result.base_offset == -1


def test_trim_makes_old_offsets_out_of_range_naming_the_start(peer):
    _sync(peer, _range(1))
    _append(peer, [(1, b"x" * 10)] * 10)
    msg, _ = peer.call(TrimStreamsRequest(trimmed_streams=[TrimmedStream(1, 6)]))
    [res] = msg.streams
    assert res.status.ok and res.trimmed_stream.start_offset == 6 and res.range.start_offset == 6
    _, statuses, _ = _fetch(peer, [_entry(1, offset=2)])
    status = statuses[0][0]
    assert status.code == ErrorCode.OFFSET_OUT_OF_RANGE and "6" in status.message
    _, _, batches = _fetch(peer, [_entry(1, offset=6)])
    assert [parse_header(b).base_offset for b in batches[0]] == [6, 7, 8, 9]


def test_seal_returns_the_sealed_range_and_stops_appends(peer):
    _sync(peer, _range(1))
    _append(peer, [(1, b"a"), (1, b"b"), (1, b"c")])
    msg, _ = peer.call(SealRangesRequest(ranges=[RangeId(1, 0), RangeId(1, 5), RangeId(-1, 0)]))
    sealed, missing, bad = msg.seal_responses
    assert sealed.status.ok and sealed.range.end_offset == 3 == sealed.range.next_offset
    assert missing.status.code == ErrorCode.RANGE_NOT_FOUND
    assert bad.status.code == ErrorCode.INVALID_REQUEST
    again, = peer.call(SealRangesRequest(ranges=[RangeId(1, 0)]))[0].seal_responses
    assert again.range.end_offset == 3  # idempotent
    assert _codes(_append(peer, [(1, b"d")]).append_responses) == [ErrorCode.RANGE_SEALED]
    _, statuses, _ = _fetch(peer, [_entry(1, offset=3)], max_wait_ms=10_000)
    assert statuses[0][0].code == ErrorCode.RANGE_SEALED
    # The next range continues the stream on this server.
    _sync(peer, _range(1, index=1, start=3))
    assert [r.base_offset for r in _append(peer, [(1, b"d")]).append_responses] == [3]
    _, _, batches = _fetch(peer, [_entry(1, offset=1)])
    assert [parse_header(b).base_offset for b in batches[0]] == [1, 2, 3]


def test_describe_ranges_reports_the_live_next_offset(peer):
    _sync(peer, _range(1, start=10))
    _append(peer, [(1, b"a"), (1, b"b")])
    msg, _ = peer.call(DescribeRangesRequest(ranges=[RangeId(1, 0), RangeId(1, -1),
                                                     RangeId(1, 3)]))
    a, b, c = msg.describe_responses
    assert a.range.next_offset == b.range.next_offset == 12 and a.range.end_offset == -1
    assert a.range.servers[0].server.server_id == ME and a.range.servers[0].is_primary
    assert c.status.code == ErrorCode.RANGE_NOT_FOUND


def test_restart_keeps_ranges_data_and_server_id(tmp_path):
    with Server(_config(tmp_path)).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(3))
        _append(peer, [(3, b"persist me")])
    with Server(RangeServerConfig(data_dir=str(tmp_path))).start() as srv, \
            RawPeer(srv.address) as peer:
        assert srv.server_id == ME
        _, _, batches = _fetch(peer, [_entry(3)])
        assert [b[ENVELOPE_SIZE:] for b in batches[0]] == [b"persist me"]
        assert [r.base_offset for r in _append(peer, [(3, b"more")]).append_responses] == [1]


def test_retention_deletes_expired_data_and_reports_the_trim(tmp_path):
    cfg = _config(tmp_path, storage=StorageConfig(fsync="never", segment_bytes=4096))
    with Server(cfg).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        for _ in range(3):
            _append(peer, [(1, b"o" * 3000)])
        trims = []
        srv.retention.on_trim = lambda sid, start: trims.append((sid, start))
        srv.retention.set_period(1, 60_000)
        assert srv.retention.apply(now_ms=int(time.time() * 1000) + 120_000) == [(1, 3)]
        assert trims == [(1, 3)]
        _, statuses, _ = _fetch(peer, [_entry(1, offset=0)])
        assert statuses[0][0].code == ErrorCode.OFFSET_OUT_OF_RANGE


def test_heartbeat_is_answered_with_this_server(server, peer):
    msg, _ = peer.call(HeartbeatRequest(client_id="c-1", client_role=ClientRole.CLIENT))
    assert msg.client_id == "c-1" and msg.range_server.server_id == ME
    assert msg.range_server.advertise_addr == server.advertise_addr


def test_shutdown_ends_long_polls_early_and_says_goaway(tmp_path):
    _stop_during_a_long_poll(tmp_path)


def test_a_goaway_slow_to_go_out_still_comes_before_the_connection_ends(tmp_path,
                                                                         monkeypatch):
    # The stopping thread marks the connection as going away, then writes the GOAWAY; the
    # long poll it woke may answer and end the connection in between (seen under load: the
    # peer got the answer and then the end of the connection, never the GOAWAY).
    write = net.Connection._write_goaway

    def slow_write(conn, reason: str) -> None:
        time.sleep(0.3)
        write(conn, reason)

    monkeypatch.setattr(net.Connection, "_write_goaway", slow_write)
    _stop_during_a_long_poll(tmp_path)


def _stop_during_a_long_poll(tmp_path) -> None:
    srv = Server(_config(tmp_path)).start()
    with RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        waiting = peer.request(FetchRequest(30_000, 1, [_entry(1)]))
        wait_until(lambda: srv.metrics.fetches, "the FETCH handler to run (long-polling)")
        began = time.monotonic()
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        frames = peer.response(waiting, timeout=10)
        assert time.monotonic() - began < 10
        assert frames[-1].is_end and not isinstance(decode_response(frames[-1]), SystemError)
        assert any(f.opcode == Opcode.GOAWAY for f in peer.frames) or \
            peer.next_frame().opcode == Opcode.GOAWAY
        assert peer.wait_eof()
        stopper.join(10)


def test_primary_replicates_to_secondaries_and_seals_when_one_fails(tmp_path):
    primary = Server(RangeServerConfig(data_dir=str(tmp_path / "p"), server_id=1)).start()
    secondary = Server(RangeServerConfig(data_dir=str(tmp_path / "s"), server_id=2)).start()
    try:
        replicas = [RangeReplica(RangeServer(1, primary.advertise_addr), True),
                    RangeReplica(RangeServer(2, secondary.advertise_addr), False)]
        rng = Range(5, 0, 0, 0, -1, replicas)
        with RawPeer(primary.address) as p, RawPeer(secondary.address) as s:
            assert _sync(p, rng)[0].ranges and _sync(s, rng)[0].ranges
            resp = _append(p, [(5, b"one"), (5, b"two")])
            assert [r.base_offset for r in resp.append_responses] == [0, 1]
            assert [r.base_offset for r in _append(p, [(5, b"three")]).append_responses] == [2]
            _, _, originals = _fetch(p, [_entry(5)])
            assert len(originals[0]) == 3
            # The secondary learns that the last append settled from the primary's cap notice
            # (the range went quiet), with no further append (test_cap_notice.py).
            wait_until(lambda: _fetch(s, [_entry(5)])[2][0] == originals[0],
                       "the secondary to serve the three batches")
            # A client's batch sent to the secondary is refused.
            assert _codes(_append(s, [(5, b"x")]).append_responses) == [ErrorCode.NOT_PRIMARY]
            secondary.stop()
            resp = _append(p, [(5, b"four")])
            assert _codes(resp.append_responses) == [ErrorCode.REPLICATION_FAILED]
            # "four" reached the primary alone: until the PD records the end, readers see 3
            # records and the range is not shown sealed.
            [desc] = p.call(DescribeRangesRequest(ranges=[RangeId(5, 0)]))[0].describe_responses
            assert (desc.range.next_offset, desc.range.end_offset) == (3, -1)
            assert _codes(_append(p, [(5, b"five")]).append_responses) == [
                ErrorCode.RANGE_SEALED]
            # The primary stopped taking appends before "four", whose writer was told it
            # failed: a PD that counts the primary alone (the secondary is gone) must not keep
            # it in the range, or the writer's resend would be a second copy.
            [sealed] = p.call(SealRangesRequest(ranges=[RangeId(5, 0)]))[0].seal_responses
            assert (sealed.range.next_offset, sealed.range.end_offset) == (3, 3)
            assert len(_fetch(p, [_entry(5)])[2][0]) == 3
    finally:
        primary.stop()
        secondary.stop()


class FullDisk(Disk):
    """Segment writes fail with ENOSPC while ``full`` is set."""

    full = False

    def write(self, fd: int, buffers, offset: int) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(fd, buffers, offset)


def test_disk_full_fails_the_entries_with_storage_full(tmp_path):
    disk = FullDisk()
    config = _config(tmp_path, fetch_frame_bytes=64 * 1024)  # as the `server` fixture's
    with Server(config, disk=disk).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        assert _codes(_append(peer, [(1, b"kept")]).append_responses) == [0]
        disk.full = True
        resp = _append(peer, [(1, b"lost")])
        disk.full = False
        assert _codes(resp.append_responses) == [ErrorCode.STORAGE_FULL]
        assert "disk full" in resp.append_responses[0].status.message
        _, _, batches = _fetch(peer, [_entry(1)])
        assert [b[ENVELOPE_SIZE:] for b in batches[0]] == [b"kept"]
        assert [r.base_offset for r in _append(peer, [(1, b"next")]).append_responses] == [1]


def test_fetch_of_corrupt_stored_data_fails_that_entry_cleanly(tmp_path):
    cfg = _config(tmp_path, storage=StorageConfig(fsync="never", segment_bytes=4096))
    with Server(cfg).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        for _ in range(3):
            _append(peer, [(1, b"c" * 3000)])
        first_segment = sorted(p for p in (tmp_path / "data").rglob("*.seg"))[0]
    with open(first_segment, "r+b") as f:
        f.seek(200)
        f.write(b"\xee")
    with Server(RangeServerConfig(data_dir=str(tmp_path))).start() as srv, \
            RawPeer(srv.address) as peer:
        _, statuses, batches = _fetch(peer, [_entry(1, offset=0, index=0),
                                             _entry(1, offset=1, index=1)])
        assert statuses[0][-1].code == ErrorCode.DATA_CORRUPT
        assert "corrupt at offset 0" in statuses[0][-1].message
        assert [parse_header(b).base_offset for b in batches[1]] == [1, 2]


def test_fetch_serves_the_sound_batches_around_a_corrupt_one(tmp_path):
    with Server(_config(tmp_path)).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        _append(peer, [(1, bytes([i]) * 500) for i in range(4)])
        [segment_file] = list((tmp_path / "data").rglob("*.seg"))
    data = segment_file.read_bytes()
    at = data.index(bytes([1]) * 500)  # the body of the batch at offset 1
    with open(segment_file, "r+b") as f:
        f.seek(at + 10)
        f.write(b"\x00")
    with Server(RangeServerConfig(data_dir=str(tmp_path))).start() as srv, \
            RawPeer(srv.address) as peer:
        _, statuses, batches = _fetch(peer, [_entry(1, offset=0, index=0),
                                             _entry(1, offset=2, index=1)])
        assert [parse_header(b).base_offset for b in batches[0]] == [0]
        assert statuses[0][-1].code == ErrorCode.DATA_CORRUPT
        assert "corrupt at offset 1" in statuses[0][-1].message
        assert [parse_header(b).base_offset for b in batches[1]] == [2, 3]
        # The damaged offset is never handed out again.
        assert [r.base_offset for r in _append(peer, [(1, b"new")]).append_responses] == [4]


def test_a_range_sealed_above_what_this_replica_stored_sends_readers_elsewhere(peer):
    # The PD sealed the range where its primary stopped (5); this replica stored 2 records of
    # it (it missed the rest). Readers got OK answers with no batches for offsets 2 to 4 at
    # once, long poll or not, and asked again forever; now they are told to read elsewhere.
    _sync(peer, _range(1))
    _append(peer, [(1, b"a"), (1, b"b")])
    _sync(peer, _range(1, end=5))
    _, statuses, batches = _fetch(peer, [_entry(1, offset=0)])
    assert [parse_header(b).base_offset for b in batches[0]] == [0, 1]
    assert statuses[0][-1].code == ErrorCode.DATA_CORRUPT
    assert "ends at 5 but this replica stores only up to 2" in statuses[0][-1].message
    began = time.monotonic()
    _, statuses, _ = _fetch(peer, [_entry(1, offset=3)], max_wait_ms=5000, min_bytes=1000)
    assert statuses[0][-1].code == ErrorCode.DATA_CORRUPT
    assert "corrupt at offset 3" in statuses[0][-1].message
    assert time.monotonic() - began < 2
    # At the end itself the answer is still that the stream continues elsewhere.
    _, statuses, _ = _fetch(peer, [_entry(1, offset=5)])
    assert statuses[0][-1].code == ErrorCode.RANGE_SEALED
    # Below what it stored, a long poll wanting more than is left answers at once too: a
    # sealed range gets nothing more, so waiting out max_wait_ms only delays the reader.
    began = time.monotonic()
    _, statuses, batches = _fetch(peer, [_entry(1, offset=1)], max_wait_ms=5000, min_bytes=1000)
    assert [parse_header(b).base_offset for b in batches[0]] == [1]
    assert statuses[0][-1].code == ErrorCode.DATA_CORRUPT
    assert time.monotonic() - began < 2
