"""A bound on how much freshly written segment data a range server leaves in the page cache.

Appended bytes go through the OS page cache. Left alone, a busy server fills the machine's free
memory with log pages that nobody will read again soon, and every append then needs a *new*
page. On virtual machines that hand free memory back to their host, the first touch of a new
page costs a host fault: measured here at 2-2.6 CPU-seconds of kernel time per GiB written,
against about 0.35 when the server reuses pages it dropped itself (the client section of
``sbp bench`` shows it).

``PageCacheBudget`` remembers the extents written, oldest first, and once they add up to more
than the budget it drops the oldest *durable* ones from the cache (``POSIX_FADV_DONTNEED``).
The most recent ``budget`` bytes stay cached for tailing and just-behind readers; older data is
read from disk, as it would be after any eviction. Dropped pages return to the kernel's free
lists, and the next appends reuse them.

Only durable bytes can be dropped (the kernel keeps dirty pages whatever it is told), so the
budget applies to every fsync policy but ``never``; under ``never`` the kernel
alone decides.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Protocol

from .disk import Disk

log = logging.getLogger(__name__)

# Default budget: the most recent data a tailing or catching-up reader is likely to want.
DEFAULT_PAGE_CACHE_BYTES = 1024 * 1024 * 1024
# The kernel caches files in folios of up to 2 MiB and drops only folios wholly inside the
# advised range: each drop starts this far back, so the folio a previous drop cut through goes
# too.
_FOLIO_BYTES = 2 * 1024 * 1024
_HAVE_FADVISE = hasattr(os, "posix_fadvise")


class CachedFile(Protocol):
    """What the budget needs of a segment."""

    fd: int
    synced_size: int

    def retain(self) -> bool: ...
    def release(self) -> None: ...


class PageCacheBudget:
    """Drops the oldest written extents from the page cache (through ``disk``) once more than
    ``limit`` bytes were written. ``limit`` 0 means no bound (the kernel alone decides)."""

    def __init__(self, limit: int, disk: Disk | None = None) -> None:
        if limit < 0:
            raise ValueError(f"page cache budget {limit} must be >= 0 (0: no bound)")
        self.limit = limit
        self._disk = disk or Disk()
        self._extents: deque[tuple[CachedFile, int, int]] = deque()
        self._held = 0
        self._lock = threading.Lock()
        self.dropped_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.limit > 0 and _HAVE_FADVISE

    @property
    def held(self) -> int:
        """Bytes written and not yet dropped (what the budget bounds)."""
        return self._held

    def wrote(self, segment: CachedFile, start: int, end: int) -> None:
        """Record that ``[start, end)`` of ``segment`` was just written."""
        if not self.enabled or end <= start:
            return
        with self._lock:
            if self._extents:
                last, last_start, last_end = self._extents[-1]
                if last is segment and last_end == start:
                    self._extents[-1] = (segment, last_start, end)
                    self._held += end - start
                    return
            self._extents.append((segment, start, end))
            self._held += end - start

    def trim(self) -> int:
        """Drop the oldest extents until the budget holds; returns the bytes dropped."""
        if not self.enabled:
            return 0
        victims: list[tuple[CachedFile, int, int]] = []
        with self._lock:
            excess = self._held - self.limit
            while excess > 0 and self._extents:
                segment, start, end = self._extents[0]
                # Only bytes already on disk: the kernel keeps dirty pages whatever we advise.
                stop = min(end, start + excess, segment.synced_size)
                if stop <= start:
                    break  # the oldest extent is not on disk yet: wait for its fsync
                victims.append((segment, start, stop))
                if stop == end:
                    self._extents.popleft()
                else:
                    self._extents[0] = (segment, stop, end)
                self._held -= stop - start
                excess -= stop - start
        dropped = 0
        for segment, start, stop in victims:
            if not segment.retain():
                continue  # deleted meanwhile: its pages went with it
            try:
                first = start - start % _FOLIO_BYTES
                self._disk.drop_cached(segment.fd, first, stop - first)
                dropped += stop - start
            except OSError as exc:  # advice only: never fail a write over it
                log.debug("dropping cached pages of %r failed: %s", segment, exc)
            finally:
                segment.release()
        with self._lock:
            self.dropped_bytes += dropped
        return dropped
