"""The retry loop and the connection pool, without a cluster."""

from __future__ import annotations

import threading
import time

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, Retrier, get_pool
from sbp_spark.client.pool import close_pool
from sbp_spark.client.retry import backoff_s, is_retriable
from sbp_spark.protocol.errors import (
    ChecksumError,
    HeaderError,
    RangeSealedError,
    SbpTimeoutError,
    ServerError,
    StreamNotFoundError,
    ThrottledError,
    TransportError,
)

from .fakes import FakeServer, echo_handler

QUICK = ClientConfig(retries=4, retry_backoff_ms=1, retry_backoff_max_ms=4)


def failing(errors: list[Exception], result: str = "done"):
    calls = []

    def op():
        calls.append(time.monotonic())
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return op, calls


def test_retriable_errors_are_retried_until_success():
    op, calls = failing([TransportError("reset"), RangeSealedError("sealed"),
                         SbpTimeoutError("slow")])
    assert Retrier(QUICK).run(op) == "done"
    assert len(calls) == 4


def test_non_retriable_error_is_raised_at_once():
    op, calls = failing([StreamNotFoundError("gone")])
    with pytest.raises(StreamNotFoundError):
        Retrier(QUICK).run(op)
    assert len(calls) == 1


def test_retries_run_out_and_raise_the_last_error():
    op, calls = failing([TransportError(f"try {i}") for i in range(10)])
    with pytest.raises(TransportError, match="try 4"):
        Retrier(QUICK).run(op)
    assert len(calls) == QUICK.retries + 1


def test_deadline_stops_retrying():
    config = ClientConfig(retries=100, retry_backoff_ms=50, retry_backoff_max_ms=50)
    op, calls = failing([TransportError("down")] * 100)
    began = time.monotonic()
    with pytest.raises(TransportError):
        Retrier(config, deadline=time.monotonic() + 0.2).run(op)
    assert time.monotonic() - began < 1.0
    assert 2 <= len(calls) <= 10


def test_throttle_time_is_honoured():
    throttled = ThrottledError("busy")
    throttled.throttle_time_ms = 150
    op, calls = failing([throttled])
    assert Retrier(QUICK).run(op) == "done"
    assert calls[1] - calls[0] >= 0.15


def test_on_error_redirect_skips_the_backoff():
    config = ClientConfig(retries=3, retry_backoff_ms=500, retry_backoff_max_ms=500)
    seen = []
    op, calls = failing([ServerError.for_status(5, "not leader")])
    began = time.monotonic()
    assert Retrier(config, on_error=lambda e: seen.append(e) or True).run(op) == "done"
    assert time.monotonic() - began < 0.4
    assert len(seen) == 1


def test_spared_failures_do_not_use_up_the_retries():
    op, calls = failing([TransportError(f"try {i}") for i in range(10)])
    # Ten failures against four retries: only the last one counts.
    assert Retrier(QUICK, spare=lambda e: str(e) != "try 9").run(op) == "done"
    assert len(calls) == 11


def test_spared_failures_stop_at_the_deadline_and_not_retriable_ones_at_once():
    config = ClientConfig(retries=0, retry_backoff_ms=20, retry_backoff_max_ms=20)
    op, calls = failing([TransportError("electing")] * 1000)
    with pytest.raises(TransportError):
        Retrier(config, deadline=time.monotonic() + 0.2, spare=lambda e: True).run(op)
    assert 2 <= len(calls) <= 20
    op, calls = failing([StreamNotFoundError("gone")])
    with pytest.raises(StreamNotFoundError):
        Retrier(config, spare=lambda e: True).run(op)
    assert len(calls) == 1


def test_spared_failures_back_off_up_to_their_own_cap(monkeypatch):
    # A PD cluster electing a leader is asked about often: its failures wait at most
    # spare_backoff_max_ms, the others grow to the config's cap.
    config = ClientConfig(retries=None, retry_backoff_ms=50, retry_backoff_max_ms=2000)
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    op, _ = failing([TransportError("electing")] * 12)
    Retrier(config, spare=lambda e: True, spare_backoff_max_ms=250).run(op)
    assert len(waits) == 12 and max(waits) <= 0.25 and max(waits[6:]) >= 0.125
    waits.clear()
    op, _ = failing([TransportError("down")] * 12)
    Retrier(config, spare=lambda e: False, spare_backoff_max_ms=250).run(op)
    assert max(waits[6:]) >= 1.0


def test_which_errors_are_retriable():
    assert is_retriable(TransportError("x"))
    assert is_retriable(ChecksumError("x"))
    assert is_retriable(ServerError.for_status(23))
    assert not is_retriable(HeaderError("x"))
    assert not is_retriable(ServerError.for_status(2))
    assert not is_retriable(ServerError.for_status(999))


def test_backoff_grows_and_is_capped():
    config = ClientConfig(retry_backoff_ms=10, retry_backoff_max_ms=80)
    for attempt, ceiling in [(0, 0.010), (1, 0.020), (2, 0.040), (3, 0.080), (10, 0.080)]:
        for _ in range(20):
            assert ceiling / 2 <= backoff_s(attempt, config) <= ceiling


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="request_timeout_s"):
        ClientConfig(request_timeout_s=0)
    with pytest.raises(ValueError, match="max_inflight_frames"):
        ClientConfig(max_inflight_frames=0)
    with pytest.raises(ValueError, match="max_frame_bytes"):
        ClientConfig(max_frame_bytes=64 * 1024 * 1024)
    with pytest.raises(ValueError, match="retry_backoff_max_ms"):
        ClientConfig(retry_backoff_ms=100, retry_backoff_max_ms=10)


def test_pool_hands_out_one_connection_per_address_across_threads():
    with FakeServer(echo_handler) as server, ConnectionPool(QUICK) as pool:
        got = []
        barrier = threading.Barrier(8)

        def grab():
            barrier.wait()
            got.append(pool.get(server.address))

        threads = [threading.Thread(target=grab) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len({id(c) for c in got}) == 1
        assert got[0].ping() >= 0  # answered, so the server has accepted it
        assert server.connections == 1


def test_pool_replaces_a_dead_connection_and_closes_everything():
    with FakeServer(echo_handler) as server:
        pool = ConnectionPool(QUICK)
        conn = pool.get(server.address)
        conn.close()
        fresh = pool.get(server.address)
        assert fresh is not conn and fresh.ping() >= 0
        pool.discard(fresh)
        assert fresh.closed
        third = pool.get(server.address)
        pool.close()
        assert third.closed
        with pytest.raises(TransportError, match="pool is closed"):
            pool.get(server.address)


def test_pool_rejects_a_bad_address():
    with ConnectionPool(QUICK) as pool, pytest.raises(ValueError, match="host:port"):
        pool.get("no-port-here")


def test_module_pool_is_shared_and_closable():
    with FakeServer(echo_handler) as server:
        pool = get_pool()
        assert get_pool() is pool
        conn = pool.get(server.address)
        close_pool()
        assert conn.closed
        assert get_pool() is not pool
        close_pool()
