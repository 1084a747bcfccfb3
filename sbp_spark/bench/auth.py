"""What authentication costs: one writer's round trip (fsync ``never``, where the network and
the servers' code are all there is) and a Spark read, on a cluster that authenticates with
tokens next to an open one (issue 44: within 5% of the open cluster).

Two server processes run the same cluster, one started with a shared secret; rounds alternate
between them so both see the machine's swings alike. A token is checked once per connection,
and every request is checked against the permissions table: the writer authenticates as a
principal with ``write`` granted on its stream, the read as one with ``read``, not as a
superuser, so the check runs as it does for users.
"""

from __future__ import annotations

import os
import secrets
import statistics
import time

from .context import BenchContext
from .loopback import SMALL_BYTES
from .report import AT_MOST_RATIO, Figure, Target
from .server_proc import ServerProcess
from .timing import percentile

SECTION = "auth"
TARGET = Target(AT_MOST_RATIO, 1.05)
WARMUP_APPENDS = 200
ROOT = "bench-root"


def _client(pd: str, token: str | None):
    from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient

    pool = ConnectionPool()
    return SbpClient(pd, ClientConfig(token=token), pool), pool


def _round_trips(pd: str, token: str | None, stream_id: int, seconds: float,
                 batch: list) -> list[float]:
    client, pool = _client(pd, token)
    try:
        writer = client.open_stream(stream_id)
        for _ in range(WARMUP_APPENDS):
            writer.append([batch])
        times = []
        end = time.perf_counter() + seconds
        while (start := time.perf_counter()) < end:
            writer.append([batch])
            times.append(time.perf_counter() - start)
        return times
    finally:
        pool.close()


def _read_seconds(ctx: BenchContext, pd: str, stream_id: int, token: str | None,
                  rows: int) -> float:
    reader = (ctx.spark().read.format("sbp").option("pd", pd).option("streams", str(stream_id))
              .option("payload", "arrow"))
    if token is not None:
        reader = reader.option("token", token)
    start = time.perf_counter()
    got = reader.load().selectExpr("sum(length(value))").collect()
    seconds = time.perf_counter() - start
    if got[0][0] is None:
        raise RuntimeError(f"the read of stream {stream_id} found no rows ({rows} written)")
    return seconds


def run(ctx: BenchContext) -> list[Figure]:
    from sbp_spark.protocol.messages import Permission
    from sbp_spark.protocol.records import encode_batch
    from sbp_spark.server.auth.tokens import create_token

    cfg = ctx.config
    secret = secrets.token_urlsafe(48).encode()
    secret_file = ctx.workdir / "auth-secret"
    secret_file.write_bytes(secret)
    tokens = {name: create_token(name, secret=secret) for name in (ROOT, "writer", "reader")}
    servers: dict[str, ServerProcess] = {}
    try:
        for kind in ("open", "auth"):
            ctx.progress(SECTION, f"starting the {kind} cluster (fsync never)")
            servers[kind] = ServerProcess(
                ctx.workdir / f"auth-{kind}", log_path=ctx.workdir / f"auth-{kind}.log",
                fsync="never", auth_secret=secret_file if kind == "auth" else None,
                superuser=ROOT).start()
        streams: dict[str, tuple[int, int]] = {}
        rows = cfg.spark_rows // 4
        for kind, server in servers.items():
            client, pool = _client(server.pd, tokens[ROOT] if kind == "auth" else None)
            try:
                [written, read] = client.create_streams(2)
                if kind == "auth":
                    version = client.pd.grant_permissions([
                        Permission("writer", "write", str(written.stream_id)),
                        Permission("reader", "read", str(read.stream_id))])
                    _wait_learned(client, version, read.stream_id, tokens["reader"])
            finally:
                pool.close()
            streams[kind] = (written.stream_id, read.stream_id)
            df = ctx.spark().range(rows, numPartitions=4).selectExpr(
                "id", "CAST(id AS STRING) AS value")
            writer = (df.write.format("sbp").option("pd", server.pd)
                      .option("stream", str(read.stream_id)).option("payload", "arrow"))
            if kind == "auth":
                writer = writer.option("token", tokens[ROOT])
            writer.mode("append").save()
        for kind in servers:  # warm Spark's Python workers and each cluster's page cache
            _read_seconds(ctx, servers[kind].pd, streams[kind][1],
                          tokens["reader"] if kind == "auth" else None, rows)
        batch = encode_batch(memoryview(os.urandom(SMALL_BYTES - 28)))
        times: dict[str, list[float]] = {"open": [], "auth": []}
        reads: dict[str, list[float]] = {"open": [], "auth": []}
        per_round = cfg.latency_seconds / cfg.latency_rounds
        for n in range(cfg.latency_rounds):
            for kind in ("open", "auth") if n % 2 == 0 else ("auth", "open"):
                token = tokens["writer"] if kind == "auth" else None
                times[kind] += _round_trips(servers[kind].pd, token, streams[kind][0],
                                            per_round, batch)
                token = tokens["reader"] if kind == "auth" else None
                reads[kind].append(_read_seconds(ctx, servers[kind].pd, streams[kind][1],
                                                 token, rows))
            ctx.progress(SECTION, f"round {n + 1}/{cfg.latency_rounds}: p50 "
                                  f"{percentile(times['auth'], 50) * 1e3:.3f} ms with a token, "
                                  f"{percentile(times['open'], 50) * 1e3:.3f} ms open")
    finally:
        for server in servers.values():
            server.stop()
    return [
        Figure(SECTION, "1 KiB APPEND round trip (fsync never) with a token: p50", "ms",
               percentile(times["auth"], 50) * 1e3, percentile(times["open"], 50) * 1e3,
               "the same, open cluster", TARGET,
               extra={"appends": len(times["auth"]), "open_appends": len(times["open"])}),
        Figure(SECTION, f"Spark read of {rows:,} rows with a token", "s",
               statistics.median(reads["auth"]), statistics.median(reads["open"]),
               "the same, open cluster", TARGET,
               extra={"times_s": reads["auth"], "open_times_s": reads["open"]}),
    ]


def _wait_learned(client, version: int, stream_id: int, token: str) -> None:
    """Until the range servers enforce ``version`` (a read with ``token`` is let through)."""
    from sbp_spark.client import SbpClient
    from sbp_spark.protocol.errors import PermissionDeniedError, ThrottledError

    reader = SbpClient(client.pd.addresses, client.config.with_token(token), client.pool)
    deadline = time.monotonic() + 30
    while True:
        try:
            list(reader.read(stream_id))
            return
        except (PermissionDeniedError, ThrottledError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the range servers did not learn permissions version "
                                   f"{version} within 30 s") from None
            time.sleep(0.1)
