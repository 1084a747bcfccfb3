"""Durable per-range logs of a range server.

Layout under ``data_dir``::

    ranges/<stream_id>-<range_index>/range.json        metadata (atomic write + rename)
    ranges/<stream_id>-<range_index>/<base>.seg         segment files (see segment.py)
    ranges/<stream_id>-<range_index>/<base>.idx         sparse index of a full segment

Stored bytes are the batches exactly as FETCH serves them (base_offset already written into the
envelope), so a fetch sends them with ``os.sendfile``.

Durability (``FsyncPolicy``):

* ``always``: every append is fsynced before it is acknowledged. Appends arriving while an
  fsync runs share the next one (group commit), so throughput does not collapse.
* ``interval``: fsync every ``fsync_interval_ms``; acknowledgements wait for that fsync.
* ``never``: acknowledged once in the page cache (fast, loses the tail on a machine crash).

Readers only ever see *committed* batches (acknowledged whole): a batch still waiting for its
fsync is invisible to FETCH and DESCRIBE_RANGES, so nothing a client read can vanish in a
crash. On restart every range is recovered by scanning its segments; a torn or corrupt tail is
cut off.
"""

from __future__ import annotations

import bisect
import enum
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..protocol.errors import (
    InvalidRequestError,
    OffsetOutOfRangeError,
    RangeSealedError,
    ReplicationFailedError,
    SbpError,
    StorageFullError,
    StreamNotFoundError,
)
from ..protocol.frame import crc32
from ..protocol.records import ENVELOPE_SIZE, BatchHeader, set_base_offset
from .pagecache import DEFAULT_PAGE_CACHE_BYTES, PageCacheBudget
from .read_cap import CapState, ReadCap
from .segment import (
    SEGMENT_SUFFIX,
    STORAGE_HEADER_SIZE,
    CorruptDataError,
    Segment,
    StoredBatch,
    atomic_write,
    combined_crc,
    crc32_with_prefix,
    fsync_dir,
    pack_storage_header,
    verify_batches,
    verify_once,
)

log = logging.getLogger(__name__)

__all__ = [
    "CorruptDataError",
    "FsyncPolicy",
    "RangeLog",
    "ReadChunk",
    "Replica",
    "Storage",
    "StorageConfig",
    "StoredBatch",
]

# A segment rolls over once it reaches this size: big enough that per-file costs (open fds,
# index files, directory entries) stay small, small enough that retention and trims, which
# delete whole segments, free space in reasonable steps.
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
# One sparse-index entry per this many bytes: a lookup then scans at most this many bytes of
# stored-batch headers (a handful of 32-byte reads for large batches).
DEFAULT_INDEX_INTERVAL_BYTES = 64 * 1024
# Group-commit period of the ``interval`` policy: a small added append latency for
# one fsync per period instead of one per append.
DEFAULT_FSYNC_INTERVAL_MS = 10
# Ranges fsynced at the same time in one group-commit round.
_SYNC_THREADS = 8

_META_FILE = "range.json"
_RANGES_DIR = "ranges"


class FsyncPolicy(str, enum.Enum):
    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


@dataclass
class StorageConfig:
    """How a :class:`Storage` writes and syncs."""

    fsync: FsyncPolicy | str = FsyncPolicy.INTERVAL
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


@dataclass(frozen=True)
class Replica:
    """One server holding a copy of a range."""

    server_id: int
    advertise_addr: str = ""
    is_primary: bool = False


@dataclass
class ReadChunk:
    """Committed batches read for one fetch step. Release it (or use ``with``) when sent."""

    batches: list[StoredBatch]
    nbytes: int
    next_offset: int  # where the following read continues
    _segment: Segment | None = field(default=None, repr=False)

    @property
    def crc(self) -> int:
        """CRC-32 of the batches end to end, from their stored CRCs (reads no data)."""
        return combined_crc(self.batches)

    def verify(self) -> int:
        """Check the bytes on disk against the stored CRCs (an mmap pass, no copy); returns
        the CRC of the batches end to end. Raises ``CorruptDataError``."""
        return verify_batches(self.batches)

    def checked_crc(self) -> int:
        """Like ``verify()``, but skips bytes this process already checked (its own writes,
        recovery scans, earlier reads): the steady state reads no data at all."""
        if self._segment is None:
            return verify_batches(self.batches)
        return verify_once(self._segment, self.batches)

    @property
    def verified(self) -> bool:
        """Whether every byte of the chunk was already checked by this process."""
        if not self.batches or self._segment is None:
            return not self.batches
        last = self.batches[-1]
        return last.position + last.length <= self._segment.verified_size

    def release(self) -> None:
        seg, self._segment = self._segment, None
        if seg is not None:
            seg.release()

    def __enter__(self) -> ReadChunk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


Waiter = Callable[[BaseException | None], None]


class RangeLog:
    """The local log of one range: its segments, offsets and metadata."""

    def __init__(self, storage: Storage, directory: str, meta: dict) -> None:
        self.storage = storage
        self.directory = directory
        self.stream_id: int = meta["stream_id"]
        self.range_index: int = meta["range_index"]
        self.base_start_offset: int = meta["base_start_offset"]
        self._start_offset: int = meta["start_offset"]
        self._end_offset: int = meta["end_offset"]
        self._deleted: bool = meta.get("deleted", False)
        self._replicas: tuple[Replica, ...] = tuple(Replica(**r) for r in meta.get("replicas", ()))
        self.lock = threading.RLock()
        self.segments: list[Segment] = []
        self._written = self._start_offset  # next offset after the last written batch
        self._committed = self._start_offset  # next offset after the last durable batch
        self._failed: str | None = None  # set when an fsync failed: no more writes
        # How far readers may see (read_cap.py): for a replicated range, only what every
        # replica is known to hold, until the PD records the range's end.
        self.cap = self._restored_cap(meta.get("end_final", True))
        # Segments with bytes not yet fsynced: the active one and any just rolled.
        self._unsynced: list[Segment] = []

    def __repr__(self) -> str:
        return (f"<RangeLog {self.stream_id}/{self.range_index} [{self._start_offset}, "
                f"{self._committed}) end={self._end_offset}>")

    # -- metadata --------------------------------------------------------------------------

    @property
    def start_offset(self) -> int:
        """First offset still readable (after trims and retention)."""
        return self._start_offset

    @property
    def next_offset(self) -> int:
        """Offset after the last acknowledged (readable) record."""
        return self._committed

    @property
    def readable_offset(self) -> int:
        """Offset after the last record readers may see: acknowledged (durable here and, while
        the range is capped, stored by every replica), or the end of a sealed range."""
        return self.cap.visible(self._committed, self._end_offset)

    @property
    def read_cap(self) -> int | None:
        """How far readers may see while the range is capped (None: no cap), durability
        aside."""
        return self.cap.cap

    def _restored_cap(self, final: bool) -> ReadCap:
        return ReadCap.restored(len(self._replicas), self._start_offset, self._end_offset,
                                final, self.storage.notify_data)

    @property
    def written_offset(self) -> int:
        """Offset after the last written record, durable or not."""
        return self._written

    @property
    def end_offset(self) -> int:
        """Where the range was sealed; -1 while open."""
        return self._end_offset

    @property
    def sealed(self) -> bool:
        return self._end_offset >= 0

    @property
    def deleted(self) -> bool:
        return self._deleted

    @property
    def replicas(self) -> tuple[Replica, ...]:
        return self._replicas

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def _meta(self, end_final: bool | None = None) -> dict:
        return {
            "stream_id": self.stream_id,
            "range_index": self.range_index,
            "base_start_offset": self.base_start_offset,
            "start_offset": self._start_offset,
            "end_offset": self._end_offset,
            # Whether the end is the one the PD recorded (not only where this replica stopped).
            "end_final": self.cap.state is CapState.FINAL if end_final is None else end_final,
            "deleted": self._deleted,
            "replicas": [r.__dict__ for r in self._replicas],
        }

    def _save_meta(self, end_final: bool | None = None) -> None:
        atomic_write(os.path.join(self.directory, _META_FILE),
                     json.dumps(self._meta(end_final), indent=1).encode())

    def set_replicas(self, replicas: Sequence[Replica]) -> None:
        with self.lock:
            replicas = tuple(replicas)
            if replicas == self._replicas:
                return
            self._replicas = replicas
            self._save_meta()
            self.cap.replicas_changed(len(replicas), self._committed)
        self.storage.notify_data()

    def mark_deleted(self) -> None:
        """Refuse further writes (the stream was deleted); reads of stored data still work."""
        with self.lock:
            if not self._deleted:
                self._deleted = True
                self._save_meta()
        self.storage.notify_data()

    # -- writing ---------------------------------------------------------------------------

    def check_writable(self) -> None:
        if self._deleted:
            raise StreamNotFoundError(f"stream {self.stream_id} was deleted")
        if self._end_offset >= 0:
            raise RangeSealedError(
                f"range {self.stream_id}/{self.range_index} is sealed at {self._end_offset}")
        if self._failed is not None:
            raise StorageFullError(
                f"range {self.stream_id}/{self.range_index} is not writable: {self._failed}")

    def append(self, batches: Sequence[tuple[BatchHeader, memoryview]],
               now_ms: int | None = None, *, replicated: bool = False,
               stored: list | None = None,
               crcs: Sequence[int | None] | None = None) -> tuple[list[int], int]:
        """Store ``batches`` (validated envelopes and their bytes) at the end of the range.

        Returns (base offset of each batch, the commit target): the batches are acknowledged
        once ``next_offset`` reaches the target (see ``Storage.when_durable``). Either every
        batch is stored or none is.

        ``replicated``: the batches come from the range's primary and already carry their
        base offsets, which must continue this log exactly (else ``ReplicationFailedError``).
        ``stored``: if given, receives each batch as stored, as [envelope, body] buffers (what
        a primary forwards to its secondaries).
        ``crcs``: if given, the CRC-32 of each batch's bytes as received (None where not
        known), already checked by the frame decoder: the stored CRC then follows from it
        without another pass over the batch.
        """
        if now_ms is None:
            now_ms = time.time_ns() // 1_000_000
        with self.lock:
            self.check_writable()
            if replicated:
                expect = self._written
                for header, _ in batches:
                    if header.base_offset != expect:
                        raise ReplicationFailedError(
                            f"range {self.stream_id}/{self.range_index}: replicated batch at "
                            f"offset {header.base_offset}, but this replica continues at "
                            f"{expect}")
                    expect += header.record_count
            seg = self._active_for(sum(h.batch_length for h, _ in batches))
            bases: list[int] = []
            pieces: list = []
            records: list[tuple[int, int, int]] = []
            offset, pos = self._written, seg.size
            for i, (header, data) in enumerate(batches):
                envelope = bytearray(data[:ENVELOPE_SIZE])
                set_base_offset(envelope, 0, offset)
                body = data[ENVELOPE_SIZE:]
                length = header.batch_length
                known = crcs[i] if crcs is not None else None
                if known is None:
                    batch_crc = crc32(body, crc32(envelope))
                else:
                    batch_crc = crc32_with_prefix(known, bytes(data[:ENVELOPE_SIZE]),
                                                  bytes(envelope), length)
                pieces += [pack_storage_header(length, batch_crc, offset, header.record_count,
                                               now_ms), envelope, body]
                if stored is not None:
                    stored.append([envelope, body])
                records.append((offset, header.record_count, pos))
                bases.append(offset)
                offset += header.record_count
                pos += STORAGE_HEADER_SIZE + length
            seg.write(pieces, records, now_ms)
            self._written = offset
            if seg not in self._unsynced:
                self._unsynced.append(seg)
            never = self.storage.config.fsync is FsyncPolicy.NEVER
            if never:
                self._committed = offset
        self.storage.stats.bytes_written += pos - records[0][2]
        self.storage.page_cache.wrote(seg, records[0][2], pos)
        if never:
            self.storage.notify_data()
        else:
            self.storage._mark_dirty(self)
        return bases, offset

    def _active_for(self, nbytes: int) -> Segment:
        """The segment to write ``nbytes`` into, rolling to a new one when this one is full."""
        seg = self.segments[-1]
        if not seg.empty and seg.size + nbytes > self.storage.config.segment_bytes:
            if self.storage.config.fsync is FsyncPolicy.NEVER:
                # No fsync will come to write its index (see sync()): write it now.
                seg.write_index()
                seg.index_written = True
            seg = self._new_segment(self._written)
        return seg

    def _new_segment(self, base_offset: int) -> Segment:
        seg = Segment(self.directory, base_offset, self.storage.config.index_interval_bytes)
        fsync_dir(self.directory)
        self.segments.append(seg)
        return seg

    def sync(self) -> None:
        """fsync everything written so far and make it readable."""
        with self.lock:
            target = self._written
            pending = list(self._unsynced)
        try:
            for seg in pending:
                if seg.retain():
                    try:
                        seg.fsync()
                    finally:
                        seg.release()
        except OSError as exc:
            with self.lock:
                self._failed = f"fsync failed: {exc}"
            log.error("fsync of range %s failed: %s", self, exc)
            raise StorageFullError(f"fsync failed: {exc}") from exc
        with self.lock:
            self._unsynced = [s for s in self._unsynced if s.size > s.synced_size]
            for seg in self.segments[:-1]:
                if not seg.index_written and seg.synced_size == seg.size:
                    # Full and durable: persist its index so a restart need not scan it.
                    try:
                        seg.write_index()
                    except OSError as exc:
                        log.warning("could not write index %s: %s", seg.index_path, exc)
                    seg.index_written = True
            if target > self._committed:
                self._committed = target
        self.storage.notify_data()

    def seal(self) -> int:
        """Stop taking appends here (fence the range) at its current end, which this returns.
        Idempotent. A replicated range stays capped until the PD records its end
        (``seal_at``): the PD may end it below this replica's end."""
        with self.lock:
            if self._end_offset >= 0:
                return self._end_offset
            self._end_offset = self._written  # blocks further appends from here on
            try:
                self._save_meta()
            except OSError:
                self._end_offset = -1
                raise
            self.cap.fence()
        if self.storage.config.fsync is not FsyncPolicy.NEVER:
            self.sync()
        self.storage.notify_data()
        return self._end_offset

    def seal_at(self, end_offset: int) -> None:
        """Adopt the PD's record that this range ended at ``end_offset``: from now on readers
        see up to it.

        A replica sealed here past the PD's end (a failover seals where every survivor holds
        data, and this one held more) takes the PD's end: the records past it were never
        acknowledged, are not part of the stream and must not be served.
        """
        with self.lock:
            final = self.cap.state is CapState.FINAL
            if final and not 0 <= end_offset < self._end_offset:
                return  # already final there (or asked to move it up: the first end rules)
            if 0 <= end_offset < self._end_offset:
                log.info("range %s: sealed here at %d but by the PD at %d; records past %d "
                         "are not served", self, self._end_offset, end_offset, end_offset)
            elif end_offset > self._written:
                log.warning("range %s sealed by the PD at %d beyond local data at %d", self,
                            end_offset, self._written)
            before = self._end_offset
            self._end_offset = end_offset
            try:
                self._save_meta(end_final=True)
            except OSError:
                self._end_offset = before
                raise
            self.cap.finalize(end_offset)

    # -- reading ---------------------------------------------------------------------------

    def check_readable(self, offset: int) -> None:
        """Raise ``OffsetOutOfRangeError`` unless ``offset`` can be fetched here (or waited on)."""
        if offset < self._start_offset:
            raise OffsetOutOfRangeError(
                f"offset {offset} of stream {self.stream_id} is below the start "
                f"{self._start_offset} (trimmed); fetch from {self._start_offset}")
        limit = self.readable_offset
        if self.cap.capped:
            # Stored here but not yet known to be on every replica: a reader may already have
            # seen it (on a replica that knew more, or on this one before it restarted), so it
            # waits for it rather than fail.
            limit = max(limit, self._written)
        if offset > limit:
            raise OffsetOutOfRangeError(
                f"offset {offset} of stream {self.stream_id} is beyond the range's "
                f"{'end' if self._end_offset >= 0 else 'next offset'} {limit}")

    def read(self, offset: int, max_bytes: int, end_offset: int = -1,
             first: bool = True, count: bool = True) -> ReadChunk:
        """Committed batches from the one containing ``offset``, within one segment.

        Returns an empty chunk when nothing is committed at ``offset`` yet. ``max_bytes``
        bounds the bytes, but a first batch (``first``) is returned even if larger.
        ``end_offset`` (-1: none) stops before batches starting at or after it. Checksums are
        the caller's choice (``chunk.verify()`` or ``chunk.crc``). ``count``: add the bytes
        to the read statistics.
        """
        with self.lock:
            self.check_readable(offset)
            # A sealed range may hold bytes past its end (it was sealed where every replica
            # has data); those are never served.
            committed = min(self._committed, self.readable_offset)
            if offset >= committed or (end_offset >= 0 and offset >= end_offset):
                return ReadChunk([], 0, offset)
            bases = [s.base_offset for s in self.segments]
            i = max(bisect.bisect_right(bases, offset) - 1, 0)
            seg = self.segments[i]
            # Everything below size is written whole (size moves only after a write).
            limit_size = seg.size
            if not seg.retain():
                raise CorruptDataError(f"segment {seg.path} vanished")
        # Batches past the committed offset may already be in the file: bound by offset.
        bound = committed if end_offset < 0 else min(committed, end_offset)
        try:
            batches = seg.read_batches(offset, limit_size, max_bytes, bound, first)
        except BaseException:
            seg.release()
            raise
        if not batches:
            seg.release()
            return ReadChunk([], 0, offset)
        nbytes = sum(b.length for b in batches)
        if count:
            self.storage.stats.bytes_read += nbytes
        return ReadChunk(batches, nbytes, batches[-1].end_offset, seg)

    def available_bytes(self, offset: int, limit: int) -> int:
        """Committed bytes from the batch holding ``offset`` on, counted up to ``limit``."""
        total = 0
        while total < limit:
            try:
                chunk = self.read(offset, limit - total, first=True, count=False)
            except OffsetOutOfRangeError:
                break
            with chunk:
                if not chunk.batches:
                    break
                total += chunk.nbytes
                offset = chunk.next_offset
        return total

    # -- trimming and retention ------------------------------------------------------------

    def trim(self, offset: int) -> int:
        """Make offsets below ``offset`` unreadable and delete whole segments below it.

        Returns the new start offset (never moves backwards, never past what readers may see:
        the end of a sealed range, else ``readable_offset``).
        """
        with self.lock:
            # Never past what readers may see (the read cap of an open replicated range).
            limit = self.readable_offset
            new_start = min(max(offset, self._start_offset), limit)
            if new_start == self._start_offset:
                return new_start
            self._start_offset = new_start
            self._save_meta()
            self._drop_segments_below(new_start)
        return new_start

    def expire(self, retention_ms: int, now_ms: int | None = None) -> int | None:
        """Delete segments whose newest batch is older than ``retention_ms``.

        Returns the new start offset if it moved, else None.
        """
        if retention_ms < 0:
            return None
        if now_ms is None:
            now_ms = time.time_ns() // 1_000_000
        cutoff = now_ms - retention_ms
        with self.lock:
            new_start = None
            for seg in list(self.segments):
                if seg.empty or seg.max_time >= cutoff or seg.end_offset > self.readable_offset:
                    break
                new_start = seg.end_offset
            if new_start is None or new_start <= self._start_offset:
                return None
            self._start_offset = new_start
            self._save_meta()
            self._drop_segments_below(new_start)
            return new_start

    def _drop_segments_below(self, offset: int) -> None:
        """Delete segments lying wholly below ``offset``; an open range keeps a last one."""
        doomed = []
        while self.segments:
            seg = self.segments[0]
            if seg.empty or seg.end_offset > offset:
                break
            if len(self.segments) == 1 and self._end_offset < 0:
                # The active segment goes: start a fresh one first, so that the range still
                # knows its next offset after a restart. (All of it is committed: trims and
                # retention never pass next_offset.)
                self._new_segment(self._written)
            doomed.append(self.segments.pop(0))
        for seg in doomed:
            if seg in self._unsynced:
                self._unsynced.remove(seg)
            seg.delete()
        if doomed:
            fsync_dir(self.directory)
            log.info("range %s: deleted %d segments below offset %d", self, len(doomed), offset)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        with self.lock:
            for seg in self.segments:
                seg.close()

    def destroy(self) -> None:
        """Delete the range's files entirely."""
        with self.lock:
            for seg in self.segments:
                seg.delete()
            self.segments = []
        shutil.rmtree(self.directory, ignore_errors=True)

    def describe(self) -> dict:
        return {**self._meta(), "next_offset": self._committed}

    # -- recovery --------------------------------------------------------------------------

    def _recover(self) -> None:
        """Open the segments found on disk, cut torn or corrupt tails, restore the offsets."""
        names = sorted(n for n in os.listdir(self.directory) if n.endswith(SEGMENT_SUFFIX))
        segs: list[Segment] = []
        for n in names:
            try:
                base = int(n[:-len(SEGMENT_SUFFIX)])
            except ValueError:
                log.warning("ignoring unexpected file %s in %s", n, self.directory)
                continue
            segs.append(Segment(self.directory, base, self.storage.config.index_interval_bytes))
        kept: list[Segment] = []
        for i, seg in enumerate(segs):
            last = i == len(segs) - 1
            if kept and seg.base_offset != kept[-1].end_offset:
                log.error("range %s: segment %s starts at %d, the one before ends at %d",
                          self, seg.path, seg.base_offset, kept[-1].end_offset)
            if not last and seg.load_index():
                kept.append(seg)
                continue
            result = seg.scan()
            for first, end, lost_from, lost_to in result.damaged:
                log.error("range %s: bytes %d-%d of %s are corrupt; offsets %d to %d are "
                          "unreadable, the batches after them are kept", self, first, end,
                          seg.path, lost_from, lost_to)
            if result.problem is None:
                seg.adopt_scan(result)
            elif last:
                # Only the segment being written can hold a torn write: cut it off.
                lost = os.fstat(seg.fd).st_size - result.valid_size
                log.warning("range %s: %s; cutting %d bytes of %s", self, result.problem, lost,
                            seg.path)
                seg.adopt_scan(result)
            else:
                log.error("range %s: %s in full segment %s; offsets %d to %d are unreadable",
                          self, result.problem, seg.path, result.end_offset,
                          segs[i + 1].base_offset)
                seg.adopt_damaged(result, segs[i + 1].base_offset)
            kept.append(seg)
        # Segments wholly below the start were being deleted when we stopped.
        while kept and kept[0].end_offset <= self._start_offset and (
                len(kept) > 1 or self._end_offset >= 0):
            kept.pop(0).delete()
        self.segments = kept
        if kept and kept[0].base_offset > self._start_offset:
            log.error("range %s: data below %d is missing", self, kept[0].base_offset)
            self._start_offset = kept[0].base_offset
        if kept:
            end = kept[-1].end_offset
        else:
            end = self._end_offset if self._end_offset >= 0 else self._start_offset
        self._written = self._committed = max(end, self._start_offset)
        if self._end_offset < 0 and (not kept or kept[-1].end_offset != self._written):
            # The open range needs an active segment that ends exactly at next_offset.
            self._new_segment(self._written)
        if self._end_offset >= 0 and self._written < self._end_offset:
            log.warning("range %s: sealed at %d but only %d is stored", self, self._end_offset,
                        self._written)
        # Restarted: nothing past the start is known to be on every replica (the start may
        # have moved up above, when data below it was missing).
        self.cap = self._restored_cap(self.cap.state is CapState.FINAL)


class StorageStats:
    """Byte counters for metrics (approximate under concurrency)."""

    def __init__(self) -> None:
        self.bytes_written = 0
        self.bytes_read = 0
        self.fsyncs = 0


class Storage:
    """All range logs of one range server, and the thread that fsyncs them."""

    def __init__(self, data_dir: str, config: StorageConfig | None = None) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.config = config or StorageConfig()
        self.stats = StorageStats()
        self._ranges: dict[tuple[int, int], RangeLog] = {}
        self._by_stream: dict[int, list[RangeLog]] = {}
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()
        self._data_version = 0
        # Woken whenever readable data, seals or deletions change: long-poll fetches wait on it.
        self.data_changed = threading.Condition()
        self._dirty: dict[int, RangeLog] = {}  # id(range) -> range with unsynced writes
        self._waiters: list[tuple[RangeLog, int, Waiter]] = []
        self._sync_cond = threading.Condition()
        self._closed = False
        # Only durable data can leave the page cache: no bound when nothing is fsynced.
        self.page_cache = PageCacheBudget(
            0 if self.config.fsync is FsyncPolicy.NEVER else self.config.page_cache_bytes)
        os.makedirs(os.path.join(self.data_dir, _RANGES_DIR), exist_ok=True)
        self._recover()
        self._syncer: threading.Thread | None = None
        if self.config.fsync is not FsyncPolicy.NEVER:
            self._syncer = threading.Thread(target=self._sync_loop, name="sbp-fsync",
                                            daemon=True)
            self._syncer.start()

    # -- ranges ----------------------------------------------------------------------------

    def create_range(self, stream_id: int, range_index: int, start_offset: int,
                     end_offset: int = -1, replicas: Sequence[Replica] = ()) -> RangeLog:
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
            os.makedirs(directory, exist_ok=True)
            meta = {"stream_id": stream_id, "range_index": range_index,
                    "base_start_offset": start_offset, "start_offset": start_offset,
                    "end_offset": end_offset, "deleted": False,
                    "replicas": [r.__dict__ for r in replicas]}
            rlog = RangeLog(self, directory, meta)
            rlog._new_segment(start_offset)
            rlog._written = rlog._committed = start_offset
            rlog._save_meta()
            fsync_dir(os.path.dirname(directory))
            with self._lock:
                self._add(rlog)
        return rlog

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

    def drop_range(self, stream_id: int, range_index: int) -> None:
        """Forget a range and delete its files."""
        with self._lock:
            rlog = self._ranges.pop((stream_id, range_index), None)
            if rlog is not None:
                self._by_stream[stream_id].remove(rlog)
        if rlog is not None:
            rlog.destroy()

    # -- durability ------------------------------------------------------------------------

    def when_durable(self, rlog: RangeLog, target: int, callback: Waiter) -> None:
        """Call ``callback(None)`` once ``rlog.next_offset >= target`` (now, if already true),
        or ``callback(error)`` if the data cannot be made durable. Callbacks run on the fsync
        thread: they must not block."""
        with self._sync_cond:
            if rlog.next_offset < target and rlog._failed is None and not self._closed:
                self._waiters.append((rlog, target, callback))
                return
        callback(self._failure(rlog) if rlog.next_offset < target else None)

    def wait_durable(self, rlog: RangeLog, target: int, timeout: float | None = None) -> None:
        """Block until ``rlog.next_offset >= target``; raises on fsync failure or timeout."""
        done = threading.Event()
        result: list[BaseException | None] = []

        def finish(exc: BaseException | None) -> None:
            result.append(exc)
            done.set()

        self.when_durable(rlog, target, finish)
        if not done.wait(timeout):
            raise SbpError(f"data of {rlog} not durable within {timeout} s")
        if result[0] is not None:
            raise result[0]

    def _failure(self, rlog: RangeLog) -> BaseException:
        if self._closed:
            return StorageFullError("storage closed before the data was synced")
        return StorageFullError(rlog._failed or "data could not be synced")

    def _mark_dirty(self, rlog: RangeLog) -> None:
        with self._sync_cond:
            if not self._dirty:
                self._sync_cond.notify()
            self._dirty[id(rlog)] = rlog

    def _sync_one(self, rlog: RangeLog) -> None:
        try:
            rlog.sync()
            self.stats.fsyncs += 1
        except (OSError, SbpError) as exc:
            log.error("fsync of %s failed: %s", rlog, exc)

    def _sync_loop(self) -> None:
        interval = self.config.fsync_interval_ms / 1000.0
        always = self.config.fsync is FsyncPolicy.ALWAYS
        # Started with the second range that needs an fsync in one round.
        pool: ThreadPoolExecutor | None = None
        last_round = -interval  # monotonic start of the previous round
        try:
            while True:
                with self._sync_cond:
                    while not self._dirty and not self._closed:
                        self._sync_cond.wait()
                    if not self._dirty:
                        break  # closed and nothing left to sync
                    if not always and not self._closed:
                        # Group commit: appends until one interval after the previous round
                        # began share this fsync. Counting from its start, not its end, keeps
                        # rounds at most one per interval without adding the fsync's own
                        # duration to every acknowledgement's wait.
                        wait = last_round + interval - time.monotonic()
                        if wait > 0:
                            self._sync_cond.wait_for(lambda: self._closed, timeout=wait)
                    dirty = list(self._dirty.values())
                    self._dirty.clear()
                last_round = time.monotonic()
                # Under "always", appends that arrive during these fsyncs wait for the next
                # round, which starts at once: one fsync per round, not per append.
                if len(dirty) == 1:
                    self._sync_one(dirty[0])
                else:
                    # Many active ranges: their fsyncs run side by side (the file system can
                    # commit them in one journal transaction), not one after another.
                    if pool is None:
                        pool = ThreadPoolExecutor(_SYNC_THREADS, thread_name_prefix="sbp-fsync")
                    list(pool.map(self._sync_one, dirty))
                self._release_waiters()
                self.page_cache.trim()  # after the answers: not on their critical path
        finally:
            if pool is not None:
                pool.shutdown()
            self._release_waiters(final=True)

    def _release_waiters(self, final: bool = False) -> None:
        ready: list[tuple[Waiter, BaseException | None]] = []
        with self._sync_cond:
            keep = []
            for rlog, target, cb in self._waiters:
                if rlog.next_offset >= target:
                    ready.append((cb, None))
                elif rlog._failed is not None or final:
                    ready.append((cb, self._failure(rlog)))
                else:
                    keep.append((rlog, target, cb))
            self._waiters = keep
        for cb, exc in ready:
            try:
                cb(exc)
            except Exception:
                log.exception("durability callback failed")

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
            meta_path = os.path.join(directory, _META_FILE)
            if not os.path.isdir(directory):
                continue
            try:
                with open(meta_path, "rb") as f:
                    meta = json.loads(f.read())
                rlog = RangeLog(self, directory, meta)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("skipping range directory %s: unreadable %s (%s)", directory,
                          _META_FILE, exc)
                continue
            rlog._recover()
            self._add(rlog)
        if self._ranges:
            log.info("recovered %d ranges from %s", len(self._ranges), self.data_dir)

    def close(self) -> None:
        """Sync what was written, stop the fsync thread and close every file."""
        with self._sync_cond:
            if self._closed:
                return
            self._closed = True
            self._sync_cond.notify_all()
        if self._syncer is not None:
            self._syncer.join()
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
