"""A CREATE_STREAMS whose answer is lost: the PD made the streams, so sending it again would
make them twice. The client says the outcome is unknown instead of resending it. A
DELETE_STREAMS whose answer is lost is resent, and "already deleted" is then its success.

An answer-losing proxy sits between the client and the PD: it forwards the
request, lets the PD carry it out, then drops the answer and the connection.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sbp_spark.cli import main
from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.errors import StreamNotFoundError, TransportError

from .proxies import AnswerLosingProxy
from .test_append_resend_check import CONFIG


@pytest.fixture
def lossy(cluster) -> Iterator[tuple[AnswerLosingProxy, SbpClient, SbpClient]]:
    """The proxy in front of the PD, a client through it, and one that reads past it."""
    proxy = AnswerLosingProxy(cluster.pd_address)
    try:
        with ConnectionPool(CONFIG) as pool:
            yield (proxy, SbpClient(proxy.address, CONFIG, pool),
                   SbpClient(cluster.pd_address, CONFIG, pool))
    finally:
        proxy.close()


def test_a_create_whose_answer_was_lost_is_not_sent_again(lossy):
    proxy, client, reader = lossy
    before = {s.stream_id for s in reader.list_streams()}
    proxy.armed.set()
    lost = "CREATE_STREAMS .* may have carried it out"
    with pytest.raises(TransportError, match=lost) as info:
        client.create_streams(1)
    assert proxy.lost.is_set()
    assert not info.value.retriable
    made = {s.stream_id for s in reader.list_streams()} - before
    assert len(made) == 1, made
    # The client recovers: the next create goes through on a new connection.
    (stream,) = client.create_streams(1)
    assert stream.stream_id not in before | made


def test_a_create_that_was_not_sent_is_still_retried(cluster, monkeypatch):
    # The pooled connection closes (idle, GOAWAY) between being handed out and the send:
    # the PD never saw the request, so sending it on a new connection is safe.
    with ConnectionPool(CONFIG) as pool:
        client = SbpClient(cluster.pd_address, CONFIG, pool)
        before = {s.stream_id for s in client.list_streams()}
        get = pool.get
        handed = []

        def get_closed_once(address, config=None):
            conn = get(address, config)
            if not handed:
                conn.close()
            handed.append(conn)
            return conn

        monkeypatch.setattr(pool, "get", get_closed_once)
        (stream,) = client.create_streams(1)
        assert len(handed) == 2 and handed[0].closed and not handed[1].closed
        monkeypatch.undo()
        assert {s.stream_id for s in client.list_streams()} - before == {stream.stream_id}


def test_a_delete_whose_answer_was_lost_succeeds_on_the_resend(lossy):
    # The PD deleted the stream; the resend is answered "stream S was deleted", which is
    # the end state the caller asked for.
    proxy, client, reader = lossy
    first, second = (s.stream_id for s in reader.create_streams(2))
    proxy.armed.set()
    deleted = client.delete_streams([first, second])
    assert proxy.lost.is_set()
    assert [(s.stream_id, s.deleted) for s in deleted] == [(first, True), (second, True)]
    assert not {first, second} & {s.stream_id for s in reader.list_streams()}
    # Not a resend: a stream found deleted already is still an error.
    with pytest.raises(StreamNotFoundError, match=f"stream {first} was deleted"):
        client.delete_streams([first])


def test_sbp_streams_delete_whose_answer_was_lost_exits_0(cluster, capsys):
    proxy = AnswerLosingProxy(cluster.pd_address)
    try:
        with ConnectionPool(CONFIG) as pool:
            (stream,) = SbpClient(cluster.pd_address, CONFIG, pool).create_streams(1)
        proxy.armed.set()
        status = main(["streams", "delete", str(stream.stream_id), "--pd", proxy.address])
        out, err = capsys.readouterr()
        assert proxy.lost.is_set()
        assert (status, out, err) == (0, f"deleted stream {stream.stream_id}\n", "")
    finally:
        proxy.close()
