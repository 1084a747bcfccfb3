"""A range server answers PING on a connection while an APPEND on it waits for its fsync or for
its secondaries: clients PING a server whose answer is late and take one that does not answer
as stopped (client/connection.py, ``late_answer``), so a slow but healthy server must keep
answering PINGs, or its writers would give up on it and send their batches again elsewhere.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient
from sbp_spark.protocol.constants import MAX_INFLIGHT_PER_CONNECTION, Opcode
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.frame import encode_frame
from sbp_spark.protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResponse,
    RangeReplica,
    RangeServer,
    decode_response,
)
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.range_server import RangeServer as Server
from sbp_spark.server.range_server import RangeServerConfig
from sbp_spark.server.storage import StorageConfig
from tests.client.fakes import FakeServer, Peer
from tests.server.disks import HeldSyncs
from tests.server.secondary import sync_range

STREAM = 9
PROBE_S = 0.2
CONFIG = ClientConfig(request_timeout_s=10, retries=0, probe_interval_s=PROBE_S)
# A small APPEND is stored on the connection's reader itself; a large one on its handler
# thread (range_server/requests.py, INLINE_APPEND_BYTES).
BODY_SIZES = [1024, 1024 * 1024]


@pytest.fixture
def held_fsync() -> Iterator[HeldSyncs]:
    """A disk whose every fsync of segment data waits for ``release`` (set at the end of the
    test at the latest); ``entered`` is set once one does."""
    disk = HeldSyncs(timeout_s=30)
    yield disk
    disk.release.set()


def primary(tmp_path, secondary: str | None = None, disk: HeldSyncs | None = None) -> Server:
    server = Server(RangeServerConfig(data_dir=str(tmp_path), server_id=1,
                                      storage=StorageConfig(fsync="group")), disk=disk).start()
    replicas = [RangeReplica(RangeServer(1, server.advertise_addr), True)]
    if secondary is not None:
        replicas.append(RangeReplica(RangeServer(2, secondary), False))
    sync_range(server, STREAM, replicas)
    return server


@contextlib.contextmanager
def primary_client(tmp_path, secondary: str | None = None, disk: HeldSyncs | None = None
                   ) -> Iterator[RangeServerClient]:
    """A client of a running ``primary`` (stopped at the end)."""
    server = primary(tmp_path, secondary, disk)
    try:
        with ConnectionPool(CONFIG) as pool:
            yield RangeServerClient(server.advertise_addr, CONFIG, pool)
    finally:
        server.stop()


def start_append(client: RangeServerClient, body: bytes, timeout_ms: int = 10_000):
    """Send one APPEND of one batch on the client's connection; its answer stream."""
    batch = batch_bytes(body)
    header = AppendRequest(timeout_ms, [AppendEntry(STREAM, 0, len(batch))]).to_flatbuffers()
    return client.connection().start(
        Opcode.APPEND, lambda sid: encode_frame(Opcode.APPEND, 0, sid, header, [batch]))


@pytest.mark.parametrize("size", BODY_SIZES)
def test_ping_is_answered_while_an_append_waits_for_its_fsync(tmp_path, held_fsync, size):
    entered, release = held_fsync.entered, held_fsync.release
    with primary_client(tmp_path, disk=held_fsync) as client:
        answer = start_append(client, b"x" * size)
        assert entered.wait(10)
        assert answer.poll(0.2) is None  # waiting for the fsync
        assert client.connection().ping(timeout=1.0) < 1.0
        release.set()
        assert answer.poll(10) is not None


@pytest.mark.parametrize("size", BODY_SIZES)
def test_an_append_held_by_a_slow_fsync_is_waited_for(tmp_path, held_fsync, size):
    release = held_fsync.release
    with primary_client(tmp_path, disk=held_fsync) as client:
        # The fsync takes 5 probe intervals: the client PINGs, the server answers, and the
        # append is waited for (not failed as if the server had stopped).
        threading.Timer(5 * PROBE_S, release.set).start()
        began = time.monotonic()
        (result,) = client.append([(STREAM, batch_bytes(b"y" * size))])
        took = time.monotonic() - began
    assert result.unwrap().base_offset == 0
    assert took >= 5 * PROBE_S


def silent(peer: Peer) -> None:
    """A secondary that reads every frame and answers nothing, not even PING."""
    while peer.read_frame(timeout=60, pings=True) is not None:
        pass


@pytest.mark.parametrize("size", BODY_SIZES)
def test_ping_is_answered_while_an_append_waits_for_a_silent_secondary(tmp_path, size):
    with FakeServer(silent) as secondary, primary_client(tmp_path, secondary.address) as client:
        # The primary waits for the secondary as long as the append's timeout_ms allows.
        answer = start_append(client, b"z" * size, timeout_ms=2000)
        assert answer.poll(0.3) is None
        assert client.connection().ping(timeout=1.0) < 1.0
        frame = answer.poll(10)
        assert frame is not None
        (result,) = decode_response(frame, AppendResponse).append_responses
        assert result.status.code == ErrorCode.REPLICATION_FAILED


def test_a_connection_the_server_stopped_reading_is_waited_for(tmp_path, held_fsync):
    # With MAX_INFLIGHT_PER_CONNECTION requests in flight on one connection (writer threads
    # sharing it) the server reads nothing more until one is answered, a PING neither: an
    # unanswered PING then does not mean the server stopped.
    entered, release = held_fsync.entered, held_fsync.release
    with primary_client(tmp_path, disk=held_fsync) as client:
        others = [start_append(client, b"o%d" % i) for i in range(MAX_INFLIGHT_PER_CONNECTION)]
        assert entered.wait(10)
        threading.Timer(5 * PROBE_S, release.set).start()
        (result,) = client.append([(STREAM, batch_bytes(b"last"))])
        assert result.unwrap().base_offset == MAX_INFLIGHT_PER_CONNECTION
        assert all(answer.poll(10) is not None for answer in others)


@pytest.mark.parametrize("size", BODY_SIZES)
def test_an_append_whose_client_left_before_its_fsync_ends_quietly(tmp_path, held_fsync,
                                                                     caplog, size):
    # A client that gives up (a timeout, a killed Spark task) closes its connection with
    # appends in flight; their answers have nowhere to go, which is no error of the server's.
    entered, release = held_fsync.entered, held_fsync.release
    server = primary(tmp_path, disk=held_fsync)
    try:
        with ConnectionPool(CONFIG) as pool:
            client = RangeServerClient(server.advertise_addr, CONFIG, pool)
            start_append(client, b"q" * size)
            assert entered.wait(10)
            client.connection().close()
        deadline = time.monotonic() + 10
        while server.net.connection_count and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        time.sleep(0.5)  # the flush answers (or drops) the append
        assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    finally:
        server.stop()
