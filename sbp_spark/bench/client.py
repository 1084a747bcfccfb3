"""Client figures: APPEND and FETCH against the bench cluster, next to the raw loopback ceiling.

The client runs in this process and the cluster in the server process, and the loopback
ceiling copies the same number of bytes between the same two processes over plain TCP.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .context import BenchContext
from .loopback import NO_FSYNC, LoopbackClient
from .report import AT_LEAST_RATIO, Figure, Target
from .timing import MB, MIB

if TYPE_CHECKING:
    from sbp_spark.client import SbpClient

SECTION = "client"
# Issue 18: 1 MiB APPENDs against the disk's own durable append, measured beside them. (The
# loopback push, which the disk itself cannot reach here, stays as a figure without a target.)
APPEND_TARGET = Target(AT_LEAST_RATIO, 0.7)
FETCH_TARGET = Target(AT_LEAST_RATIO, 0.5)
BATCH_BYTES = MIB
# Batches handed to one StreamWriter.append call: enough to keep its frames in flight.
APPEND_CALL_BATCHES = 64


def storage_durability(fsync: str | None) -> tuple[int, str]:
    """The fsync interval (ms, ``NO_FSYNC`` or 0 for back to back) under which the bench
    cluster acknowledges an APPEND, and the storage ceiling's name for it."""
    from sbp_spark.server.storage import FsyncPolicy, StorageConfig

    storage = StorageConfig() if fsync is None else StorageConfig(fsync=fsync)
    if storage.fsync is FsyncPolicy.NEVER:
        return NO_FSYNC, "file append (page cache)"
    if storage.fsync is FsyncPolicy.ALWAYS:
        return 0, "file append, fsync back to back"
    interval = storage.fsync_interval_ms
    return interval, f"file append, fsync every {interval} ms"


def _opaque_batches(count: int) -> list[list]:
    from sbp_spark.protocol.records import encode_batch

    body = memoryview(os.urandom(BATCH_BYTES - 28))  # whole batch: 1 MiB with its envelope
    return [encode_batch(body) for _ in range(count)]


def random_records_batch(records: int, size: int):
    """A payload=records Arrow batch of ``records`` random values of ``size`` bytes each."""
    import pyarrow as pa

    from sbp_spark.protocol.records import make_records_batch

    offsets = pa.array(range(0, (records + 1) * size, size), pa.int32())
    values = pa.BinaryArray.from_buffers(pa.binary(), records, [
        None, offsets.buffers()[1], pa.py_buffer(os.urandom(records * size))])
    return make_records_batch(values)


def timed_append(client, stream_id: int, batches: list, total_batches: int) -> float:
    """Seconds ``client`` takes to append ``total_batches`` batches to ``stream_id``, handing
    ``batches`` (or as many of them as are left) to each ``append`` call."""
    writer = client.open_stream(stream_id)
    start = time.perf_counter()
    left = total_batches
    while left:
        n = min(left, len(batches))
        writer.append(batches[:n])
        left -= n
    return time.perf_counter() - start


def timed_read(client, stream_id: int, decode_arrow: bool = False) -> tuple[float, int, int]:
    """Seconds ``client`` takes to read the whole stream, its bytes and its records."""
    from sbp_spark.protocol.records import ENVELOPE_SIZE, body_to_arrow

    nbytes = records = 0
    start = time.perf_counter()
    for fetched in client.read(stream_id):
        nbytes += fetched.data.nbytes
        if decode_arrow:
            records += body_to_arrow(fetched.data[ENVELOPE_SIZE:]).num_rows
        else:
            records += fetched.header.record_count
    return time.perf_counter() - start, nbytes, records


def append_in_ranges(client: SbpClient, stream_id: int, batch: Callable[[int], Any], count: int,
                     ranges: int, per_call: int,
                     after_range: Callable[[int], None] | None = None) -> None:
    """Append ``batch(0)`` ... ``batch(count - 1)`` to ``stream_id``, ``count // ranges``
    batches per range, ``per_call`` batches per append call; the PD seals each range once it
    is full and opens the next. ``after_range(batches so far)`` is called after each range."""
    per_range = max(1, count // ranges)
    writer = client.open_stream(stream_id)
    made = 0
    while made < count:
        in_range = min(per_range, count - made)
        for first in range(0, in_range, per_call):
            n = min(per_call, in_range - first)
            writer.append([batch(made + first + i) for i in range(n)])
        made += in_range
        if made < count:
            client.seal_range(stream_id)
        if after_range is not None:
            after_range(made)


def _append(ctx: BenchContext, stream_id: int, batches: list, total_batches: int) -> float:
    with ctx.client() as client:
        return timed_append(client, stream_id, batches, total_batches)


def _fetch(ctx: BenchContext, stream_id: int, decode_arrow: bool) -> tuple[float, int, int]:
    """Seconds to read the whole stream, its bytes and its records."""
    with ctx.client() as client:
        return timed_read(client, stream_id, decode_arrow)


def run(ctx: BenchContext) -> list[Figure]:
    cfg = ctx.config
    names = ("APPEND 1 MiB batches", "FETCH 1 MiB batches",
             "APPEND 1 MiB batches, next to the storage",
             f"APPEND {cfg.record_size} B records (Arrow, {cfg.client_batch_records}/batch)",
             f"FETCH {cfg.record_size} B records (Arrow, {cfg.client_batch_records}/batch)")
    total = cfg.client_bytes // BATCH_BYTES
    batches = _opaque_batches(min(total, APPEND_CALL_BATCHES))
    append_times, fetch_times, files, sends, receives = [], [], [], [], []
    files_around: list[list[float]] = []  # each round's ceiling before and after its APPEND
    # The storage ceiling: the same bytes appended to a file in the server process, made
    # durable the way the cluster acknowledges an APPEND.
    interval_ms, storage_ceiling = storage_durability(cfg.fsync)
    mb = cfg.client_bytes / MB
    # Each ceiling is measured right before and right after the figure it stands next to, in
    # every round: this machine's loopback speed swings by 2-5x within minutes, and a ratio
    # is only meaningful between measurements taken under the same conditions.
    with LoopbackClient(ctx.server.loopback) as lo:
        lo.send(64 * MIB)  # warm-up: socket buffers, page faults
        lo.receive(64 * MIB)
        for n in range(cfg.client_runs + 1):
            stream_id = ctx.create_stream()
            push_s = [lo.send(cfg.client_bytes)]
            # The storage ceiling right before and right after each APPEND run, and the faster
            # of the two is the one the run stands next to: this disk's speed swings with what
            # was written just before (one ceiling after an APPEND ran at half its usual speed
            # and made the APPEND look faster than the disk), so a single measurement can
            # flatter the ratio; the faster neighbour cannot.
            file_before = lo.file_append(cfg.client_bytes, interval_ms)
            a = _append(ctx, stream_id, batches, total)
            push_s.append(lo.send(cfg.client_bytes))
            file_after = lo.file_append(cfg.client_bytes, interval_ms)
            file_s = min(file_before, file_after)
            pull_s = [lo.receive(cfg.client_bytes)]
            f, nbytes, _ = _fetch(ctx, stream_id, decode_arrow=False)
            pull_s.append(lo.receive(cfg.client_bytes))
            if nbytes != total * BATCH_BYTES:
                raise RuntimeError(
                    f"FETCH returned {nbytes} bytes, {total * BATCH_BYTES} appended")
            if n:  # the first round warms the server's files and the connections
                append_times.append(a)
                fetch_times.append(f)
                files.append(file_s)
                files_around.append([file_before, file_after])
                sends += push_s
                receives += pull_s
            ctx.progress(
                SECTION,
                f"{'warm-up' if not n else f'run {n}/{cfg.client_runs}'}: APPEND {mb / a:,.0f} "
                f"MB/s (loopback push {mb / max(push_s):,.0f}-{mb / min(push_s):,.0f}, durable "
                f"file append {mb / file_before:,.0f} before, {mb / file_after:,.0f} after), "
                f"FETCH {mb / f:,.0f} MB/s (loopback pull {mb / max(pull_s):,.0f}-"
                f"{mb / min(pull_s):,.0f})")
    push = mb / statistics.median(sends)
    pull = mb / statistics.median(receives)
    disk = mb / statistics.median(files)

    per_batch = cfg.client_batch_records
    record_batches = max(1, cfg.client_bytes // (per_batch * cfg.record_size) // 4)
    from sbp_spark.protocol.records import encode_arrow_batch

    # Encoded once: Arrow encoding is the connector's cost, this figure is the client's.
    encoded = encode_arrow_batch(random_records_batch(per_batch, cfg.record_size))
    rec_append, rec_fetch = [], []
    for _ in range(cfg.client_runs):
        stream_id = ctx.create_stream()
        rec_append.append(_append(ctx, stream_id, [encoded] * APPEND_CALL_BATCHES,
                                  record_batches))
        f, _, records = _fetch(ctx, stream_id, decode_arrow=True)
        if records != record_batches * per_batch:
            raise RuntimeError(f"FETCH decoded {records} records, "
                               f"{record_batches * per_batch} appended")
        rec_fetch.append(f)
    records_total = record_batches * per_batch
    ctx.progress(SECTION, f"records: APPEND {records_total / statistics.median(rec_append):,.0f}"
                          f"/s, FETCH {records_total / statistics.median(rec_fetch):,.0f}/s")

    return [
        Figure(SECTION, names[0], "MB/s", mb / statistics.median(append_times), push,
               "loopback push", extra={"times_s": append_times, "ceiling_times_s": sends}),
        Figure(SECTION, names[1], "MB/s", mb / statistics.median(fetch_times), pull,
               "loopback pull", FETCH_TARGET,
               extra={"times_s": fetch_times, "ceiling_times_s": receives}),
        Figure(SECTION, names[2], "MB/s", mb / statistics.median(append_times), disk,
               storage_ceiling, APPEND_TARGET,
               extra={"ceiling_times_s": files, "ceiling_before_after_s": files_around}),
        Figure(SECTION, names[3], "records/s", records_total / statistics.median(rec_append),
               extra={"times_s": rec_append, "records": records_total}),
        Figure(SECTION, names[4], "records/s", records_total / statistics.median(rec_fetch),
               extra={"times_s": rec_fetch, "records": records_total}),
    ]
