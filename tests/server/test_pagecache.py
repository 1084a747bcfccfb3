"""The page-cache budget: old written data leaves the cache once durable; nothing is lost."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest

from sbp_spark.protocol.records import batch_bytes, parse_header
from sbp_spark.server.storage import FsyncPolicy, StorageConfig
from sbp_spark.server.storage.disk import Disk
from sbp_spark.server.storage.pagecache import PageCacheBudget
from sbp_spark.server.storage.store import Storage
from tests.polling import wait_until

MIB = 1 << 20
needs_mincore = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"),
    reason="page-cache residency is checked with Linux mincore and posix_fadvise")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _cached(fd: int, start: int, end: int) -> int:
    """How many pages of ``[start, end)`` of the file are in the page cache (mincore of a
    mapping: nothing is read, nothing faulted in)."""
    page = mmap.PAGESIZE
    length = end - start
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
        if _libc.mincore(addr, length, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vec)
    finally:
        _libc.munmap(addr, length)


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


class DropCalls(Disk):
    """Records every drop from the page cache as (fd, start, end), still passed on."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def drop_cached(self, fd: int, offset: int, length: int) -> None:
        self.calls.append((fd, offset, offset + length))
        super().drop_cached(fd, offset, length)


def test_oldest_durable_extents_are_dropped_down_to_the_budget(files):
    disk = DropCalls()
    advised = disk.calls
    budget = PageCacheBudget(2 * MIB, disk)
    a, b = files(2 * MIB), files(2 * MIB)
    budget.wrote(a, 0, MIB)
    budget.wrote(a, MIB, 2 * MIB)  # continues the previous extent
    budget.wrote(b, 0, 2 * MIB)
    assert budget.held == 4 * MIB
    a.sync()
    b.sync()
    assert budget.trim() == 2 * MIB
    assert budget.held == 2 * MIB
    assert advised == [(a.fd, 0, 2 * MIB)]  # the oldest file, in one call
    assert budget.trim() == 0 and len(advised) == 1  # within budget now


def test_data_not_yet_durable_stays_cached(files):
    disk = DropCalls()
    advised = disk.calls
    budget = PageCacheBudget(2 * MIB, disk)
    a = files(6 * MIB)
    budget.wrote(a, 0, 6 * MIB)
    assert budget.trim() == 0 and advised == []  # nothing on disk: the kernel keeps dirty pages
    a.synced_size = 3 * MIB
    assert budget.trim() == 3 * MIB
    assert budget.held == 3 * MIB
    a.synced_size = 6 * MIB
    assert budget.trim() == MIB
    # Each drop starts at the 2 MiB folio boundary below it, so the folio the first drop cut
    # through (2-4 MiB) goes with the second.
    assert advised == [(a.fd, 0, 3 * MIB), (a.fd, 2 * MIB, 4 * MIB)]


@needs_mincore
def test_dropped_pages_really_leave_the_cache(files):
    budget = PageCacheBudget(2 * MIB)
    a = files(8 * MIB)
    a.sync()
    budget.wrote(a, 0, 8 * MIB)
    assert budget.trim() == 6 * MIB
    pages = MIB // mmap.PAGESIZE
    assert _cached(a.fd, 0, 6 * MIB) == 0
    assert _cached(a.fd, 6 * MIB, 8 * MIB) == 2 * pages


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


@needs_mincore
@pytest.mark.parametrize("fsync", [FsyncPolicy.INTERVAL, FsyncPolicy.ALWAYS])
def test_storage_keeps_only_the_newest_bytes_cached_and_reads_everything_back(tmp_path, fsync):
    config = StorageConfig(fsync=fsync, fsync_interval_ms=5, page_cache_bytes=2 * MIB)
    bodies = [os.urandom(256 * 1024) for _ in range(32)]  # 8 MiB
    with Storage(str(tmp_path), config) as store:
        rlog = store.create_range(1, 0, 0)
        for body in bodies:
            data = memoryview(batch_bytes(body))
            _, target = rlog.append([(parse_header(data), data)])
        store.durability.wait_durable(rlog, target, timeout=30)
        # The fsync thread trims right after it answers: wait for it to have done so.
        wait_until(lambda: store.page_cache.trim() >= 0
                   and store.page_cache.dropped_bytes >= 6 * MIB, "the fsync thread's trim")
        assert store.page_cache.held <= 2 * MIB
        assert store.page_cache.dropped_bytes >= 6 * MIB
        [seg] = rlog.segments
        # The oldest data left the cache (whole 2 MiB folios: at least the first 4 MiB).
        assert _cached(seg.fd, 0, 4 * MIB) == 0
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
