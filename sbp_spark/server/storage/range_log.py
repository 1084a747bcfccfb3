"""The local log of one range: its segment files, offsets, metadata, reads and recovery.

Layout of a range's directory (under the storage's ``ranges/``)::

    <stream_id>-<range_index>/range.json        metadata (atomic write + rename)
    <stream_id>-<range_index>/<base>.seg         segment files (see segment.py)
    <stream_id>-<range_index>/<base>.idx         sparse index of a full segment

Stored bytes are the batches exactly as FETCH serves them (base_offset already written into the
envelope), so a fetch sends them with ``os.sendfile``.

Readers only ever see *committed* batches (acknowledged whole): a batch still waiting for its
fsync (``durability.py``) is invisible to FETCH and DESCRIBE_RANGES, so nothing a client read
can vanish in a crash; for a replicated range, the read cap (``read_cap.py``) also holds
readers below what every replica stores. On restart the log is recovered by scanning its
segments; a torn or corrupt tail is cut off.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from ...protocol.errors import (
    OffsetOutOfRangeError,
    RangeSealedError,
    ReplicationFailedError,
    StorageFullError,
    StreamNotFoundError,
)
from ...protocol.frame import crc32
from ...protocol.messages import RangeReplica, RangeServer
from ...protocol.records import ENVELOPE_SIZE, BatchHeader, set_base_offset
from .disk import Disk
from .read_cap import CapState, ReadCap
from .segment import (
    SEGMENT_SUFFIX,
    CorruptDataError,
    ProducedBatch,
    Segment,
    StoredBatch,
    atomic_write,
    combined_crc,
    crc32_with_prefix,
    pack_storage_header,
    verify_batches,
    verify_once,
)

log = logging.getLogger(__name__)
# From this batch size on, the CRC stored with a batch is derived from the frame's checked
# payload CRC (``crc32_with_prefix``, about 3 us whatever the size) instead of computed over
# the batch again; below it the second pass over bytes still in the CPU cache is cheaper
# (0.4 us for 1 KiB, 2.6 us for 64 KiB here).
_REUSE_CRC_BYTES = 64 * 1024

META_FILE = "range.json"


class ByteCounts(Protocol):
    """Where range logs count the bytes they write and read (the server's metrics)."""

    bytes_written: int
    bytes_read: int


class WrittenExtents(Protocol):
    """Where range logs record what they wrote (the page-cache bound, pagecache.py)."""

    def wrote(self, segment: Segment, start: int, end: int) -> None: ...


@dataclass(frozen=True)
class ConsumerHold:
    """Retention that waits for a stream's named consumers: records at or past ``low_offset``
    (the lowest position they committed) outlive the retention period until they are older
    than ``cap_ms`` or the range's held segments take more than ``cap_bytes`` (-1: no cap)."""

    low_offset: int
    cap_bytes: int = -1
    cap_ms: int = -1


@dataclass(frozen=True)
class LogEnv:
    """What a range log uses of the storage it belongs to: the settings of its files, and
    where it reports what it did."""

    segment_bytes: int
    index_interval_bytes: int
    # Whether flushes make appends durable (every fsync policy but ``never``); without them
    # an append is committed as soon as it is written.
    flushed: bool
    counts: ByteCounts
    extents: WrittenExtents
    # ``(range, nbytes)``: the range wrote ``nbytes`` that a flush is to make durable.
    mark_dirty: Callable[[RangeLog, int], None]
    # What readers may see changed (long polls wait for it).
    data_changed: Callable[[], None]
    # Where segment bytes are written and synced.
    disk: Disk


def _replica_record(replica: RangeReplica) -> dict:
    """How ``range.json`` keeps a replica of the range."""
    return {"server_id": replica.server.server_id,
            "advertise_addr": replica.server.advertise_addr, "is_primary": replica.is_primary}


def _replica_of(record: dict) -> RangeReplica:
    return RangeReplica(RangeServer(record["server_id"], record.get("advertise_addr", "")),
                        record.get("is_primary", False))


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

    def checked_crc(self) -> int:
        """The bytes on disk checked against the stored CRCs (``verify_batches``), skipping
        those this process already checked (its own writes, recovery scans, earlier reads):
        the steady state reads no data at all. Returns the CRC of the batches end to end;
        raises ``CorruptDataError``."""
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



class RangeLog:
    """The local log of one range: its segments, offsets and metadata."""

    def __init__(self, env: LogEnv, directory: str, meta: dict) -> None:
        self._env = env
        self.directory = directory
        self.stream_id: int = meta["stream_id"]
        self.range_index: int = meta["range_index"]
        self.base_start_offset: int = meta["base_start_offset"]
        self._start_offset: int = meta["start_offset"]
        self._end_offset: int = meta["end_offset"]
        self._deleted: bool = meta.get("deleted", False)
        # The servers holding the range, as the PD placed it (none known: a range of its own).
        self._replicas = tuple(_replica_of(r) for r in meta.get("replicas", ()))
        # ``lock`` guards the range's state (offsets, segment list, metadata) and is held only
        # briefly. ``_append_lock`` serializes appends, which write their bytes holding it but
        # not ``lock``: an fsync or a read need not wait for a 1 MiB write to end (measured:
        # the flush thread spent a third of a run of 1 MiB appends waiting for it). Whatever
        # changes what an append may do (seals, trims, deletes) takes both, ``_append_lock``
        # first, so it never falls in the middle of one.
        self.lock = threading.RLock()
        self._append_lock = threading.Lock()
        self.segments: list[Segment] = []
        self._written = self._start_offset  # next offset after the last written batch
        self._committed = self._start_offset  # next offset after the last durable batch
        self._failed: str | None = None  # set when an fsync failed: no more writes
        # How far readers may see (read_cap.py): for a replicated range, only what every
        # replica is known to hold, until the PD records the range's end.
        self.cap = self._restored_cap(meta.get("end_final", True))
        # Segments with bytes not yet fsynced: the active one and any just rolled.
        self._unsynced: list[Segment] = []
        # A segment was created since the last sync() without its directory entry synced.
        self._dir_unsynced = False
        # Full, durable segments whose index is to be written (write_due_indexes).
        self._index_due: list[Segment] = []

    @classmethod
    def create(cls, env: LogEnv, directory: str, stream_id: int, range_index: int,
               start_offset: int, end_offset: int, replicas: Sequence[RangeReplica]
               ) -> RangeLog:
        """A new, empty range in ``directory``: its metadata written, its first segment
        open at its start offset."""
        meta = {"stream_id": stream_id, "range_index": range_index,
                "base_start_offset": start_offset, "start_offset": start_offset,
                "end_offset": end_offset, "deleted": False,
                "replicas": [_replica_record(r) for r in replicas]}
        rlog = cls(env, directory, meta)
        start = rlog._start_offset
        rlog._new_segment(start)
        rlog._written = rlog._committed = start
        rlog._save_meta()
        return rlog

    @classmethod
    def open(cls, env: LogEnv, directory: str, meta: dict) -> RangeLog:
        """The range found in ``directory`` with its metadata ``meta``, recovered from its
        segment files (see ``_recover``)."""
        rlog = cls(env, directory, meta)
        rlog._recover()
        return rlog

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
                                final, self._env.data_changed)

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
    def end_pending(self) -> bool:
        """Sealed here, but the PD has not recorded the range's end yet: a replicated range
        fenced here may end further on (another replica held more when a failover sealed it
        without this one), so its end here is not yet where the next range starts."""
        return self.cap.state is CapState.FENCED

    @property
    def deleted(self) -> bool:
        return self._deleted

    @property
    def failure(self) -> str | None:
        """Why the range takes no more writes after a failed fsync (None: it never failed)."""
        return self._failed

    @property
    def replicas(self) -> tuple[RangeReplica, ...]:
        return self._replicas

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
            "replicas": [_replica_record(r) for r in self._replicas],
        }

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold off appends and everything else: for changes an append must not straddle."""
        with self._append_lock, self.lock:
            yield

    def _save_meta(self, end_final: bool | None = None) -> None:
        atomic_write(os.path.join(self.directory, META_FILE),
                     json.dumps(self._meta(end_final), indent=1).encode())

    def set_replicas(self, replicas: Sequence[RangeReplica]) -> None:
        with self._exclusive():
            replicas = tuple(replicas)
            if replicas == self._replicas:
                return
            self._replicas = replicas
            self._save_meta()
            self.cap.replicas_changed(len(replicas), self._committed)
        self._env.data_changed()

    def mark_deleted(self) -> None:
        """Refuse further writes (the stream was deleted); reads of stored data still work."""
        with self._exclusive():
            if not self._deleted:
                self._deleted = True
                self._save_meta()
        self._env.data_changed()

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
               crcs: Sequence[int | None] | None = None,
               producers: Sequence[tuple[int, int] | None] | None = None
               ) -> tuple[list[int], int]:
        """Store ``batches`` (validated envelopes and their bytes) at the end of the range.

        Returns (base offset of each batch, the commit target): the batches are acknowledged
        once ``next_offset`` reaches the target (see ``GroupCommit.when_durable``). Either every
        batch is stored or none is.

        ``replicated``: the batches come from the range's primary and already carry their
        base offsets, which must continue this log exactly (else ``ReplicationFailedError``).
        ``stored``: if given, receives each batch as stored, as [envelope, body] buffers (what
        a primary forwards to its secondaries).
        ``crcs``: if given, the CRC-32 of each batch's bytes as received (None where not
        known), already checked by the frame decoder: the stored CRC then follows from it
        without another pass over the batch.
        ``producers``: if given, each batch's (producer_id, sequence), or None, kept in its
        storage header (``segment.pack_storage_header``) so the producers' state can be
        rebuilt from the log.
        """
        if now_ms is None:
            now_ms = time.time_ns() // 1_000_000
        with self._append_lock:
            with self.lock:
                self.check_writable()
                if replicated:
                    expect = self._written
                    for header, _ in batches:
                        if header.base_offset != expect:
                            raise ReplicationFailedError(
                                f"range {self.stream_id}/{self.range_index}: replicated batch "
                                f"at offset {header.base_offset}, but this replica continues "
                                f"at {expect}")
                        expect += header.record_count
                seg = self._active_for(sum(h.batch_length for h, _ in batches))
                offset, pos = self._written, seg.size
            bases: list[int] = []
            pieces: list = []
            records: list[tuple[int, int, int]] = []
            for i, (header, data) in enumerate(batches):
                envelope = bytearray(data[:ENVELOPE_SIZE])
                set_base_offset(envelope, 0, offset)
                body = data[ENVELOPE_SIZE:]
                length = header.batch_length
                known = crcs[i] if crcs is not None and length >= _REUSE_CRC_BYTES else None
                if known is None:
                    batch_crc = crc32(body, crc32(envelope))
                else:
                    batch_crc = crc32_with_prefix(known, bytes(data[:ENVELOPE_SIZE]),
                                                  bytes(envelope), length)
                head = pack_storage_header(length, batch_crc, offset, header.record_count,
                                           now_ms, producers[i] if producers else None)
                pieces += [head, envelope, body]
                if stored is not None:
                    stored.append([envelope, body])
                records.append((offset, header.record_count, pos))
                bases.append(offset)
                offset += header.record_count
                pos += len(head) + length
            # Outside ``lock``: readers and fsyncs go on meanwhile (a reader sees only up to
            # the committed offset, and a segment's size moves only once its bytes are in).
            seg.write(pieces, records, now_ms)
            env = self._env
            never = not env.flushed
            if not never:
                # An fsync will come for these bytes: let the disk start on them now.
                seg.start_writeback()
            with self.lock:
                self._written = offset
                if seg not in self._unsynced:
                    self._unsynced.append(seg)
                if never:
                    self._committed = offset
        start = records[0][2]
        env.counts.bytes_written += pos - start
        env.extents.wrote(seg, start, pos)
        if never:
            env.data_changed()
        else:
            env.mark_dirty(self, pos - start)
        return bases, offset

    def _active_for(self, nbytes: int) -> Segment:
        """The segment to write ``nbytes`` into, rolling to a new one when this one is full."""
        seg = self.segments[-1]
        if not seg.empty and seg.size + nbytes > self._env.segment_bytes:
            if not self._env.flushed:
                # No fsync will come to write its index (see sync()): write it now.
                seg.write_index()
                seg.index_written = True
            # The new file's directory entry is made durable by the next sync(), before any
            # byte written to it is acknowledged: not here, on the append's path. (``never``
            # has no next sync: there it is synced now.)
            seg = self._new_segment(self._written,
                                    sync_dir=not self._env.flushed)
        return seg

    def _new_segment(self, base_offset: int, sync_dir: bool = True) -> Segment:
        seg = Segment(self.directory, base_offset, self._env.index_interval_bytes,
                      self._env.disk)
        if sync_dir:
            self._env.disk.sync_dir(self.directory)
        else:
            self._dir_unsynced = True
        self.segments.append(seg)
        return seg

    def sync(self) -> None:
        """fsync everything written so far and make it readable."""
        with self.lock:
            target = self._written
            pending = list(self._unsynced)
            sync_dir, self._dir_unsynced = self._dir_unsynced, False
        try:
            if sync_dir:
                try:
                    self._env.disk.sync_dir(self.directory)
                except OSError:
                    with self.lock:
                        self._dir_unsynced = True
                    raise
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
                    # Full and durable: its index is persisted after this round's answers
                    # (write_due_indexes), so a restart need not scan it.
                    seg.index_written = True
                    self._index_due.append(seg)
            if target > self._committed:
                self._committed = target
        self._env.data_changed()

    def write_due_indexes(self) -> None:
        """Persist the index of each segment that sync() found full and durable (called by
        the flush thread once the round's answers are out: an index only spares a restart
        the scan of its segment, and is never waited for)."""
        if not self._index_due:  # the common case, read without the lock (a round may
            return               # flush hundreds of ranges); a stale read defers to the next
        with self.lock:
            due, self._index_due = self._index_due, []
        for seg in due:
            try:
                seg.write_index()
            except OSError as exc:
                log.warning("could not write index %s: %s", seg.index_path, exc)

    def seal(self) -> int:
        """Stop taking appends here (fence the range) at its current end, which this returns:
        on a primary, before the first append not yet stored by every secondary (see
        ``ReadCap.fence``). Idempotent. A replicated range stays capped until the PD records
        its end (``seal_at``): the PD may end it below this replica's end."""
        with self._exclusive():
            if self._end_offset >= 0:
                return self._end_offset
            # Blocks further appends from here on.
            self._end_offset = self.cap.fence(self._written)
            try:
                self._save_meta()
            except OSError:
                self._end_offset = -1
                raise
        if self._env.flushed:
            self.sync()
        self._env.data_changed()
        return self._end_offset

    def seal_at(self, end_offset: int) -> None:
        """Adopt the PD's record that this range ended at ``end_offset``: from now on readers
        see up to it.

        A replica sealed here past the PD's end (a failover seals where every survivor holds
        data, and this one held more) takes the PD's end: the records past it were never
        acknowledged, are not part of the stream and must not be served.
        """
        with self._exclusive():
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
        the caller's choice (``chunk.checked_crc()`` or ``chunk.crc``). ``count``: add the bytes
        to the read statistics.
        """
        with self.lock:
            self.check_readable(offset)
            # A sealed range may hold bytes past its end (it was sealed where every replica
            # has data); those are never served.
            committed = min(self._committed, self.readable_offset)
            if offset >= committed or (end_offset >= 0 and offset >= end_offset):
                if self._written <= offset < self.readable_offset and (
                        end_offset < 0 or offset < end_offset):
                    # Sealed above what this replica stored (it missed the tail, or lost it
                    # in a crash): nothing will ever come here, the reader must go elsewhere.
                    raise CorruptDataError(
                        f"range {self.stream_id}/{self.range_index} ends at "
                        f"{self._end_offset} but this replica stores only up to "
                        f"{self._written}", offset)
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
            self._env.counts.bytes_read += nbytes
        return ReadChunk(batches, nbytes, batches[-1].end_offset, seg)

    def produced_since(self, min_time_ms: int) -> list[ProducedBatch]:
        """The batches appended under a producer (idempotent appends) in the segments
        written to at ``min_time_ms`` or later, in order."""
        with self.lock:
            segments = [(seg, seg.size) for seg in self.segments
                        if not 0 <= seg.max_time < min_time_ms and seg.retain()]
        out: list[ProducedBatch] = []
        try:
            for seg, size in segments:
                out += seg.produced_batches(size)
        finally:
            for seg, _ in segments:
                seg.release()
        return out

    def available_bytes(self, offset: int, limit: int) -> int:
        """Committed bytes from the batch holding ``offset`` on, counted up to ``limit``."""
        total = 0
        while total < limit:
            try:
                chunk = self.read(offset, limit - total, first=True, count=False)
            except (OffsetOutOfRangeError, CorruptDataError):
                break  # what is readable so far; the fetch itself reports the rest
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
        with self._exclusive():
            # Never past what readers may see (the read cap of an open replicated range).
            limit = self.readable_offset
            new_start = min(max(offset, self._start_offset), limit)
            if new_start == self._start_offset:
                return new_start
            self._start_offset = new_start
            self._save_meta()
            self._drop_segments_below(new_start)
        return new_start

    def expire(self, retention_ms: int, now_ms: int | None = None,
               hold: ConsumerHold | None = None) -> int | None:
        """Delete segments whose newest batch is older than ``retention_ms``; with ``hold``,
        keep those holding records at or past its ``low_offset`` (not read by the stream's
        named consumers) until they pass one of its caps.

        Returns the new start offset if it moved, else None.
        """
        if retention_ms < 0:
            return None
        if now_ms is None:
            now_ms = time.time_ns() // 1_000_000
        cutoff = now_ms - retention_ms
        with self._exclusive():
            expired = []
            for seg in list(self.segments):
                if seg.empty or seg.max_time >= cutoff or seg.end_offset > self.readable_offset:
                    break
                expired.append(seg)
            held = [seg for seg in expired
                    if hold is not None and seg.end_offset > hold.low_offset]
            held_bytes = sum(seg.size for seg in held)
            new_start = None
            for seg in expired:
                if seg in held:
                    assert hold is not None
                    aged = hold.cap_ms > 0 and seg.max_time < now_ms - hold.cap_ms
                    over = hold.cap_bytes > 0 and held_bytes > hold.cap_bytes
                    if not (aged or over):
                        break  # consumers have not read it, and no cap is passed
                    held_bytes -= seg.size
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
            self._env.disk.sync_dir(self.directory)
            log.info("range %s: deleted %d segments below offset %d", self, len(doomed), offset)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        with self._exclusive():
            for seg in self.segments:
                seg.close()


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
            segs.append(Segment(self.directory, base, self._env.index_interval_bytes,
                                self._env.disk))
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
