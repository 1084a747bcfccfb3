"""Where the bench meets the other layers' public APIs (client, connector, streaming).

Every check here answers "can this figure be measured yet?" with None or a reason, so a section
whose code has not landed is reported as not available instead of failing or being faked.
"""

from __future__ import annotations

import importlib
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


def sbp_client(ctx: BenchContext, private: bool = False) -> Any:
    """A client of the bench cluster; ``private`` gives it connections of its own."""
    from sbp_spark.client import SbpClient

    return SbpClient(ctx.server.pd)


def create_stream(ctx: BenchContext) -> int:
    """A new, empty stream on the bench cluster; returns its id."""
    client = sbp_client(ctx)
    try:
        (stream,) = client.create_streams(count=1)
    finally:
        close_all(client)
    return int(stream.stream_id)


def close_all(*objects: Any) -> None:
    """Close each object that has a ``close`` method (clients, writers), in order."""
    for obj in objects:
        close = getattr(obj, "close", None)
        if close is not None:
            close()


def register_connector(spark) -> None:
    """Register the connector explicitly (discovery happens at session start only)."""
    import sbp_spark

    if hasattr(sbp_spark, "register"):
        sbp_spark.register(spark)
    else:
        import pyspark_sbp

        spark.dataSource.register(pyspark_sbp.DefaultSource)
