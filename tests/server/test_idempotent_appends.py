"""Idempotent appends on the range server: a batch resent under its producer and sequence is
stored once and answered with its first base offset, also after a restart (the state comes
back from the log), on secondaries too; the producers' state is bounded; data directories
written before the producer extension existed still read."""

from __future__ import annotations

import tarfile
import threading
import time
from pathlib import Path

from sbp_spark.protocol.errors import ErrorCode, SequencePendingError, UnknownProducerError
from sbp_spark.protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResponse,
    DescribeRangesRequest,
    FetchEntry,
    LookupSequencesRequest,
    LookupSequencesResponse,
    ProducerSequence,
    RangeId,
)
from sbp_spark.protocol.records import ENVELOPE_SIZE, batch_bytes
from sbp_spark.server.range_server import RangeServer as Server
from sbp_spark.server.range_server import RangeServerConfig
from sbp_spark.server.range_server.producers import ProducerLimits, Producers
from sbp_spark.server.storage import StorageConfig
from sbp_spark.server.storage.segment import PRODUCER_EXTENSION_SIZE, STORAGE_HEADER_SIZE

from .disks import HeldSyncs
from .test_range_server import _fetch, _range, _sync
from .test_read_cap import STREAM, Trio
from .wire import RawPeer

ME = 1
PRODUCER = 0x1234_5678_9ABC
OLD_DATA_DIR = Path(__file__).parent.parent / "vectors" / "data_dir_0.2.0.tar.gz"


def _config(tmp_path, **kw) -> RangeServerConfig:
    kw.setdefault("storage", StorageConfig(fsync="interval", fsync_interval_ms=2))
    return RangeServerConfig(data_dir=str(tmp_path), server_id=ME, **kw)


def _append(peer, stream_id, items, producer=PRODUCER, index=0) -> AppendResponse:
    """items: (sequence, body); request_index = position."""
    entries, payload, producers = [], [], []
    for i, (seq, body) in enumerate(items):
        batch = batch_bytes(body)
        entries.append(AppendEntry(stream_id, i, len(batch)))
        payload.append(batch)
        producers.append(ProducerSequence(producer, seq, index))
    msg, _ = peer.call(AppendRequest(timeout_ms=5000, append_requests=entries,
                                     producers=producers), b"".join(payload))
    assert isinstance(msg, AppendResponse), msg
    return msg


def _answers(resp) -> list[tuple[int, int]]:
    return [(r.status.code, r.base_offset) for r in resp.append_responses]


def _next_offset(peer, stream_id, index=0) -> int:
    [res] = peer.call(DescribeRangesRequest(ranges=[RangeId(stream_id, index)]))[0] \
        .describe_responses
    return res.range.next_offset


def _bodies(peer, stream_id) -> list[bytes]:
    _, _, batches = _fetch(peer, [FetchEntry(stream_id, 0, 0, 1 << 30)])
    return [b[ENVELOPE_SIZE:] for b in batches.get(0, [])]


def test_a_resent_batch_is_stored_once_and_answered_with_its_first_offset(tmp_path):
    with Server(_config(tmp_path)).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        assert _answers(_append(peer, 1, [(0, b"a"), (1, b"b")])) == [(0, 0), (0, 1)]
        # The answer to the first try was lost: the writer sends both again, with a new one.
        assert _answers(_append(peer, 1, [(0, b"a"), (1, b"b"), (2, b"c")])) == [
            (0, 0), (0, 1), (0, 2)]
        assert _next_offset(peer, 1) == 3
        assert _bodies(peer, 1) == [b"a", b"b", b"c"]
        # Another producer's sequence 0 is its own batch; a batch without producer is never
        # deduplicated (plain at-least-once).
        assert _answers(_append(peer, 1, [(0, b"d")], producer=7)) == [(0, 3)]
        msg, _ = peer.call(AppendRequest(timeout_ms=5000, append_requests=[
            AppendEntry(1, 0, len(batch_bytes(b"a")))]), batch_bytes(b"a"))
        assert _answers(msg) == [(0, 4)]
        assert srv.metrics.duplicate_appends == 2


def test_the_producers_state_comes_back_from_the_log_after_a_restart(tmp_path):
    config = _config(tmp_path, storage=StorageConfig(fsync="always", segment_bytes=4096))
    with Server(config).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        # Enough batches to roll segments: full segments come back from their index.
        for seq in range(60):
            assert _answers(_append(peer, 1, [(seq, b"x" * 100)])) == [(0, seq)]
    with Server(config).start() as srv, RawPeer(srv.address) as peer:
        assert _answers(_append(peer, 1, [(3, b"x" * 100), (59, b"x" * 100),
                                          (60, b"new")])) == [(0, 3), (0, 59), (0, 60)]
        assert _next_offset(peer, 1) == 61


def test_a_batch_numbered_for_another_range_is_not_stored_in_this_one(tmp_path):
    with Server(_config(tmp_path)).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        resp = _append(peer, 1, [(0, b"a")], index=1)  # the PD's next range, not here yet
        assert _answers(resp) == [(ErrorCode.RANGE_NOT_FOUND, -1)]
        _sync(peer, _range(1, end=0), _range(1, index=1))
        resp = _append(peer, 1, [(0, b"a")], index=0)  # its range was sealed meanwhile
        assert _answers(resp) == [(ErrorCode.RANGE_SEALED, -1)]
        assert "range 1/0 is sealed" in resp.append_responses[0].status.message
        assert _answers(_append(peer, 1, [(0, b"a")], index=1)) == [(0, 0)]


def test_an_append_without_one_producer_per_entry_is_refused_whole(tmp_path):
    with Server(_config(tmp_path)).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        batch = batch_bytes(b"a")
        msg, _ = peer.call(AppendRequest(append_requests=[
            AppendEntry(1, 0, len(batch)), AppendEntry(1, 1, len(batch))],
            producers=[ProducerSequence(PRODUCER, 0, 0)]), batch + batch)
        assert msg.status.code == ErrorCode.INVALID_REQUEST
        assert "one per entry" in msg.status.message
        # One sequence twice in one APPEND: the second is refused, the first stored.
        resp = _append(peer, 1, [(0, b"a"), (0, b"a")])
        assert [c for c, _ in _answers(resp)] == [0, ErrorCode.INVALID_REQUEST]
        assert _answers(_append(peer, 1, [(-1, b"a")]))[0][0] == ErrorCode.INVALID_REQUEST
        assert _next_offset(peer, 1) == 1


def test_a_resend_before_its_batch_is_durable_is_told_to_ask_again(tmp_path):
    disk = HeldSyncs(timeout_s=30)
    config = _config(tmp_path, storage=StorageConfig(fsync="always"))
    with Server(config, disk=disk).start() as srv, RawPeer(srv.address) as first, \
            RawPeer(srv.address) as second:
        _sync(first, _range(1))
        disk.entered.clear()
        answered: list[AppendResponse] = []
        waiting = threading.Thread(target=lambda: answered.append(
            _append(first, 1, [(0, b"a")])))
        waiting.start()
        assert disk.entered.wait(10)
        resp = _append(second, 1, [(0, b"a")])
        assert _answers(resp) == [(ErrorCode.SEQUENCE_PENDING, -1)]
        assert "ask again" in resp.append_responses[0].status.message
        disk.release.set()
        waiting.join(10)
        assert _answers(answered[0]) == [(0, 0)]
        assert _answers(_append(second, 1, [(0, b"a")])) == [(0, 0)]
        assert _next_offset(second, 1) == 1


def test_a_data_dir_written_before_the_producer_extension_reads_and_takes_new_batches(
        tmp_path):
    """``data_dir_0.2.0.tar.gz`` was written by the range server of sbp-spark 0.2.0 (main
    before idempotent appends): stream 5, range 0, 40 one-record batches ("old record NNN"
    ten times), in segments of 4 KiB with their indexes."""
    with tarfile.open(OLD_DATA_DIR) as tar:
        tar.extractall(tmp_path / "dd", filter="data")
    config = _config(tmp_path / "dd", storage=StorageConfig(fsync="always",
                                                            segment_bytes=4096))
    old = [f"old record {i:03d} ".encode() * 10 for i in range(40)]
    with Server(config).start() as srv, RawPeer(srv.address) as peer:
        assert _bodies(peer, 5) == old
        assert _answers(_append(peer, 5, [(0, b"new 0"), (1, b"new 1")])) == [(0, 40), (0, 41)]
    # Old and new headers side by side in one segment, read back after a restart (a scan).
    segment = max((tmp_path / "dd" / "data" / "ranges" / "5-0").glob("*.seg"))
    assert segment.stat().st_size > 2 * (STORAGE_HEADER_SIZE + PRODUCER_EXTENSION_SIZE)
    (segment.with_suffix(".idx")).unlink(missing_ok=True)
    with Server(config).start() as srv, RawPeer(srv.address) as peer:
        assert _bodies(peer, 5) == old + [b"new 0", b"new 1"]
        assert _answers(_append(peer, 5, [(1, b"new 1")])) == [(0, 41)]
        assert _next_offset(peer, 5) == 42


def test_a_torn_producer_extension_is_cut_off_on_restart(tmp_path):
    config = _config(tmp_path, storage=StorageConfig(fsync="always"))
    with Server(config).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        _append(peer, 1, [(0, b"kept"), (1, b"torn")])
    [segment] = (tmp_path / "data" / "ranges" / "1-0").glob("*.seg")
    size = segment.stat().st_size
    last = size - (STORAGE_HEADER_SIZE + PRODUCER_EXTENSION_SIZE + ENVELOPE_SIZE + 4)
    with open(segment, "r+b") as f:  # the second batch's producer extension half written
        f.truncate(last + STORAGE_HEADER_SIZE + 6)
    with Server(config).start() as srv, RawPeer(srv.address) as peer:
        assert _bodies(peer, 1) == [b"kept"]
        assert _answers(_append(peer, 1, [(0, b"kept"), (1, b"torn")])) == [(0, 0), (0, 1)]


# -- the bounds, on the state itself -----------------------------------------------------------


class _Log:
    """A range's log as ``Producers`` sees it: everything settled, nothing stored before."""

    def __init__(self, stream_id: int = 1, range_index: int = 0) -> None:
        self.stream_id, self.range_index = stream_id, range_index
        self.readable_offset, self.end_offset = 1 << 40, -1

    def produced_since(self, min_time_ms):
        return []


def _verdict(producers, rlog, producer_id, seq):
    with producers.guard(rlog):
        return producers.check(rlog, producer_id, seq)


def test_each_producer_keeps_its_last_window_of_sequences():
    producers, rlog = Producers(ProducerLimits(window=4)), _Log()
    producers.record(rlog, [(9, seq, seq, seq + 1) for seq in range(10)])
    assert _verdict(producers, rlog, 9, 8).held == (8, 9)
    assert _verdict(producers, rlog, 9, 6).held == (6, 7)
    forgotten = _verdict(producers, rlog, 9, 5)
    assert isinstance(forgotten.error, UnknownProducerError) and "above 5" in str(
        forgotten.error)
    assert _verdict(producers, rlog, 9, 10) == (None, None)  # new: stored


def test_idle_producers_expire_and_the_least_recent_makes_room():
    producers = Producers(ProducerLimits(expiry_s=60, max_states=2))
    rlog = _Log()
    producers.record(rlog, [(1, 0, 0, 1)], now_ms=1_000)
    producers.record(rlog, [(2, 0, 1, 2)], now_ms=2_000)
    producers.record(rlog, [(3, 0, 2, 3)], now_ms=3_000)  # producer 1 makes room
    assert len(producers) == 2
    lost = _verdict(producers, rlog, 1, 1)
    assert isinstance(lost.error, UnknownProducerError) and "no longer knows" in str(lost.error)
    # Sequence 0 of a producer the range does not know starts it anew.
    assert _verdict(producers, rlog, 4, 0) == (None, None)
    producers.record(rlog, [(3, 1, 3, 4)], now_ms=70_000)  # producer 2 idle for 68 s: gone
    assert len(producers) == 1 and _verdict(producers, rlog, 3, 1).held == (3, 4)


def test_one_batch_is_recorded_as_a_list_of_one_is():
    # record_one, the lone writer's path: windows, new producers and expiry as record does.
    producers = Producers(ProducerLimits(expiry_s=60, window=2))
    rlog = _Log()
    producers.guard(rlog)  # loaded (nothing in its log) at the time of day
    t = time.time_ns() // 1_000_000
    producers.record_one(rlog, 1, 0, 0, 1, now_ms=t)  # new to the range
    producers.record_one(rlog, 1, 1, 1, 2, now_ms=t + 100)
    producers.record_one(rlog, 1, 2, 2, 5, now_ms=t + 200)  # sequence 0 leaves the window
    assert _verdict(producers, rlog, 1, 2).held == (2, 5)
    assert isinstance(_verdict(producers, rlog, 1, 0).error, UnknownProducerError)
    producers.record_one(rlog, 2, 0, 5, 6, now_ms=t + 1_000)
    producers.record_one(rlog, 2, 1, 6, 7, now_ms=t + 90_000)  # producer 1 idle 89 s: expired
    assert len(producers) == 1 and _verdict(producers, rlog, 2, 1).held == (6, 7)


def test_a_producer_expired_for_idleness_is_new_again_but_one_dropped_for_room_is_not():
    producers = Producers(ProducerLimits(expiry_s=60))
    rlog = _Log()
    producers.record(rlog, [(1, 5, 0, 1)], now_ms=1_000)
    producers.record(rlog, [(2, 0, 1, 2)], now_ms=90_000)  # producer 1 idle 89 s: expired
    assert len(producers) == 1
    # Idle that long, producer 1 resends nothing: whatever it sends now is new.
    assert _verdict(producers, rlog, 1, 6) == (None, None)


def test_once_a_range_dropped_a_producer_for_room_only_sequence_0_starts_one(tmp_path):
    config = _config(tmp_path, producers=ProducerLimits(max_states=1))
    with Server(config).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        assert _answers(_append(peer, 1, [(0, b"a")], producer=1)) == [(0, 0)]
        assert _answers(_append(peer, 1, [(0, b"b")], producer=2)) == [(0, 1)]  # 1 dropped
        # A producer that starts here now: its sequence 0 and those after it in the APPEND.
        assert _answers(_append(peer, 1, [(0, b"c"), (1, b"d")], producer=3)) == [
            (0, 2), (0, 3)]
        # Producer 1 again: the range cannot tell whether it holds its sequence 1.
        assert _answers(_append(peer, 1, [(1, b"e")], producer=1)) == [
            (ErrorCode.UNKNOWN_PRODUCER, -1)]
        assert _next_offset(peer, 1) == 4


def test_a_batch_beyond_the_seal_or_not_yet_settled_is_not_answered_as_stored():
    producers, rlog = Producers(), _Log()
    producers.record(rlog, [(1, 0, 0, 5), (1, 1, 5, 10)])
    rlog.readable_offset = 5
    assert _verdict(producers, rlog, 1, 0).error is None
    assert isinstance(_verdict(producers, rlog, 1, 1).error, SequencePendingError)
    rlog.end_offset = 5
    assert _verdict(producers, rlog, 1, 1).error.code == ErrorCode.RANGE_SEALED


def test_every_secondary_keeps_the_producers_and_rebuilds_them_after_a_restart(tmp_path):
    trio = Trio(tmp_path)
    try:
        with RawPeer(trio.servers[1].address) as peer:
            assert _answers(_append(peer, STREAM, [(0, b"a"), (1, b"b")])) == [(0, 0), (0, 1)]

        def held(sid: int) -> dict:
            server = trio.servers[sid]
            rlog = server.storage.stream_ranges(STREAM)[-1]
            return server.producers.held(rlog, PRODUCER, [0, 1, 2])

        for sid in (1, 2, 3):
            assert held(sid) == {0: (0, 1), 1: (1, 2), 2: None}, sid
        trio.restart(2)
        assert held(2) == {0: (0, 1), 1: (1, 2), 2: None}
    finally:
        trio.close()


def _lookup(peer, stream_id, sequences, producer=PRODUCER, index=0):
    msg, _ = peer.call(LookupSequencesRequest(RangeId(stream_id, index), producer, sequences))
    assert isinstance(msg, LookupSequencesResponse), msg
    return msg


def test_a_sealed_range_says_which_batches_of_a_producer_it_holds(tmp_path):
    with Server(_config(tmp_path)).start() as srv, RawPeer(srv.address) as peer:
        _sync(peer, _range(1))
        _append(peer, 1, [(0, b"a"), (1, b"b"), (2, b"c")])
        # Open: what it holds is not settled yet.
        pending = _lookup(peer, 1, [0])
        assert pending.status.code == ErrorCode.SEQUENCE_PENDING and not pending.base_offsets
        # The PD ended the range at 2: the batch at 2 is not part of it.
        _sync(peer, _range(1, end=2))
        assert _lookup(peer, 1, [0, 1, 2, 3]).base_offsets == [0, 1, -1, -1]
        assert _lookup(peer, 1, [0], producer=99).base_offsets == [-1]
        assert _lookup(peer, 2, [0]).status.code == ErrorCode.RANGE_NOT_FOUND
        assert _lookup(peer, 1, [0], producer=-5).status.code == ErrorCode.INVALID_REQUEST
