"""The range server's storage engine: appends, reads, restarts, torn tails, fsync policies,
retention, trims and a full disk."""

from __future__ import annotations

import errno
import os
import threading
import time
import zlib

import pytest

from sbp_spark.protocol.errors import (
    DataCorruptError,
    OffsetOutOfRangeError,
    RangeSealedError,
    StorageFullError,
    StreamNotFoundError,
)
from sbp_spark.protocol.messages import RangeReplica, RangeServer
from sbp_spark.protocol.records import ENVELOPE_SIZE, batch_bytes, parse_header
from sbp_spark.server.storage import FsyncPolicy, StorageConfig
from sbp_spark.server.storage import segment as segment_mod
from sbp_spark.server.storage.disk import Disk
from sbp_spark.server.storage.segment import CorruptDataError, verify_batches
from sbp_spark.server.storage.store import Storage

# No background fsync during a test unless the test asks for it.
_MANUAL = StorageConfig(fsync="interval", fsync_interval_ms=3_600_000)


def _batch(body: bytes, ts: int = 1_700_000_000_000) -> tuple:
    data = memoryview(batch_bytes(body, base_timestamp_ms=ts))
    return parse_header(data), data


def _read_all(rlog, offset: int = None, max_bytes: int = 1 << 30) -> list[bytes]:
    """Every committed batch from ``offset`` as bytes, across segments."""
    offset = rlog.start_offset if offset is None else offset
    out = []
    while True:
        with rlog.read(offset, max_bytes) as chunk:
            if not chunk.batches:
                return out
            data = b"".join(os.pread(b.fd, b.length, b.position) for b in chunk.batches)
            assert chunk.crc == verify_batches(chunk.batches) == zlib.crc32(data)
            assert chunk.nbytes == len(data)
            for b in chunk.batches:
                out.append(os.pread(b.fd, b.length, b.position))
            offset = chunk.next_offset


def _segment_files(rlog) -> list[str]:
    return sorted(os.path.join(rlog.directory, n) for n in os.listdir(rlog.directory)
                  if n.endswith(".seg"))


@pytest.fixture
def store(tmp_path):
    s = Storage(str(tmp_path), _MANUAL)
    yield s
    s.close()


def test_append_assigns_offsets_and_reads_back_patched_batches(store):
    rlog = store.create_range(7, 0, start_offset=100,
                              replicas=[RangeReplica(RangeServer(1, "h:1"), True)])
    bases, target = rlog.append([_batch(b"one"), _batch(b"two")])
    assert bases == [100, 101] and target == 102
    bases, target = rlog.append([_batch(b"three")])
    assert bases == [102]
    rlog.sync()
    assert rlog.next_offset == 103
    stored = _read_all(rlog)
    assert len(stored) == 3
    for expected_offset, body, raw in zip((100, 101, 102), (b"one", b"two", b"three"), stored,
                                          strict=True):
        header = parse_header(raw)
        assert header.base_offset == expected_offset
        assert raw[ENVELOPE_SIZE:] == body
    # A read from inside the stream starts with the batch holding that offset.
    with rlog.read(101, 1 << 20) as chunk:
        assert [b.base_offset for b in chunk.batches] == [101, 102]


def test_stored_crcs_are_right_whether_derived_from_the_frames_or_computed(store):
    # The range server passes the frame's checked payload CRC for a one-batch frame; the
    # stored CRC must still cover the batch as stored (with its assigned base offset).
    rlog = store.create_range(8, 0, start_offset=1_000)
    # A large batch's stored CRC is derived from the one given; a small one's is computed.
    one, four = _batch(b"p" * 70_000), _batch(b"q" * 5_000)
    two, three = _batch(b"a" * 10), _batch(b"b" * 20)
    rlog.append([one], crcs=[zlib.crc32(one[1])])
    rlog.append([two, three], crcs=[zlib.crc32(two[1]), None])
    rlog.append([four], crcs=[zlib.crc32(four[1])])
    rlog.sync()
    stored = _read_all(rlog)  # checks every stored CRC against the bytes read back
    assert [parse_header(memoryview(b)).base_offset for b in stored] == [
        1_000, 1_001, 1_002, 1_003]


def test_crc32_with_prefix_matches_a_full_pass():
    data = bytearray(os.urandom(70_000))
    before = zlib.crc32(data)
    old = bytes(data[:ENVELOPE_SIZE])
    data[4:12] = os.urandom(8)
    assert segment_mod.crc32_with_prefix(before, old, bytes(data[:ENVELOPE_SIZE]),
                                         len(data)) == zlib.crc32(data)
    assert segment_mod.crc32_with_prefix(before, old, old, len(data)) == before
    with pytest.raises(ValueError):
        segment_mod.crc32_with_prefix(before, old, old[:-1], len(data))


def test_uncommitted_batches_are_invisible_until_synced(store):
    rlog = store.create_range(1, 0, 0)
    _, target = rlog.append([_batch(b"x")])
    assert rlog.written_offset == 1 and rlog.next_offset == 0
    with rlog.read(0, 1 << 20) as chunk:
        assert chunk.batches == []
    called = []
    store.durability.when_durable(rlog, target, called.append)
    assert called == []
    rlog.sync()
    store.durability.release_waiters()
    assert called == [None]
    assert len(_read_all(rlog)) == 1


def test_read_limits_max_bytes_first_batch_and_end_offset(store):
    rlog = store.create_range(1, 0, 0)
    rlog.append([_batch(b"a" * 1000) for _ in range(5)])
    rlog.sync()
    size = ENVELOPE_SIZE + 1000
    with rlog.read(0, 10) as chunk:  # smaller than one batch: the first still comes
        assert [b.base_offset for b in chunk.batches] == [0]
    with rlog.read(0, 10, first=False) as chunk:
        assert chunk.batches == []
    with rlog.read(0, 2 * size + 1) as chunk:
        assert [b.base_offset for b in chunk.batches] == [0, 1]
    with rlog.read(1, 1 << 20, end_offset=3) as chunk:
        assert [b.base_offset for b in chunk.batches] == [1, 2]
        assert chunk.next_offset == 3
    with pytest.raises(OffsetOutOfRangeError):
        rlog.read(6, 100)


def test_restart_recovers_offsets_data_and_metadata(tmp_path):
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.create_range(3, 2, 50, replicas=[RangeReplica(RangeServer(4, "a:1"), True),
                                                  RangeReplica(RangeServer(5, "b:2"))])
        rlog.append([_batch(b"x" * 10), _batch(b"y" * 20)])
        rlog.sync()
        before = _read_all(rlog)
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.get_range(3, 2)
        assert rlog.next_offset == 52 and rlog.start_offset == 50 and not rlog.sealed
        assert rlog.replicas == (RangeReplica(RangeServer(4, "a:1"), True),
                                 RangeReplica(RangeServer(5, "b:2"), False))
        assert _read_all(rlog) == before
        assert rlog.append([_batch(b"z")])[0] == [52]



def test_a_range_skipped_at_startup_is_not_created_over_its_records(tmp_path):
    # A range directory whose range.json was unreadable was skipped at startup; when the PD
    # pushed the range again, create reused the directory, opened its segment as empty and
    # wrote new records over the old ones.
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.create_range(3, 2, 50)
        rlog.append([_batch(b"x" * 10), _batch(b"y" * 20)])
        rlog.sync()
        [segment] = _segment_files(rlog)
        directory = rlog.directory
    with open(segment, "rb") as f:
        before = f.read()
    with open(os.path.join(directory, "range.json"), "wb") as f:
        f.write(b"{not json")
    with Storage(str(tmp_path), _MANUAL) as s:
        assert s.get_range(3, 2) is None
        with pytest.raises(DataCorruptError, match=r"range 3/2 cannot be created .*holds "
                           r"records .*range.json is unreadable"):
            s.create_range(3, 2, 50)
        assert s.get_range(3, 2) is None
    with open(segment, "rb") as f:
        assert f.read() == before


def test_a_range_whose_creation_was_cut_short_is_created_again(tmp_path):
    # Killed between the first segment and range.json: no record was ever stored there.
    directory = tmp_path / "ranges" / "3-2"
    directory.mkdir(parents=True)
    (directory / "00000000000000000050.seg").write_bytes(b"")
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.create_range(3, 2, 50)
        assert rlog.append([_batch(b"x")])[0] == [50]

def test_torn_tail_is_cut_on_restart(tmp_path):
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.create_range(1, 0, 0)
        rlog.append([_batch(b"first"), _batch(b"second"), _batch(b"third-batch")])
        rlog.sync()
        [path] = _segment_files(rlog)
    size = os.path.getsize(path)
    os.truncate(path, size - 5)  # the last batch is now half-written
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.get_range(1, 0)
        assert rlog.next_offset == 2
        assert [parse_header(b).base_offset for b in _read_all(rlog)] == [0, 1]
        assert os.path.getsize(path) < size - 5  # the torn bytes are gone from the file
        assert rlog.append([_batch(b"again")])[0] == [2]
        rlog.sync()
        assert _read_all(rlog)[-1][ENVELOPE_SIZE:] == b"again"


def test_corrupt_batch_in_the_active_segment_keeps_the_batches_after_it(tmp_path):
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.create_range(1, 0, 0)
        rlog.append([_batch(b"first"), _batch(b"second"), _batch(b"third")])
        rlog.sync()
        with rlog.read(1, 1, first=True) as chunk:
            second = chunk.batches[0]
        [path] = _segment_files(rlog)
    with open(path, "r+b") as f:
        f.seek(second.position + ENVELOPE_SIZE)
        f.write(b"X")  # flips a body byte of batch 1
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.get_range(1, 0)
        assert rlog.next_offset == 3  # not a torn write: offsets 0 and 2 are still there
        with rlog.read(0, 1) as chunk:
            chunk.checked_crc()
        with rlog.read(1, 1) as chunk, pytest.raises(CorruptDataError) as info:
            chunk.checked_crc()
        assert info.value.offset == 1
        with rlog.read(2, 1) as chunk:
            assert chunk.checked_crc() == zlib.crc32(os.pread(
                chunk.batches[0].fd, chunk.batches[0].length, chunk.batches[0].position))
        assert rlog.append([_batch(b"fourth")])[0] == [3]


def test_corrupt_header_in_the_active_segment_is_skipped_to_the_next_good_batch(tmp_path):
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.create_range(1, 0, 0)
        rlog.append([_batch(bytes([i]) * 100) for i in range(5)])
        rlog.sync()
        with rlog.read(2, 1) as chunk:
            third = chunk.batches[0]
        [path] = _segment_files(rlog)
    with open(path, "r+b") as f:
        f.seek(third.position - 20)  # inside batch 2's storage header
        f.write(b"\xff\xff")
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.get_range(1, 0)
        assert rlog.next_offset == 5
        with pytest.raises(CorruptDataError):
            rlog.read(2, 1 << 20)
        with rlog.read(0, 1 << 20) as chunk:  # the batches before it are served
            assert [b.base_offset for b in chunk.batches] == [0, 1]
        with rlog.read(3, 1 << 20) as chunk:
            assert [b.base_offset for b in chunk.batches] == [3, 4]
            chunk.checked_crc()


@pytest.mark.parametrize("lose_index", [False, True], ids=["indexed", "rescanned"])
def test_corrupt_byte_in_a_full_segment_is_detected_on_read(tmp_path, lose_index):
    cfg = StorageConfig(fsync="never", segment_bytes=4096)
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.create_range(1, 0, 0)
        for _ in range(6):
            rlog.append([_batch(b"p" * 1500)])
        first_segment = _segment_files(rlog)[0]
        assert len(_segment_files(rlog)) >= 3
    if lose_index:
        for name in os.listdir(os.path.dirname(first_segment)):
            if name.endswith(".idx"):
                os.unlink(os.path.join(os.path.dirname(first_segment), name))
    with open(first_segment, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.get_range(1, 0)
        assert rlog.next_offset == 6  # a damaged full segment does not cost later data
        with rlog.read(0, 1 << 20) as chunk, pytest.raises(CorruptDataError, match="checksum"):
            verify_batches(chunk.batches)
        with rlog.read(2, 1 << 20) as chunk:  # other segments still serve
            assert chunk.batches[0].base_offset == 2


def test_segments_roll_and_indexes_survive_restart(tmp_path):
    cfg = StorageConfig(fsync="never", segment_bytes=8192, index_interval_bytes=1024)
    bodies = [bytes([i]) * (100 + 37 * i) for i in range(60)]
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.create_range(9, 1, 1000)
        for i in range(0, 60, 3):
            rlog.append([_batch(b) for b in bodies[i:i + 3]])
        assert len(_segment_files(rlog)) > 3
        before = _read_all(rlog)
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.get_range(9, 1)
        assert rlog.next_offset == 1060
        after = _read_all(rlog)
        assert after == before
        assert [b[ENVELOPE_SIZE:] for b in after] == bodies
        for offset in (1000, 1017, 1042, 1059):  # index lookups land on the right batch
            with rlog.read(offset, 1) as chunk:
                assert chunk.batches[0].base_offset == offset


class SyncCalls(Disk):
    """Records every directory sync and segment data sync, with the thread that made it, in
    order (``calls``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def sync_dir(self, path: str) -> None:
        self.calls.append(("dir", threading.current_thread().name))
        super().sync_dir(path)

    def datasync(self, fd: int) -> None:
        self.calls.append(("data", threading.current_thread().name))
        super().datasync(fd)


def test_a_segment_rolled_by_an_append_has_its_entry_synced_before_its_data_is_answered(
        tmp_path):
    """Rolling to a new segment costs the append no directory fsync: the flush that makes
    the new segment's bytes durable syncs the directory first, so nothing in a segment whose
    entry could vanish in a crash is ever acknowledged."""
    cfg = StorageConfig(fsync="always", segment_bytes=8192)
    disk = SyncCalls()
    disk_calls = disk.calls
    with Storage(str(tmp_path), cfg, disk) as s:
        rlog = s.create_range(1, 0, 0)
        s.durability.wait_durable(rlog, rlog.append([_batch(b"a" * 5000)])[1], timeout=10)
        disk_calls.clear()
        answered = []
        _, target = rlog.append([_batch(b"b" * 5000)])  # does not fit: a new segment
        assert len(_segment_files(rlog)) == 2
        appender = threading.current_thread().name
        assert all(thread != appender for _, thread in disk_calls)  # it synced nothing
        s.durability.when_durable(rlog, target, lambda exc: answered.append(
            (exc, list(disk_calls))))
        s.durability.wait_durable(rlog, target, timeout=10)
        [(exc, before_answer)] = answered
        assert exc is None
        assert ("dir", "sbp-fsync") in before_answer
        assert before_answer.index(("dir", "sbp-fsync")) < before_answer.index(
            ("data", "sbp-fsync"))
        disk_calls.clear()
        s.durability.wait_durable(rlog, rlog.append([_batch(b"c" * 100)])[1], timeout=10)
        assert ("dir", "sbp-fsync") not in disk_calls  # once per new segment, not per flush
    with Storage(str(tmp_path), cfg) as s:
        assert [b[ENVELOPE_SIZE:] for b in _read_all(s.get_range(1, 0))] == [
            b"a" * 5000, b"b" * 5000, b"c" * 100]


class FailingDirSyncs(Disk):
    """Directory syncs fail with EIO once ``failing`` is set."""

    failing = False

    def sync_dir(self, path: str) -> None:
        if self.failing:
            raise OSError(errno.EIO, "Input/output error")
        super().sync_dir(path)


def test_a_failed_directory_sync_fails_the_appends_waiting_for_it(tmp_path):
    cfg = StorageConfig(fsync="always", segment_bytes=8192)
    disk = FailingDirSyncs()
    with Storage(str(tmp_path), cfg, disk) as s:
        rlog = s.create_range(1, 0, 0)
        s.durability.wait_durable(rlog, rlog.append([_batch(b"a" * 5000)])[1], timeout=10)
        disk.failing = True
        _, target = rlog.append([_batch(b"b" * 5000)])
        with pytest.raises(StorageFullError, match="Input/output error"):
            s.durability.wait_durable(rlog, target, timeout=10)
        assert rlog.next_offset == 1  # the batch in the new segment was never acknowledged
        with pytest.raises(StorageFullError, match="not writable"):
            rlog.append([_batch(b"c")])


def test_full_segments_get_their_index_after_the_flush_answers(tmp_path):
    """A segment found full and durable by a flush has its index written once that flush's
    answers are out; a restart then adopts the indexes instead of scanning."""
    cfg = StorageConfig(fsync="always", segment_bytes=8192, index_interval_bytes=1024)
    bodies = [bytes([i]) * (300 + 11 * i) for i in range(40)]
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.create_range(3, 0, 0)
        for body in bodies:
            s.durability.wait_durable(rlog, rlog.append([_batch(body)])[1], timeout=10)
        full = rlog.segments[:-1]
        assert len(full) >= 2
    assert all(os.path.exists(seg.index_path) for seg in full)
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.get_range(3, 0)
        assert [b[ENVELOPE_SIZE:] for b in _read_all(rlog)] == bodies
        for offset in (0, 13, 27, 39):
            with rlog.read(offset, 1) as chunk:
                assert chunk.batches[0].base_offset == offset


def test_no_index_is_written_for_a_deleted_segment(tmp_path):
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.create_range(1, 0, 0)
        rlog.append([_batch(b"x" * 100)])
        seg = rlog.segments[0]
        seg.delete()
        seg.write_index()  # a flush that found it full just before the delete
        assert not os.path.exists(seg.index_path)
        assert not os.path.exists(seg.path)


def test_fsync_always_acknowledges_after_fsync(tmp_path):
    with Storage(str(tmp_path), StorageConfig(fsync="always")) as s:
        rlog = s.create_range(1, 0, 0)
        _, target = rlog.append([_batch(b"a")])
        s.durability.wait_durable(rlog, target, timeout=10)
        assert rlog.next_offset == 1
        assert s.stats.fsyncs >= 1


def test_fsync_interval_group_commits_concurrent_appends(tmp_path):
    with Storage(str(tmp_path), StorageConfig(fsync="interval", fsync_interval_ms=20)) as s:
        ranges = [s.create_range(i, 0, 0) for i in range(4)]
        done = []

        def writer(rlog):
            for _ in range(10):
                _, target = rlog.append([_batch(b"v" * 100)])
                s.durability.wait_durable(rlog, target, timeout=10)
            done.append(rlog.stream_id)

        threads = [threading.Thread(target=writer, args=(r,)) for r in ranges]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(done) == [0, 1, 2, 3]
        assert all(r.next_offset == 10 for r in ranges)


def test_fsync_interval_starts_rounds_at_most_one_interval_apart(tmp_path):
    # Rounds are spaced from the start of the previous one: with an fsync taking 40 ms and a
    # 50 ms interval, a steady writer gets a round about every 50 ms (not every 90 ms, as when
    # the interval was counted from the end of the previous fsync), and never more than one.
    interval_s, fsync_s = 0.05, 0.04
    with Storage(str(tmp_path), StorageConfig(fsync="interval", fsync_interval_ms=50)) as s:
        rlog = s.create_range(1, 0, 0)
        real_sync = rlog.sync

        def slow_sync():
            time.sleep(fsync_s)
            real_sync()

        rlog.sync = slow_sync
        _, target = rlog.append([_batch(b"first")])
        s.durability.wait_durable(rlog, target, timeout=10)
        rounds_before = s.stats.fsyncs
        stop = threading.Event()

        def writer():
            while not stop.is_set():
                rlog.append([_batch(b"w" * 1000)])
                time.sleep(0.002)

        t = threading.Thread(target=writer)
        start = time.monotonic()
        t.start()
        time.sleep(1.0)
        stop.set()
        t.join(10)
        elapsed = time.monotonic() - start
        rounds = s.stats.fsyncs - rounds_before
        assert elapsed / (interval_s + fsync_s) + 3 < rounds <= elapsed / interval_s + 1


def test_fsync_never_makes_appends_visible_at_once(tmp_path):
    with Storage(str(tmp_path), StorageConfig(fsync=FsyncPolicy.NEVER)) as s:
        rlog = s.create_range(1, 0, 0)
        rlog.append([_batch(b"a")])
        assert rlog.next_offset == 1
        assert s.stats.fsyncs == 0


def test_unknown_fsync_policy_is_rejected():
    with pytest.raises(ValueError, match="sometimes"):
        StorageConfig(fsync="sometimes")


def test_retention_deletes_old_segments_and_moves_the_start(tmp_path):
    cfg = StorageConfig(fsync="never", segment_bytes=4096)
    now = 1_800_000_000_000
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.create_range(1, 0, 0)
        for i in range(4):  # old data, one segment each
            rlog.append([_batch(b"o" * 3000)], now_ms=now - 100_000 + i)
        for _ in range(2):
            rlog.append([_batch(b"n" * 3000)], now_ms=now)
        assert len(_segment_files(rlog)) == 6
        assert rlog.expire(retention_ms=10_000, now_ms=now) == 4
        assert rlog.start_offset == 4
        assert len(_segment_files(rlog)) == 2
        with pytest.raises(OffsetOutOfRangeError, match="fetch from 4"):
            rlog.read(0, 100)
        assert rlog.expire(retention_ms=10_000, now_ms=now) is None
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.get_range(1, 0)
        assert (rlog.start_offset, rlog.next_offset) == (4, 6)


def test_retention_may_empty_an_open_range_without_losing_its_next_offset(tmp_path):
    cfg = StorageConfig(fsync="never", segment_bytes=4096)
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.create_range(1, 0, 10)
        rlog.append([_batch(b"o" * 100)] * 3, now_ms=1000)
        assert rlog.expire(retention_ms=1, now_ms=10_000) == 13
        assert rlog.start_offset == rlog.next_offset == 13
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.get_range(1, 0)
        assert (rlog.start_offset, rlog.next_offset) == (13, 13)
        assert rlog.append([_batch(b"new")])[0] == [13]


def test_trim_deletes_whole_segments_below_the_offset(tmp_path):
    cfg = StorageConfig(fsync="never", segment_bytes=4096)
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.create_range(1, 0, 0)
        for _ in range(5):
            rlog.append([_batch(b"t" * 3000)])
        assert rlog.trim(3) == 3
        assert len(_segment_files(rlog)) == 2  # segments of offsets 3 and 4 stay
        with pytest.raises(OffsetOutOfRangeError):
            rlog.read(2, 100)
        assert rlog.trim(1) == 3  # never moves backwards
        assert rlog.trim(99) == 5  # never past next_offset
    with Storage(str(tmp_path), cfg) as s:
        assert s.get_range(1, 0).start_offset == 5


def test_seal_stops_appends_and_survives_restart(tmp_path):
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.create_range(1, 0, 0)
        rlog.append([_batch(b"a"), _batch(b"b")])
        assert rlog.seal() == 2
        assert rlog.next_offset == 2  # sealing syncs what was written
        with pytest.raises(RangeSealedError):
            rlog.append([_batch(b"c")])
    with Storage(str(tmp_path), _MANUAL) as s:
        rlog = s.get_range(1, 0)
        assert rlog.sealed and rlog.end_offset == 2
        with pytest.raises(RangeSealedError):
            rlog.append([_batch(b"c")])


class HeldWrites(Disk):
    """Segment writes that stop after their bytes are in, until ``release`` is set;
    ``entered`` is set once one has written."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def write(self, fd: int, buffers, offset: int) -> int:
        written = super().write(fd, buffers, offset)
        self.entered.set()
        assert self.release.wait(10)
        return written


@pytest.fixture
def held_write():
    disk = HeldWrites()
    yield disk
    disk.release.set()


def test_reads_and_fsyncs_go_on_while_an_append_writes(tmp_path, held_write):
    """An append holds only the range's append lock while its bytes go in: a reader and the
    flush need not wait for it, and they see none of it before it ends."""
    entered, release = held_write.entered, held_write.release
    with Storage(str(tmp_path), _MANUAL, held_write) as s:
        rlog = s.create_range(1, 0, 0)
        release.set()
        rlog.append([_batch(b"first")])
        rlog.sync()
        release.clear()
        entered.clear()
        writer = threading.Thread(target=rlog.append, args=([_batch(b"second")],))
        writer.start()
        assert entered.wait(10)
        done = threading.Event()

        def read_and_sync():
            assert [b[ENVELOPE_SIZE:] for b in _read_all(rlog)] == [b"first"]
            rlog.sync()
            assert rlog.next_offset == 1  # the write under way is not committed by it
            done.set()

        threading.Thread(target=read_and_sync).start()
        assert done.wait(10), "a read or fsync waited for an append to finish writing"
        release.set()
        writer.join(10)
        rlog.sync()
        assert [b[ENVELOPE_SIZE:] for b in _read_all(rlog)] == [b"first", b"second"]


def test_a_seal_waits_for_the_append_being_written_and_ends_after_it(tmp_path, held_write):
    """A seal never falls in the middle of an append: the one being written is in the
    range (and acknowledged once durable); the next is refused."""
    entered, release = held_write.entered, held_write.release
    with Storage(str(tmp_path), _MANUAL, held_write) as s:
        rlog = s.create_range(1, 0, 0)
        writer = threading.Thread(target=rlog.append, args=([_batch(b"a"), _batch(b"b")],))
        writer.start()
        assert entered.wait(10)
        sealed: list[int] = []
        sealer = threading.Thread(target=lambda: sealed.append(rlog.seal()))
        sealer.start()
        sealer.join(0.3)
        assert sealer.is_alive() and not sealed  # held off by the write under way
        release.set()
        writer.join(10)
        sealer.join(10)
        assert sealed == [2] and rlog.next_offset == 2
        with pytest.raises(RangeSealedError):
            rlog.append([_batch(b"c")])


def test_deleted_stream_rejects_writes(store):
    rlog = store.create_range(5, 0, 0)
    assert store.delete_stream(5)
    with pytest.raises(StreamNotFoundError):
        rlog.append([_batch(b"a")])
    assert not store.delete_stream(6)


class FillingDisk(Disk):
    """Once ``full`` is set, a write puts part of its first buffer in, as a filling disk
    does, then fails with ENOSPC."""

    full = False

    def write(self, fd: int, buffers, offset: int) -> int:
        if not self.full:
            return super().write(fd, buffers, offset)
        super().write(fd, [memoryview(buffers[0])[:10]], offset)
        raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_stores_nothing_and_reports_storage_full(tmp_path):
    disk = FillingDisk()
    with Storage(str(tmp_path), StorageConfig(fsync="never"), disk) as s:
        rlog = s.create_range(1, 0, 0)
        rlog.append([_batch(b"ok")])
        [path] = _segment_files(rlog)
        size = os.path.getsize(path)
        disk.full = True
        with pytest.raises(StorageFullError, match="disk full"):
            rlog.append([_batch(b"too much")])
        disk.full = False
        assert os.path.getsize(path) == size
        assert rlog.next_offset == 1
        assert rlog.append([_batch(b"after")])[0] == [1]
        assert [b[ENVELOPE_SIZE:] for b in _read_all(rlog)] == [b"ok", b"after"]


class ShortWrites(Disk):
    """Records the size of every write call (``calls``); every other one writes only part of
    what it was given."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def write(self, fd: int, buffers, offset: int) -> int:
        self.calls.append(sum(memoryview(b).nbytes for b in buffers))
        if len(self.calls) % 2:
            first = memoryview(buffers[0])
            return super().write(fd, [first[:max(1, first.nbytes // 3)]], offset)
        return super().write(fd, buffers, offset)


def test_large_batches_are_written_in_bounded_calls_and_survive_short_writes(tmp_path):
    """A batch larger than ``WRITE_CALL_BYTES`` goes to the file in calls of at most that
    size (one large call is slow on some kernels), and a call the kernel cuts short is
    carried on from where it stopped: the batches read back byte for byte."""
    disk = ShortWrites()
    calls = disk.calls
    bodies = [os.urandom(5 * 1024 * 1024 + 17), b"small", os.urandom(3 * 1024 * 1024)]
    with Storage(str(tmp_path), StorageConfig(fsync="never"), disk) as s:
        rlog = s.create_range(1, 0, 0)
        rlog.append([_batch(b) for b in bodies])
        assert calls and max(calls) <= segment_mod.WRITE_CALL_BYTES
        assert [b[ENVELOPE_SIZE:] for b in _read_all(rlog)] == bodies
    with Storage(str(tmp_path), StorageConfig(fsync="never")) as s:
        assert [b[ENVELOPE_SIZE:] for b in _read_all(s.get_range(1, 0))] == bodies


def test_create_range_validates_and_is_idempotent(store):
    a = store.create_range(1, 0, 5)
    assert store.create_range(1, 0, 5) is a
    with pytest.raises(Exception, match="already exists"):
        store.create_range(1, 0, 6)
    with pytest.raises(Exception, match=">= 0"):
        store.create_range(-1, 0, 0)
    b = store.create_range(1, 1, 9, end_offset=12)
    assert b.sealed and b.end_offset == 12
    assert store.find_range(1, 7) is a and store.find_range(1, 10) is b
    assert store.find_range(1, 2) is None


def test_wait_for_is_woken_by_a_commit(tmp_path):
    with Storage(str(tmp_path), StorageConfig(fsync="never")) as s:
        rlog = s.create_range(1, 0, 0)
        t = threading.Timer(0.05, lambda: rlog.append([_batch(b"a")]))
        t.start()
        started = time.monotonic()
        assert s.wait_for(lambda: rlog.next_offset > 0, timeout=10)
        assert time.monotonic() - started < 5
        t.join()


def test_reads_check_each_stored_byte_once_per_process(tmp_path):
    cfg = StorageConfig(fsync="never", segment_bytes=4096)
    with Storage(str(tmp_path), cfg) as s:
        rlog = s.create_range(1, 0, 0)
        for _ in range(3):
            rlog.append([_batch(b"q" * 1500)])
    with Storage(str(tmp_path), cfg) as s:  # full segments come back unchecked (index only)
        rlog = s.get_range(1, 0)
        with rlog.read(0, 1 << 20) as chunk:
            assert not chunk.verified
            crc = chunk.checked_crc()
            assert chunk.verified
            path, at = _segment_files(rlog)[0], chunk.batches[0].position
        with open(path, "r+b") as f:  # damage after the check: only a full verify sees it
            f.seek(at + 40)
            f.write(b"!")
        with rlog.read(0, 1 << 20) as chunk:
            assert chunk.checked_crc() == crc
            with pytest.raises(CorruptDataError):
                verify_batches(chunk.batches)
