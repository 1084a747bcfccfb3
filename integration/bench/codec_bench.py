"""Codec speed: typed APPEND/FETCH headers and 1 MiB payload frames, pure CPU, one process.

Targets: APPEND request (16 entries) + response round trips >= 10,000/s; 1 MiB frames
(encode + decode + checksum on both sides) >= 0.7x the speed of ``zlib.crc32`` over the same
buffer. Wall-clock rates are the targets; rates per CPU second sit next to them because on a
shared machine they move much less with the load (printed too). For scale, the same figures
are given for the generic table codec and for flatc's generated builders on the pure-Python
FlatBuffers runtime.

Usage: ``python integration/bench/codec_bench.py [--quick] [--json FILE]``.
Each ``bench_*`` function returns a dict of figures and can be imported on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib

import flatbuffers

from sbp_spark.bench.timing import rate
from sbp_spark.protocol._generated import AppendEntry as GenAppendEntry
from sbp_spark.protocol._generated import AppendRequest as GenAppendRequest
from sbp_spark.protocol.frame import Frame, FrameDecoder
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
    decode_request,
    request_frame,
)

MIB = 1024 * 1024
MB = 1_000_000
ENTRIES = 16
# The decoder is fed as a socket fills it: recv_into its buffer in pieces this big (PERF_NOTES).
FEED_PIECE = 256 * 1024


def cpu_rate(fn, units_per_call: float, min_time_s: float = 0.2, repeats: int = 5) -> float:
    """Median units per second of this process's CPU time: unlike wall-clock rates, barely
    moved by other processes competing for the cores (the machine is shared and noisy)."""
    fn()
    samples = []
    for _ in range(repeats):
        calls = 0
        start = time.process_time()
        while (elapsed := time.process_time() - start) < min_time_s:
            fn()
            calls += 1
        samples.append(calls * units_per_call / elapsed)
    return statistics.median(samples)


def _append_messages(entries: int) -> tuple[AppendRequest, AppendResponse]:
    request = AppendRequest(30_000, [AppendEntry(1000 + i, i, MIB) for i in range(entries)])
    response = AppendResponse(0, Status(), [
        AppendResult(1000 + i, i, i * 10_000, 1_700_000_000_000 + i) for i in range(entries)])
    return request, response


def _fetch_messages(entries: int) -> tuple[FetchRequest, FetchResponse]:
    request = FetchRequest(500, 1, [FetchEntry(1000 + i, i, i * 10_000, MIB)
                                    for i in range(entries)])
    response = FetchResponse(0, Status(), [FetchResult(1000 + i, i, MIB)
                                           for i in range(entries)])
    return request, response


def _round_trip(request, response, encode_request, encode_response):
    req_cls, resp_cls = type(request), type(response)

    def run() -> None:
        req_cls.from_flatbuffers(encode_request(request))
        resp_cls.from_flatbuffers(encode_response(response))

    return run


def bench_headers(kind: str = "append", entries: int = ENTRIES, min_time: float = 0.3
                  ) -> dict:
    """Round trips/s (encode + decode of request and response) and each step's microseconds,
    for the hand-written codec the classes use and for the generic table codec."""
    request, response = (_append_messages if kind == "append" else _fetch_messages)(entries)
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
    fast = _round_trip(request, response, type(request).to_flatbuffers,
                       type(response).to_flatbuffers)
    generic = _round_trip(request, response, req_cls._CODEC.encode, resp_cls._CODEC.encode)
    out["round_trips_per_s"] = round(rate(fast, 1, min_time)[0])
    out["round_trips_per_cpu_s"] = round(cpu_rate(fast, 1, min_time))
    out["generic_codec_round_trips_per_s"] = round(rate(generic, 1, min_time)[0])
    return out


def bench_generated_builder(entries: int = ENTRIES, min_time: float = 0.3) -> dict:
    """Encodes/s of the APPEND request with flatc's generated builders (pure-Python runtime),
    next to the hand-written encoder the message class uses."""
    request, _ = _append_messages(entries)

    def generated() -> bytes:
        b = flatbuffers.Builder(64 + 16 * entries)
        GenAppendRequest.StartAppendRequestsVector(b, entries)
        for e in reversed(request.append_requests):
            GenAppendEntry.CreateAppendEntry(b, e.stream_id, e.request_index, e.batch_length)
        vec = b.EndVector()
        GenAppendRequest.Start(b)
        GenAppendRequest.AddTimeoutMs(b, request.timeout_ms)
        GenAppendRequest.AddAppendRequests(b, vec)
        b.Finish(GenAppendRequest.End(b))
        return b.Output()

    if AppendRequest.from_flatbuffers(bytes(generated())) != request:
        raise AssertionError("generated builder output does not decode to the request")
    return {
        "entries": entries,
        "generated_builder_encodes_per_s": round(rate(generated, 1, min_time)[0]),
        "hand_written_encodes_per_s": round(rate(request.to_flatbuffers, 1, min_time)[0]),
    }


def bench_frames(payload_size: int = MIB, min_time: float = 0.3) -> dict:
    """MB/s of payload through request_frame -> FrameDecoder (fed in 256 KiB pieces, CRC
    checked) -> decode_request, next to zlib.crc32 on the same buffer."""
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
        if not isinstance(frame, Frame) or frame.payload.nbytes != payload_size:
            raise AssertionError(f"frame round trip produced {frame!r}")
        decode_request(frame)

    frames = rate(round_trip, payload_size / MB, min_time)[0]
    crc = rate(lambda: zlib.crc32(payload), payload_size / MB, min_time)[0]
    frames_cpu = cpu_rate(round_trip, payload_size / MB, min_time)
    crc_cpu = cpu_rate(lambda: zlib.crc32(payload), payload_size / MB, min_time)
    return {"payload_bytes": payload_size, "frames_mb_per_s": round(frames),
            "zlib_crc32_mb_per_s": round(crc), "ratio_to_zlib_crc32": round(frames / crc, 2),
            "ratio_to_zlib_crc32_cpu_time": round(frames_cpu / crc_cpu, 2)}


def run(quick: bool = False) -> dict:
    """Every figure of this benchmark, with its target checked."""
    min_time = 0.1 if quick else 0.3
    append = bench_headers("append", min_time=min_time)
    frames = bench_frames(min_time=min_time)
    return {
        "machine": {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)},
        "append_headers": append,
        "fetch_headers": bench_headers("fetch", min_time=min_time),
        "generated_builder": bench_generated_builder(min_time=min_time),
        "frames": frames,
        "targets": {
            "append_round_trips_per_s >= 10000": append["round_trips_per_s"] >= 10_000,
            "frames >= 0.7x zlib.crc32": frames["ratio_to_zlib_crc32"] >= 0.7,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    figures = run(quick=args.quick)
    for section, values in figures.items():
        print(section)
        for key, value in values.items():
            print(f"  {key:40} {value}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)
    return 0 if all(figures["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
