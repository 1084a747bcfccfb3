"""How a range server's storage writes and syncs (``StorageConfig``), and its defaults."""

from __future__ import annotations

from dataclasses import dataclass

from .durability import DEFAULT_FSYNC_INTERVAL_MS, FsyncPolicy
from .pagecache import DEFAULT_PAGE_CACHE_BYTES

# A segment rolls over once it reaches this size: big enough that per-file costs (open fds,
# index files, directory entries) stay small, small enough that retention and trims, which
# delete whole segments, free space in reasonable steps.
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
# One sparse-index entry per this many bytes: a lookup then scans at most this many bytes of
# stored-batch headers (a handful of 32-byte reads for large batches).
DEFAULT_INDEX_INTERVAL_BYTES = 64 * 1024


@dataclass
class StorageConfig:
    """How a range server's storage (``store.Storage``) writes and syncs."""

    fsync: FsyncPolicy | str = FsyncPolicy.GROUP
    fsync_interval_ms: int = DEFAULT_FSYNC_INTERVAL_MS
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES
    # Check stored bytes against their CRCs before a fetch sends them, once per process (bytes
    # this process wrote or scanned count as checked): corruption on disk becomes a clean error
    # instead of a frame whose checksum fails at the client.
    verify_reads: bool = True
    # Most recently written bytes left in the OS page cache; older written data is dropped
    # from it once durable, so its pages are reused (see pagecache.py). 0: no bound; no
    # effect under FsyncPolicy.NEVER.
    page_cache_bytes: int = DEFAULT_PAGE_CACHE_BYTES

    @property
    def policy(self) -> FsyncPolicy:
        """``fsync`` as the policy (a name given at construction is one by then)."""
        return FsyncPolicy(self.fsync)

    def __post_init__(self) -> None:
        try:
            self.fsync = FsyncPolicy(self.fsync)
        except ValueError:
            allowed = ", ".join(p.value for p in FsyncPolicy)
            raise ValueError(f"fsync policy {self.fsync!r} is not one of {allowed}") from None
        if self.fsync_interval_ms <= 0:
            raise ValueError(f"fsync_interval_ms={self.fsync_interval_ms} must be > 0")
        if self.segment_bytes < 4096:
            raise ValueError(f"segment_bytes={self.segment_bytes} must be at least 4096")
        if self.index_interval_bytes <= 0:
            raise ValueError(f"index_interval_bytes={self.index_interval_bytes} must be > 0")
        if self.page_cache_bytes < 0:
            raise ValueError(f"page_cache_bytes={self.page_cache_bytes} must be >= 0 (0: no "
                             f"bound)")
