"""What an append that fails says about its batches: stored, not stored, or in doubt (sent, with
no answer saying whether they were stored). "Not stored" only when the client knows it; batches
in doubt end the call with ``AppendOutcomeUnknownError``, naming them.

Scripted servers show each kind of failure of one APPEND frame; a real cluster behind a proxy
that loses every APPEND answer shows a whole call ending in doubt, its batches in fact stored.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient, SbpClient
from sbp_spark.client.types import Outcome
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import Opcode
from sbp_spark.protocol.errors import (
    AppendOutcomeUnknownError,
    ErrorCode,
    SbpError,
    TransportError,
)
from sbp_spark.protocol.records import ENVELOPE_SIZE, batch_bytes, encode_batch
from sbp_spark.server.cluster import EmbeddedCluster

from .fakes import FakeServer, Peer
from .proxies import AnswerLosingProxy, ProxiedClient, _opcode_at

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=2, retry_backoff_ms=10,
                      retry_backoff_max_ms=50, retry_deadline_s=2)


@pytest.fixture
def pool() -> Iterator[ConnectionPool]:
    with ConnectionPool(CONFIG) as private:
        yield private


def _append(pool: ConnectionPool, handler, batches: int = 2) -> list:
    with FakeServer(handler) as server:
        return RangeServerClient(server.address, CONFIG, pool).append(
            [(1, batch_bytes(b"b%d" % i)) for i in range(batches)])


def _status_answer(code: int):
    def answer(peer: Peer) -> None:
        frame = peer.read_frame()
        peer.send(m.response_frame(frame.stream_id, m.AppendResponse(append_responses=[
            m.AppendResult(e.stream_id, e.request_index, -1, status=m.Status(code, "no"))
            for e in m.decode_request(frame).append_requests])))
    return answer


@pytest.mark.parametrize("code,outcome", [
    (ErrorCode.RANGE_SEALED, Outcome.NOT_DONE),  # refused before storing
    (ErrorCode.NOT_PRIMARY, Outcome.NOT_DONE),
    (ErrorCode.REPLICATION_FAILED, Outcome.NOT_DONE),  # the seal fences it off
    (ErrorCode.UNKNOWN, Outcome.UNKNOWN),  # the server may have failed after storing
    (ErrorCode.STORAGE_FULL, Outcome.UNKNOWN),  # an fsync that failed left the bytes written
    (ErrorCode.REQUEST_TIMEOUT, Outcome.UNKNOWN),
    (99, Outcome.UNKNOWN),  # a code this client does not know says nothing
])
def test_an_entry_refused_by_the_server_is_in_doubt_only_when_its_code_says_so(pool, code,
                                                                               outcome):
    results = _append(pool, _status_answer(code))
    assert [r.outcome for r in results] == [outcome, outcome]


def test_a_system_error_on_the_frame_says_nothing_was_stored(pool):
    def shutting_down(peer: Peer) -> None:
        frame = peer.read_frame()
        peer.send(m.system_error_frame(frame.stream_id, frame.opcode,
                                       m.Status(ErrorCode.SHUTTING_DOWN, "stopping")))

    assert [r.outcome for r in _append(pool, shutting_down)] == [Outcome.NOT_DONE] * 2


def test_a_connection_lost_after_the_frame_went_out_leaves_it_in_doubt(pool):
    def stores_and_dies(peer: Peer) -> None:
        peer.read_frame()
        peer.close()

    results = _append(pool, stores_and_dies)
    assert [r.outcome for r in results] == [Outcome.UNKNOWN] * 2
    assert all(isinstance(r.exception(), TransportError) for r in results)


def test_a_server_that_cannot_be_reached_stored_nothing(pool):
    with FakeServer(lambda peer: None) as server:
        address = server.address
    results = RangeServerClient(address, CONFIG, pool).append([(1, batch_bytes(b"x"))])
    assert [r.outcome for r in results] == [Outcome.NOT_DONE]


def test_an_answer_that_leaves_an_entry_out_leaves_that_entry_in_doubt(pool):
    def answers_one(peer: Peer) -> None:
        frame = peer.read_frame()
        first = m.decode_request(frame).append_requests[0]
        peer.send(m.response_frame(frame.stream_id, m.AppendResponse(append_responses=[
            m.AppendResult(first.stream_id, first.request_index, 0)])))

    results = _append(pool, answers_one)
    assert [r.outcome for r in results] == [Outcome.DONE, Outcome.UNKNOWN]


# -- a whole call against a real cluster -----------------------------------------------------


class AppendAnswerLosingProxy(AnswerLosingProxy):
    """Once armed, every APPEND answer is swallowed and its connection closed (PINGs and
    everything else pass): the range server stores each batch, the writer never hears."""

    def forward(self, pair: int, answers: bool, data: bytes) -> bytes | None:
        if answers and self.armed.is_set() and _opcode_at(data) == Opcode.APPEND:
            self.lost.set()
            return None
        return data


@pytest.fixture
def lossy(tmp_path) -> Iterator[tuple[SbpClient, SbpClient, AppendAnswerLosingProxy]]:
    with EmbeddedCluster(str(tmp_path / "cluster"), range_servers=1) as cluster:
        proxy = AppendAnswerLosingProxy(cluster.range_server_addresses[0])
        try:
            with ConnectionPool(CONFIG) as pool:
                client = ProxiedClient(cluster.pd_address, CONFIG, pool)
                client.proxy, client.proxy_for = proxy, cluster.range_server_addresses[0]
                yield client, SbpClient(cluster.pd_address, CONFIG, pool), proxy
        finally:
            proxy.close()


def test_a_call_whose_answers_are_lost_fails_as_in_doubt_naming_the_batches(lossy):
    client, reader, proxy = lossy
    (stream,) = client.create_streams()
    sid = stream.stream_id
    writer = client.open_stream(sid)
    writer.append([encode_batch(b"first")])  # the range took a batch: the rest go together
    proxy.armed.set()
    bodies = [b"doubt-%d" % i for i in range(3)]
    began = time.monotonic()
    with pytest.raises(AppendOutcomeUnknownError) as failure:
        writer.append([encode_batch(b) for b in bodies])
    took = time.monotonic() - began
    error = failure.value
    assert proxy.lost.is_set()
    assert (error.stream_id, error.in_doubt, error.ranges, error.stored, error.batches) == (
        sid, (0, 1, 2), (0,), (), 3)
    assert not error.retriable and isinstance(error.__cause__, SbpError)
    message = str(error)
    assert message.startswith(f"append to stream {sid} gave up after ")
    assert "(its deadline passed): 0 of 3 batches of the call stored, 3 in doubt" in message
    assert "may be in the stream" in message and "0 not stored" in message
    assert CONFIG.retry_deadline_s <= took < CONFIG.retry_deadline_s + 3
    # In doubt, not lost: the server stored them (every attempt did: at least once).
    stored = [bytes(b.data[ENVELOPE_SIZE:]) for b in reader.read(sid)]
    assert stored[0] == b"first" and set(stored[1:]) == set(bodies)
    # Spark pickles executor errors: the fields travel with it.
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is AppendOutcomeUnknownError and str(copy) == message
    assert (copy.stream_id, copy.in_doubt, copy.ranges, copy.stored, copy.batches) == (
        sid, (0, 1, 2), (0,), (), 3)


def test_a_batch_found_stored_before_its_resend_is_no_longer_in_doubt(lossy):
    client, reader, proxy = lossy
    (stream,) = client.create_streams()
    sid = stream.stream_id
    writer = client.open_stream(sid)
    writer.append([encode_batch(b"first")])
    proxy.armed.set()
    bodies = [b"found-%d" % i for i in range(2)]

    def already_stored(indexes: list[int]) -> dict:
        # The idempotent sink's check: batch 0 is found where it landed, batch 1 is not
        # looked for (as if its tag were not there yet).
        found = {bytes(b.data[ENVELOPE_SIZE:]): b for b in reader.read(sid)}
        from sbp_spark.client import Appended

        return {0: Appended(sid, 0, found[bodies[0]].header.base_offset, 1,
                            found[bodies[0]].header.batch_length)} if 0 in indexes else {}

    with pytest.raises(AppendOutcomeUnknownError) as failure:
        writer.append([encode_batch(b) for b in bodies], before_resend=already_stored)
    assert (failure.value.in_doubt, failure.value.stored) == ((1,), (0,))
    assert "1 of 2 batches of the call stored, 1 in doubt (batch 1," in str(failure.value)
