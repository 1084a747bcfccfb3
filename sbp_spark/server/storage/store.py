"""The range logs of a range server: where they live and how they are found.

Layout under ``data_dir``::

    ranges/<stream_id>-<range_index>/    one range's log (see range_log.py)

``Storage`` is the registry of the local ranges (create, find, recover them all at start),
owns their group commit (``durability.py``: when appends become durable under the
``FsyncPolicy``), the page-cache bound and the signal that wakes long polls when readable
data changes. Its range logs see it only as a ``LogEnv``: their settings and where they report.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from ...protocol.errors import DataCorruptError, InvalidRequestError
from ...protocol.messages import RangeReplica
from ..conditions import WaitedCondition
from ..latency import LatencyHistogram
from .config import StorageConfig
from .disk import Disk, fsync_dir
from .durability import FsyncPolicy, GroupCommit
from .pagecache import PageCacheBudget
from .range_log import META_FILE, LogEnv, RangeLog
from .segment import SEGMENT_SUFFIX

log = logging.getLogger(__name__)

_RANGES_DIR = "ranges"


class StorageStats:
    """Byte counters for metrics (approximate under concurrency)."""

    def __init__(self) -> None:
        self.bytes_written = 0
        self.bytes_read = 0
        self.fsyncs = 0
        self.fsync_seconds = LatencyHistogram()  # how long each range's fsync took


def _stored_segments(directory: str) -> list[str]:
    """The segment files in ``directory`` that hold bytes (none if it does not exist)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(SEGMENT_SUFFIX))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        size = os.path.getsize(os.path.join(directory, name))
        if size:
            out.append(f"{name}: {size} bytes")
    return out


class Storage:
    """All range logs of one range server (by stream and range index), their group commit
    (``durability``), and the data-change signal long polls wait on."""

    def __init__(self, data_dir: str, config: StorageConfig | None = None,
                 disk: Disk | None = None) -> None:
        self.data_dir = os.path.abspath(data_dir)
        disk = disk or Disk()
        self.config = config or StorageConfig()
        self.stats = StorageStats()
        self._ranges: dict[tuple[int, int], RangeLog] = {}
        self._by_stream: dict[int, list[RangeLog]] = {}
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()
        self._data_version = 0
        # Woken whenever readable data, seals or deletions change: long-poll fetches wait on it.
        self.data_changed = WaitedCondition()
        self._closed = False
        # Only durable data can leave the page cache: no bound when nothing is fsynced.
        self.page_cache = PageCacheBudget(
            0 if self.config.fsync is FsyncPolicy.NEVER else self.config.page_cache_bytes, disk)
        os.makedirs(os.path.join(self.data_dir, _RANGES_DIR), exist_ok=True)
        self.durability: GroupCommit[RangeLog] = GroupCommit(
            self.config.policy, self.config.fsync_interval_ms, on_synced=self._count_fsync,
            after_round=self._after_flush)
        self._env = LogEnv(
            segment_bytes=self.config.segment_bytes,
            index_interval_bytes=self.config.index_interval_bytes,
            flushed=self.config.policy is not FsyncPolicy.NEVER, counts=self.stats,
            extents=self.page_cache, mark_dirty=self.durability.mark_dirty,
            data_changed=self.notify_data, disk=disk)
        try:
            self._recover()
        except BaseException:
            self.durability.close()
            raise

    # -- ranges ----------------------------------------------------------------------------

    def create_range(self, stream_id: int, range_index: int, start_offset: int,
                     end_offset: int = -1, replicas: Sequence[RangeReplica] = ()) -> RangeLog:
        """Create a local range (idempotent when it already exists with the same start)."""
        if stream_id < 0 or range_index < 0 or start_offset < 0:
            raise InvalidRequestError(
                f"range {stream_id}/{range_index} at {start_offset}: ids and offsets must be "
                f">= 0")
        if end_offset >= 0 and end_offset < start_offset:
            raise InvalidRequestError(
                f"range {stream_id}/{range_index}: end_offset {end_offset} is below its start "
                f"{start_offset}")
        key = (stream_id, range_index)
        # Creations are serialised on their own lock: they write and fsync files, and must not
        # hold up the lookups every append and fetch makes (self._lock).
        with self._create_lock:
            existing = self._ranges.get(key)
            if existing is not None:
                if existing.base_start_offset != start_offset:
                    raise InvalidRequestError(
                        f"range {stream_id}/{range_index} already exists starting at "
                        f"{existing.base_start_offset}, not {start_offset}")
                existing.set_replicas(replicas)
                if end_offset >= 0:
                    existing.seal_at(end_offset)
                return existing
            directory = os.path.join(self.data_dir, _RANGES_DIR, f"{stream_id}-{range_index}")
            stored = _stored_segments(directory)
            if stored:
                # Skipped at startup (its range.json unreadable): a new range here would
                # open these files as empty and write over their records.
                log.error("refusing to create range %d/%d: %s holds records (%s) but was not "
                          "recovered (its %s is unreadable); move it aside or repair it",
                          stream_id, range_index, directory, ", ".join(stored), META_FILE)
                raise DataCorruptError(
                    f"range {stream_id}/{range_index} cannot be created on this server: its "
                    f"directory {directory} holds records ({', '.join(stored)}) that were not "
                    f"recovered because its {META_FILE} is unreadable; they are kept, not "
                    f"overwritten, until an operator moves the directory aside or repairs it")
            os.makedirs(directory, exist_ok=True)
            rlog = RangeLog.create(self._env, directory, stream_id, range_index, start_offset,
                                   end_offset, replicas)
            fsync_dir(os.path.dirname(directory))
            with self._lock:
                self._add(rlog)
        return rlog

    def _count_fsync(self, seconds: float) -> None:
        self.stats.fsyncs += 1
        self.stats.fsync_seconds.observe(seconds)

    def _after_flush(self, ranges: list[RangeLog]) -> None:
        """After a flush's answers went out: persist the indexes of the segments it found
        full, then keep the page cache within its budget."""
        for rlog in ranges:
            rlog.write_due_indexes()
        self.page_cache.trim()

    def _add(self, rlog: RangeLog) -> None:
        self._ranges[(rlog.stream_id, rlog.range_index)] = rlog
        lst = self._by_stream.setdefault(rlog.stream_id, [])
        lst.append(rlog)
        lst.sort(key=lambda r: r.range_index)

    def get_range(self, stream_id: int, range_index: int) -> RangeLog | None:
        return self._ranges.get((stream_id, range_index))

    def stream_ranges(self, stream_id: int) -> list[RangeLog]:
        """Local ranges of a stream, by range_index."""
        with self._lock:
            return list(self._by_stream.get(stream_id, ()))

    def ranges(self) -> list[RangeLog]:
        with self._lock:
            return list(self._ranges.values())

    def find_range(self, stream_id: int, offset: int) -> RangeLog | None:
        """The local range of ``stream_id`` holding ``offset`` (or, for the open range,
        where ``offset`` would be written next)."""
        for rlog in reversed(self.stream_ranges(stream_id)):
            if offset >= rlog.base_start_offset:
                return rlog
        return None

    def delete_stream(self, stream_id: int) -> bool:
        """Mark every local range of the stream deleted; False if none is known."""
        ranges = self.stream_ranges(stream_id)
        for rlog in ranges:
            rlog.mark_deleted()
        return bool(ranges)

    # -- long polls ------------------------------------------------------------------------

    def notify_data(self) -> None:
        with self.data_changed:
            self._data_version += 1
            self.data_changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until ``predicate()`` is true; re-checked on every
        data change. Returns the predicate's last value.

        The predicate runs without the condition's lock (it may read files and take range
        locks); a change that lands while it runs is noticed through a version counter.
        """
        deadline = time.monotonic() + timeout
        while True:
            with self.data_changed:
                seen = self._data_version
            if predicate():
                return True
            with self.data_changed:
                while self._data_version == seen:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        break
                    self.data_changed.wait(left)
                else:
                    continue
            return predicate()

    # -- lifecycle -------------------------------------------------------------------------

    def _recover(self) -> None:
        root = os.path.join(self.data_dir, _RANGES_DIR)
        for name in sorted(os.listdir(root)):
            directory = os.path.join(root, name)
            meta_path = os.path.join(directory, META_FILE)
            if not os.path.isdir(directory):
                continue
            try:
                with open(meta_path, "rb") as f:
                    meta = json.loads(f.read())
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("skipping range directory %s: unreadable %s (%s)", directory,
                          META_FILE, exc)
                continue
            self._add(RangeLog.open(self._env, directory, meta))
        if self._ranges:
            log.info("recovered %d ranges from %s", len(self._ranges), self.data_dir)

    def close(self) -> None:
        """Sync what was written, stop the fsync thread and close every file."""
        if self._closed:
            return
        self._closed = True
        self.durability.close()
        self.notify_data()
        for rlog in self.ranges():
            rlog.close()

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def disk_free_bytes(self) -> int:
        st = os.statvfs(self.data_dir)
        return st.f_bavail * st.f_frsize
