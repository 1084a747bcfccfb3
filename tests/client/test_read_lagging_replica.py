"""A read that falls back to a replica that lags behind never ends short in silence.

A secondary of an open replicated range serves records only once it knows every replica holds
them (its primary tells it with the next forward, or a cap notice once the range goes
quiet; the tests here silence the notices, as a primary that dies right after an append
settled would). A read that knows the range reaches further
and lands on such a secondary must keep going (other replicas, the PD's seal after a failover)
or fail saying so; returning fewer records than asked would lose data without a word.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from sbp_spark.client import ClientConfig, SbpClient
from sbp_spark.protocol.errors import ReplicaBehindError
from sbp_spark.protocol.records import ENVELOPE_SIZE, encode_batch
from sbp_spark.server.cluster import EmbeddedCluster
from tests.client.private_cluster import (
    client_of,
    numbered_body,
    private_cluster,
    retrying_config,
)
from tests.polling import wait_until

CONFIG = retrying_config(retries=50, retry_deadline_s=30)


def body(i: int) -> bytes:
    return numbered_body(b"lagging", i, 1000)


@pytest.fixture
def cluster(tmp_path) -> Iterator[EmbeddedCluster]:
    with private_cluster(tmp_path, range_servers=4) as running:
        yield running


@pytest.fixture
def client(cluster) -> Iterator[SbpClient]:
    with client_of(cluster, CONFIG) as running:
        yield running


def _values(batches) -> list[tuple[int, bytes]]:
    return [(b.header.base_offset, bytes(b.data[ENVELOPE_SIZE:])) for b in batches]


def _silence_cap_notices(cluster: EmbeddedCluster) -> None:
    """Primaries send no cap notice: the secondaries learn the cap only from forwards, one
    append behind (what they know when the primary dies before its notice leaves)."""
    for rs in cluster.range_servers:
        if rs is not None:
            rs.cap_notices.send = lambda rlog: None


def _replicated_range(client: SbpClient, n: int):
    """A new stream with 3 replicas holding ``n`` records, one APPEND per batch (each forward
    moves the secondaries' caps): (stream id, its range)."""
    (stream,) = client.create_streams(replicas=3)
    sid = stream.stream_id
    writer = client.open_stream(sid)
    for i in range(n):
        writer.append([encode_batch(body(i))])
    (rng,) = client.list_ranges(sid)
    return sid, rng


def test_read_past_a_lagging_secondary_waits_for_the_failover_seal(cluster, client):
    _silence_cap_notices(cluster)
    sid, rng = _replicated_range(client, 12)
    assert client.open_range_end(rng) == 12  # the primary: everything settled
    primary = next(r.server.advertise_addr for r in rng.servers if r.is_primary)
    secondary = next(r.server.advertise_addr for r in rng.servers if not r.is_primary)
    # The secondaries learned only the cap sent with the last forward: they hold 12 records
    # but serve 11.
    served = [h.base_offset for h, _ in client.range_server(secondary).fetch(sid, 0, 12)]
    assert served == list(range(11))
    cluster.stop_range_server(cluster.range_server_addresses.index(primary))
    started = time.monotonic()
    # A reader planned with the range's end (as Spark's planner does, from the primary) must
    # not stop at 11: the secondaries lag until the PD seals the range where they all hold data.
    got = _values(client.fetch(rng, 0, 12))
    assert got == [(i, body(i)) for i in range(12)]
    assert time.monotonic() - started < CONFIG.retry_deadline_s
    # The PD seals the replicas first and records the seal after: wait for its record.
    wait_until(lambda: not client.list_ranges(sid)[0].is_open, "the PD to record the seal",
               timeout=20)
    (sealed, *_) = client.list_ranges(sid)
    assert not sealed.is_open and sealed.end_offset == 12
    assert _values(client.read(sid)) == got


def test_a_replica_that_cannot_catch_up_fails_the_read_clearly(cluster, client):
    _silence_cap_notices(cluster)
    sid, rng = _replicated_range(client, 5)
    secondary = next(r for r in rng.servers if not r.is_primary)
    # A caller that planned with only that secondary (say, a task handed one replica).
    lone = type(rng)(rng.stream_id, rng.range_index, rng.start_offset, rng.next_offset,
                     rng.end_offset, [secondary])
    impatient = SbpClient(cluster.pd_address, ClientConfig(
        retries=3, retry_backoff_ms=10, retry_backoff_max_ms=20, retry_deadline_s=2),
        client.pool)
    impatient.pd.describe_ranges = lambda *a, **k: (_ for _ in ()).throw(  # no PD help
        ReplicaBehindError("the PD is not consulted in this test"))
    got = []
    with pytest.raises(ReplicaBehindError, match="served nothing .* at offset 4"):
        for batch in impatient.fetch(lone, 0, 5):
            got.append(batch.header.base_offset)
    assert got == [0, 1, 2, 3]


def test_read_to_the_end_waits_for_the_primary_or_the_seal(cluster, client):
    """`read(stream)` asks where the open range ends: a secondary's answer is only a lower
    bound, so with the primary gone it waits for the failover seal instead of ending at 11."""
    sid, rng = _replicated_range(client, 12)
    primary = next(r.server.advertise_addr for r in rng.servers if r.is_primary)
    cluster.stop_range_server(cluster.range_server_addresses.index(primary))
    assert client.open_range_end(rng) == 12
    assert _values(client.read(sid)) == [(i, body(i)) for i in range(12)]
