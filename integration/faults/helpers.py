"""What the fault cases share: self-checking record bodies, writer and reader threads, and the
checks every case ends with.

Every batch body names its stream and a sequence number and ends with a CRC-32 of the rest, so a
reader can tell a corrupted or foreign batch from a good one without knowing what was written,
and duplicates show up as a repeated sequence number.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from integration.netlab.reaper import dying_with_parent
from sbp_spark.client import ClientConfig, SbpClient
from sbp_spark.protocol.errors import SbpError, ServerError
from sbp_spark.protocol.records import ENVELOPE_SIZE, BatchHeader, batch_bytes

# Enough retrying to ride out a process restart (a cold interpreter: about a second) and a PD
# failover (three missed heartbeats: about three seconds).
RIDE_OUT = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retries=200,
                        retry_backoff_ms=20, retry_backoff_max_ms=250, retry_deadline_s=60)

_TRAILER = struct.Struct(">I")


def make_body(stream_id: int, seq: int, size: int = 256, note: str = "") -> bytes:
    """A body of about ``size`` bytes naming ``stream_id`` and ``seq`` (then ``note``, words
    of the writer's own), with a CRC trailer."""
    head = f"s{stream_id:06d} n{seq:09d} {note + ' ' if note else ''}".encode()
    filler = (head * (size // len(head) + 1))[:max(size - len(head) - 4, 0)]
    core = head + filler
    return core + _TRAILER.pack(zlib.crc32(core))


def check_body(body: bytes) -> tuple[int, int]:
    """(stream_id, seq) of a body made by ``make_body``; ValueError if it is damaged."""
    if len(body) < 22:
        raise ValueError(f"body of {len(body)} bytes is too short")
    core, (crc,) = body[:-4], _TRAILER.unpack(body[-4:])
    if zlib.crc32(core) != crc:
        raise ValueError(f"body fails its CRC: {body[:24]!r}...")
    try:
        return int(core[1:7]), int(core[9:18])
    except ValueError:
        raise ValueError(f"body does not name a stream and sequence: {body[:24]!r}") from None


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.02)


@contextmanager
def busy_cores(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` processes spinning on the CPU while the block runs: a busy neighbour. Each is
    a child of this thread that dies with it (``reaper.dying_with_parent``), so a killed run
    leaves none spinning; on the way out they are killed."""
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            spinners.append(subprocess.Popen(
                [sys.executable, "-c", "while True: pass"], preexec_fn=dying_with_parent(),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        yield spinners
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait(10)


class Writer(threading.Thread):
    """Appends numbered batches to one stream until stopped; keeps what was acknowledged."""

    def __init__(self, client: SbpClient, stream_id: int, batches_per_append: int = 8,
                 body_size: int = 256, light: bool = False, pause_s: float = 0.0) -> None:
        super().__init__(name=f"writer-{stream_id}", daemon=True)
        self.client = client
        self.stream_id = stream_id
        self.batches_per_append = batches_per_append
        self.body_size = body_size
        self.light = light
        self.pause_s = pause_s  # between appends: a steady rate instead of as fast as it can
        # base_offset -> body (light: the body's CRC-32, for long runs)
        self.acked: dict[int, bytes | int] = {}
        self.acked_bytes = 0
        self.failures: list[SbpError] = []
        self.stop = threading.Event()
        self.last_ack = time.monotonic()
        self.longest_stall_s = 0.0  # longest time between two acknowledged appends
        self._seq = 0

    def run(self) -> None:
        writer = self.client.open_stream(self.stream_id)
        while not self.stop.is_set():
            bodies = []
            for _ in range(self.batches_per_append):
                self._seq += 1
                bodies.append(make_body(self.stream_id, self._seq, self.body_size))
            try:
                done = writer.append([batch_bytes(b) for b in bodies])
            except SbpError as exc:  # gave up on these: unacknowledged, may or may not exist
                self.failures.append(exc)
                continue
            now = time.monotonic()
            self.longest_stall_s = max(self.longest_stall_s, now - self.last_ack)
            self.last_ack = now
            for appended, body in zip(done, bodies, strict=True):
                self.acked[appended.base_offset] = zlib.crc32(body) if self.light else body
                self.acked_bytes += len(body)
            if self.pause_s:
                self.stop.wait(self.pause_s)

    def wait_for_more(self, count: int, timeout: float = 60.0) -> None:
        """Block until ``count`` more batches were acknowledged."""
        target = len(self.acked) + count
        wait_until(lambda: len(self.acked) >= target or not self.is_alive(), timeout,
                   f"stream {self.stream_id} to get {count} more acknowledged batches "
                   f"(failures: {self.failures[-3:]})")
        assert len(self.acked) >= target, f"writer of stream {self.stream_id} died"

    def finish(self, timeout: float = 60.0) -> None:
        self.stop.set()
        self.join(timeout)
        assert not self.is_alive(), f"writer of stream {self.stream_id} did not stop"


@dataclass
class StreamCheck:
    """What a full read of a stream found."""

    stream_id: int
    batches: int = 0
    records: int = 0
    end: int = 0
    bad_bodies: list[int] = field(default_factory=list)  # offsets of damaged batches
    holes: list[int] = field(default_factory=list)  # offsets where a gap begins
    duplicates: list[int] = field(default_factory=list)  # seqs stored more than once
    lost: list[int] = field(default_factory=list)  # acknowledged offsets missing or changed

    @property
    def ok(self) -> bool:
        return not (self.bad_bodies or self.holes or self.lost)

    def summary(self) -> str:
        return (f"stream {self.stream_id}: {self.batches} batches, offsets [0, {self.end}), "
                f"{len(self.bad_bodies)} corrupt, {len(self.holes)} holes, "
                f"{len(self.lost)} acknowledged lost, {len(self.duplicates)} duplicated "
                "(at-least-once retries)")


def check_batches(stream_id: int, batches: Iterator,
                  acked: dict[int, bytes | int] | None = None, start: int = 0) -> StreamCheck:
    """Check a stream's batches read from ``start``: valid bodies of this stream, offsets
    without holes, and every acknowledged batch where its acknowledgement said."""
    result = StreamCheck(stream_id)
    expected = start
    stored: dict[int, int] = {}  # base_offset -> CRC-32 of the body
    seen: set[int] = set()
    for b in batches:
        base, count = b.header.base_offset, b.header.record_count
        if base + count <= expected and base in stored:
            continue  # the same batch again (a resumed read): not a new record
        if base != expected:
            result.holes.append(expected)
        expected = base + count
        body = bytes(memoryview(b.data)[ENVELOPE_SIZE:])
        stored[base] = zlib.crc32(body)
        result.batches += 1
        result.records += count
        try:
            sid, seq = check_body(body)
        except ValueError:
            result.bad_bodies.append(base)
            continue
        if sid != stream_id:
            result.bad_bodies.append(base)
        elif seq in seen:
            result.duplicates.append(seq)
        seen.add(seq)
    result.end = expected
    if acked:
        result.lost = sorted(o for o, want in acked.items() if stored.get(o) != (
            want if isinstance(want, int) else zlib.crc32(want)))
    return result


def check_stream(client: SbpClient, stream_id: int,
                 acked: dict[int, bytes | int] | None = None) -> StreamCheck:
    """Read a whole stream and check it (see ``check_batches``)."""
    return check_batches(stream_id, client.read(stream_id), acked)


def range_at(client: SbpClient, stream_id: int, offset: int):
    """The range of ``stream_id`` holding (or, open, due to hold) ``offset``, as the PD lists
    it now; None when there is none yet (the PD has not opened the next range)."""
    for rng in client.list_ranges(stream_id):
        if rng.start_offset <= offset and (rng.is_open or offset < rng.end_offset):
            return rng
    return None


class Seen(NamedTuple):
    """A batch a reader kept (a copy: the client's view dies with its frame)."""

    header: BatchHeader
    data: bytes
    server: str = ""  # the replica that served it


class StreamFollower(ABC):
    """Follows a stream like a streaming reader: long-polls its open range, moves on when it is
    sealed, rides out server failures. Subclasses say what to do with each new batch
    (``_got``), with a failure (``_failed``: raise to stop) and when to stop (``_stopped``)."""

    client: SbpClient
    stream_id: int
    wait_ms: int
    offset: int

    def _range_at(self, offset: int):
        return range_at(self.client, self.stream_id, offset)

    @abstractmethod
    def _got(self, batch) -> None:
        """A batch past the offset read so far (the offset moves past it afterwards)."""

    @abstractmethod
    def _failed(self, error: SbpError) -> None:
        """A read failed; raise to stop following."""

    @abstractmethod
    def _stopped(self) -> bool:
        """Whether to stop following."""

    def _pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def _follow(self) -> None:
        while not self._stopped():
            try:
                rng = self._range_at(self.offset)
                if rng is None:
                    self._pause(0.05)  # the PD has not opened the next range yet
                    continue
                for b in self.client.fetch(rng, self.offset,
                                           max_wait_ms=self.wait_ms if rng.is_open else 0):
                    if b.header.end_offset <= self.offset:
                        continue
                    self._got(b)
                    self.offset = b.header.end_offset
                    if self._stopped():
                        break
            except SbpError as exc:
                self._failed(exc)
                self._pause(0.05)  # a server is down or moving: ask the PD again shortly


class Tail(StreamFollower, threading.Thread):
    """Follows a stream from offset 0 (see ``StreamFollower``); checks every batch it gets."""

    def __init__(self, client: SbpClient, stream_id: int, wait_ms: int = 200,
                 light: bool = False) -> None:
        super().__init__(name=f"tail-{stream_id}", daemon=True)
        self.client = client
        self.stream_id = stream_id
        self.wait_ms = wait_ms
        self.offset = 0
        # light: check each batch as it arrives and keep only counts (for long runs)
        self.light = light
        self.inline = StreamCheck(stream_id)
        self.bytes_read = 0
        self._seqs: set[int] = set()
        self.batches: list[Seen] = []
        self.errors: list[SbpError] = []
        self.stop = threading.Event()
        self.fatal: BaseException | None = None

    def run(self) -> None:
        try:
            self._follow()
        except BaseException as exc:  # reported by the test through .fatal
            self.fatal = exc

    def _stopped(self) -> bool:
        return self.stop.is_set()

    def _got(self, b) -> None:
        if self.light:
            self._check_inline(b)
        else:
            self.batches.append(Seen(b.header, bytes(b.data), b.server))
        self.bytes_read += b.header.batch_length

    def _failed(self, error: SbpError) -> None:
        if isinstance(error, ServerError) and not error.retriable:
            raise error
        self.errors.append(error)

    def _check_inline(self, b) -> None:
        c = self.inline
        if b.header.base_offset != self.offset:
            c.holes.append(self.offset)
        c.batches += 1
        c.records += b.header.record_count
        c.end = b.header.end_offset
        try:
            sid, seq = check_body(bytes(b.data[ENVELOPE_SIZE:]))
        except ValueError:
            c.bad_bodies.append(b.header.base_offset)
            return
        if sid != self.stream_id:
            c.bad_bodies.append(b.header.base_offset)
        elif seq in self._seqs:
            c.duplicates.append(seq)
        self._seqs.add(seq)

    def caught_up_to(self, end: int, timeout: float = 60.0) -> None:
        wait_until(lambda: self.offset >= end or self.fatal is not None, timeout,
                   f"the tail of stream {self.stream_id} to reach {end} (at {self.offset})")
        assert self.fatal is None, f"tail failed: {self.fatal!r}"

    def finish(self, end: int) -> None:
        """Wait until the tail reached ``end``, then stop it (also when the wait fails)."""
        try:
            self.caught_up_to(end)
        finally:
            self.stop.set()
            self.join(30)

    def check(self, acked: dict[int, bytes | int]) -> StreamCheck:
        """What the tail saw (light: checked as it came, without the acknowledged bodies)."""
        if self.light:
            return self.inline
        return check_batches(self.stream_id, iter(self.batches), acked)


class Writers(list):
    """``Writer`` threads for several streams, started on entering and stopped on leaving."""

    def __init__(self, client: SbpClient, stream_ids: list[int], **kwargs) -> None:
        super().__init__(Writer(client, sid, **kwargs) for sid in stream_ids)

    def __enter__(self) -> Writers:
        for writer in self:
            writer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        for writer in self:
            writer.finish()

    def wait_for_more(self, count: int, timeout: float = 60.0) -> None:
        """Block until every writer got ``count`` more batches acknowledged."""
        for writer in self:
            writer.wait_for_more(count, timeout)
