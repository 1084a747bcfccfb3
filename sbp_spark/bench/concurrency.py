"""Server memory under many concurrent clients, sampled from /proc while they run.

Each client has its own connections (a private pool): a writer appending 16 x 64 KiB batches
per call and a reader long-polling its stream (4 MiB budget, 500 ms wait), the load shape of
integration/bench/server_bench.py, driven here through the public ``SbpClient``.
"""

from __future__ import annotations

import os
import threading

from .context import BenchContext
from .procmem import PeakSampler, rss_kib
from .report import AT_MOST, Figure, Target
from .timing import MB, MIB

SECTION = "memory"
RSS_TARGET = Target(AT_MOST, 512)
BATCH_BYTES = 64 * 1024
BATCHES_PER_CALL = 16
FETCH_BUDGET = 4 * MIB
LONG_POLL_MS = 500


def _writer(ctx: BenchContext, stream_id: int, batch: list, stop: threading.Event,
            appended: list[int], errors: list[BaseException]) -> None:
    try:
        with ctx.client(private=True) as client:
            writer = client.open_stream(stream_id)
            while not stop.is_set():
                writer.append([batch] * BATCHES_PER_CALL)
                appended.append(BATCHES_PER_CALL * BATCH_BYTES)
    except BaseException as exc:  # handed to the main thread, which raises it
        errors.append(exc)


def _reader(ctx: BenchContext, stream_id: int, stop: threading.Event, fetched: list[int],
            errors: list[BaseException]) -> None:
    try:
        with ctx.client(private=True) as client:
            (open_range,) = client.list_ranges(stream_id)[-1:]
            offset = 0
            while not stop.is_set():
                for batch in client.fetch(open_range, offset, max_bytes=FETCH_BUDGET,
                                          max_wait_ms=LONG_POLL_MS, min_bytes=1):
                    fetched.append(batch.data.nbytes)
                    offset = batch.header.end_offset
    except BaseException as exc:
        errors.append(exc)


def run(ctx: BenchContext) -> list[Figure]:
    from sbp_spark.protocol.records import encode_batch

    cfg = ctx.config
    clients = cfg.concurrent_clients
    name = f"server peak RSS, {clients} concurrent clients"
    streams = ctx.create_streams(clients)
    batch = encode_batch(os.urandom(BATCH_BYTES - 28))
    appended: list[int] = []
    fetched: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    ctx.progress(SECTION, f"{clients} clients (a writer and a long-polling reader each) for "
                          f"{cfg.concurrent_seconds:g} s")
    threads = [threading.Thread(target=_writer, args=(ctx, s, batch, stop, appended, errors),
                                daemon=True) for s in streams]
    threads += [threading.Thread(target=_reader, args=(ctx, s, stop, fetched, errors),
                                 daemon=True) for s in streams]
    idle = rss_kib(ctx.server.pid)
    with PeakSampler([ctx.server.pid]) as sampler:
        for t in threads:
            t.start()
        stop.wait(cfg.concurrent_seconds)  # the load runs for a fixed time
        stop.set()
        for t in threads:
            t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} client threads failed; first: {errors[0]!r}"
                           ) from errors[0]
    peak = sampler.max_mib()
    ctx.progress(SECTION, f"server peak {peak:,.0f} MiB; appended "
                          f"{sum(appended) / MB / cfg.concurrent_seconds:,.0f} MB/s, fetched "
                          f"{sum(fetched) / MB / cfg.concurrent_seconds:,.0f} MB/s in all")
    return [Figure(SECTION, name, "MiB", peak, target=RSS_TARGET,
                   extra={"clients": clients, "seconds": cfg.concurrent_seconds,
                          "idle_rss_mib": None if idle is None else idle / 1024,
                          "appended_bytes": sum(appended), "fetched_bytes": sum(fetched)})]
