"""Range servers that take connections but answer nothing (a process stopped with SIGSTOP, or
hung): the kernel still completes handshakes and buffers requests. A client whose APPEND or
FETCH answer is late PINGs the server; one that answers no PING either fails the request at
once (retriable), so a writer follows the PD's failover and a reader moves to another
replica, instead of waiting out the request timeout (30 s, plus the request's timeout_ms for
an APPEND). A server that answers PINGs (a slow disk, a long poll) is waited for.

Scripted servers (``fakes.py``) show the client's side on its own; the last tests stop the
primary of a replicated stream in a real cluster of ``sbp`` processes.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient, SbpClient
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import MAX_INFLIGHT_PER_CONNECTION, Opcode
from sbp_spark.protocol.errors import ReadTimeoutError
from sbp_spark.protocol.records import batch_body, batch_bytes
from sbp_spark.server.cluster import ProcessCluster

from .fakes import FakeServer, Peer
from .private_cluster import client_of

PROBE_S = 0.2
# A request timeout the probe must beat by far: without it, an APPEND to a silent server
# waited request_timeout_s + server_timeout_ms (6 s here) before failing.
CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=5, server_timeout_ms=1000,
                      retry_backoff_ms=1, retry_backoff_max_ms=5, probe_interval_s=PROBE_S)


@pytest.fixture
def pool() -> Iterator[ConnectionPool]:
    with ConnectionPool(CONFIG) as private:
        yield private


def respond(peer: Peer, frame, msg, payload=b"", end=True) -> None:
    peer.send(m.response_frame(frame.stream_id, msg, payload, end=end))


def append_answer(frame) -> m.AppendResponse:
    return m.AppendResponse(append_responses=[
        m.AppendResult(e.stream_id, e.request_index, e.request_index)
        for e in m.decode_request(frame).append_requests])


def silent(release: threading.Event):
    """A server whose process stopped: the connection is accepted, nothing is read or
    answered (the kernel buffers the requests) until ``release``."""

    def handler(peer: Peer) -> None:
        release.wait(10)

    return handler


def test_config_refuses_a_probe_interval_that_is_not_positive():
    for bad in (0, -1.0, "1"):
        with pytest.raises(ValueError, match="probe_interval_s"):
            ClientConfig(probe_interval_s=bad)


def _appends_to_a_silent_server(pool, config: ClientConfig, count: int) -> float:
    """Append ``count`` small batches to a server that answers nothing (PINGs neither), check
    that each failed as unanswered, naming the server; the seconds that took."""
    release = threading.Event()
    with FakeServer(silent(release)) as server:
        try:
            began = time.monotonic()
            results = RangeServerClient(server.address, config, pool).append(
                [(1, batch_bytes(b"x" * 100)) for _ in range(count)])
            took = time.monotonic() - began
        finally:
            release.set()
    for result in results:
        error = result.exception()
        assert isinstance(error, ReadTimeoutError) and error.retriable
        assert "nor to a PING" in str(error) and server.address in str(error)
    return took


def test_appends_in_flight_to_a_silent_server_fail_at_once(pool):
    # Three frames in flight: they fail together, not one probe after another.
    took = _appends_to_a_silent_server(
        pool, dataclasses.replace(CONFIG, append_frame_bytes=200), 3)
    # A probe interval of waiting, then one for the PING: not the 6 s timeout.
    assert took < 10 * PROBE_S


# More frames in flight than a server reads ahead on one connection: a PING sent behind them
# may not be read until one of them is answered.
MANY = MAX_INFLIGHT_PER_CONNECTION + 6
MANY_CONFIG = dataclasses.replace(CONFIG, append_frame_bytes=200, max_inflight_frames=MANY)


def test_a_full_connection_to_a_silent_server_fails_at_once(pool):
    took = _appends_to_a_silent_server(pool, MANY_CONFIG, MANY)
    # It used to take the server for a busy one and wait the 6 s timeout.
    assert took < 10 * PROBE_S


def test_a_full_connection_to_a_slow_server_is_waited_for(pool):
    appends: list = []
    answered = threading.Event()

    def slow_disk(peer: Peer) -> None:
        # Holds every APPEND for 4 probe intervals (a slow disk) and answers PINGs at once,
        # on any connection, as a range server's network core does.
        while (frame := peer.read_frame()) is not None:
            appends.append(frame)
            if len(appends) == MANY:
                time.sleep(4 * PROBE_S)
                for held in appends:
                    respond(peer, held, append_answer(held))
                answered.set()

    with FakeServer(slow_disk) as server:
        began = time.monotonic()
        results = RangeServerClient(server.address, MANY_CONFIG, pool).append(
            [(1, batch_bytes(b"x" * 100)) for _ in range(MANY)])
        took = time.monotonic() - began
    assert answered.is_set() and took >= 4 * PROBE_S
    assert all(result.ok for result in results)


def test_a_slow_append_answer_is_waited_for_while_the_server_answers_pings(pool):
    appends: list = []
    pings: list = []

    def slow_disk(peer: Peer) -> None:
        # Answers each APPEND after 4 probe intervals (as after a slow fsync) and PINGs at
        # once meanwhile, as a range server's network core does.
        while (frame := peer.read_frame(pings=True)) is not None:
            if frame.opcode == Opcode.PING:
                pings.append(frame)
                peer.reply(frame, bytes(frame.header), bytes(frame.payload))
                continue
            appends.append(frame)
            threading.Timer(4 * PROBE_S, respond, (peer, frame, append_answer(frame))).start()

    with FakeServer(slow_disk) as server:
        began = time.monotonic()
        (result,) = RangeServerClient(server.address, CONFIG, pool).append(
            [(1, batch_bytes(b"slow"))])
        took = time.monotonic() - began
    assert result.unwrap().base_offset == 0
    assert len(appends) == 1 and took >= 4 * PROBE_S
    assert len(pings) >= 2  # it was probed while late, and waited for


def test_a_fetch_from_a_silent_server_fails_at_once(pool):
    release = threading.Event()
    with FakeServer(silent(release)) as server:
        try:
            began = time.monotonic()
            with pytest.raises(ReadTimeoutError, match="nor to a PING"):
                list(RangeServerClient(server.address, CONFIG, pool).fetch(3, 0))
            took = time.monotonic() - began
        finally:
            release.set()
    assert took < 10 * PROBE_S  # not the 5 s request timeout


def test_a_long_poll_is_not_probed_within_its_max_wait(pool):
    pings: list = []
    data = batch_bytes(b"late", base_offset=0)

    def long_poll(peer: Peer) -> None:
        # Holds the FETCH for most of its max_wait_ms (5 probe intervals), and never answers
        # a PING: within the long poll, a quiet server is no sign of a stopped one.
        while (frame := peer.read_frame(pings=True)) is not None:
            if frame.opcode == Opcode.PING:
                pings.append(frame)
                continue
            time.sleep(4 * PROBE_S)
            respond(peer, frame, m.FetchResponse(fetch_responses=[
                m.FetchResult(3, 0, len(data))]), data)

    with FakeServer(long_poll) as server:
        got = [bytes(v) for _, v in RangeServerClient(server.address, CONFIG, pool).fetch(
            3, 0, max_wait_ms=int(5 * PROBE_S * 1000), min_bytes=1)]
    assert got == [data] and pings == []


# -- a real cluster: the primary of a replicated stream stopped ------------------------------

# What a user gets: the default timeouts (30 s per answer, plus 30 s of timeout_ms for an
# APPEND) and retry policy.
USER_CONFIG = ClientConfig()
# The PD fails a silent server's ranges over after 3 missed heartbeats of 1 s; an append or
# read must follow within a few seconds of that, far from the 30-60 s it used to wait.
BOUND_S = 15.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[ProcessCluster]:
    with ProcessCluster(tmp_path_factory.mktemp("frozen-rs"), range_servers=3) as started:
        yield started


def freeze(pid: int) -> None:
    """SIGSTOP process ``pid`` and wait until every thread of it stopped. The signal takes
    effect a moment after ``kill`` returns: a request sent at once may still be served (and
    its answer lost), and the writer's resend is then a second copy, as after any failover
    that falls between storing an append and answering it (at-least-once)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
        if all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.005)


def stop_primary(cluster: ProcessCluster, client: SbpClient, stream_id: int) -> int:
    """SIGSTOP the process of the primary of ``stream_id``'s open range; its pid."""
    primary = client.list_ranges(stream_id)[-1].primary
    assert primary is not None
    (proc,) = [p for p in cluster.range_servers
               if p is not None and p.info["range_server"] == primary.advertise_addr]
    freeze(proc.pid)
    return proc.pid


def written_stream(client: SbpClient, prefix: bytes):
    """A new R=2 stream holding five batches ``prefix-0`` .. ``prefix-4``: the stream, its
    writer and the bodies."""
    (stream,) = client.create_streams(1, replicas=2)
    writer = client.open_stream(stream.stream_id)
    bodies = [b"%s-%d" % (prefix, i) for i in range(5)]
    for body in bodies:
        writer.append([batch_bytes(body)])
    return stream, writer, bodies


def written(client: SbpClient, stream_id: int) -> list[bytes]:
    """The bodies of the stream's batches, in offset order."""
    return [bytes(batch_body(b.data)) for b in client.read(stream_id)]


@pytest.mark.slow
def test_append_and_read_move_on_from_a_stopped_primary(cluster, caplog):
    with client_of(cluster, USER_CONFIG) as client:
        stream, writer, bodies = written_stream(client, b"before")
        pid = stop_primary(cluster, client, stream.stream_id)
        try:
            began = time.monotonic()
            # Sent to the stopped primary on the connection it answered a moment ago; it
            # used to wait 60 s there, and then the retry deadline had passed: it failed.
            with caplog.at_level("INFO", logger="sbp_spark.client.writer"):
                (appended,) = writer.append([batch_bytes(b"after")])
            took_append = time.monotonic() - began
            bodies.append(b"after")
            began = time.monotonic()
            # The sealed range is read from its primary first (stopped), then its replica.
            got = written(client, stream.stream_id)
            took_read = time.monotonic() - began
        finally:
            os.kill(pid, signal.SIGCONT)
    assert appended.range_index >= 1  # on the range the PD opened on live servers
    assert got == bodies
    assert took_append < BOUND_S and took_read < BOUND_S
    # The PD counted the stopped server live for its timeout, but heard nothing from it after
    # the writer's append: the writer left the range to the failover and asked for no seal
    # (which would have waited on the stopped primary, holding up the failover).
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "giving up on it" in m or "sealing range" in m
                or "sealed the range" in m], said


@pytest.mark.slow
def test_reading_an_open_range_whose_primary_stopped(cluster):
    with client_of(cluster, USER_CONFIG) as client:
        stream, writer, bodies = written_stream(client, b"open")
        pid = stop_primary(cluster, client, stream.stream_id)
        try:
            with client_of(cluster, USER_CONFIG) as fresh:
                began = time.monotonic()
                # Where the open range ends only its primary can say (stopped): the read
                # asks it, then waits for the PD to seal the range after the failover.
                got = written(fresh, stream.stream_id)
                took = time.monotonic() - began
        finally:
            os.kill(pid, signal.SIGCONT)
    assert got == bodies
    assert took < BOUND_S


def secondary_of(cluster: ProcessCluster, client: SbpClient, stream_id: int) -> int:
    """The index in ``cluster`` of the (one) secondary of ``stream_id``'s open range."""
    (secondary,) = [r.server for r in client.list_ranges(stream_id)[-1].servers
                    if not r.is_primary]
    (index,) = [i for i, p in enumerate(cluster.range_servers)
                if p is not None and p.info["range_server"] == secondary.advertise_addr]
    return index


def append_one_at_a_time(writer, bodies: list[bytes]) -> list:
    """Append each body as a batch of its own; where each landed."""
    return [a for body in bodies for a in writer.append([batch_bytes(body)])]


def assert_once_in_order(got: list[bytes], expected: list[bytes], appended: list) -> None:
    assert got == expected  # each batch once (a resent one used to be there twice)
    offsets = [a.base_offset for a in appended]
    assert offsets == sorted(set(offsets))


@pytest.mark.slow
def test_appends_while_the_secondary_is_stopped_land_once_and_in_order(cluster):
    with client_of(cluster, USER_CONFIG) as client:
        stream, writer, bodies = written_stream(client, b"before")
        pid = cluster.range_servers[secondary_of(cluster, client, stream.stream_id)].pid
        freeze(pid)
        try:
            began = time.monotonic()
            # The primary forwards to the stopped secondary, whose kernel takes the bytes:
            # it used to wait its 30 s forward timeout although the PD failed the range over
            # after a few seconds, keeping the first batch in the sealed range, and the
            # writer, told it failed, sent it again: it was in the stream twice.
            after = [b"after-%d" % i for i in range(5)]
            appended = append_one_at_a_time(writer, after)
            took_append = time.monotonic() - began
            got = written(client, stream.stream_id)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert_once_in_order(got, bodies + after, appended)
    assert took_append < BOUND_S


@pytest.mark.slow
def test_appends_after_the_secondary_crashed_land_once_and_in_order(cluster):
    with client_of(cluster, USER_CONFIG) as client:
        stream, writer, bodies = written_stream(client, b"before")
        index = secondary_of(cluster, client, stream.stream_id)
        cluster.kill_range_server(index)
        try:
            # The forward to the killed secondary fails at once and the primary seals the
            # range; it used to seal it past the batch it had just failed, so the PD, which
            # could ask the primary alone, kept the batch that the writer then sent again.
            after = [b"after-%d" % i for i in range(5)]
            appended = append_one_at_a_time(writer, after)
            got = written(client, stream.stream_id)
        finally:
            cluster.start_range_server(index)
    assert_once_in_order(got, bodies + after, appended)


@pytest.mark.slow
def test_many_appends_in_flight_move_on_from_a_stopped_primary(cluster):
    # One append call with more frames in flight than a server reads ahead on a connection
    # (one batch of 150 bytes per frame).
    config = dataclasses.replace(USER_CONFIG, append_frame_bytes=200, max_inflight_frames=MANY)
    with client_of(cluster, config) as client:
        stream, writer, bodies = written_stream(client, b"before")
        pid = stop_primary(cluster, client, stream.stream_id)
        try:
            began = time.monotonic()
            # It used to take the stopped primary for a busy one, wait the whole 60 s for
            # the answers and then give up (the retry deadline had passed).
            after = [b"after-%03d|" % i + b"x" * 100 for i in range(MANY)]
            appended = writer.append([batch_bytes(body) for body in after])
            took = time.monotonic() - began
            got = written(client, stream.stream_id)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert all(a.range_index >= 1 for a in appended)
    assert got == bodies + after
    assert took < BOUND_S
