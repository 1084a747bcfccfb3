"""SBP frames: encoding to buffer lists and an incremental, sans-IO decoder (docs/wire.md:
Framing, Checksum, Bad frames).

Layout (big-endian)::

    frame_length u32 | magic u8 | opcode u16 | flags u8 | stream_id u32 |
    header_format u8 | header_length u24 | header | payload | crc32(payload) u32

``frame_length`` counts every byte after itself. The decoder never trusts a length before it has
checked it against the limits, so a hostile peer cannot make it allocate more than one frame.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

from .constants import (
    CHECKSUM_SIZE,
    FIXED_HEADER_SIZE,
    HEADER_FORMAT_FLATBUFFERS,
    MAGIC,
    MAX_FRAME_LENGTH,
    MAX_HEADER_LENGTH,
    MIN_FRAME_LENGTH,
    Flags,
)
from .errors import ChecksumError, FrameError, HeaderError, ProtocolError

try:  # isal's crc32 gives the same IEEE result as zlib's, about ten times faster.
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a declared dependency
    from zlib import crc32 as _crc32

Buffer = bytes | bytearray | memoryview

_PREFIX = struct.Struct(">IBHBIBBH")  # length, magic, opcode, flags, stream_id, fmt, hlen(u24)
_U32 = struct.Struct(">I")
# The flags as plain ints: testing a frame's flags against the IntFlag members built a new
# member on every test, on every frame.
_RESPONSE, _END, _SYSTEM_ERROR = int(Flags.RESPONSE), int(Flags.END), int(Flags.SYSTEM_ERROR)

# Receive buffer for small frames and frame prefixes. Bodies of frames larger than this are read
# straight into a buffer of their own; 256 KiB pieces measured fastest on loopback.
RECEIVE_CHUNK = 256 * 1024
# Frames with a wrong magic are skipped (docs/wire.md, Bad frames); a peer that keeps sending
# them is not speaking SBP, so after this many the connection is given up.
MAX_BAD_MAGIC_FRAMES = 8


def crc32(data: Buffer, value: int = 0) -> int:
    """IEEE CRC-32 (the value ``zlib.crc32`` computes), continuing from ``value``."""
    return _crc32(data, value)


@dataclass(slots=True)
class Frame:
    """One decoded frame. ``header`` and ``payload`` are views into the received bytes."""

    opcode: int
    flags: int
    stream_id: int
    header: Buffer = b""
    payload: Buffer = b""
    header_format: int = HEADER_FORMAT_FLATBUFFERS
    # The payload's CRC-32, once a decoder has checked it against the frame's trailer.
    payload_crc: int | None = None

    @property
    def is_response(self) -> bool:
        return bool(self.flags & _RESPONSE)

    @property
    def is_end(self) -> bool:
        return bool(self.flags & _END)

    @property
    def is_system_error(self) -> bool:
        return bool(self.flags & _SYSTEM_ERROR)


@dataclass(slots=True)
class InvalidFrame:
    """A frame whose framing was intact but whose content is not acceptable.

    The receiver answers it on ``stream_id`` (SYSTEM_ERROR) instead of closing the connection.
    """

    opcode: int
    flags: int
    stream_id: int
    error: ProtocolError


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def frame_prefix(
    opcode: int,
    flags: int,
    stream_id: int,
    header_length: int,
    payload_length: int,
    header_format: int = HEADER_FORMAT_FLATBUFFERS,
) -> bytes:
    """The 16 bytes before a frame's header, after checking every limit."""
    if header_length > MAX_HEADER_LENGTH:
        raise ProtocolError(f"header of {header_length} bytes exceeds the u24 header_length field")
    frame_length = MIN_FRAME_LENGTH + header_length + payload_length
    if frame_length > MAX_FRAME_LENGTH:
        raise ProtocolError(
            f"frame of {frame_length} bytes exceeds the {MAX_FRAME_LENGTH}-byte frame limit "
            f"(header {header_length}, payload {payload_length})"
        )
    if not 0 <= stream_id <= 0xFFFFFFFF:
        raise ProtocolError(f"stream_id {stream_id} does not fit in 32 bits")
    return _PREFIX.pack(
        frame_length, MAGIC, opcode, flags, stream_id, header_format,
        header_length >> 16, header_length & 0xFFFF,
    )


def checksum_trailer(payload_crc: int) -> bytes:
    """The 4-byte trailer carrying a payload's CRC-32."""
    return _U32.pack(payload_crc)


def encode_frame(
    opcode: int,
    flags: int,
    stream_id: int,
    header: Buffer = b"",
    payload: Buffer | Sequence[Buffer] = b"",
    header_format: int = HEADER_FORMAT_FLATBUFFERS,
) -> list[Buffer]:
    """A frame as a list of buffers for ``socket.sendmsg``; payload buffers are not copied.

    ``payload`` may be one buffer or a sequence of buffers laid end to end (an APPEND frame's
    record batches, for instance).
    """
    pieces = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    crc = 0
    payload_length = 0
    for piece in pieces:
        crc = _crc32(piece, crc)
        payload_length += _nbytes(piece)
    prefix = frame_prefix(opcode, flags, stream_id, _nbytes(header), payload_length, header_format)
    out: list[Buffer] = [prefix + bytes(header) if header else prefix]
    out.extend(p for p in pieces if _nbytes(p))
    out.append(_U32.pack(crc))
    return out


def frame_bytes(*args, **kwargs) -> bytes:
    """``encode_frame`` joined into one bytes object (tests, small control frames)."""
    return b"".join(encode_frame(*args, **kwargs))


class FrameDecoder:
    """Turns received bytes, in chunks of any size, into ``Frame`` and ``InvalidFrame`` events.

    Two ways to give it bytes:

    * ``feed(data)`` copies ``data`` in (tests, fuzzing, small peers);
    * ``buf = get_buffer(); n = sock.recv_into(buf); buffer_updated(n)`` lets the socket write
      straight into the decoder's memory. A large frame's body gets a buffer of its own, so
      its payload reaches the caller without being copied again.

    Fatal framing errors raise ``FrameError``; afterwards the decoder refuses more input.
    """

    def __init__(self, max_frame_length: int = MAX_FRAME_LENGTH,
                 allocate: Callable[[int], bytearray] | None = None) -> None:
        """``allocate(n)``, when given, supplies the writable buffer of exactly ``n`` bytes a
        large frame's body is received into (default: a new ``bytearray``), so a receiver can
        recycle buffers whose frames are no longer referenced."""
        if not MIN_FRAME_LENGTH <= max_frame_length <= MAX_FRAME_LENGTH:
            raise ValueError(
                f"max_frame_length={max_frame_length} must be in "
                f"[{MIN_FRAME_LENGTH}, {MAX_FRAME_LENGTH}]"
            )
        self.max_frame_length = max_frame_length
        self._allocate = allocate if allocate is not None else bytearray
        self.discarded = 0  # frames skipped for a wrong magic
        self._events: deque[Frame | InvalidFrame] = deque()
        self._stage = bytearray(RECEIVE_CHUNK)
        self._stage_view = memoryview(self._stage)
        self._start = 0  # first unconsumed byte in the stage
        self._end = 0  # end of received bytes in the stage
        # A large frame being received directly into its own buffer.
        self._body: bytearray | None = None
        self._body_filled = 0
        self._fields: tuple[int, int, int, int, int, int] | None = None
        # Its payload checksum so far, up to body byte ``_crc_at``: each piece is checked
        # while the socket's copy still has it in the CPU cache, not in a second pass over
        # a whole frame that no longer fits there.
        self._crc = 0
        self._crc_at = 0
        # After a large frame, expect another: receive only the next fixed header into the
        # stage, so the body that follows lands in its own buffer without a copy.
        self._expect_large = False
        self._broken: FrameError | None = None

    # -- input -----------------------------------------------------------------------------

    def get_buffer(self) -> memoryview:
        """A writable view for the next received bytes (never empty)."""
        self._check_usable()
        if self._body is not None:
            return memoryview(self._body)[self._body_filled:]
        if self._end == len(self._stage):
            self._compact()
        if self._expect_large:
            missing = FIXED_HEADER_SIZE - (self._end - self._start)
            if missing > 0:
                return self._stage_view[self._end:self._end + missing]
        return self._stage_view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        """Record that ``nbytes`` were written into the last ``get_buffer()`` view."""
        self._check_usable()
        if nbytes <= 0:
            return
        if self._body is not None:
            self._body_filled += nbytes
            self._checksum_body(self._body)
            if self._body_filled == len(self._body):
                body, fields = self._body, self._fields
                self._body, self._fields = None, None
                self._expect_large = True
                self._emit(fields, memoryview(body), self._crc)
            return
        self._end += nbytes
        self._parse_stage()

    def feed(self, data: Buffer) -> None:
        """Copy ``data`` in and decode whatever is complete."""
        view = memoryview(data).cast("B")
        pos, total = 0, view.nbytes
        while pos < total:
            buf = self.get_buffer()
            n = min(buf.nbytes, total - pos)
            buf[:n] = view[pos:pos + n]
            self.buffer_updated(n)
            pos += n

    # -- output ----------------------------------------------------------------------------

    def next_event(self) -> Frame | InvalidFrame | None:
        """The oldest decoded event, or None when no whole frame is waiting."""
        return self._events.popleft() if self._events else None

    def events(self) -> Iterator[Frame | InvalidFrame]:
        """Drain every decoded event."""
        while self._events:
            yield self._events.popleft()

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a decoded frame."""
        pending = self._end - self._start
        return pending + (self._body_filled if self._body is not None else 0)

    # -- internals -------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken

    def _fail(self, message: str) -> NoReturn:
        self._broken = FrameError(message)
        raise self._broken

    def _compact(self) -> None:
        pending = self._end - self._start
        if self._start:
            self._stage[:pending] = self._stage[self._start:self._end]
        self._start, self._end = 0, pending

    def _parse_stage(self) -> None:
        stage = self._stage
        while True:
            avail = self._end - self._start
            if avail < 4:
                break
            frame_length = _U32.unpack_from(stage, self._start)[0]
            if frame_length < MIN_FRAME_LENGTH or frame_length > self.max_frame_length:
                self._fail(
                    f"frame_length {frame_length} outside [{MIN_FRAME_LENGTH}, "
                    f"{self.max_frame_length}]: framing lost"
                )
            if avail < FIXED_HEADER_SIZE:
                break
            (_, magic, opcode, flags, stream_id, fmt, hl_hi, hl_lo) = _PREFIX.unpack_from(
                stage, self._start)
            fields = (magic, opcode, flags, stream_id, fmt, (hl_hi << 16) | hl_lo)
            total = 4 + frame_length
            body_len = total - FIXED_HEADER_SIZE
            if avail >= total:
                self._expect_large = False
                body_start = self._start + FIXED_HEADER_SIZE
                whole = bytes(stage[body_start:body_start + body_len])
                self._start += total
                self._emit(fields, memoryview(whole))
                continue
            if total > len(stage):
                # Too big for the stage: give the rest of this frame its own buffer.
                body = self._allocate(body_len)
                have = avail - FIXED_HEADER_SIZE
                body_start = self._start + FIXED_HEADER_SIZE
                body[:have] = stage[body_start:self._end]
                self._start = self._end = 0
                self._body, self._body_filled, self._fields = body, have, fields
                self._crc = 0
                self._crc_at = fields[5]  # the payload starts after the header
                self._checksum_body(body)
                return
            if self._start + total > len(stage):
                self._compact()
            break
        if self._start == self._end:
            self._start = self._end = 0

    def _checksum_body(self, body: bytearray) -> None:
        """Extend the running payload checksum of the large ``body`` (``self._body``) over
        what has arrived."""
        end = min(self._body_filled, len(body) - CHECKSUM_SIZE)
        if end > self._crc_at:
            self._crc = _crc32(memoryview(body)[self._crc_at:end], self._crc)
            self._crc_at = end

    def _emit(self, fields, body: memoryview, crc: int | None = None) -> None:
        """Decode one whole frame body; ``crc`` is its payload's checksum when already
        computed while the body arrived."""
        magic, opcode, flags, stream_id, fmt, header_length = fields
        if magic != MAGIC:
            self.discarded += 1
            if self.discarded >= MAX_BAD_MAGIC_FRAMES:
                self._fail(f"{self.discarded} frames with a wrong magic: peer does not speak SBP")
            return
        frame_payload_end = body.nbytes - CHECKSUM_SIZE
        if header_length > frame_payload_end:
            self._events.append(InvalidFrame(opcode, flags, stream_id, HeaderError(
                f"header_length {header_length} exceeds the frame's "
                f"{frame_payload_end} header and payload bytes")))
            return
        if fmt != HEADER_FORMAT_FLATBUFFERS:
            self._events.append(InvalidFrame(opcode, flags, stream_id, HeaderError(
                f"header_format {fmt} is not supported (only 1, FlatBuffers)")))
            return
        payload = body[header_length:frame_payload_end]
        expected = _U32.unpack_from(body, frame_payload_end)[0]
        if crc is None:
            crc = _crc32(payload) if payload.nbytes else 0
        actual = crc
        if actual != expected:
            self._events.append(InvalidFrame(opcode, flags, stream_id, ChecksumError(
                f"payload checksum {actual:#010x} does not match the frame's {expected:#010x} "
                f"(opcode {opcode:#06x}, stream_id {stream_id})")))
            return
        self._events.append(Frame(opcode, flags, stream_id, body[:header_length], payload, fmt,
                                  actual))


def decode_frame(data: Buffer, max_frame_length: int = MAX_FRAME_LENGTH) -> Frame:
    """Decode exactly one whole frame, raising a ``ProtocolError`` for anything invalid."""
    view = memoryview(data).cast("B")
    if view.nbytes < 4:
        raise FrameError(f"{view.nbytes} bytes cannot hold a frame_length")
    frame_length = _U32.unpack_from(view, 0)[0]
    if frame_length < MIN_FRAME_LENGTH or frame_length > max_frame_length:
        raise FrameError(
            f"frame_length {frame_length} outside [{MIN_FRAME_LENGTH}, {max_frame_length}]")
    if view.nbytes != 4 + frame_length:
        raise FrameError(f"frame_length {frame_length} says {4 + frame_length} bytes, "
                         f"got {view.nbytes}")
    if view[4] != MAGIC:
        raise FrameError(f"magic {view[4]} is not {MAGIC}")
    decoder = FrameDecoder(max_frame_length)
    decoder.feed(view)
    event = decoder.next_event()
    if isinstance(event, InvalidFrame):
        raise event.error
    assert event is not None  # a whole frame with the right magic always yields an event
    return event
