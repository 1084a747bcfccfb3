"""A primary whose secondary goes silent (a link that drops everything: no reset, no answer)
fails the append within the time the writer asked for, not the whole replication timeout, and
seals the range so writers move on (found by the partition case "primary cut off from its
secondaries", where every writer waited 30 s). One that answers no PING either is given up
on a few seconds late (``SECONDARY_GIVE_UP_S``), whatever the writer asked for; one that is
only slow, and answers PINGs, is waited for."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient
from sbp_spark.client.config import DEFAULT_PROBE_INTERVAL_S
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.messages import RangeReplica, RangeServer
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.range_server import RangeServer as Server
from sbp_spark.server.range_server import RangeServerConfig
from sbp_spark.server.range_server.replication import (
    DEFAULT_REPLICATION_TIMEOUT_S,
    SECONDARY_GIVE_UP_S,
)
from sbp_spark.server.storage import StorageConfig
from tests.client.fakes import FakeServer, Peer
from tests.server.secondary import sync_range

STREAM = 6


def silent(peer: Peer) -> None:
    """Reads every frame and never answers (what a dropped link looks like from the sender)."""
    while peer.read_frame(timeout=60) is not None:
        pass


def test_a_silent_secondary_fails_the_append_within_the_writer_s_timeout(tmp_path):
    with _primary_of(tmp_path, silent) as (primary, client, _):
        began = time.monotonic()
        [result] = client.append([(STREAM, batch_bytes(b"x"))], timeout_ms=1500)
        waited = time.monotonic() - began
        assert result.status.code == ErrorCode.REPLICATION_FAILED, result.status
        assert "ReadTimeoutError" in result.status.message
        # The writer's 1.5 s, not the 30 s replication timeout (and no client timeout).
        assert waited < DEFAULT_REPLICATION_TIMEOUT_S / 2
        assert primary.storage.get_range(STREAM, 0).sealed


def deaf(peer: Peer) -> None:
    """Reads every frame, PINGs included, and answers none: a secondary the primary cannot
    reach (a link that drops what the secondary sends), or one that is stopped."""
    while peer.read_frame(timeout=60, pings=True) is not None:
        pass


# Past the time from which a primary PINGs a late secondary, and a probe interval more.
SLOW_S = SECONDARY_GIVE_UP_S + 1.5


def slow_but_there(peer: Peer) -> None:
    """Answers PINGs at once (its network core reads on meanwhile) and each forward only
    after ``SLOW_S`` (a slow disk): every entry stored at the offset it came with."""
    while (frame := peer.read_frame(timeout=60)) is not None:
        answer = m.AppendResponse(append_responses=[
            m.AppendResult(e.stream_id, e.request_index, 0)
            for e in m.decode_request(frame).append_requests]).to_flatbuffers()
        threading.Timer(SLOW_S, peer.reply, (frame, answer)).start()


@contextmanager
def _primary_of(tmp_path, *handlers) -> Iterator[tuple[Server, RangeServerClient,
                                                        ConnectionPool]]:
    """A primary of ``STREAM``'s range 0 whose secondaries (ids 2, 3, ...) are fakes run by
    ``handlers``: (the primary, a client of it, the client's pool)."""
    config = ClientConfig(request_timeout_s=DEFAULT_REPLICATION_TIMEOUT_S, retries=0)
    with ExitStack() as stack:
        fakes = [stack.enter_context(FakeServer(handler)) for handler in handlers]
        pool = stack.enter_context(ConnectionPool(config))
        primary = Server(RangeServerConfig(data_dir=str(tmp_path), server_id=1,
                                           storage=StorageConfig(fsync="never"))).start()
        try:
            sync_range(primary, STREAM, [
                RangeReplica(RangeServer(1, primary.advertise_addr), True),
                *(RangeReplica(RangeServer(2 + i, fake.address), False)
                  for i, fake in enumerate(fakes))])
            yield primary, RangeServerClient(primary.advertise_addr, config, pool), pool
        finally:
            primary.stop()


def _append_through(tmp_path, secondary_handler, timeout_ms: int, secondaries: int = 1):
    """One append to a primary whose ``secondaries`` secondaries are ``secondary_handler``:
    (its result, the seconds it took, whether the primary sealed the range)."""
    with _primary_of(tmp_path, *[secondary_handler] * secondaries) as (primary, client, _):
        began = time.monotonic()
        [result] = client.append([(STREAM, batch_bytes(b"x"))], timeout_ms=timeout_ms)
        return result, time.monotonic() - began, primary.storage.get_range(STREAM, 0).sealed


def _seal_answer(pool: ConnectionPool, primary: Server) -> m.SealRangesResult:
    """The primary's answer to the PD's seal of ``STREAM``'s range 0."""
    answer, _ = pool.get(primary.advertise_addr).call(
        m.SealRangesRequest(5000, [m.RangeId(STREAM, 0)]))
    [sealed] = answer.seal_responses
    return sealed


def test_a_secondary_that_answers_no_ping_fails_the_append_within_seconds(tmp_path):
    # The writer allows 30 s (the default timeout_ms): a primary cut off from its secondary
    # used to hold every writer of the range that long before it sealed the range.
    result, waited, sealed = _append_through(tmp_path, deaf, timeout_ms=30_000)
    assert result.status.code == ErrorCode.REPLICATION_FAILED, result.status
    assert "nor to a PING" in result.status.message
    # Late past the PD's failover of a stopped secondary, then one unanswered PING.
    assert waited < SECONDARY_GIVE_UP_S + 2 * DEFAULT_PROBE_INTERVAL_S + 2.0
    assert sealed


def test_a_slow_secondary_that_answers_pings_is_waited_for(tmp_path):
    result, waited, sealed = _append_through(tmp_path, slow_but_there, timeout_ms=30_000)
    assert result.ok, result.status
    assert waited >= SLOW_S and not sealed


def test_two_secondaries_cut_off_fail_the_append_as_soon_as_one_would(tmp_path):
    # A 3-replica range whose primary is cut off from both secondaries: the second wait used
    # to begin when the first ended, and the writers stalled twice the give-up time (12 s,
    # seen by the nemesis). Each answer's lateness now counts from when the forwards went out,
    # and once the first is found unreachable the second is not PINGed in turn (a second more
    # with every writer of the range stalled, seen by the nemesis too).
    result, waited, sealed = _append_through(tmp_path, deaf, timeout_ms=30_000, secondaries=2)
    assert result.status.code == ErrorCode.REPLICATION_FAILED, result.status
    message = result.status.message
    assert message.count("nor to a PING") == 1, message
    assert "no answer yet when another secondary was found unreachable" in message, message
    # The give-up time and one unanswered PING, as with one secondary.
    assert waited < SECONDARY_GIVE_UP_S + 2 * DEFAULT_PROBE_INTERVAL_S + 2.0
    assert sealed


def answering(peer: Peer) -> None:
    """Stores nothing and answers every forward at once, as a secondary that took it."""
    while (frame := peer.read_frame(timeout=60)) is not None:
        peer.reply(frame, m.AppendResponse(append_responses=[
            m.AppendResult(e.stream_id, e.request_index, 0)
            for e in m.decode_request(frame).append_requests]).to_flatbuffers())


def test_the_primary_s_seal_answer_names_the_secondary_it_could_not_reach(tmp_path):
    # The PD keeps the next range away from both ends of the broken link (the nemesis saw a
    # range placed on the other end of one, and its writers wait out the give-up time twice).
    with _primary_of(tmp_path, answering, deaf) as (primary, client, pool):
        [result] = client.append([(STREAM, batch_bytes(b"x"))], timeout_ms=30_000)
        assert result.status.code == ErrorCode.REPLICATION_FAILED, result.status
        sealed = _seal_answer(pool, primary)
        assert sealed.status.ok and sealed.range.end_offset == 0, sealed
        assert sealed.unreachable == [3]


def test_a_seal_answer_names_nobody_when_every_secondary_answered(tmp_path):
    with _primary_of(tmp_path, answering) as (primary, client, pool):
        [result] = client.append([(STREAM, batch_bytes(b"x"))], timeout_ms=30_000)
        assert result.ok, result.status
        sealed = _seal_answer(pool, primary)
        assert sealed.status.ok and sealed.range.end_offset == 1, sealed
        assert sealed.unreachable == []
