"""The calls the storage's write path makes to the disk, in one object: ``Disk``.

Appends write segment bytes, flushes sync them (and the directory entries of new segments),
write-behind hands fresh bytes to the disk early (``writeback.py``) and the page-cache bound
drops old ones from the cache (``pagecache.py``). They all go through the ``Disk`` of their
storage, which is where a test puts a disk that is slow, full or failing: a subclass
overriding the call it means.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .writeback import start_writeback

# fdatasync where the platform has it (Linux): a file's data and size, not its times.
_datasync = getattr(os, "fdatasync", os.fsync)


def fsync_dir(path: str) -> None:
    """Make file creations, renames and deletions in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Disk:
    """The write path's disk: each call does what the system call it is named after does."""

    def write(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Write ``buffers`` back to back at ``offset`` of ``fd`` in one call (``pwritev``);
        the number of bytes written, which may be fewer."""
        return os.pwritev(fd, buffers, offset)

    def datasync(self, fd: int) -> None:
        """Make what was written to ``fd`` durable: its data and its size."""
        _datasync(fd)

    def sync_dir(self, path: str) -> None:
        """Make file creations and deletions in the directory ``path`` durable."""
        fsync_dir(path)

    def start_writeback(self, fd: int, offset: int, length: int) -> bool:
        """Have the disk start writing ``[offset, offset + length)`` of ``fd`` without waiting
        (advice, see writeback.py); False when the system cannot."""
        return start_writeback(fd, offset, length)

    def drop_cached(self, fd: int, offset: int, length: int) -> None:
        """Advise the kernel to drop ``[offset, offset + length)`` of ``fd`` from the page
        cache (only pages already on disk go)."""
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
