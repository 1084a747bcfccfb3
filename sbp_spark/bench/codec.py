"""Codec figures: APPEND header round trips/s and 1 MiB frame round trips next to zlib.crc32.

Pure CPU in this process, no sockets; uses only the protocol layer's public API.
"""

from __future__ import annotations

import os
import zlib

from .context import BenchContext
from .report import AT_LEAST, AT_LEAST_RATIO, Figure, Target, unavailable
from .timing import MB, MIB, rate

SECTION = "codec"
APPEND_ENTRIES = 16
FRAME_PAYLOAD = MIB
# The decoder is fed the way a socket would fill it: recv_into its buffer in pieces this big.
FEED_PIECE = 256 * 1024

HEADER_TARGET = Target(AT_LEAST, 10_000)
FRAME_TARGET = Target(AT_LEAST_RATIO, 0.7)


def append_header_roundtrip():
    """A callable doing one APPEND request + response header encode/decode round trip.

    Raises ImportError while ``sbp_spark.protocol.messages`` has not landed.
    """
    from sbp_spark.protocol.messages import (
        AppendEntry,
        AppendRequest,
        AppendResponse,
        AppendResult,
        Status,
    )

    entries = [AppendEntry(stream_id=1000 + i, request_index=i, batch_length=MIB)
               for i in range(APPEND_ENTRIES)]
    results = [AppendResult(stream_id=1000 + i, request_index=i, base_offset=i * 10_000,
                            stream_append_time_ms=1_700_000_000_000 + i, status=Status())
               for i in range(APPEND_ENTRIES)]

    def roundtrip() -> None:
        request = AppendRequest(timeout_ms=30_000, append_requests=entries)
        decoded = AppendRequest.from_flatbuffers(request.to_flatbuffers())
        if len(decoded.append_requests) != APPEND_ENTRIES:
            raise AssertionError("APPEND request lost entries in a round trip")
        response = AppendResponse(throttle_time_ms=0, status=Status(), append_responses=results)
        back = AppendResponse.from_flatbuffers(response.to_flatbuffers())
        if len(back.append_responses) != APPEND_ENTRIES:
            raise AssertionError("APPEND response lost entries in a round trip")

    return roundtrip


def frame_roundtrip(payload: bytes):
    """A callable encoding one frame around ``payload`` and decoding it as a socket would."""
    from sbp_spark.protocol.constants import Opcode
    from sbp_spark.protocol.frame import Frame, FrameDecoder, encode_frame

    decoder = FrameDecoder()
    header = b"\0" * 64  # about the size of a one-entry APPEND header

    def roundtrip() -> None:
        for piece in encode_frame(Opcode.APPEND, 0, 7, header, payload):
            view = memoryview(piece).cast("B")
            pos = 0
            while pos < view.nbytes:
                buf = decoder.get_buffer()
                n = min(buf.nbytes, view.nbytes - pos, FEED_PIECE)
                buf[:n] = view[pos:pos + n]
                decoder.buffer_updated(n)
                pos += n
        event = decoder.next_event()
        if not isinstance(event, Frame) or len(event.payload) != len(payload):
            raise AssertionError(f"frame round trip produced {event!r}")

    return roundtrip


def run(ctx: BenchContext) -> list[Figure]:
    figures: list[Figure] = []
    min_time = 0.1 if ctx.config.quick else 0.25

    name = f"APPEND request+response header ({APPEND_ENTRIES} entries) round trips"
    try:
        fn = append_header_roundtrip()
    except ImportError as exc:
        figures.append(unavailable(SECTION, name, "/s", f"{exc}", HEADER_TARGET))
    else:
        ctx.progress(SECTION, "APPEND header round trips")
        value, samples = rate(fn, 1, min_time)
        figures.append(Figure(SECTION, name, "/s", value, target=HEADER_TARGET,
                              extra={"samples": samples}))

    payload = os.urandom(FRAME_PAYLOAD)
    ctx.progress(SECTION, "zlib.crc32 on a 1 MiB buffer (ceiling)")
    crc_rate, crc_samples = rate(lambda: zlib.crc32(payload), FRAME_PAYLOAD / MB, min_time)
    ctx.progress(SECTION, "1 MiB frame encode+decode round trips")
    value, samples = rate(frame_roundtrip(payload), FRAME_PAYLOAD / MB, min_time)
    figures.append(Figure(
        SECTION, "1 MiB frame encode+decode", "MB/s", value, crc_rate, "zlib.crc32",
        FRAME_TARGET, extra={"samples": samples, "ceiling_samples": crc_samples}))
    return figures
