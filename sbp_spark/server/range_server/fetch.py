"""FETCH on a range server: wait for data (long poll), then stream whole batches in frames.

A request's entries are served together: the long poll waits until the entries together have
``min_bytes`` committed below their ends (or ``max_wait_ms`` passes, or an entry holds every
batch below its ``end_offset``: waiting cannot bring it more), then the server sends frames of
whole batches for one or more entries (WIRE.md 10), until each entry reached its
``end_offset``, its ``batch_max_bytes`` budget, or the data that was committed when streaming
began. A frame holds at most ``frame_bytes`` (1 MiB) read into memory, and up to
``sendfile_frame_bytes`` (4 MiB) in all: bytes sent from the file cost no memory while a slow
client keeps the frame waiting, and fewer, larger frames cost both sides less per byte (1 MiB
batches, alternating runs: about 10% more MB/s and 8% less server CPU per GiB than 1 MiB
frames).

Large batches leave the segment file by ``os.sendfile``; runs of small batches are read with one
``pread`` and sent with ``sendmsg`` (one sendfile call per 100-byte batch would cost more than
the copy).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ...protocol.errors import (
    ErrorCode,
    RangeNotFoundError,
    RangeSealedError,
    ServerError,
    StreamNotFoundError,
)
from ...protocol.frame import crc32
from ...protocol.messages import FetchEntry, FetchRequest, FetchResponse, FetchResult, Status
from ..net import ConnectionClosed, FileRegion, RequestContext
from ..storage.range_log import RangeLog, ReadChunk
from ..storage.segment import CorruptDataError, StoredBatch, crc32_combine
from .metrics import Metrics

log = logging.getLogger(__name__)

# Target payload of one FETCH response frame: large enough to amortise the header and the
# syscalls, small enough that the client starts decoding while the server still sends.
DEFAULT_FETCH_FRAME_BYTES = 1024 * 1024
# Target size of a frame whose batches are sent from the segment file (no memory held).
DEFAULT_SENDFILE_FRAME_BYTES = 4 * 1024 * 1024
# Below this average batch size a chunk is read with one pread and sent from memory instead of
# one sendfile call per batch.
SENDFILE_MIN_BATCH_BYTES = 64 * 1024
# Longest long poll a request may ask for; longer waits are cut to this.
MAX_FETCH_WAIT_MS = 60_000
# Extra header bytes one FetchResult may add to a frame (for the frame-size guard).
_RESULT_HEADER_BYTES = 64
_RESPONSE_HEADER_BYTES = 64
_FRAME_PAYLOAD_LIMIT = 16 * 1024 * 1024 - 16


@dataclass
class _Entry:
    req: FetchEntry
    offset: int
    remaining: int
    status: Status | None = None  # set on error: answered with it, nothing more sent
    done: bool = False
    sent_bytes: int = 0
    reported: bool = False
    stop: int = -1  # where streaming stops for the current range (end bound or snapshot)
    corrupt: CorruptDataError | None = None  # found at ``stop``: reported once there
    rlog: RangeLog | None = field(default=None, repr=False)

    def fail(self, exc: ServerError) -> None:
        self.status = Status(int(exc.code), exc.message)
        self.done = True


def validate_entry(entry: FetchEntry) -> str | None:
    """Why ``entry`` cannot be served, or None."""
    if entry.stream_id < 0:
        return f"stream_id {entry.stream_id} must be >= 0"
    if entry.fetch_offset < 0:
        return f"fetch_offset {entry.fetch_offset} of stream {entry.stream_id} must be >= 0"
    if entry.batch_max_bytes <= 0:
        return (f"batch_max_bytes {entry.batch_max_bytes} of stream {entry.stream_id} "
                f"must be > 0")
    if entry.end_offset < -1:
        return f"end_offset {entry.end_offset} of stream {entry.stream_id} must be >= -1"
    if entry.end_offset != -1 and entry.end_offset < entry.fetch_offset:
        return (f"end_offset {entry.end_offset} of stream {entry.stream_id} is below "
                f"fetch_offset {entry.fetch_offset}")
    return None


class FetchSource(Protocol):
    """The local ranges, as FETCH reads them (the storage)."""

    def stream_ranges(self, stream_id: int) -> list[RangeLog]: ...

    def find_range(self, stream_id: int, offset: int) -> RangeLog | None: ...

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool: ...


class FetchServer:
    """Serves FETCH requests from the local ranges, and counts them in ``metrics``."""

    def __init__(self, source: FetchSource, metrics: Metrics,
                 frame_bytes: int = DEFAULT_FETCH_FRAME_BYTES, verify_reads: bool = True,
                 sendfile_frame_bytes: int = DEFAULT_SENDFILE_FRAME_BYTES) -> None:
        self.source = source
        self.metrics = metrics
        self.frame_bytes = frame_bytes  # read into memory, per frame
        self.sendfile_frame_bytes = max(frame_bytes, sendfile_frame_bytes)  # in all, per frame
        self.verify_reads = verify_reads

    def _full(self, frame: _FrameBuilder) -> bool:
        return (frame.nbytes >= self.sendfile_frame_bytes
                or frame.memory_bytes >= self.frame_bytes)

    # -- entry resolution ------------------------------------------------------------------

    def _resolve(self, e: _Entry) -> RangeLog | None:
        """Find the range for the entry's offset; fails or finishes the entry when there is
        nothing to serve. Returns None when the entry is done."""
        sid = e.req.stream_id
        ranges = self.source.stream_ranges(sid)
        if not ranges:
            e.fail(RangeNotFoundError(f"stream {sid} has no range on this server"))
            return None
        if any(r.deleted for r in ranges):
            e.fail(StreamNotFoundError(f"stream {sid} was deleted"))
            return None
        bound = e.req.end_offset
        if bound >= 0 and e.offset >= bound:
            e.done = True
            return None
        rlog = self.source.find_range(sid, e.offset)
        if rlog is None:
            # Below every range held here: an earlier range lives on other servers.
            e.fail(RangeNotFoundError(
                f"offset {e.offset} of stream {sid} is in a range not held by this server "
                f"(its ranges here start at {ranges[0].base_start_offset})"))
            return None
        if rlog.sealed and e.offset > rlog.end_offset:
            e.fail(RangeNotFoundError(
                f"offset {e.offset} of stream {sid} is past the end {rlog.end_offset} of range "
                f"{rlog.range_index}; the range holding it is not on this server"))
            return None
        try:
            rlog.check_readable(e.offset)
        except ServerError as exc:
            e.fail(exc)
            return None
        if rlog.sealed and e.offset >= rlog.end_offset:
            if rlog.end_pending:
                e.fail(RangeSealedError(
                    f"range {sid}/{rlog.range_index} is sealed here at {rlog.end_offset}, "
                    f"and the PD has not recorded its end yet: other replicas may hold more "
                    f"of it (ask the PD where it ends)"))
            else:
                e.fail(RangeSealedError(
                    f"range {sid}/{rlog.range_index} is sealed at {rlog.end_offset}; the "
                    f"stream continues in the next range (ask the PD)"))
            return None
        if e.rlog is not rlog:
            e.rlog = rlog
            snapshot = rlog.readable_offset
            e.stop = snapshot if bound < 0 else min(bound, snapshot)
        return rlog

    def _ready_bytes(self, entries: list[_Entry], min_bytes: int) -> int:
        """The bytes the entries would get now, counted up to ``min_bytes`` (at least
        ``max(min_bytes, 1)`` when the poll should end at once: an entry that will not change,
        one on a sealed range whose readers see all they ever will, or one that already holds
        every batch below its ``end_offset``)."""
        total = 0
        for e in entries:
            if e.done:
                continue
            rlog = self.source.find_range(e.req.stream_id, e.offset)
            if rlog is None:
                continue
            if rlog.deleted or e.offset < rlog.start_offset or (
                    rlog.sealed and e.offset >= min(rlog.end_offset, rlog.written_offset)):
                # Answer now: a deleted stream, a trimmed offset, RANGE_SEALED or a tail sealed
                # here but never stored (DATA_CORRUPT) will not change.
                return max(min_bytes, 1)
            readable = rlog.readable_offset
            if readable <= e.offset:
                continue
            if min_bytes <= 1:
                return 1
            if rlog.sealed and rlog.read_cap is None:
                # Sealed, with no cap left to rise: what is readable now is all it will hold.
                return min_bytes
            bound = e.req.end_offset
            if 0 <= bound <= min(readable, rlog.next_offset):
                # Every batch below the entry's end is here: waiting cannot bring it more.
                return min_bytes
            # Short of its end, nothing at or past it is readable yet: every byte counted
            # here is one the entry gets.
            total += rlog.available_bytes(e.offset, min_bytes - total)
            if total >= min_bytes:
                break
        return total

    # -- serving ---------------------------------------------------------------------------

    def serve(self, ctx: RequestContext, req: FetchRequest) -> None:
        """Answer one FETCH request on ``ctx`` (one or more frames, the last with END).

        Raises ``ConnectionClosed`` when the reader's connection is gone, which the network
        core takes as the request given up: a reader that left is no failure (nor a failed
        fetch in the metrics)."""
        metrics = self.metrics
        started = time.monotonic()
        metrics.fetches += 1
        try:
            self._serve(ctx, req)
        except ConnectionClosed:
            raise
        except BaseException:
            metrics.failed_fetches += 1
            raise
        finally:
            metrics.fetch_latency_s += time.monotonic() - started
        for fe in req.fetch_requests:
            rlog = self.source.find_range(fe.stream_id, fe.fetch_offset)
            if rlog is not None:
                metrics.touch(rlog)

    def _serve(self, ctx: RequestContext, req: FetchRequest) -> None:
        if req.max_wait_ms < 0 or req.min_bytes < 0:
            ctx.reply(FetchResponse(status=Status(
                ErrorCode.INVALID_REQUEST,
                f"max_wait_ms {req.max_wait_ms} and min_bytes {req.min_bytes} must be >= 0")))
            return
        entries: list[_Entry] = []
        for fe in req.fetch_requests:
            e = _Entry(fe, fe.fetch_offset, fe.batch_max_bytes)
            problem = validate_entry(fe)
            if problem is not None:
                e.status = Status(ErrorCode.INVALID_REQUEST, problem)
                e.done = True
            entries.append(e)
        for e in entries:
            if not e.done:
                self._resolve(e)
        if req.max_wait_ms > 0:
            self._long_poll(ctx, entries, min(req.max_wait_ms, MAX_FETCH_WAIT_MS),
                            req.min_bytes)
        if ctx.conn.closed:
            # The reader left during the long poll (or while this server was paused, so the
            # poll's end and the closed connection are found together): there is nobody to
            # answer. Said as the send would say it, so the request is given up quietly
            # rather than taken for one the handler forgot to answer.
            raise ConnectionClosed(f"the reader at {ctx.conn.peer_str} left during the "
                                   f"long poll")
        for e in entries:
            e.rlog = None  # streaming snapshots the committed end afresh
        self._stream(ctx, entries)

    def _long_poll(self, ctx: RequestContext, entries: list[_Entry], max_wait_ms: int,
                   min_bytes: int) -> None:
        if all(e.done for e in entries):
            return
        want = max(min_bytes, 1)
        deadline = time.monotonic() + max_wait_ms / 1000.0
        while not ctx.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ctx.check_access()  # a permission revoked meanwhile ends the wait
            # Wake at least twice a second to notice a closed connection.
            if self.source.wait_for(
                    lambda: ctx.stopping or self._ready_bytes(entries, min_bytes) >= want,
                    min(left, 0.5)):
                return

    def _stream(self, ctx: RequestContext, entries: list[_Entry]) -> None:
        frame = _FrameBuilder(ctx, self.verify_reads)
        try:
            while True:
                for e in entries:
                    if e.done:
                        continue
                    if self._full(frame):
                        break
                    self._fill(frame, e)
                    if frame.nbytes and frame.overflow:
                        break
                pending = [e for e in entries if not e.done]
                if not pending:
                    break
                if frame.empty:
                    # Nothing fit and nothing failed: cannot happen with a correct storage;
                    # guard against spinning anyway.
                    for e in pending:
                        e.done = True
                    break
                frame.flush(end=False)
            unreported = [e for e in entries if not e.reported]
            if unreported and (frame.nbytes + len(unreported) * _RESULT_HEADER_BYTES
                               > _FRAME_PAYLOAD_LIMIT - _RESPONSE_HEADER_BYTES):
                frame.flush(end=False)
            for e in unreported:
                frame.add_result(e, None)
            frame.flush(end=True)
        finally:
            frame.release()

    def _fill(self, frame: _FrameBuilder, e: _Entry) -> None:
        """Add as many of the entry's batches to ``frame`` as fit."""
        while not e.done:
            rlog = self._resolve(e)
            if rlog is None:
                if e.status is not None:
                    frame.add_result(e, None)
                return
            if e.offset >= e.stop:
                if e.corrupt is not None:
                    self._corrupt(frame, e, e.corrupt)
                    return
                e.done = True  # caught up with what was committed when streaming began
                return
            # Each read fits what the frame may still take into memory (it may turn out to be
            # sent from the file, and the loop then reads on).
            room = min(self.frame_bytes - frame.memory_bytes,
                       self.sendfile_frame_bytes - frame.nbytes)
            budget = min(room, e.remaining)
            try:
                chunk = rlog.read(e.offset, budget, e.stop, first=frame.empty)
            except ServerError as exc:
                e.fail(exc)
                frame.add_result(e, None)
                return
            except CorruptDataError as exc:
                self._corrupt(frame, e, exc)
                return
            if not chunk.batches:
                if frame.empty or (budget == e.remaining and e.sent_bytes):
                    # Nothing here (or the next batch exceeds what is left of the budget).
                    e.done = True
                else:
                    # The next batch needs a frame of its own (an entry's first batch goes
                    # even past its budget, but only as the first of a frame).
                    frame.overflow = True
                return
            if e.sent_bytes and chunk.batches[0].length > e.remaining:
                chunk.release()
                e.done = True
                return
            try:
                frame.add_chunk(e, chunk)
            except CorruptDataError as exc:
                if exc.offset > e.offset:
                    # Serve the sound batches before the bad one, then report it.
                    e.stop, e.corrupt = exc.offset, exc
                    continue
                self._corrupt(frame, e, exc)
                return
            e.offset = chunk.next_offset
            e.remaining -= chunk.nbytes
            e.sent_bytes += chunk.nbytes
            if e.remaining <= 0:
                e.done = True
            if self._full(frame):
                return


    @staticmethod
    def _corrupt(frame: _FrameBuilder, e: _Entry, exc: CorruptDataError) -> None:
        """Answer the entry DATA_CORRUPT: the reader takes the rest from another replica."""
        offset = exc.offset if exc.offset >= 0 else e.offset
        log.error("fetch of stream %d at %d: stored data is corrupt at offset %d: %s",
                  e.req.stream_id, e.offset, offset, exc)
        e.status = Status(ErrorCode.DATA_CORRUPT,
                          f"stored copy of stream {e.req.stream_id} is corrupt at offset "
                          f"{offset} on this server: {exc}")
        e.done = True
        frame.add_result(e, None)


class _FrameBuilder:
    """One FETCH response frame being assembled: results, payload parts and their CRC."""

    def __init__(self, ctx: RequestContext, verify: bool) -> None:
        self.ctx = ctx
        self.verify = verify
        self._reset()

    def _reset(self) -> None:
        self.results: list[FetchResult] = []
        self.parts: list = []
        self.crc = 0
        self.nbytes = 0
        self.chunks: list[ReadChunk] = []
        self.overflow = False
        self.memory_bytes = 0  # payload read into memory (not sent from the file)

    @property
    def empty(self) -> bool:
        return self.nbytes == 0

    def add_result(self, e: _Entry, nbytes: int | None) -> None:
        status = e.status if e.status is not None else Status()
        self.results.append(FetchResult(e.req.stream_id, e.req.request_index, nbytes or 0,
                                        status))
        e.reported = True

    def add_chunk(self, e: _Entry, chunk: ReadChunk) -> None:
        batches = chunk.batches
        try:
            if chunk.nbytes >= SENDFILE_MIN_BATCH_BYTES * len(batches):
                crc = chunk.checked_crc() if self.verify else chunk.crc
                parts: list = [FileRegion(b.fd, b.position, b.length) for b in batches]
            else:
                parts, crc = _read_small(batches, self.verify and not chunk.verified)
                self.memory_bytes += chunk.nbytes
        except BaseException:
            chunk.release()
            raise
        self.chunks.append(chunk)
        self.parts += parts
        self.crc = crc32_combine(self.crc, crc, chunk.nbytes)
        self.nbytes += chunk.nbytes
        self.add_result(e, chunk.nbytes)

    def flush(self, end: bool) -> None:
        header = FetchResponse(fetch_responses=self.results).to_flatbuffers()
        try:
            self.ctx.send_with_regions(header, self.parts, self.crc, end=end)
        finally:
            self.release()
            self._reset()

    def release(self) -> None:
        for chunk in self.chunks:
            chunk.release()
        self.chunks = []


def _read_small(batches: list[StoredBatch], verify: bool) -> tuple[list[memoryview], int]:
    """Read a run of small batches with one pread; returns views of each batch and the CRC."""
    first, last = batches[0], batches[-1]
    span = last.position + last.length - first.position
    buf = bytearray(span)
    view = memoryview(buf)
    got = os.preadv(first.fd, [buf], first.position)
    if got != span:
        raise CorruptDataError(f"short read: {got} of {span} bytes at {first.position}")
    parts = []
    combined = 0
    for b in batches:
        at = b.position - first.position
        piece = view[at:at + b.length]
        if verify:
            actual = crc32(piece)
            if actual != b.crc:
                raise CorruptDataError(
                    f"stored batch at offset {b.base_offset} fails its checksum "
                    f"({actual:#010x} != {b.crc:#010x})", b.base_offset)
        parts.append(piece)
        combined = crc32_combine(combined, b.crc, b.length)
    return parts, combined
