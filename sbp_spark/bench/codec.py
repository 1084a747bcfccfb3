"""Codec figures: APPEND header round trips/s and 1 MiB frame round trips next to zlib.crc32.

Pure CPU in this process, no sockets; uses only the protocol layer's public API. The
``bench_headers`` and ``bench_frames`` functions return plain dicts (the same figures and keys
as integration/bench/codec_bench.py), so scripts can reuse them.
"""

from __future__ import annotations

import os
import zlib

from .context import BenchContext
from .report import AT_LEAST, AT_LEAST_RATIO, Figure, Target
from .timing import MB, MIB, rate

SECTION = "codec"
ENTRIES = 16
# The decoder is fed as a socket fills it: recv_into its buffer in pieces this big (what one
# read of a busy loopback socket brings; the server's readers ask for up to RECV_PIECE).
FEED_PIECE = 256 * 1024

HEADER_TARGET = Target(AT_LEAST, 10_000)
FRAME_TARGET = Target(AT_LEAST_RATIO, 0.7)


def sample_messages(kind: str, entries: int):
    """A request and its response with ``entries`` entries, for ``kind`` append or fetch."""
    from sbp_spark.protocol.messages import (
        AppendEntry,
        AppendRequest,
        AppendResponse,
        AppendResult,
        FetchEntry,
        FetchRequest,
        FetchResponse,
        FetchResult,
        Status,
    )

    if kind == "append":
        return (AppendRequest(30_000, [AppendEntry(1000 + i, i, MIB) for i in range(entries)]),
                AppendResponse(0, Status(), [AppendResult(1000 + i, i, i * 10_000,
                                                          1_700_000_000_000 + i)
                                             for i in range(entries)]))
    if kind == "fetch":
        return (FetchRequest(500, 1, [FetchEntry(1000 + i, i, i * 10_000, MIB)
                                      for i in range(entries)]),
                FetchResponse(0, Status(), [FetchResult(1000 + i, i, MIB)
                                            for i in range(entries)]))
    raise ValueError(f"kind={kind!r}: expected 'append' or 'fetch'")


def bench_headers(kind: str = "append", entries: int = ENTRIES, min_time: float = 0.3) -> dict:
    """Request + response header round trips/s (encode and decode of both) and the
    microseconds of each step, for ``kind`` ``append`` or ``fetch`` with ``entries`` entries."""
    request, response = sample_messages(kind, entries)
    req_cls, resp_cls = type(request), type(response)
    req_bytes, resp_bytes = request.to_flatbuffers(), response.to_flatbuffers()
    if req_cls.from_flatbuffers(req_bytes) != request or \
            resp_cls.from_flatbuffers(resp_bytes) != response:
        raise AssertionError(f"{kind} headers do not round-trip")
    steps = {
        "request_encode_us": request.to_flatbuffers,
        "request_decode_us": lambda: req_cls.from_flatbuffers(req_bytes),
        "response_encode_us": response.to_flatbuffers,
        "response_decode_us": lambda: resp_cls.from_flatbuffers(resp_bytes),
    }
    out: dict = {"entries": entries, "request_bytes": len(req_bytes),
                 "response_bytes": len(resp_bytes)}
    for name, fn in steps.items():
        out[name] = round(1e6 / rate(fn, 1, min_time / 2)[0], 2)

    def round_trip() -> None:
        req_cls.from_flatbuffers(request.to_flatbuffers())
        resp_cls.from_flatbuffers(response.to_flatbuffers())

    value, samples = rate(round_trip, 1, min_time)
    out["round_trips_per_s"] = value
    out["samples"] = samples
    return out


def bench_frames(payload_size: int = MIB, min_time: float = 0.3) -> dict:
    """MB/s of payload through request_frame -> FrameDecoder (fed in 256 KiB pieces, CRC
    checked) -> decode_request, next to zlib.crc32 on the same buffer."""
    from sbp_spark.protocol.frame import Frame, FrameDecoder
    from sbp_spark.protocol.messages import (
        AppendEntry,
        AppendRequest,
        decode_request,
        request_frame,
    )

    payload = os.urandom(payload_size)
    request = AppendRequest(30_000, [AppendEntry(7, 0, payload_size)])
    decoder = FrameDecoder()

    def round_trip() -> None:
        for piece in request_frame(1, request, payload):
            view = memoryview(piece).cast("B")
            pos = 0
            while pos < view.nbytes:
                buf = decoder.get_buffer()
                n = min(buf.nbytes, view.nbytes - pos, FEED_PIECE)
                buf[:n] = view[pos:pos + n]
                decoder.buffer_updated(n)
                pos += n
        frame = decoder.next_event()
        if not isinstance(frame, Frame) or memoryview(frame.payload).nbytes != payload_size:
            raise AssertionError(f"frame round trip produced {frame!r}")
        decode_request(frame)

    frames, frame_samples = rate(round_trip, payload_size / MB, min_time)
    crc, crc_samples = rate(lambda: zlib.crc32(payload), payload_size / MB, min_time)
    return {"payload_bytes": payload_size, "frames_mb_per_s": frames,
            "zlib_crc32_mb_per_s": crc, "ratio_to_zlib_crc32": frames / crc,
            "samples": frame_samples, "crc_samples": crc_samples}


def run(ctx: BenchContext) -> list[Figure]:
    min_time = 0.1 if ctx.config.quick else 0.3
    header_name = f"APPEND request+response headers ({ENTRIES} entries) round trips"
    frame_name = "1 MiB frame encode+decode"
    ctx.progress(SECTION, "APPEND header round trips")
    headers = bench_headers("append", ENTRIES, min_time)
    ctx.progress(SECTION, "1 MiB frames and zlib.crc32 on the same buffer")
    frames = bench_frames(MIB, min_time)
    return [
        Figure(SECTION, header_name, "/s", headers.pop("round_trips_per_s"),
               target=HEADER_TARGET, extra=headers),
        Figure(SECTION, frame_name, "MB/s", frames.pop("frames_mb_per_s"),
               frames.pop("zlib_crc32_mb_per_s"), "zlib.crc32", FRAME_TARGET, extra=frames),
    ]
