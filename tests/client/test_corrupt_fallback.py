"""Stored bytes that rot on one replica: the read comes from another replica; with no sound
copy left the read fails naming the corrupt offset and the servers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbp_spark.client import SbpClient
from sbp_spark.protocol.errors import DataCorruptError, ErrorCode, SbpError
from sbp_spark.protocol.records import ENVELOPE_SIZE, encode_batch
from sbp_spark.server.cluster import EmbeddedCluster
from tests.client.private_cluster import client_of, numbered_body, retrying_config
from tests.segment_files import flip_body_byte, only_segment, stored_batches

BATCHES = 40
BAD = 20  # offset of the batch whose stored bytes get a flipped byte
CONFIG = retrying_config(retries=3, retry_deadline_s=15, retry_backoff_max_ms=100)


def body(i: int) -> bytes:
    return numbered_body(b"record", i, 4000)


@pytest.fixture
def cluster(tmp_path) -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(str(tmp_path / "cluster"), range_servers=2) as running:
        yield running


@pytest.fixture
def client(cluster) -> Iterator[SbpClient]:
    with client_of(cluster, CONFIG) as running:
        yield running


def write_stream(client: SbpClient, replicas: int) -> int:
    """A stream whose range 0 holds BATCHES batches, sealed there: every replica serves all of
    it at once (a replica of an open range shows only what every replica acknowledged)."""
    (stream,) = client.create_streams(replicas=replicas)
    client.append(stream.stream_id, [encode_batch(body(i)) for i in range(BATCHES)])
    client.seal_range(stream.stream_id)
    return stream.stream_id


def primary_index(cluster: EmbeddedCluster, client: SbpClient, sid: int) -> int:
    rng = client.list_ranges(sid)[0]
    assert rng.primary is not None
    return cluster.range_server_addresses.index(rng.primary.advertise_addr)


def flip_byte_of_batch(cluster: EmbeddedCluster, i: int, sid: int, offset: int) -> None:
    """Flip one byte in the body of the stored batch at ``offset`` in server ``i``'s copy."""
    segment = only_segment(Path(cluster.data_dir) / f"rs-{i}" / "data" / "ranges", sid)
    [(position, length)] = [(pos, length) for pos, length, base in stored_batches(segment)
                            if base == offset]
    flip_body_byte(segment, position, length)


def restart(cluster: EmbeddedCluster, i: int) -> str:
    """Restart server ``i``: recovery rescans its segment, so reads check the bytes again."""
    cluster.stop_range_server(i)
    return cluster.start_range_server(i).advertise_addr


def read_all(client: SbpClient, sid: int) -> list[tuple[int, bytes]]:
    return [(b.header.base_offset, bytes(b.data[ENVELOPE_SIZE:])) for b in client.read(sid)]


def test_corrupt_primary_copy_is_read_from_the_other_replica(cluster, client):
    sid = write_stream(client, replicas=2)
    bad = primary_index(cluster, client, sid)
    flip_byte_of_batch(cluster, bad, sid, BAD)
    address = restart(cluster, bad)
    # The server itself says what is wrong and where.
    with pytest.raises(DataCorruptError, match=f"offset {BAD}") as caught:
        list(client.range_server(address).fetch(sid, BAD, BAD + 1))
    assert caught.value.code == ErrorCode.DATA_CORRUPT and caught.value.retriable
    rng = client.list_ranges(sid)[0]
    assert rng.primary is not None and rng.primary.advertise_addr == address
    assert read_all(client, sid) == [(i, body(i)) for i in range(BATCHES)]


def test_corruption_seen_while_running_falls_back_too(cluster, client):
    # No restart: the server trusts the bytes it wrote, the frame checksum catches them.
    sid = write_stream(client, replicas=2)
    flip_byte_of_batch(cluster, primary_index(cluster, client, sid), sid, BAD)
    assert read_all(client, sid) == [(i, body(i)) for i in range(BATCHES)]


def test_no_sound_copy_fails_naming_offset_and_server(cluster, client):
    sid = write_stream(client, replicas=1)
    only = primary_index(cluster, client, sid)
    flip_byte_of_batch(cluster, only, sid, BAD)
    address = restart(cluster, only)
    got: list[tuple[int, bytes]] = []
    started = time.monotonic()
    with pytest.raises(SbpError) as caught:
        for batch in client.read(sid):
            got.append((batch.header.base_offset, bytes(batch.data[ENVELOPE_SIZE:])))
    error = caught.value
    assert isinstance(error, DataCorruptError), error
    message = str(error)
    assert f"offset {BAD} is corrupt on every replica" in message and address in message
    assert f"stream {sid}" in message
    # Everything before the corrupt batch was read, exactly; nothing after was made up.
    assert got == [(i, body(i)) for i in range(BAD)]
    # Asking the same server again would return the same bytes: no retry rounds.
    assert time.monotonic() - started < CONFIG.retry_deadline_s / 2
