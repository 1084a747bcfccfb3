"""Fixtures of the authentication tests: the keys of a module's cluster, and clients of it
(``cluster``, which each module starts as it needs) as one principal or another."""

from __future__ import annotations

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient

from .keys import Keys


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def as_(cluster, keys):
    """``as_(name)``: a client of ``cluster`` authenticated as ``name``, with a short retry
    deadline (refusals are not retried; a test waits no longer on anything else)."""
    pools: list[ConnectionPool] = []

    def client(name: str) -> SbpClient:
        pool = ConnectionPool()
        pools.append(pool)
        return SbpClient(cluster.pd_address, ClientConfig(retry_deadline_s=2), pool,
                         token=keys.token(name))

    yield client
    for pool in pools:
        pool.close()
