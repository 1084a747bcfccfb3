"""Client test fixtures: one embedded cluster (a PD and two range servers on free loopback ports)
for the whole test session, and a private connection pool per test."""

from __future__ import annotations

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient

# Short waits keep failing tests fast; retries stay on so seals and redirects are followed.
TEST_CONFIG = ClientConfig(connect_timeout_s=5, request_timeout_s=20, retry_backoff_ms=5,
                           retry_backoff_max_ms=200, retry_deadline_s=30)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    from sbp_spark.server.cluster import EmbeddedCluster

    with EmbeddedCluster(str(tmp_path_factory.mktemp("client-cluster")),
                         range_servers=2) as running:
        yield running


@pytest.fixture
def pool():
    with ConnectionPool(TEST_CONFIG) as private:
        yield private


@pytest.fixture
def client(cluster, pool) -> SbpClient:
    return SbpClient(cluster.pd_address, TEST_CONFIG, pool)
