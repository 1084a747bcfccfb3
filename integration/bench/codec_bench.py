"""Codec speed: typed APPEND/FETCH headers and 1 MiB payload frames, pure CPU, one process.

Targets: APPEND request (16 entries) + response round trips >= 10,000/s; 1 MiB frames
(encode + decode + checksum on both sides) >= 0.7x the speed of ``zlib.crc32`` over the same
buffer. The measurements are ``sbp_spark.bench.codec``'s (the ones ``sbp bench`` reports);
this script adds, for scale, flatc's generated builders on the pure-Python FlatBuffers runtime.

Usage: ``python integration/bench/codec_bench.py [--quick] [--json FILE]`` (from a checkout:
flatc's classes live with the tests, in ``tests/flatc_classes``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import flatbuffers

from sbp_spark.bench.codec import ENTRIES, bench_frames, bench_headers, sample_messages
from sbp_spark.bench.timing import rate
from sbp_spark.protocol.messages import AppendRequest

# Run as a script, this file's folder is on sys.path, not the checkout that holds tests/.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.flatc_classes import AppendEntry as GenAppendEntry  # noqa: E402
from tests.flatc_classes import AppendRequest as GenAppendRequest  # noqa: E402


def bench_generated_builder(entries: int = ENTRIES, min_time: float = 0.3) -> dict:
    """Encodes/s of the APPEND request with flatc's generated builders (pure-Python runtime),
    next to the hand-written encoder the message class uses."""
    request, _ = sample_messages("append", entries)

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
