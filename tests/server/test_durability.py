"""Group commit (server/durability.py): when flushes start under each fsync policy, and that an
append is acknowledged only once the fsync covering it returned.

Nothing here checks a speed: a flush that must start "at once" is checked against an interval
of an hour, and what must not happen is watched over a short window (tests/polling.py).
"""

from __future__ import annotations

import threading

import pytest

from sbp_spark.protocol.records import batch_bytes, parse_header
from sbp_spark.server.storage import FsyncPolicy, StorageConfig
from sbp_spark.server.storage.disk import Disk
from sbp_spark.server.storage.store import Storage
from tests.polling import stays_true, wait_until
from tests.server.disks import HeldSyncs

HOUR_MS = 3_600_000


def _batch(body: bytes) -> list:
    data = memoryview(batch_bytes(body))
    return [(parse_header(data), data)]


def _storage(tmp_path, policy: str, interval_ms: int = HOUR_MS, disk: Disk | None = None
             ) -> Storage:
    return Storage(str(tmp_path), StorageConfig(fsync=policy, fsync_interval_ms=interval_ms),
                   disk)


def test_group_is_the_default_policy():
    assert StorageConfig().fsync is FsyncPolicy.GROUP


@pytest.mark.parametrize("policy", ["group", "always"])
def test_a_lone_write_is_flushed_at_once_not_after_the_interval(tmp_path, policy):
    # An interval of an hour: only a flush that starts as soon as the write is stored makes
    # it durable within the test's timeout.
    with _storage(tmp_path, policy) as s:
        rlog = s.create_range(1, 0, 0)
        for i in range(5):
            _, target = rlog.append(_batch(b"w%d" % i))
            s.durability.wait_durable(rlog, target, timeout=10)
            assert rlog.next_offset == i + 1
        assert s.durability.flushes == 5


def test_interval_waits_for_its_tick(tmp_path):
    with _storage(tmp_path, "interval") as s:
        rlog = s.create_range(1, 0, 0)
        _, target = rlog.append(_batch(b"first"))  # the first flush: at once
        s.durability.wait_durable(rlog, target, timeout=10)
        _, target = rlog.append(_batch(b"second"))  # the next: an hour after the first
        stays_true(lambda: rlog.next_offset == 1, "the second write waiting for the tick", 0.3)


def test_group_gathers_a_burst_and_flushes_when_it_is_stored(tmp_path):
    with _storage(tmp_path, "group") as s:
        rlog = s.create_range(1, 0, 0)
        durable = threading.Event()
        with s.durability.storing():  # an append of a burst is being stored
            _, target = rlog.append(_batch(b"a"))
            s.durability.when_durable(rlog, target, lambda exc: durable.set())
            stays_true(lambda: not durable.is_set(), "the flush waiting for the burst", 0.3)
            rlog.append(_batch(b"b"))  # stored before the flush: shares it
        assert durable.wait(10)
        wait_until(lambda: rlog.next_offset == 2, "the burst to be durable")
        assert s.durability.flushes == 1


def test_group_waits_for_a_burst_at_most_the_interval(tmp_path):
    with _storage(tmp_path, "group", interval_ms=50) as s:
        rlog = s.create_range(1, 0, 0)
        with s.durability.storing():  # other appends keep being stored: never a quiet moment
            with s.durability.storing():
                _, target = rlog.append(_batch(b"a"))
            s.durability.wait_durable(rlog, target, timeout=10)


@pytest.mark.parametrize("policy", ["group", "always", "interval"])
def test_an_append_is_acknowledged_only_after_its_fsync_returned(tmp_path, policy):
    """The fsync of the segment is held: the append stays unacknowledged (and unreadable)
    until it returns, under every policy that fsyncs."""
    disk = HeldSyncs(timeout_s=10)
    entered, release = disk.entered, disk.release
    with _storage(tmp_path, policy, interval_ms=5, disk=disk) as s:
        rlog = s.create_range(1, 0, 0)
        acked = threading.Event()
        _, target = rlog.append(_batch(b"x"))
        s.durability.when_durable(rlog, target, lambda exc: exc is None and acked.set())
        assert entered.wait(10)
        stays_true(lambda: not acked.is_set() and rlog.next_offset == 0,
                   "the acknowledgement waiting for the fsync", 0.2)
        release.set()
        assert acked.wait(10)
        assert rlog.next_offset == 1


class SlowSyncs(Disk):
    """Every datasync takes 0.2 s more."""

    def datasync(self, fd: int) -> None:
        threading.Event().wait(0.2)
        super().datasync(fd)


def test_group_waits_for_the_writers_its_last_flush_answered(tmp_path):
    # Flushes take 0.2 s here: two writers answered by one flush come back one after the
    # other, and the next flush waits for the second (at most as long as a flush takes)
    # instead of covering the first alone.
    with _storage(tmp_path, "group", disk=SlowSyncs()) as s:
        ranges = [s.create_range(i, 0, 0) for i in (1, 2)]

        def append(rlog, body: bytes) -> threading.Event:
            with s.durability.storing():
                _, target = rlog.append(_batch(body))
            event = threading.Event()
            s.durability.when_durable(rlog, target, lambda exc: event.set())
            return event

        with s.durability.storing():  # one burst: one flush answers both writers
            first = [append(rlog, b"first") for rlog in ranges]
        assert all(e.wait(10) for e in first)
        before = s.durability.flushes
        second = [append(rlog, b"second") for rlog in ranges]  # back one after the other
        assert all(e.wait(10) for e in second)
        assert s.durability.flushes == before + 1


def test_group_flushes_at_once_once_enough_is_dirty_even_mid_burst(tmp_path, monkeypatch):
    """A burst still being stored holds the flush back, but not past GROUP_FLUSH_BYTES: the
    acknowledgements of large appends do not wait for the burst (or the interval) to end."""
    from sbp_spark.server.storage import durability

    monkeypatch.setattr(durability, "GROUP_FLUSH_BYTES", 64 * 1024)
    with _storage(tmp_path, "group") as s:  # an interval of an hour
        rlog = s.create_range(1, 0, 0)
        durable = threading.Event()
        with s.durability.storing():  # the burst goes on for the whole test
            _, small = rlog.append(_batch(b"small"))
            s.durability.when_durable(rlog, small, lambda exc: durable.set())
            stays_true(lambda: not durable.is_set(), "a small append waiting for the burst",
                       0.3)
            with s.durability.storing():
                _, target = rlog.append(_batch(bytes(64 * 1024)))
            s.durability.wait_durable(rlog, target, timeout=10)
            assert durable.is_set() and rlog.next_offset == 2


class WritebackCalls(Disk):
    """Records each write-behind hand-over as (offset, length), and hands nothing over."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def start_writeback(self, fd: int, offset: int, length: int) -> bool:
        self.calls.append((offset, length))
        return True


def test_large_appends_start_their_writeback_and_small_ones_wait_for_more(tmp_path):
    """Write-behind (writeback.py): once a segment holds WRITE_BEHIND_BYTES not yet handed to
    the disk, the append that crossed it hands them over, from where the last hand-over
    ended; under ``never`` nothing is handed over (no fsync will follow)."""
    from sbp_spark.server.storage import writeback

    disk = WritebackCalls()
    calls = disk.calls
    threshold = writeback.WRITE_BEHIND_BYTES
    with _storage(tmp_path, "group", disk=disk) as s:
        rlog = s.create_range(1, 0, 0)
        rlog.append(_batch(b"small"))
        assert calls == []
        rlog.append(_batch(bytes(threshold)))
        seg = rlog.segments[-1]
        assert calls == [(0, seg.size)]
        rlog.append(_batch(b"small again"))
        assert len(calls) == 1
        rlog.append(_batch(bytes(threshold)))
        assert calls[1] == (calls[0][1], seg.size - calls[0][1])
    calls.clear()
    with Storage(str(tmp_path / "never"), StorageConfig(fsync="never"), disk) as s:
        s.create_range(1, 0, 0).append(_batch(bytes(threshold)))
    assert calls == []


def test_start_writeback_on_a_real_file(tmp_path):
    import os

    from sbp_spark.server.storage import writeback

    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, bytes(1 << 20))
        assert writeback.start_writeback(fd, 0, 1 << 20) is writeback.available()
        assert writeback.start_writeback(fd, 0, 0) is False  # nothing to hand over
    finally:
        os.close(fd)
    # A closed descriptor: the advice fails quietly (the next fsync is what counts).
    assert writeback.start_writeback(fd, 0, 1 << 20) is False
    assert path.read_bytes() == bytes(1 << 20)
