"""Where the bench meets the other layers' public APIs (client, connector, streaming).

Every check here answers "can this figure be measured yet?" with None or a reason, so a section
whose code has not landed is reported as not available instead of failing or being faked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .context import BenchContext


def _missing(module: str, *names: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        return f"{module} not importable ({exc})"
    absent = [n for n in names if not hasattr(mod, n)]
    if absent:
        return f"{module} has no {', '.join(absent)} yet"
    return None


def messages_missing() -> str | None:
    return _missing("sbp_spark.protocol.messages", "AppendRequest", "AppendResponse")


def client_missing(ctx: BenchContext) -> str | None:
    """Why the SBP client cannot be measured against the cluster (None when it can)."""
    reason = _missing("sbp_spark.client", "SbpClient")
    if reason:
        return reason
    if ctx.server.cluster_error:
        return ctx.server.cluster_error
    return None


def connector_missing(ctx: BenchContext) -> str | None:
    """Why ``format("sbp")`` cannot be measured (None when it can)."""
    reason = _missing("pyspark_sbp", "DefaultSource") or client_missing(ctx)
    return reason


def streaming_missing(ctx: BenchContext) -> str | None:
    """Why ``readStream.format("sbp")`` cannot be measured (None when it can)."""
    reason = connector_missing(ctx)
    if reason:
        return reason
    import pyspark_sbp

    if not hasattr(pyspark_sbp.DefaultSource, "streamReader") or (
            pyspark_sbp.DefaultSource.streamReader is
            importlib.import_module("pyspark.sql.datasource").DataSource.streamReader):
        return "the sbp DataSource has no streamReader yet"
    return None


@contextmanager
def bench_client(ctx: BenchContext, private: bool = False) -> Iterator[Any]:
    """An ``SbpClient`` of the bench cluster.

    ``private`` gives it a connection pool of its own, closed on exit, so concurrent bench
    clients really use separate connections; otherwise it shares the process-wide pool.
    """
    from sbp_spark.client import ConnectionPool, SbpClient

    pool = ConnectionPool() if private else None
    try:
        yield SbpClient(ctx.server.pd, pool=pool)
    finally:
        if pool is not None:
            pool.close()


def create_streams(ctx: BenchContext, count: int) -> list[int]:
    """``count`` new, empty streams on the bench cluster; returns their ids."""
    with bench_client(ctx) as client:
        return [int(s.stream_id) for s in client.create_streams(count=count)]


def create_stream(ctx: BenchContext) -> int:
    """A new, empty stream on the bench cluster; returns its id."""
    return create_streams(ctx, 1)[0]


def register_connector(spark) -> None:
    """Register the connector explicitly (discovery happens at session start only)."""
    import sbp_spark

    if hasattr(sbp_spark, "register"):
        sbp_spark.register(spark)
    else:
        import pyspark_sbp

        spark.dataSource.register(pyspark_sbp.DefaultSource)


def append_in_ranges(ctx: BenchContext, stream_id: int, batch: Callable[[int], Any], count: int,
                     ranges: int, per_call: int,
                     after_range: Callable[[int], None] | None = None) -> None:
    """Append ``batch(0)`` ... ``batch(count - 1)`` to ``stream_id``, ``count // ranges``
    batches per range, ``per_call`` batches per append call; the PD seals each range once it
    is full and opens the next. ``after_range(batches so far)`` is called after each range."""
    per_range = max(1, count // ranges)
    with bench_client(ctx) as client:
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
