"""Planning a read positioned by time, next to planning the same read by offsets.

One stream of ``planning_records`` one-byte records in ``planning_ranges`` ranges is built
straight through the client (payload=records batches of ``PLANNING_BATCH_RECORDS`` records, one
Arrow body shared by every batch, each batch with its own base timestamp; a seal after each
range), then what Spark's driver runs to plan a batch read (``SbpBatchReader.partitions()``) is
timed with ``startingTimestamp``/``endingTimestamp``, and beside it with the offsets those
times resolve to: the difference is the time search (two searches of O(log n) one-batch
FETCHes).
"""

from __future__ import annotations

import statistics
import time

from .client import append_in_ranges
from .context import BenchContext
from .report import Figure

SECTION = "planning"
PLANNING_BATCH_RECORDS = 1_000
# Batches handed to one append call.
APPEND_CALL_BATCHES = 10
T0_MS = 1_700_000_000_000


def _build(ctx: BenchContext, records: int, ranges: int) -> tuple[int, int]:
    """A stream of ``records`` records in ``ranges`` ranges, base timestamps one ms apart per
    batch from T0_MS; returns (stream id, number of batches)."""
    import pyarrow as pa

    from sbp_spark.protocol.records import BodyFormat, arrow_to_body, encode_batch
    from sbp_spark.protocol.records import make_records_batch as records_batch

    body = memoryview(arrow_to_body(records_batch(
        pa.array([b"x"] * PLANNING_BATCH_RECORDS, pa.binary()))))
    batches = records // PLANNING_BATCH_RECORDS
    per_range = max(1, batches // ranges)
    stream_id = ctx.create_stream()

    def progress(made: int) -> None:
        if made % (per_range * 100) == 0:
            ctx.progress(SECTION, f"built {made * PLANNING_BATCH_RECORDS:,} records")

    with ctx.client() as client:
        append_in_ranges(
            client, stream_id, lambda i: encode_batch(body, PLANNING_BATCH_RECORDS, T0_MS + i,
                                                      BodyFormat.ARROW),
            batches, ranges, APPEND_CALL_BATCHES, progress)
    return stream_id, batches


def _plan_ms(options: dict[str, str], runs: int) -> tuple[float, list[float], int]:
    """Median ms of planning a batch read with ``options`` (after a warm-up), every run's ms,
    and the records planned."""
    from sbp_spark.spark.options import parse_read_options
    from sbp_spark.spark.reader import SbpBatchReader
    from sbp_spark.spark.schemas import records_schema

    reader = SbpBatchReader(parse_read_options(options), records_schema())
    planned = sum(p.record_count for p in reader.partitions())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        reader.partitions()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), times, planned


def run(ctx: BenchContext) -> list[Figure]:
    cfg = ctx.config
    records, ranges = cfg.planning_records, cfg.planning_ranges
    name = f"plan a read by time ({records:,} records, {ranges:,} ranges)"
    ctx.progress(SECTION, f"building {records:,} records in {ranges:,} ranges")
    start = time.perf_counter()
    stream_id, batches = _build(ctx, records, ranges)
    build_s = time.perf_counter() - start
    ctx.progress(SECTION, f"built in {build_s:.1f} s")

    from sbp_spark.spark import cluster_access
    from sbp_spark.spark.options import parse_read_options
    from sbp_spark.spark.times import resolve_time_positions

    base = {"pd": ctx.server.pd, "streams": str(stream_id)}
    start_ms, end_ms = T0_MS + batches // 4, T0_MS + batches * 3 // 4
    by_time = {**base, "startingTimestamp": str(start_ms), "endingTimestamp": str(end_ms)}
    options = parse_read_options(by_time)
    client = cluster_access.get_client(options.client)
    layouts = cluster_access.stream_layouts(client, options.streams, options.client.pd)
    resolved = resolve_time_positions(client, layouts, options)
    lo, hi = resolved.starting.for_stream(stream_id), resolved.ending.for_stream(stream_id)
    by_offsets = {**base, "startingOffsets": f'{{"{stream_id}": {lo}}}',
                  "endingOffsets": f'{{"{stream_id}": {hi}}}'}

    time_ms, time_runs, planned = _plan_ms(by_time, cfg.planning_runs)
    offset_ms, offset_runs, planned_offsets = _plan_ms(by_offsets, cfg.planning_runs)
    expected = (batches * 3 // 4 - batches // 4) * PLANNING_BATCH_RECORDS
    if planned != expected or planned_offsets != expected:
        raise RuntimeError(f"planned {planned} records by time and {planned_offsets} by "
                           f"offsets, expected {expected}")
    ctx.progress(SECTION, f"by time {time_ms:.1f} ms, by offsets {offset_ms:.1f} ms")
    return [Figure(SECTION, name, "ms", time_ms, offset_ms, "planning by offsets",
                   extra={"times_ms": time_runs, "ceiling_times_ms": offset_runs,
                          "build_s": build_s, "batches": batches, "planned_records": planned})]
