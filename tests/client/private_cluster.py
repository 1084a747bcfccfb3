"""A cluster of a test's own (failover cases stop and restart its servers), a client of it with
the test's retry policy, and the numbered record bodies those tests write."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.server.cluster import EmbeddedCluster, ProcessCluster

# Short heartbeats: the PD notices a stopped server (and fails it over) within about a second.
HEARTBEAT_S = 0.2


@contextmanager
def private_cluster(path, range_servers: int) -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(str(path / "cluster"), range_servers=range_servers,
                         heartbeat_interval_s=HEARTBEAT_S) as running:
        yield running


@contextmanager
def client_of(cluster: EmbeddedCluster | ProcessCluster, config: ClientConfig
              ) -> Iterator[SbpClient]:
    with ConnectionPool(config) as pool:
        yield SbpClient(cluster.pd_address, config, pool)


def retrying_config(retries: int, retry_deadline_s: float,
                    retry_backoff_max_ms: int = 200) -> ClientConfig:
    """Short timeouts and quick backoff: the retry policy of the failover tests."""
    return ClientConfig(connect_timeout_s=2, request_timeout_s=10, retries=retries,
                        retry_backoff_ms=20, retry_backoff_max_ms=retry_backoff_max_ms,
                        retry_deadline_s=retry_deadline_s)


def numbered_body(tag: bytes, i: int, size: int) -> bytes:
    """Record ``i``'s body: its tag and number, then ``size`` bytes that depend on ``i``."""
    return b"%s-%06d|" % (tag, i) + bytes([i % 251]) * size
