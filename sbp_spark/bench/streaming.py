"""Streaming figures: end-to-end latency from append to a foreachBatch sink at a steady offered
rate, with trigger(processingTime="0 seconds"), and the records/s a query sustains when it
catches up on a backlog.

A producer thread in this (the driver's) process appends small Arrow batches stamped with the
append time; the sink, which also runs in this process, subtracts that stamp from its own clock
when a micro-batch arrives. One clock, no skew.
"""

from __future__ import annotations

import os
import threading
import time

from .context import BenchContext
from .report import AT_MOST, Figure, Target
from .timing import percentile

SECTION = "streaming"
P50_TARGET = Target(AT_MOST, 1.0)
P99_TARGET = Target(AT_MOST, 2.0)
# The producer appends this often; at 10,000 records/s that is 100 records per batch.
PRODUCER_TICK_S = 0.01
# Latencies of records appended in the first seconds are dropped: the query is still warming.
WARMUP_S = 2.0
DRAIN_TIMEOUT_S = 60.0
# maxRecordsPerTrigger of the catch-up query: several micro-batches, so a rate can be taken
# between the first and the last arrival.
CATCH_UP_TRIGGER_RECORDS = 100_000


class _Sink:
    """foreachBatch target: per micro-batch, arrival time and each record's append stamp."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies_s: list[tuple[float, float]] = []  # (append time, latency)
        self.arrivals: list[tuple[float, int]] = []  # (arrival time, records) per micro-batch
        self.records = 0

    def __call__(self, df, batch_id: int) -> None:
        import pyarrow as pa

        table = df.select("timestamp").toArrow()
        now = time.time()
        stamps = table.column(0).cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
        appended = [us / 1e6 for us in stamps.to_pylist() if us is not None]
        with self.lock:
            self.latencies_s.extend((t, now - t) for t in appended)
            self.records += table.num_rows
            if table.num_rows:
                self.arrivals.append((now, table.num_rows))


def _producer(ctx: BenchContext, stream_id: int, rate: int, seconds: float, size: int,
              sent: list[int], errors: list[BaseException]) -> None:
    """Append ``rate`` records/s for ``seconds``: every tick, whatever is due by then.

    An append that takes longer than a tick makes the next batch larger, so the offered rate
    holds even when the server or the GIL is slow to answer.
    """
    import pyarrow as pa

    from sbp_spark.protocol.records import encode_arrow_batch, make_records_batch

    most = max(1, rate)  # a second's worth: the largest batch a late tick may need
    offsets = pa.array(range(0, (most + 1) * size, size), pa.int32())
    values = pa.BinaryArray.from_buffers(pa.binary(), most, [
        None, offsets.buffers()[1], pa.py_buffer(os.urandom(most * size))])
    template = make_records_batch(values)
    try:
        with ctx.client(private=True) as client:
            writer = client.open_stream(stream_id)
            start = time.monotonic()
            total = 0
            while (elapsed := time.monotonic() - start) < seconds:
                due = min(most, int(rate * elapsed) + 1 - total)
                if due > 0:
                    writer.append([encode_arrow_batch(template.slice(0, due),
                                                      base_timestamp_ms=int(time.time() * 1000))])
                    sent.append(due)
                    total += due
                pause = PRODUCER_TICK_S - (time.monotonic() - start - elapsed)
                if pause > 0:
                    time.sleep(pause)  # pacing the offered load, not waiting for a condition
    except BaseException as exc:
        errors.append(exc)


def _start_query(ctx: BenchContext, stream_id: int, sink: _Sink, name: str, **options: str):
    return (ctx.spark().readStream.format("sbp").option("pd", ctx.server.pd)
            .option("streams", str(stream_id)).option("startingOffsets", "earliest")
            .options(**options).load()
            .writeStream.foreachBatch(sink).trigger(processingTime="0 seconds")
            .option("checkpointLocation", str(ctx.workdir / "checkpoints" / name))
            .queryName(name).start())


def _wait_for(predicate, timeout_s: float, what: str, query) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if query.exception() is not None:
            raise RuntimeError(f"streaming query failed while waiting for {what}: "
                               f"{query.exception()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)  # polling with a deadline


def _latency(ctx: BenchContext) -> list[Figure]:
    cfg = ctx.config
    stream_id = ctx.create_stream()
    sink = _Sink()
    query = _start_query(ctx, stream_id, sink, "bench_latency")
    try:
        # Prime the query (Python workers, first micro-batch) before offering the load.
        primer: list[int] = []
        errors: list[BaseException] = []
        _producer(ctx, stream_id, 100, PRODUCER_TICK_S, cfg.record_size, primer, errors)
        if errors:
            raise errors[0]
        _wait_for(lambda: sink.records >= sum(primer), DRAIN_TIMEOUT_S, "the first record", query)
        with sink.lock:
            sink.latencies_s.clear()
            base = sink.records
        ctx.progress(SECTION, f"offering {cfg.stream_rate:,} records/s for "
                              f"{cfg.stream_seconds:g} s")
        sent: list[int] = []
        started = time.time()
        producer = threading.Thread(target=_producer, args=(
            ctx, stream_id, cfg.stream_rate, cfg.stream_seconds, cfg.record_size, sent,
            errors), daemon=True)
        producer.start()
        producer.join()
        if errors:
            raise errors[0]
        stopped = time.time()
        _wait_for(lambda: sink.records - base >= sum(sent), DRAIN_TIMEOUT_S,
                  "every appended record to reach the sink", query)
    finally:
        query.stop()
    measured = [lat for t, lat in sink.latencies_s if t >= started + WARMUP_S]
    if not measured:
        raise RuntimeError("no record reached the sink after the warm-up window")
    p50, p99 = percentile(measured, 50), percentile(measured, 99)
    # Sustained: the records appended while the load was steady (after the warm-up window),
    # over the time their arrivals spanned at the sink (at least the time they took to offer).
    t0 = started + WARMUP_S
    if stopped <= t0:
        raise RuntimeError(f"--stream-seconds must exceed the {WARMUP_S:g} s warm-up window")
    arrivals = [t + lat for t, lat in sink.latencies_s if t0 <= t <= stopped]
    if not arrivals:
        raise RuntimeError("no record appended after the warm-up window reached the sink")
    sustained = len(arrivals) / max(max(arrivals) - min(arrivals), stopped - t0)
    offered = sum(sent) / (stopped - started)
    ctx.progress(SECTION, f"latency p50 {p50 * 1000:,.0f} ms, p99 {p99 * 1000:,.0f} ms; "
                          f"offered {offered:,.0f}/s, sink received {sustained:,.0f}/s")
    extra = {"offered_records_per_s": offered, "records": len(measured),
             "max_s": max(measured)}
    rate_label = f"{cfg.stream_rate / 1000:g}k records/s"
    return [
        Figure(SECTION, f"append-to-sink latency p50 at {rate_label}", "s", p50,
               target=P50_TARGET, extra=extra),
        Figure(SECTION, f"append-to-sink latency p99 at {rate_label}", "s", p99,
               target=P99_TARGET, extra=extra),
        Figure(SECTION, f"sustained records/s at the sink, {rate_label} offered", "records/s",
               sustained, extra=extra),
    ]


def _catch_up(ctx: BenchContext) -> Figure:
    import pyarrow as pa

    from sbp_spark.protocol.records import encode_arrow_batch, make_records_batch

    cfg = ctx.config
    stream_id = ctx.create_stream()
    per_batch = 10_000
    size = cfg.record_size
    offsets = pa.array(range(0, (per_batch + 1) * size, size), pa.int32())
    values = pa.BinaryArray.from_buffers(pa.binary(), per_batch, [
        None, offsets.buffers()[1], pa.py_buffer(os.urandom(per_batch * size))])
    body = encode_arrow_batch(make_records_batch(values))
    batches = max(1, cfg.stream_backlog // per_batch)
    with ctx.client() as client:
        client.open_stream(stream_id).append([body] * batches)
    total = batches * per_batch
    ctx.progress(SECTION, f"catching up on a backlog of {total:,} records, "
                          f"{CATCH_UP_TRIGGER_RECORDS:,} per micro-batch")
    sink = _Sink()
    query = _start_query(ctx, stream_id, sink, "bench_catch_up",
                         maxRecordsPerTrigger=str(CATCH_UP_TRIGGER_RECORDS))
    try:
        _wait_for(lambda: sink.records >= total, DRAIN_TIMEOUT_S + total / 10_000,
                  "the backlog to reach the sink", query)
    finally:
        query.stop()
    # From the first micro-batch's arrival on, so the query's start-up is not counted.
    (first, first_n), (last, _) = sink.arrivals[0], sink.arrivals[-1]
    if last <= first:
        raise RuntimeError("the backlog arrived in a single micro-batch: no rate to take")
    rate = (total - first_n) / (last - first)
    return Figure(SECTION, f"catch-up records/s ({total / 1e6:g}M backlog, "
                           f"{CATCH_UP_TRIGGER_RECORDS // 1000}k per micro-batch)",
                  "records/s", rate, extra={"seconds": last - first, "records": total,
                                            "micro_batches": len(sink.arrivals)})


def run(ctx: BenchContext) -> list[Figure]:
    return _latency(ctx) + [_catch_up(ctx)]
