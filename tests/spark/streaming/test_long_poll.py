"""Long polls at the streams' tails, without Spark or a cluster: which range servers are asked
for which tails, and how a wait ends."""

from __future__ import annotations

import threading
import time

import pytest

from sbp_spark.client import ReplicaLocation
from sbp_spark.protocol.errors import SbpTimeoutError
from sbp_spark.spark.planning import RangeLayout, StreamLayout
from sbp_spark.spark.streaming.long_poll import LongPoller, Tail, poll_targets


def stream(sid: int, address: str, end: int, is_open: bool = True) -> StreamLayout:
    replicas = (ReplicaLocation(1, address, True), ReplicaLocation(2, "127.0.0.1:9", False))
    return StreamLayout(sid, 0, (RangeLayout(0, 0, 4, replicas, False),
                                 RangeLayout(1, 4, end, replicas, is_open)))


def test_tails_are_grouped_by_the_server_to_ask():
    layouts = {1: stream(1, "a:1", 10), 2: stream(2, "b:1", 7), 3: stream(3, "a:1", 5),
               4: stream(4, "a:1", 8, is_open=False),  # sealed last range: nothing to watch
               5: None,                                   # deleted stream
               6: StreamLayout(6, 0, ())}                 # no ranges
    assert poll_targets(layouts) == {"a:1": [Tail(1, 10), Tail(3, 5)], "b:1": [Tail(2, 7)]}


def test_one_server_is_asked_in_the_calling_thread():
    calls = []

    def waiter(address, positions, wait_ms):
        calls.append((address, list(positions), wait_ms, threading.current_thread()))
        return [1]

    poller = LongPoller(waiter)
    assert poller.wait({1: stream(1, "a:1", 10), 3: stream(3, "a:1", 5)}, 250) == [3]
    assert calls == [("a:1", [(1, 10), (3, 5)], 250, threading.current_thread())]
    poller.close()


def test_a_wait_ends_with_the_first_server_that_sees_a_record():
    released = threading.Event()

    def waiter(address, positions, wait_ms):
        if address == "slow:1":
            released.wait(10)
            return []
        return [0]

    poller = LongPoller(waiter)
    began = time.monotonic()
    try:
        assert poller.wait({1: stream(1, "slow:1", 3), 2: stream(2, "fast:1", 3)}, 5_000) == [2]
        assert time.monotonic() - began < 5
    finally:
        released.set()
        poller.close()


def test_a_failed_poll_ends_the_wait_quietly():
    def waiter(address, positions, wait_ms):
        raise SbpTimeoutError("no answer")

    assert LongPoller(waiter).wait({1: stream(1, "a:1", 3)}, 100) == []


@pytest.mark.parametrize("wait_ms", [0, -5])
def test_no_time_to_wait_asks_nobody(wait_ms):
    def waiter(address, positions, wait_ms):
        raise AssertionError("asked")

    assert LongPoller(waiter).wait({1: stream(1, "a:1", 3)}, wait_ms) == []
    assert LongPoller(waiter).wait({1: stream(1, "a:1", 3, is_open=False)}, 100) == []
