"""Planning a read of many streams named by a pattern, next to planning them by their ids.

``pattern_streams`` empty streams named ``<run>-<i>`` are created (a hundred per CREATE_STREAMS)
beside a few that the pattern does not match; then what Spark's driver runs to plan a batch
read (``SbpBatchReader.partitions()``) is timed with ``streamPattern`` and with ``streams``
listing the same ids. The difference is the look-up: one DESCRIBE_STREAMS listing every live
stream and the pattern matched over the names.
"""

from __future__ import annotations

import statistics
import time
import uuid

from .context import BenchContext
from .report import Figure

SECTION = "names"
# Streams one create asks the PD for (as `sbp streams create` does).
CREATE_CHUNK = 100
# Streams made beside them that the pattern must leave out.
UNMATCHED = 10


def _build(ctx: BenchContext, count: int) -> tuple[str, list[int]]:
    """``count`` streams whose names the returned pattern matches, and a few it does not."""
    run = f"bench{uuid.uuid4().hex[:8]}"
    ids: list[int] = []
    with ctx.client() as client:
        for first in range(0, count, CREATE_CHUNK):
            names = [f"{run}-{i}" for i in range(first, min(count, first + CREATE_CHUNK))]
            ids += [s.stream_id for s in client.create_streams(names=names)]
        client.create_streams(names=[f"other-{run}-{i}" for i in range(UNMATCHED)])
    return f"{run}-[0-9]+", ids


def _plan_ms(options: dict[str, str], runs: int) -> tuple[float, list[float], list[int]]:
    """Median ms of planning a batch read with ``options`` (after a warm-up), every run's ms,
    and the streams the plan read."""
    from sbp_spark.spark import cluster_access, stream_names
    from sbp_spark.spark.options import parse_read_options
    from sbp_spark.spark.reader import SbpBatchReader
    from sbp_spark.spark.schemas import records_schema

    parsed = parse_read_options(options)
    reader = SbpBatchReader(parsed, records_schema())
    reader.partitions()
    streams = list(stream_names.resolve_read(cluster_access.get_client(parsed.client),
                                             parsed).streams)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        reader.partitions()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), times, streams


def run(ctx: BenchContext) -> list[Figure]:
    cfg = ctx.config
    count = cfg.pattern_streams
    name = f"plan a read of {count:,} streams by pattern"
    ctx.progress(SECTION, f"creating {count:,} named streams")
    start = time.perf_counter()
    pattern, ids = _build(ctx, count)
    build_s = time.perf_counter() - start
    ctx.progress(SECTION, f"created in {build_s:.1f} s")
    base = {"pd": ctx.server.pd}
    pattern_ms, pattern_runs, matched = _plan_ms({**base, "streamPattern": pattern},
                                                 cfg.planning_runs)
    ids_ms, ids_runs, listed = _plan_ms({**base, "streams": ",".join(map(str, ids))},
                                        cfg.planning_runs)
    if sorted(matched) != sorted(ids) or listed != ids:
        raise RuntimeError(f"the pattern planned {len(matched)} streams and the ids "
                           f"{len(listed)}, expected the {len(ids)} made")
    ctx.progress(SECTION, f"by pattern {pattern_ms:.1f} ms, by ids {ids_ms:.1f} ms")
    return [Figure(SECTION, name, "ms", pattern_ms, ids_ms, "planning by ids",
                   extra={"times_ms": pattern_runs, "ceiling_times_ms": ids_runs,
                          "build_s": build_s, "streams": count})]
