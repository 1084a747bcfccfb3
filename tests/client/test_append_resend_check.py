"""An APPEND whose answer is lost: resent under its producer and sequences (the default) it
lands once, at the offsets it got first; resent blindly (appends not idempotent) it lands
twice; with a resend check, once.

A proxy between the writer and its range server forwards the APPEND, lets the server store it,
then drops the answer and the connection, as a network failure at the worst moment would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from sbp_spark.client import Appended, ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.messages import RangeId
from sbp_spark.protocol.records import ENVELOPE_SIZE, encode_batch
from sbp_spark.server.cluster import EmbeddedCluster

from .proxies import AnswerLosingProxy, ProxiedClient

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retries=5,
                      retry_backoff_ms=10, retry_backoff_max_ms=50, retry_deadline_s=20)


@pytest.fixture
def cluster(tmp_path) -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(str(tmp_path / "cluster"), range_servers=1) as running:
        yield running


@pytest.fixture(params=[False, True], ids=["at-least-once", "idempotent"])
def setup(cluster, request):
    proxy = AnswerLosingProxy(cluster.range_server_addresses[0])
    config = dataclasses.replace(CONFIG, idempotent=request.param)
    with ConnectionPool(CONFIG) as pool:
        client = ProxiedClient(cluster.pd_address, config, pool)
        client.proxy, client.proxy_for = proxy, cluster.range_server_addresses[0]
        reader = SbpClient(cluster.pd_address, CONFIG, pool)
        yield client, reader, proxy
    proxy.close()


def _bodies(n: int) -> list[bytes]:
    return [b"resend-%03d|" % i + bytes([i]) * 500 for i in range(n)]


def _stored(reader: SbpClient, sid: int) -> list[bytes]:
    return [bytes(b.data[ENVELOPE_SIZE:]) for b in reader.read(sid)]


def _started(client: SbpClient, reader: SbpClient) -> int:
    """A new stream whose open range holds a batch: the first batch to a range goes alone
    (``StreamWriter._send``), and these cases lose the answer of a frame of several."""
    (stream,) = client.create_streams()
    client.open_stream(stream.stream_id).append([encode_batch(b"first")])
    assert _stored(reader, stream.stream_id) == [b"first"]
    return stream.stream_id


def test_a_lost_answer_means_a_second_copy_only_when_appends_are_not_idempotent(setup):
    client, reader, proxy = setup
    sid = _started(client, reader)
    bodies = _bodies(5)
    proxy.armed.set()
    appended = client.open_stream(sid).append([encode_batch(b) for b in bodies])
    assert proxy.lost.is_set()
    if client.config.idempotent:
        # The range server knew the batches by their sequences: answered where they landed.
        assert [a.base_offset for a in appended] == [1, 2, 3, 4, 5]
        assert _stored(reader, sid) == [b"first"] + bodies
    else:
        # at least once, as documented
        assert [a.base_offset for a in appended] == [6, 7, 8, 9, 10]
        assert _stored(reader, sid) == [b"first"] + bodies + bodies


def test_the_resend_check_keeps_a_lost_answer_from_landing_twice(setup):
    client, reader, proxy = setup
    sid = _started(client, reader)
    bodies = _bodies(5)
    asked: list[list[int]] = []

    def already_stored(indexes: list[int]) -> dict[int, Appended]:
        asked.append(indexes)
        where = {bytes(b.data[ENVELOPE_SIZE:]): b for b in reader.read(sid)}
        return {i: Appended(sid, where[bodies[i]].range_index,
                            where[bodies[i]].header.base_offset, 1,
                            where[bodies[i]].header.batch_length)
                for i in indexes if bodies[i] in where}

    proxy.armed.set()
    appended = client.open_stream(sid).append([encode_batch(b) for b in bodies],
                                              before_resend=already_stored)
    assert proxy.lost.is_set() and asked == [[0, 1, 2, 3, 4]]
    assert [a.base_offset for a in appended] == [1, 2, 3, 4, 5]
    assert _stored(reader, sid) == [b"first"] + bodies
    # Only what was found is held back: a later append still lands.
    client.open_stream(sid).append([encode_batch(b"after")], before_resend=already_stored)
    assert _stored(reader, sid) == [b"first"] + bodies + [b"after"]


def test_a_batch_in_doubt_when_its_range_is_sealed_is_looked_up_there_not_resent(setup):
    """The answer is lost, then the range is sealed before the resend (as a failover would):
    the idempotent writer asks the sealed range, finds its batches there and sends nothing
    again; the at-least-once one stores them a second time in the next range."""
    client, reader, proxy = setup
    sid = _started(client, reader)
    bodies = _bodies(4)
    sealed: list[int] = []

    def seal_once(indexes: list[int]) -> dict[int, Appended]:
        if not sealed:
            (result,) = reader.pd.seal_ranges([RangeId(sid, 0)])
            sealed.append(result.unwrap().range_index)
        return {}

    proxy.armed.set()
    appended = client.open_stream(sid).append([encode_batch(b) for b in bodies],
                                              before_resend=seal_once)
    assert proxy.lost.is_set() and sealed == [1]
    if client.config.idempotent:
        assert [(a.range_index, a.base_offset) for a in appended] == [(0, i) for i in
                                                                       range(1, 5)]
        assert _stored(reader, sid) == [b"first"] + bodies
    else:
        assert [a.base_offset for a in appended] == [5, 6, 7, 8]  # in the next range
        assert _stored(reader, sid) == [b"first"] + bodies + bodies
