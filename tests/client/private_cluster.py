"""A cluster of a test's own (failover cases stop and restart its servers), and a client of it
with the test's retry policy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.server.cluster import EmbeddedCluster

# Short heartbeats: the PD notices a stopped server (and fails it over) within about a second.
HEARTBEAT_S = 0.2


@contextmanager
def private_cluster(path, range_servers: int) -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(str(path / "cluster"), range_servers=range_servers,
                         heartbeat_interval_s=HEARTBEAT_S) as running:
        yield running


@contextmanager
def client_of(cluster: EmbeddedCluster, config: ClientConfig) -> Iterator[SbpClient]:
    with ConnectionPool(config) as pool:
        yield SbpClient(cluster.pd_address, config, pool)
