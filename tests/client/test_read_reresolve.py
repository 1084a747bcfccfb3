"""Reads survive a range server that comes back on another port: the client asks the PD where
the range's replicas live now instead of retrying the address it started with."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sbp_spark.client import SbpClient
from sbp_spark.protocol.errors import SbpError
from sbp_spark.protocol.records import ENVELOPE_SIZE, encode_batch
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.server.range_server import RangeServer, RangeServerConfig
from sbp_spark.server.storage import StorageConfig
from tests.client.private_cluster import (
    HEARTBEAT_S,
    client_of,
    numbered_body,
    private_cluster,
    retrying_config,
)
from tests.polling import wait_until

# Few retries: without re-resolving, the read would give up long before the deadline.
CONFIG = retrying_config(retries=4, retry_deadline_s=20)


def body(i: int) -> bytes:
    return numbered_body(b"record", i, 2000)


@pytest.fixture
def cluster(tmp_path) -> Iterator[EmbeddedCluster]:
    with private_cluster(tmp_path, range_servers=1) as running:
        yield running


@pytest.fixture
def client(cluster) -> Iterator[SbpClient]:
    with client_of(cluster, CONFIG) as running:
        yield running


@contextmanager
def moved_range_server(cluster: EmbeddedCluster, i: int) -> Iterator[RangeServer]:
    """Stop range server ``i`` and run it again on its data directory on a new free port,
    until the PD knows the new address; stopped on exit."""
    old = cluster.range_server_addresses[i]
    server_id = cluster.server_id(i)
    cluster.stop_range_server(i)
    rs = RangeServer(RangeServerConfig(
        data_dir=str(Path(cluster.data_dir) / f"rs-{i}"), port=0,
        pd_addresses=[cluster.pd_address], storage=StorageConfig(fsync="never"),
        heartbeat_interval_s=HEARTBEAT_S)).start()
    try:
        assert rs.server_id == server_id and rs.advertise_addr != old
        assert cluster.pd is not None
        pd = cluster.pd
        wait_until(lambda: pd.liveness.address(server_id) == rs.advertise_addr
                   and pd.liveness.is_live(server_id), "the PD to learn the new address",
                   timeout=20)
        yield rs
    finally:
        rs.stop()


def values(batches) -> list[tuple[int, bytes]]:
    return [(b.header.base_offset, bytes(b.data[ENVELOPE_SIZE:])) for b in batches]


def test_fetch_with_a_stale_range_finds_the_new_address(cluster, client):
    (stream,) = client.create_streams()
    sid = stream.stream_id
    client.append(sid, [encode_batch(body(i)) for i in range(30)])
    (stale,) = client.list_ranges(sid)  # what a planner handed to a task earlier
    with moved_range_server(cluster, 0) as rs:
        assert stale.servers[0].server.advertise_addr != rs.advertise_addr
        # The Spark reader and `sbp tail` fetch with the range they planned with.
        got = values(client.fetch(stale, 0, 30))
        assert got == [(i, body(i)) for i in range(30)]
        # The live end of an open range is asked from its primary: found at the new port too.
        assert client.open_range_end(stale) == 30
        assert values(client.read(sid)) == got


def test_read_started_before_the_restart_completes_exactly(cluster, client):
    (stream,) = client.create_streams()
    sid = stream.stream_id
    client.append(sid, [encode_batch(body(i)) for i in range(20)])
    client.seal_range(sid)
    client.append(sid, [encode_batch(body(i)) for i in range(20, 45)])
    reader = client.read(sid)  # lists both ranges (with today's address) on first use
    got = values(next(reader) for _ in range(20))
    assert [o for o, _ in got] == list(range(20))
    with moved_range_server(cluster, 0):
        got += values(reader)
    assert got == [(i, body(i)) for i in range(45)]


def test_without_the_server_the_read_still_fails_within_the_deadline(cluster, client):
    (stream,) = client.create_streams()
    sid = stream.stream_id
    client.append(sid, [encode_batch(body(i)) for i in range(3)])
    (rng,) = client.list_ranges(sid)
    cluster.stop_range_server(0)
    started = time.monotonic()
    with pytest.raises(SbpError):
        list(client.fetch(rng, 0, 3))
    assert time.monotonic() - started < CONFIG.retry_deadline_s + 5
