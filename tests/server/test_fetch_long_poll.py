"""FETCH long polls bounded by ``end_offset``, on a real cluster.

A long poll waits for ``min_bytes`` of data or ``max_wait_ms``; an entry bounded by
``end_offset`` can never get more than the batches below its bound. Once those are all
there, waiting cannot bring it more, so the poll answers at once even with fewer than
``min_bytes``; until then only the bytes the entry will get count.
"""

from __future__ import annotations

import threading
import time

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient, SbpClient
from sbp_spark.protocol.records import ENVELOPE_SIZE, batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster
from tests.polling import stays_true

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=30, retry_backoff_ms=5,
                      retry_backoff_max_ms=100, retry_deadline_s=20)
# Far more than the tests ever store: only a bound or the wait can end these polls.
MIN_BYTES = 1 << 20
LONG_WAIT_MS = 15_000
# An answer that took less than this did not wait for LONG_WAIT_MS.
PROMPT_S = 5.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with EmbeddedCluster(tmp_path_factory.mktemp("long-poll")) as c:
        yield c


@pytest.fixture(scope="module")
def pool():
    with ConnectionPool(CONFIG) as p:
        yield p


@pytest.fixture
def stream(cluster, pool) -> tuple[SbpClient, int, RangeServerClient]:
    """A new one-replica stream, a client, and its range server."""
    client = SbpClient(cluster.pd_address, CONFIG, pool)
    sid = client.create_streams(1)[0].stream_id
    [rng] = client.list_ranges(sid)
    return client, sid, RangeServerClient(rng.servers[0].server.advertise_addr, CONFIG, pool)


def append(client: SbpClient, sid: int, *bodies: bytes) -> None:
    client.append(sid, [batch_bytes(b) for b in bodies])


def long_poll(rs: RangeServerClient, sid: int, start: int, end: int) -> tuple[list[bytes], float]:
    """The bodies one long poll for ``[start, end)`` returns, and how long it took."""
    began = time.monotonic()
    got = [bytes(view[ENVELOPE_SIZE:]) for _, view in rs.fetch(
        sid, start, end_offset=end, max_wait_ms=LONG_WAIT_MS, min_bytes=MIN_BYTES)]
    return got, time.monotonic() - began


def test_an_entry_holding_everything_up_to_its_end_is_answered_at_once(stream):
    client, sid, rs = stream
    append(client, sid, b"r0", b"r1", b"r2")
    got, took = long_poll(rs, sid, 0, 3)
    assert got == [b"r0", b"r1", b"r2"]
    assert took < PROMPT_S, f"the poll waited {took:.1f} s for bytes its bound rules out"
    # From the middle of the range, too.
    got, took = long_poll(rs, sid, 1, 3)
    assert got == [b"r1", b"r2"] and took < PROMPT_S


def test_an_entry_is_complete_at_its_end_whatever_lies_past_it(stream):
    client, sid, rs = stream
    append(client, sid, *[b"r%d" % i for i in range(6)])
    got, took = long_poll(rs, sid, 0, 2)
    assert got == [b"r0", b"r1"] and took < PROMPT_S


def test_a_poll_waits_until_its_entry_is_complete(stream):
    client, sid, rs = stream
    append(client, sid, b"r0", b"r1")
    answer: list = []
    poller = threading.Thread(target=lambda: answer.append(long_poll(rs, sid, 0, 4)))
    poller.start()
    try:
        # Records 2 and 3 are missing: the poll waits for them (or for min_bytes).
        stays_true(lambda: not answer, "the poll waiting for records 2 and 3", 0.5)
        append(client, sid, b"r2")
        stays_true(lambda: not answer, "the poll waiting for record 3", 0.5)
        append(client, sid, b"r3", b"r4")
    finally:
        poller.join(LONG_WAIT_MS / 1000 + 10)
    [(got, took)] = answer
    assert got == [b"r0", b"r1", b"r2", b"r3"]
    assert took < LONG_WAIT_MS / 1000, "the last record did not end the poll"
