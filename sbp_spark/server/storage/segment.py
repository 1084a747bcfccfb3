"""One segment file of a range's log: stored batches, their sparse index, and recovery scans.

A segment is an append-only file named after the offset of its first record
(``00000000000000000042.seg``). Each stored batch is a 32-byte storage header followed by the
batch exactly as FETCH serves it (envelope with the assigned base_offset, then the body)::

    batch_length u32 | batch_crc u32 | base_offset i64 | record_count i32 |
    append_time_ms i64 | header_crc u32

``batch_crc`` is the CRC-32 of the batch bytes; ``header_crc`` covers the 28 bytes before it, so a
torn or zeroed header is never mistaken for a batch. A batch appended under a producer
(idempotent appends) has the top bit of ``batch_length`` set and a 16-byte producer extension
between the header and the batch::

    producer_id i64 | sequence i32 | extension_crc u32

Batches never reach 2 GiB, so segments written before the extension existed have that bit
clear everywhere and read as before. When a segment stops growing its sparse
index is written next to it (``.idx``) so a restart need not rescan it.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ...protocol.errors import SbpError, StorageFullError
from ...protocol.frame import crc32
from .disk import Disk, fsync_dir
from .writeback import WRITE_BEHIND_BYTES

log = logging.getLogger(__name__)

STORAGE_HEADER = struct.Struct(">IIqiqI")
STORAGE_HEADER_SIZE = STORAGE_HEADER.size  # 32
_HEADER_CRC_SPAN = STORAGE_HEADER_SIZE - 4
# The producer extension of an idempotent batch, flagged in batch_length's top bit.
PRODUCER_EXTENSION = struct.Struct(">qiI")
PRODUCER_EXTENSION_SIZE = PRODUCER_EXTENSION.size  # 16
_PRODUCER_FLAG = 0x80000000
# What each CRC covers: the header and the extension, each without its CRC.
_HEADER_BEFORE_CRC = struct.Struct(">IIqiq")
_PRODUCER_BEFORE_CRC = struct.Struct(">qi")

SEGMENT_SUFFIX = ".seg"
INDEX_SUFFIX = ".idx"
_INDEX_MAGIC = b"SBPIDX01"
_INDEX_HEAD = struct.Struct(">8sqqqqI")  # magic, base, end_offset, size, max_time, entries
_INDEX_ENTRY = struct.Struct(">qq")  # offset, position
_U32 = struct.Struct(">I")
# Reads of stored-batch headers while scanning a segment go through a buffer this large.
_SCAN_CHUNK = 1024 * 1024


class CorruptDataError(SbpError):
    """Stored bytes do not match their checksum. ``offset``: the first bad batch's base
    offset, when known (-1 otherwise)."""

    def __init__(self, message: str, offset: int = -1) -> None:
        super().__init__(message)
        self.offset = offset


class StoredBatch(NamedTuple):
    """Where one stored batch lives, as FETCH needs it (position is of the batch bytes)."""

    fd: int
    position: int
    length: int
    base_offset: int
    record_count: int
    crc: int
    append_time_ms: int

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.record_count


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}{SEGMENT_SUFFIX}"


def pack_storage_header(batch_length: int, batch_crc: int, base_offset: int,
                        record_count: int, append_time_ms: int,
                        producer: tuple[int, int] | None = None) -> bytes:
    """The storage header of one batch; with ``producer`` (producer_id, sequence), followed
    by its producer extension."""
    if producer is None:
        head = _HEADER_BEFORE_CRC.pack(batch_length, batch_crc, base_offset, record_count,
                                       append_time_ms)
        return head + _U32.pack(crc32(head))
    head = _HEADER_BEFORE_CRC.pack(batch_length | _PRODUCER_FLAG, batch_crc, base_offset,
                                   record_count, append_time_ms)
    ext = _PRODUCER_BEFORE_CRC.pack(*producer)
    return b"".join((head, _U32.pack(crc32(head)), ext, _U32.pack(crc32(ext))))


def unpack_storage_header(buf, pos: int = 0) -> tuple[int, int, int, int, int, int] | None:
    """(batch_length, batch_crc, base_offset, record_count, append_time_ms, span), or None if
    torn; ``span`` is the bytes from ``pos`` to the batch itself (the header, and the producer
    extension when the batch has one)."""
    length, batch_crc, base, count, ts, head_crc = STORAGE_HEADER.unpack_from(buf, pos)
    if crc32(memoryview(buf)[pos:pos + _HEADER_CRC_SPAN]) != head_crc:
        return None
    if length & _PRODUCER_FLAG:
        return (length & ~_PRODUCER_FLAG, batch_crc, base, count, ts,
                STORAGE_HEADER_SIZE + PRODUCER_EXTENSION_SIZE)
    return length, batch_crc, base, count, ts, STORAGE_HEADER_SIZE


def unpack_producer(buf, pos: int = 0) -> tuple[int, int] | None:
    """(producer_id, sequence) of the producer extension at ``pos``, or None if torn."""
    producer_id, sequence, ext_crc = PRODUCER_EXTENSION.unpack_from(buf, pos)
    if crc32(memoryview(buf)[pos:pos + PRODUCER_EXTENSION_SIZE - 4]) != ext_crc:
        return None
    return producer_id, sequence


class ProducedBatch(NamedTuple):
    """A stored batch appended under a producer: what rebuilds the producers' state."""

    base_offset: int
    record_count: int
    append_time_ms: int
    producer_id: int
    sequence: int


@dataclass
class ScanResult:
    """What a recovery scan found in a segment file."""

    valid_size: int  # end of the last good batch: anything after it is a torn tail
    end_offset: int
    max_time: int
    index: list[tuple[int, int]]
    problem: str | None  # why the tail after valid_size is unusable, if there is one
    # Corrupt stretches with good batches after them: (first byte, end byte, first offset,
    # end offset). Their bytes stay on disk; reads reaching them fail cleanly.
    damaged: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def first_damage(self) -> int:
        """Position of the first corrupt byte (or valid_size when nothing is damaged)."""
        return self.damaged[0][0] if self.damaged else self.valid_size


class Segment:
    """An open segment file. Appends happen under the owning range's lock; reads are lock-free.

    Readers ``retain()`` a segment while they use its fd; ``delete()`` unlinks the file at once
    and closes the fd when the last reader releases it.
    """

    def __init__(self, directory: str, base_offset: int, index_interval: int, disk: Disk
                 ) -> None:
        self.directory = directory
        self._disk = disk
        self.base_offset = base_offset
        self.path = os.path.join(directory, segment_name(base_offset))
        self.index_path = self.path[:-len(SEGMENT_SUFFIX)] + INDEX_SUFFIX
        self.index_interval = index_interval
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.size = 0
        self.end_offset = base_offset  # offset after the last stored batch
        self.max_time = -1  # newest append_time_ms stored here; -1 when empty
        self._index_offsets: list[int] = []
        self._index_positions: list[int] = []
        self._last_indexed_pos = -index_interval
        self._refs = 0
        self._deleted = False
        self._ref_lock = threading.Lock()
        self.synced_size = 0  # bytes known to be on disk (fsynced)
        self._writeback_from = 0  # bytes below this were handed to the disk (writeback.py)
        # Bytes whose CRCs were checked by this process: written from memory, scanned at
        # recovery, or verified on a read. Reads below it need no second pass over the data.
        self.verified_size = 0
        self.index_written = False

    def __repr__(self) -> str:
        return f"<Segment {self.path} [{self.base_offset}, {self.end_offset}) {self.size} B>"

    @property
    def empty(self) -> bool:
        return self.size == 0

    # -- writing ---------------------------------------------------------------------------

    def write(self, pieces: list, records: list[tuple[int, int, int]], max_time: int) -> None:
        """Append ``pieces`` (storage headers and batch bytes) at the end of the file.

        ``records`` lists (base_offset, record_count, position) of each batch written, for the
        index. On any OS error the file is cut back to its previous size, so a half-written
        batch is never left behind; ENOSPC becomes ``StorageFullError``.
        """
        start = self.size
        total = sum(memoryview(p).nbytes for p in pieces)
        try:
            _pwritev_all(self._disk.write, self.fd, pieces, start)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, start)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(f"disk full writing {self.path}: {exc}") from exc
            raise StorageFullError(f"cannot write {self.path}: {exc}") from exc
        if self.verified_size == start:
            self.verified_size = start + total
        self.size = start + total
        for base, count, pos in records:
            if pos - self._last_indexed_pos >= self.index_interval:
                self._index_offsets.append(base)
                self._index_positions.append(pos)
                self._last_indexed_pos = pos
            self.end_offset = base + count
        self.max_time = max(self.max_time, max_time)

    def start_writeback(self, min_bytes: int = WRITE_BEHIND_BYTES) -> None:
        """Have the disk start on the bytes written since the last call, once there are at
        least ``min_bytes`` of them (write-behind, see writeback.py)."""
        size = self.size
        if size - self._writeback_from >= min_bytes:
            self._disk.start_writeback(self.fd, self._writeback_from,
                                       size - self._writeback_from)
            self._writeback_from = size

    def fsync(self) -> None:
        """Make everything written before the call durable: the data and the file's size
        (``fdatasync``: what reading it back needs, without the times an ``fsync`` also
        writes)."""
        size = self.size
        self._disk.datasync(self.fd)
        self.synced_size = max(self.synced_size, size)

    def write_index(self) -> None:
        """Persist the sparse index (atomically) once the segment no longer grows; nothing
        once the segment is deleted (no index outlives its segment)."""
        head = _INDEX_HEAD.pack(_INDEX_MAGIC, self.base_offset, self.end_offset, self.size,
                                self.max_time, len(self._index_offsets))
        body = b"".join(_INDEX_ENTRY.pack(o, p)
                        for o, p in zip(self._index_offsets, self._index_positions, strict=True))
        data = head + body
        data += _U32.pack(crc32(data))
        with self._ref_lock:  # delete() marks the segment under it before unlinking
            if not self._deleted:
                atomic_write(self.index_path, data)

    def load_index(self) -> bool:
        """Adopt the persisted index if it matches the file; False means: scan instead."""
        try:
            with open(self.index_path, "rb") as f:
                data = f.read()
            file_size = os.fstat(self.fd).st_size
        except OSError:
            return False
        if len(data) < _INDEX_HEAD.size + 4 or crc32(data[:-4]) != _U32.unpack(data[-4:])[0]:
            return False
        magic, base, end, size, max_time, count = _INDEX_HEAD.unpack_from(data)
        if (magic != _INDEX_MAGIC or base != self.base_offset or size != file_size
                or len(data) != _INDEX_HEAD.size + count * _INDEX_ENTRY.size + 4):
            return False
        offsets, positions = [], []
        for i in range(count):
            o, p = _INDEX_ENTRY.unpack_from(data, _INDEX_HEAD.size + i * _INDEX_ENTRY.size)
            offsets.append(o)
            positions.append(p)
        self.size, self.end_offset, self.max_time = size, end, max_time
        self.synced_size, self.index_written = size, True
        self._index_offsets, self._index_positions = offsets, positions
        self._last_indexed_pos = positions[-1] if positions else -self.index_interval
        return True

    # -- recovery --------------------------------------------------------------------------

    def scan(self) -> ScanResult:
        """Walk every stored batch, checking headers, CRCs and offset continuity.

        A bad batch followed by good ones is corruption, not a torn write (appends only ever
        tear at the end): the scan resumes at the next good batch and reports the stretch in
        ``damaged``, so acknowledged batches after it keep their offsets. A bad batch with no
        good one after it is a torn tail, reported in ``problem``.
        """
        file_size = os.fstat(self.fd).st_size
        pos, expect, max_time = 0, self.base_offset, -1
        index: list[tuple[int, int]] = []
        damaged: list[tuple[int, int, int, int]] = []
        last_indexed = -self.index_interval
        problem = None
        valid_end = 0
        mm = _map(self.fd, file_size)
        try:
            view = memoryview(mm) if mm is not None else memoryview(b"")
            try:
                while pos < file_size:
                    fields, why = _check_batch_at(view, pos, file_size, expect, exact=True)
                    if fields is None:
                        found = _resync(mm, view, pos + 1, file_size, expect)
                        if found is None:
                            problem = why
                            break
                        next_pos, next_base = found
                        damaged.append((pos, next_pos, expect, next_base))
                        pos, expect = next_pos, next_base
                        last_indexed = -self.index_interval  # index the batch after it
                        continue
                    length, _, base, count, ts, span = fields
                    if pos - last_indexed >= self.index_interval:
                        index.append((base, pos))
                        last_indexed = pos
                    expect = base + count
                    max_time = max(max_time, ts)
                    pos += span + length
                    valid_end = pos
            finally:
                view.release()
        finally:
            if mm is not None:
                mm.close()
        return ScanResult(valid_end, expect, max_time, index, problem, damaged)

    def adopt_scan(self, result: ScanResult) -> None:
        """Take the scan's valid prefix as the segment's content, cutting off anything after."""
        if os.fstat(self.fd).st_size != result.valid_size:
            os.ftruncate(self.fd, result.valid_size)
        # What survived a process crash may still sit only in the page cache: make it durable
        # before it is served.
        os.fsync(self.fd)
        self.size = self.synced_size = result.valid_size
        self.verified_size = result.first_damage
        self.end_offset = result.end_offset
        self.max_time = result.max_time
        self._index_offsets = [o for o, _ in result.index]
        self._index_positions = [p for _, p in result.index]
        self._last_indexed_pos = (self._index_positions[-1] if self._index_positions
                                  else -self.index_interval)

    def adopt_damaged(self, result: ScanResult, end_offset: int) -> None:
        """Keep a full segment whose middle is corrupt: the valid prefix stays indexed, the
        bytes after it stay on disk, and reads that reach them fail with CorruptDataError."""
        self.size = self.synced_size = os.fstat(self.fd).st_size
        self.verified_size = result.first_damage
        self.end_offset = end_offset
        self.max_time = result.max_time
        self._index_offsets = [o for o, _ in result.index]
        self._index_positions = [p for _, p in result.index]
        self.index_written = True  # never persist an index for it: rescan at each start

    # -- reading ---------------------------------------------------------------------------

    def retain(self) -> bool:
        """Pin the fd for a reader; False if the segment was deleted meanwhile."""
        with self._ref_lock:
            if self._deleted:
                return False
            self._refs += 1
            return True

    def release(self) -> None:
        with self._ref_lock:
            self._refs -= 1
            close = self._deleted and self._refs == 0
        if close:
            self._close_fd()

    def read_batches(self, offset: int, limit_size: int, max_bytes: int, end_offset: int,
                     first: bool) -> list[StoredBatch]:
        """Stored batches from the one containing ``offset``, in order, within the limits.

        Only bytes below ``limit_size`` (the committed size) are looked at. ``max_bytes``
        bounds the total batch bytes, except that the first batch is always returned when
        ``first`` is true. ``end_offset`` (-1: none) stops before batches starting at or after it.
        """
        pos = self._position_for(offset)
        out: list[StoredBatch] = []
        total = 0
        buf = bytearray(STORAGE_HEADER_SIZE)
        while pos + STORAGE_HEADER_SIZE <= limit_size:
            fields = None
            if os.preadv(self.fd, [buf], pos) == STORAGE_HEADER_SIZE:
                fields = unpack_storage_header(buf)
            if fields is None:
                if out:
                    break  # serve the sound batches before it; the next read fails here
                raise CorruptDataError(
                    f"{self.path}: the storage header at byte {pos} is corrupt (reading "
                    f"offset {offset})")
            length, batch_crc, base, count, ts, span = fields
            if end_offset >= 0 and base >= end_offset:
                break
            if base + count <= offset:  # before the wanted offset: skip
                pos += span + length
                continue
            if out or not first:
                if total + length > max_bytes:
                    break
            out.append(StoredBatch(self.fd, pos + span, length, base, count, batch_crc, ts))
            total += length
            pos += span + length
            if total >= max_bytes:
                break
        return out

    def produced_batches(self, limit_size: int) -> list[ProducedBatch]:
        """Every batch below ``limit_size`` (the committed size) that was appended under a
        producer, in order (their headers only are read)."""
        out: list[ProducedBatch] = []
        buf = bytearray(STORAGE_HEADER_SIZE + PRODUCER_EXTENSION_SIZE)
        pos = 0
        while pos + STORAGE_HEADER_SIZE <= limit_size:
            got = os.preadv(self.fd, [buf], pos)
            fields = unpack_storage_header(buf) if got >= STORAGE_HEADER_SIZE else None
            if fields is None:
                break  # damage: the batches before it are what this segment tells
            length, _, base, count, ts, span = fields
            if span > STORAGE_HEADER_SIZE:
                producer = (unpack_producer(buf, STORAGE_HEADER_SIZE) if got >= len(buf)
                            else None)
                if producer is not None:
                    out.append(ProducedBatch(base, count, ts, *producer))
            pos += span + length
        return out

    def _position_for(self, offset: int) -> int:
        i = bisect.bisect_right(self._index_offsets, offset) - 1
        return self._index_positions[i] if i >= 0 else 0

    # -- deleting --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the fd now (shutdown); readers must be gone."""
        with self._ref_lock:
            self._deleted = True
        self._close_fd()

    def delete(self) -> None:
        """Remove the files; the fd closes when the last reader releases it."""
        with self._ref_lock:
            self._deleted = True
            close = self._refs == 0
        for path in (self.path, self.index_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if close:
            self._close_fd()

    def _close_fd(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _check_batch_at(view: memoryview, pos: int, file_size: int, expect: int, exact: bool
                    ) -> tuple[tuple[int, int, int, int, int, int] | None, str]:
    """The stored batch at ``pos`` if it is whole and sound, else (None, why not).

    ``exact``: its base_offset must be ``expect``; otherwise any base_offset >= ``expect``.
    The fields are those of ``unpack_storage_header``.
    """
    if file_size - pos < STORAGE_HEADER_SIZE:
        return None, f"{file_size - pos} trailing bytes at {pos} (torn header)"
    fields = unpack_storage_header(view, pos)
    if fields is None:
        return None, f"storage header at {pos} fails its checksum"
    length, batch_crc, base, count, _, span = fields
    body_at = pos + span
    if span > STORAGE_HEADER_SIZE and (
            body_at > file_size or unpack_producer(view, pos + STORAGE_HEADER_SIZE) is None):
        return None, f"producer extension of the batch at {pos} is torn or fails its checksum"
    if body_at + length > file_size:
        return None, f"batch at {pos} needs {length} bytes, the file ends first (torn)"
    if count < 1 or (base != expect if exact else base < expect):
        return None, f"batch at {pos} has base_offset {base}, expected {expect}"
    if crc32(view[body_at:body_at + length]) != batch_crc:
        return None, f"batch at {pos} (offset {base}) fails its checksum"
    return fields, ""


# A stored batch's envelope starts with this byte, right after the storage header.
_ENVELOPE_MAGIC = b"\x42"


def _resync(mm, view: memoryview, start: int, file_size: int, expect: int
            ) -> tuple[int, int] | None:
    """The first sound batch at or after ``start`` (position, base_offset), or None.

    Candidates are the positions followed by an envelope magic 32 bytes on (48 with a
    producer extension); each must pass every check of a good batch (two or three CRCs), so a
    false match is practically impossible.
    """
    pos = start
    while True:
        hit = mm.find(_ENVELOPE_MAGIC, pos + STORAGE_HEADER_SIZE, file_size)
        if hit < 0:
            return None
        for span in (STORAGE_HEADER_SIZE + PRODUCER_EXTENSION_SIZE, STORAGE_HEADER_SIZE):
            candidate = hit - span
            if candidate < start:
                continue
            fields, _ = _check_batch_at(view, candidate, file_size, expect, exact=False)
            if fields is not None and fields[5] == span:
                return candidate, fields[2]
        pos = hit - STORAGE_HEADER_SIZE + 1


def verify_batches(batches: list[StoredBatch]) -> int:
    """Check every batch's bytes against its stored CRC; return the CRC of them end to end.

    The bytes are mapped, not copied. Raises ``CorruptDataError`` naming the first bad batch.
    """
    if not batches:
        return 0
    fd = batches[0].fd
    start = batches[0].position
    end = batches[-1].position + batches[-1].length
    map_start = start - start % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, end - map_start, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                   prot=mmap.PROT_READ, offset=map_start)
    view = memoryview(mm)
    try:
        combined = 0
        for b in batches:
            at = b.position - map_start
            actual = crc32(view[at:at + b.length])
            if actual != b.crc:
                raise CorruptDataError(
                    f"stored batch at offset {b.base_offset} fails its checksum "
                    f"({actual:#010x} != {b.crc:#010x})", b.base_offset)
            combined = crc32_combine(combined, actual, b.length)
        return combined
    finally:
        view.release()
        mm.close()


def verify_once(segment: Segment, batches: list[StoredBatch]) -> int:
    """``verify_batches`` unless this process already checked those bytes; returns the CRC of
    the batches end to end either way."""
    if not batches:
        return 0
    end = batches[-1].position + batches[-1].length
    if end <= segment.verified_size:
        return combined_crc(batches)
    crc = verify_batches(batches)
    if batches[0].position - STORAGE_HEADER_SIZE <= segment.verified_size:
        segment.verified_size = max(segment.verified_size, end)
    return crc


def combined_crc(batches: list[StoredBatch]) -> int:
    """CRC-32 of the batches end to end, from their stored CRCs (no data is read)."""
    combined = 0
    for b in batches:
        combined = crc32_combine(combined, b.crc, b.length)
    return combined


try:
    from isal.isal_zlib import crc32_combine as _isal_combine

    def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
        """CRC of A+B from crc(A), crc(B) and len(B)."""
        return _isal_combine(crc1, crc2, len2)
except ImportError:  # pragma: no cover - isal is a declared dependency
    def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
        """CRC of A+B from crc(A), crc(B) and len(B) (zlib's GF(2) matrix method)."""
        if len2 <= 0:
            return crc1

        def times(mat: list[int], vec: int) -> int:
            s, i = 0, 0
            while vec:
                if vec & 1:
                    s ^= mat[i]
                vec >>= 1
                i += 1
            return s

        def square(mat: list[int]) -> list[int]:
            return [times(mat, mat[n]) for n in range(32)]

        odd = [0xEDB88320] + [1 << n for n in range(31)]
        even = square(odd)
        odd = square(even)
        while True:
            even = square(odd)
            if len2 & 1:
                crc1 = times(even, crc1)
            len2 >>= 1
            if not len2:
                break
            odd = square(even)
            if len2 & 1:
                crc1 = times(odd, crc1)
            len2 >>= 1
            if not len2:
                break
        return crc1 ^ crc2


def crc32_with_prefix(crc: int, old: bytes, new: bytes, length: int) -> int:
    """The CRC-32 of a ``length``-byte message whose CRC was ``crc`` before its first
    ``len(old)`` bytes changed from ``old`` to ``new``, without reading the rest again.

    CRC-32 is affine over GF(2): for equal lengths, crc(A) ^ crc(B) depends only on A ^ B,
    and a difference confined to the first k bytes is the CRC of that difference (less the
    CRC of k zero bytes) carried across the remaining bytes by ``crc32_combine``."""
    k = len(old)
    if len(new) != k or length < k:
        raise ValueError(f"prefix of {k} bytes replaced by {len(new)} in a {length}-byte message")
    diff = (int.from_bytes(old, "big") ^ int.from_bytes(new, "big")).to_bytes(k, "big")
    return crc ^ crc32_combine(crc32(diff) ^ crc32(bytes(k)), 0, length - k)


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _map(fd: int, size: int) -> mmap.mmap | None:
    if size == 0:
        return None
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


# The most bytes one write call hands the kernel. In the range server here (Linux 6.18, ext4),
# a writer of 4 MiB APPEND frames, each stored with one pwritev, ran at 617-1,121 MB/s, and at
# 1,291-1,405 MB/s with the calls cut at this size. A bare file shows slow runs at every call
# size, at the larger ones more often (integration/bench/write_sizes.py). 1 MiB frames (the
# client's default) never reach the bound.
WRITE_CALL_BYTES = 2 * 1024 * 1024
# The most pieces one call takes (Linux's IOV_MAX).
_MAX_IOV = 1024


def _pwritev_all(write: Callable[[int, Sequence[memoryview], int], int], fd: int, pieces: list,
                 position: int) -> None:
    """Write ``pieces`` back to back at ``position`` with ``write`` (a ``pwritev``), at most
    ``WRITE_CALL_BYTES`` per call, going on after short writes."""
    views = [memoryview(p).cast("B") for p in pieces]
    views = [v for v in views if v.nbytes]
    i = 0
    while i < len(views):
        call, size = [], 0
        for view in views[i:i + _MAX_IOV]:
            if size + view.nbytes > WRITE_CALL_BYTES:
                call.append(view[:WRITE_CALL_BYTES - size])
                break
            call.append(view)
            size += view.nbytes
        written = write(fd, call, position)
        if written <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        position += written
        while written and i < len(views):
            n = views[i].nbytes
            if written >= n:
                written -= n
                i += 1
            else:
                views[i] = views[i][written:]
                written = 0


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old or the new file, never half."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _pwritev_all(os.pwritev, fd, [data], 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")

