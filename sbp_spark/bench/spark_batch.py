"""Spark batch figures: ``df.write.format("sbp")`` and ``spark.read.format("sbp")`` + an
aggregation, each next to the Arrow ceiling (prebuilt batches in, dropped batches out) and to
Spark's own parquet write and read of the same rows. Warm runs, interleaved, median of several.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import adapters
from .context import BenchContext
from .procmem import PeakSampler, pyspark_workers
from .report import AT_LEAST_RATIO, Figure, Target, unavailable
from .timing import MB

SECTION = "spark batch"
READ_TARGET = Target(AT_LEAST_RATIO, 0.7)
WRITE_TARGET = Target(AT_LEAST_RATIO, 0.6)
CEILING_BATCH_ROWS = 65_536
SAMPLE_INTERVAL_S = 0.5


@dataclass
class _Timed:
    """Run times of one query kind."""

    name: str
    times: list[float] = field(default_factory=list)
    error: str | None = None

    def mb_per_s(self, payload_bytes: int) -> float | None:
        return payload_bytes / MB / statistics.median(self.times) if self.times else None


def write_input(spark, rows: int, record_size: int, partitions: int):
    """The rows every writer gets: null key, ``record_size`` random value bytes.

    Made by the Arrow ceiling source (cheap next to hashing in SQL). Its values repeat every
    ``CEILING_BATCH_ROWS`` rows, megabytes apart: too far for parquet's dictionary and
    snappy's window, so parquet cannot shrink them.
    """
    from pyspark.sql.types import BinaryType, StructField, StructType

    from .spark_sources import NAME

    schema = StructType([StructField("key", BinaryType()), StructField("value", BinaryType())])
    return (spark.read.format(NAME).option("rows", rows).option("partitions", partitions)
            .option("batch_rows", CEILING_BATCH_ROWS).option("record_size", record_size)
            .option("schema", schema.json()).load())


def aggregate(df) -> tuple[int, int]:
    """The read query: rows and value bytes (every source has a value column)."""
    from pyspark.sql import functions as F

    row = df.agg(F.count(F.lit(1)).alias("n"), F.sum(F.length("value")).alias("bytes")
                 ).collect()[0]
    return int(row["n"]), int(row["bytes"] or 0)


def check_rows(what: str, got: tuple[int, int], rows: int, record_size: int) -> None:
    n, nbytes = got
    if n != rows or nbytes != rows * record_size:
        raise RuntimeError(f"{what} returned {n} rows / {nbytes} value bytes, expected "
                           f"{rows} / {rows * record_size}")


def _time(kind: _Timed, fn: Callable[[], object], ctx: BenchContext, label: str,
          record: bool) -> None:
    if kind.error:
        return
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # reported in the table and on stderr; the run goes on
        kind.error = f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:300]}"
        ctx.progress(SECTION, f"{kind.name} failed: {kind.error}")
        return
    elapsed = time.perf_counter() - start
    if record:
        kind.times.append(elapsed)
    ctx.progress(SECTION, f"{label} {kind.name}: {elapsed:.2f} s")


def run(ctx: BenchContext) -> list[Figure]:
    from .spark_sources import DEFAULT_SCHEMA, NAME, ArrowCeilingSource

    cfg = ctx.config
    rows, size, parts = cfg.spark_rows, cfg.record_size, cfg.spark_partitions
    payload = rows * size
    spark = ctx.spark()
    spark.dataSource.register(ArrowCeilingSource)
    sbp_reason = adapters.connector_missing(ctx)
    if sbp_reason is None:
        adapters.register_connector(spark)
    label = f"{rows / 1e6:g}M x {size} B"

    ctx.progress(SECTION, f"building and caching the write input ({label}, {parts} partitions)")
    source = write_input(spark, rows, size, parts).cache()
    if source.count() != rows:
        raise RuntimeError("the cached write input lost rows")

    pq_dir = ctx.workdir / "parquet"
    ceiling_w, sbp_w, pq_w = _Timed("Arrow-writer ceiling"), _Timed("sbp write"), _Timed(
        "parquet write")
    write_streams: list[int] = []
    runs = cfg.spark_runs

    def sbp_write() -> None:
        stream_id = adapters.create_stream(ctx)
        (source.write.format("sbp").option("pd", ctx.server.pd)
         .option("stream", str(stream_id)).mode("append").save())
        write_streams.append(stream_id)

    for n in range(runs + 1):
        record = n > 0
        tag = f"run {n}/{runs}" if record else "warm-up"
        _time(ceiling_w, lambda: source.write.format(NAME).mode("append").save(), ctx, tag,
              record)
        if sbp_reason is None:
            _time(sbp_w, sbp_write, ctx, tag, record)
        _time(pq_w, lambda n=n: source.write.mode("overwrite").parquet(
            str(pq_dir / f"write-{n}")), ctx, tag, record)

    # The read side: the sbp stream as written above, the ceiling shaped like the sbp read,
    # and the parquet files the last parquet write run left (the same rows).
    ceiling_r, sbp_r, pq_r = _Timed("Arrow ceiling"), _Timed("sbp read"), _Timed("parquet read")
    sbp_df = None
    read_schema = DEFAULT_SCHEMA
    if sbp_reason is None and write_streams:
        # minPartitions: the same parallelism as the ceiling, whatever the stream's ranges.
        sbp_df = (spark.read.format("sbp").option("pd", ctx.server.pd)
                  .option("streams", str(write_streams[-1])).option("minPartitions", parts)
                  .load())
        read_schema = sbp_df.schema
    elif sbp_reason is None:
        sbp_r.error = f"nothing to read: the sbp write failed ({sbp_w.error})"
    ceiling_df = (spark.read.format(NAME).option("rows", rows).option("partitions", parts)
                  .option("batch_rows", CEILING_BATCH_ROWS).option("record_size", size)
                  .option("schema", read_schema.json()).load())
    pq_read_path = str(pq_dir / f"write-{runs}")

    worker_peaks: list[float] = []
    server_peaks: list[float] = []

    def checked(what: str, df_fn) -> Callable[[], None]:
        return lambda: check_rows(what, aggregate(df_fn()), rows, size)

    def sbp_read_measured() -> None:
        # Sparse samples: the kernel's peak (VmHWM) catches what happens between them, and a
        # busy sampler would take CPU from the read it measures.
        with PeakSampler(pyspark_workers, SAMPLE_INTERVAL_S) as workers, \
                PeakSampler([ctx.server.pid], SAMPLE_INTERVAL_S) as server:
            checked("sbp read", lambda: sbp_df)()
        if workers.max_mib() is not None:
            worker_peaks.append(workers.max_mib())
        if server.max_mib() is not None:
            server_peaks.append(server.max_mib())

    for n in range(runs + 1):
        record = n > 0
        tag = f"run {n}/{runs}" if record else "warm-up"
        _time(ceiling_r, checked("Arrow ceiling", lambda: ceiling_df), ctx, tag, record)
        if sbp_df is not None:
            _time(sbp_r, sbp_read_measured, ctx, tag, record)
        _time(pq_r, checked("parquet read", lambda: spark.read.parquet(pq_read_path)), ctx,
              tag, record)
    source.unpersist()

    figures: list[Figure] = []
    extra_common = {"rows": rows, "record_size": size, "partitions": parts}

    def figure(name: str, kind: _Timed, ceiling: _Timed, target: Target | None,
               missing: str | None = None) -> Figure:
        if missing:
            return unavailable(SECTION, name, "MB/s", missing, target,
                               ceiling.mb_per_s(payload), ceiling.name)
        if kind.error or ceiling.error:
            return Figure(SECTION, name, "MB/s", target=target,
                          note=f"error: {kind.error or ceiling.error}")
        value = kind.mb_per_s(payload)
        extra = dict(extra_common, times_s=kind.times, ceiling_times_s=ceiling.times,
                     records_per_s=rows / statistics.median(kind.times))
        return Figure(SECTION, name, "MB/s", value, ceiling.mb_per_s(payload), ceiling.name,
                      target, extra=extra)

    figures.append(figure(f"write sbp ({label})", sbp_w, ceiling_w, WRITE_TARGET, sbp_reason))
    figures.append(figure(f"write parquet ({label})", pq_w, ceiling_w, None))
    figures.append(figure(f"read sbp + agg ({label})", sbp_r, ceiling_r, READ_TARGET,
                          sbp_reason))
    if sbp_df is not None and sbp_r.times:
        figures[-1].extra["sbp_read_partitions"] = sbp_df.rdd.getNumPartitions()
    figures.append(figure(f"read parquet + agg ({label})", pq_r, ceiling_r, None))
    if sbp_reason:
        figures.append(unavailable("memory", "Python worker peak RSS during sbp read", "MiB",
                                   sbp_reason))
        figures.append(unavailable("memory", "server peak RSS during Spark read", "MiB",
                                   sbp_reason))
    elif sbp_r.error:
        for name in ("Python worker peak RSS during sbp read",
                     "server peak RSS during Spark read"):
            figures.append(Figure("memory", name, "MiB", note=f"error: {sbp_r.error}"))
    else:
        for name, peaks in (("Python worker peak RSS during sbp read", worker_peaks),
                            ("server peak RSS during Spark read", server_peaks)):
            figures.append(Figure("memory", name, "MiB", max(peaks) if peaks else None,
                                  note="" if peaks else "error: no process found to sample",
                                  extra={"per_run_mib": peaks}))
    return figures
