"""Server memory under many concurrent clients: each appends 1 MiB batches and reads them back,
on its own connection, while the server process's resident size is sampled from /proc.
"""

from __future__ import annotations

import os
import threading
import time

from . import adapters
from .context import BenchContext
from .procmem import PeakSampler
from .report import AT_MOST, Figure, Target, unavailable
from .timing import MB, MIB

SECTION = "memory"
RSS_TARGET = Target(AT_MOST, 512)
BATCHES_PER_ROUND = 4


def _worker(ctx: BenchContext, stream_id: int, body: memoryview, deadline: float,
            moved: list[int], errors: list[BaseException]) -> None:
    from sbp_spark.protocol.records import encode_batch

    try:
        client = adapters.sbp_client(ctx, private=True)
        writer = client.open_stream(stream_id)
        try:
            read_from = 0
            while time.monotonic() < deadline:
                writer.append([encode_batch(body) for _ in range(BATCHES_PER_ROUND)])
                for fetched in client.read(stream_id, start=read_from):
                    moved.append(fetched.data.nbytes)
                    read_from = fetched.header.end_offset
        finally:
            adapters.close_all(writer, client)
    except BaseException as exc:  # handed to the main thread, which raises it
        errors.append(exc)


def run(ctx: BenchContext) -> list[Figure]:
    cfg = ctx.config
    name = f"server peak RSS, {cfg.concurrent_clients} concurrent clients"
    reason = adapters.client_missing(ctx)
    if reason:
        return [unavailable(SECTION, name, "MiB", reason, RSS_TARGET)]
    streams = [adapters.create_stream(ctx) for _ in range(cfg.concurrent_clients)]
    body = memoryview(os.urandom(MIB - 28))
    moved: list[int] = []
    errors: list[BaseException] = []
    ctx.progress(SECTION, f"{cfg.concurrent_clients} clients appending and fetching for "
                          f"{cfg.concurrent_seconds:g} s")
    deadline = time.monotonic() + cfg.concurrent_seconds
    with PeakSampler([ctx.server.pid]) as sampler:
        threads = [threading.Thread(target=_worker, args=(ctx, s, body, deadline, moved, errors),
                                    daemon=True) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {cfg.concurrent_clients} clients failed; "
                           f"first: {errors[0]!r}") from errors[0]
    total = sum(moved)
    ctx.progress(SECTION, f"server peak {sampler.max_mib():,.0f} MiB; clients fetched "
                          f"{total / MB / cfg.concurrent_seconds:,.0f} MB/s together")
    return [Figure(SECTION, name, "MiB", sampler.max_mib(), target=RSS_TARGET,
                   extra={"clients": cfg.concurrent_clients, "seconds": cfg.concurrent_seconds,
                          "fetched_bytes": total})]
