"""A range server's storage: the local ranges' logs on disk and when they become durable.

One concern per module, each importing only those below it:

* ``store.py``: ``Storage``, the local ranges of one data directory (create, find, recover),
  their group commit and the signal long polls wait on;
* ``range_log.py``: ``RangeLog``, one range's segments, offsets, metadata, reads, seals, trims
  and recovery; ``read_cap.py``: how far its readers may see;
* ``segment.py``: one segment file; ``writeback.py``: write-behind advice to the kernel;
* ``durability.py``: the fsync policies and the flush thread; ``pagecache.py``: the bound on
  written data left in the OS page cache;
* ``config.py``: ``StorageConfig``.

The settings a launcher needs are named here; they load none of the storage itself (the CLI
reads their defaults at start).
"""

from __future__ import annotations

from .config import StorageConfig
from .durability import DEFAULT_FSYNC_INTERVAL_MS, POLICY_HELP, FsyncPolicy
from .pagecache import DEFAULT_PAGE_CACHE_BYTES

__all__ = ["DEFAULT_FSYNC_INTERVAL_MS", "DEFAULT_PAGE_CACHE_BYTES", "POLICY_HELP", "FsyncPolicy",
           "StorageConfig"]
