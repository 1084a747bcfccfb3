"""The page-cache budget: old written data leaves the cache once durable; nothing is lost."""

from __future__ import annotations

import os
import time

import pytest

from sbp_spark.protocol.records import batch_bytes, parse_header
from sbp_spark.server.pagecache import PageCacheBudget
from sbp_spark.server.storage import FsyncPolicy, Storage, StorageConfig

MIB = 1 << 20
needs_nowait = pytest.mark.skipif(
    not hasattr(os, "RWF_NOWAIT") or not hasattr(os, "posix_fadvise"),
    reason="page-cache residency is checked with preadv(RWF_NOWAIT) and posix_fadvise")


def _cached(fd: int, pos: int) -> bool:
    """Whether the page at ``pos`` is in the page cache (a read that may not wait for I/O)."""
    try:
        os.preadv(fd, [bytearray(4096)], pos, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False


class _File:
    """A segment stand-in: an fd, how much of it is durable, retain/release."""

    def __init__(self, path: str, size: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        os.pwrite(self.fd, os.urandom(size), 0)
        self.synced_size = 0
        self.deleted = False
        self.releases = 0

    def retain(self) -> bool:
        return not self.deleted

    def release(self) -> None:
        self.releases += 1

    def sync(self) -> None:
        os.fsync(self.fd)
        self.synced_size = os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def files(tmp_path):
    made = []

    def make(size: int) -> _File:
        f = _File(str(tmp_path / f"f{len(made)}"), size)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


@needs_nowait
def test_oldest_durable_extents_are_dropped_down_to_the_budget(files):
    budget = PageCacheBudget(2 * MIB)
    a, b = files(2 * MIB), files(2 * MIB)
    budget.wrote(a, 0, MIB)
    budget.wrote(a, MIB, 2 * MIB)  # continues the previous extent
    budget.wrote(b, 0, 2 * MIB)
    assert budget.held == 4 * MIB
    a.sync()
    b.sync()
    assert budget.trim() == 2 * MIB
    assert budget.held == 2 * MIB
    assert not _cached(a.fd, 0) and not _cached(a.fd, MIB)
    assert _cached(b.fd, 0) and _cached(b.fd, MIB)
    assert budget.trim() == 0  # within budget now


@needs_nowait
def test_data_not_yet_durable_stays_cached(files):
    budget = PageCacheBudget(2 * MIB)
    a = files(6 * MIB)
    budget.wrote(a, 0, 6 * MIB)
    assert budget.trim() == 0  # nothing is on disk yet: dropping would only start writeback
    os.fsync(a.fd)
    a.synced_size = 2 * MIB  # the budget knows of the first 2 MiB only
    assert budget.trim() == 2 * MIB
    assert not _cached(a.fd, 0) and _cached(a.fd, 2 * MIB)
    assert budget.held == 4 * MIB
    a.synced_size = 6 * MIB
    assert budget.trim() == 2 * MIB
    assert not _cached(a.fd, 3 * MIB) and _cached(a.fd, 4 * MIB)


def test_deleted_segments_are_skipped_and_forgotten(files):
    budget = PageCacheBudget(MIB)
    a, b = files(MIB), files(MIB)
    budget.wrote(a, 0, MIB)
    budget.wrote(b, 0, MIB)
    a.sync()
    a.deleted = True
    assert budget.trim() == 0  # its pages left with the file; the extent is gone
    assert budget.held == MIB and a.releases == 0


def test_zero_means_no_bound_and_negative_is_refused(files):
    budget = PageCacheBudget(0)
    a = files(MIB)
    budget.wrote(a, 0, MIB)
    a.sync()
    assert budget.held == 0 and budget.trim() == 0
    with pytest.raises(ValueError, match="page cache budget -1"):
        PageCacheBudget(-1)
    with pytest.raises(ValueError, match="page_cache_bytes=-5"):
        StorageConfig(page_cache_bytes=-5)


def test_no_bound_without_fsync(tmp_path):
    with Storage(str(tmp_path), StorageConfig(fsync=FsyncPolicy.NEVER,
                                              page_cache_bytes=MIB)) as store:
        assert not store.page_cache.enabled


@needs_nowait
@pytest.mark.parametrize("fsync", [FsyncPolicy.INTERVAL, FsyncPolicy.ALWAYS])
def test_storage_keeps_only_the_newest_bytes_cached_and_reads_everything_back(tmp_path, fsync):
    config = StorageConfig(fsync=fsync, fsync_interval_ms=5, page_cache_bytes=2 * MIB)
    bodies = [os.urandom(256 * 1024) for _ in range(32)]  # 8 MiB
    with Storage(str(tmp_path), config) as store:
        rlog = store.create_range(1, 0, 0)
        for body in bodies:
            data = memoryview(batch_bytes(body))
            _, target = rlog.append([(parse_header(data), data)])
        store.wait_durable(rlog, target, timeout=30)
        # The fsync thread trims right after it answers: wait for it to have done so.
        deadline = time.monotonic() + 10
        while store.page_cache.dropped_bytes < 6 * MIB and time.monotonic() < deadline:
            store.page_cache.trim()
            time.sleep(0.01)
        assert store.page_cache.held <= 2 * MIB
        assert store.page_cache.dropped_bytes >= 6 * MIB
        [seg] = rlog.segments
        # The oldest data left the cache: every 2 MiB folio wholly dropped, so the first MiB.
        assert not _cached(seg.fd, 0) and not _cached(seg.fd, MIB)
        assert _cached(seg.fd, seg.size - 4096)  # the newest stayed
        # Everything reads back, from disk or cache, byte for byte.
        got = []
        offset = 0
        while True:
            with rlog.read(offset, 1 << 30) as chunk:
                if not chunk.batches:
                    break
                for b in chunk.batches:
                    got.append(os.pread(b.fd, b.length, b.position))
                offset = chunk.next_offset
        assert len(got) == len(bodies)
        for raw, body in zip(got, bodies, strict=True):
            assert raw.endswith(body)
