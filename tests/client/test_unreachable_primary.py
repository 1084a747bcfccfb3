"""A writer that cannot reach the primary of its stream's open range while the PD still hears
that server (only the link between the two is broken) does not wait for the network to heal:
after ``unreachable_primary_s`` without an answer it asks the PD to seal the range and goes on
in the next one, which the PD places away from that server. It used to wait on that primary
(the PD said it was still there) until its retry deadline, and fail."""

from __future__ import annotations

import time
from contextlib import contextmanager

from sbp_spark.client import ClientConfig, ConnectionPool
from sbp_spark.client.primary_reach import HEARD_MARGIN_S, PrimaryReach, heard_since
from sbp_spark.protocol.records import batch_body, batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster

from .proxies import DeafeningProxy, ProxiedClient

PROBE_S = 0.2
GIVE_UP_S = 0.4
# Long timeouts, which a writer waiting for its answers would wait out: 10 s per frame, and a
# deadline of 30 s, after which it would fail.
CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=5, server_timeout_ms=5000,
                      retry_backoff_ms=10, retry_backoff_max_ms=100, retry_deadline_s=30,
                      probe_interval_s=PROBE_S, unreachable_primary_s=GIVE_UP_S)


@contextmanager
def cut_off_stream(tmp_path, config: ClientConfig):
    """A cluster of 3 range servers and a 2-replica stream whose client reaches the primary
    through a ``DeafeningProxy`` (``proxy.deafen()`` cuts the answers off; the PD still hears
    the server): the client, the stream's id, the primary's address and the proxy."""
    with EmbeddedCluster(str(tmp_path / "cluster"), range_servers=3) as cluster, \
            ConnectionPool(config) as pool:
        client = ProxiedClient(cluster.pd_address, config, pool)
        (stream,) = client.create_streams(1, replicas=2)
        sid = stream.stream_id
        cut_off = client.list_ranges(sid)[0].primary.advertise_addr
        proxy = DeafeningProxy(cut_off)
        client.proxy, client.proxy_for = proxy, cut_off
        try:
            yield client, sid, cut_off, proxy
        finally:
            proxy.close()


def test_config_refuses_a_give_up_time_that_is_not_positive():
    import pytest

    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="unreachable_primary_s"):
            ClientConfig(unreachable_primary_s=bad)


def test_the_unreached_clock_starts_when_the_unanswered_request_was_sent():
    now = [100.0]
    reach = PrimaryReach(2.0, clock=lambda: now[0])
    assert reach.unreached_for("a:1") is None and not reach.overdue("a:1")
    now[0] = 102.0  # the append went out at 100.0; its PING went unanswered until now
    assert reach.unreached("a:1", since=100.0) == 2.0
    assert reach.overdue("a:1")
    now[0] = 103.0  # a later failure does not move the start
    assert reach.unreached("a:1", since=102.5) == 3.0
    reach.reached("a:1")
    assert reach.unreached_for("a:1") is None and not reach.overdue("a:1")
    assert reach.unreached("a:1") == 0.0  # no send time given: from now


def test_the_pd_heard_a_server_since_only_if_its_last_heartbeat_is_younger():
    # The writer has not reached the server for 2 s.
    assert heard_since(True, 800, 2.0)  # heartbeat 0.8 s ago: the server is up
    # Live to the PD (its timeout is 3 s), but silent since before the writer's request:
    # stopped or killed, the failover's to handle.
    assert not heard_since(True, 2100, 2.0)
    assert not heard_since(True, int((2.0 - HEARD_MARGIN_S / 2) * 1000), 2.0)  # too close
    assert not heard_since(False, 100, 2.0)  # not live
    assert heard_since(True, -1, 2.0)  # a PD that reports liveness only: taken at its word
    assert heard_since(True, 800, None)  # the writer reached it meanwhile


def test_a_writer_cut_off_from_a_healthy_primary_seals_and_moves_on(tmp_path):
    # The default heartbeats: the PD hears every server throughout, and fails nothing over.
    with EmbeddedCluster(str(tmp_path / "cluster"), range_servers=3) as cluster, \
            ConnectionPool(CONFIG) as pool:
        client = ProxiedClient(cluster.pd_address, CONFIG, pool)
        (stream,) = client.create_streams(1, replicas=2)
        sid = stream.stream_id
        (first,) = client.list_ranges(sid)
        cut_off = first.primary.advertise_addr
        proxy = DeafeningProxy(cut_off)
        client.proxy, client.proxy_for = proxy, cut_off
        try:
            writer = client.open_stream(sid)
            before = [b"before-%d" % i for i in range(5)]
            for body in before:
                writer.append([batch_bytes(body)])
            proxy.deafen()
            began = time.monotonic()
            (after,) = writer.append([batch_bytes(b"after")])
            took = time.monotonic() - began
        finally:
            proxy.close()
        ranges = client.list_ranges(sid)
        got = [bytes(batch_body(b.data)) for b in client.read(sid)]
    # Two probes for the first unanswered PING, the give-up time, a seal: not the 10 s
    # timeout of the frame, nor the 30 s deadline.
    assert took < 4.0, took
    assert not ranges[0].is_open and ranges[-1].is_open
    assert ranges[-1].primary.advertise_addr != cut_off
    assert cut_off not in {r.server.advertise_addr for r in ranges[-1].servers}
    # The batch whose answer was lost may be stored in the sealed range: the idempotent
    # writer asked that range before sending it to the next one, so it is stored once, and
    # its answer names the range that holds it.
    assert got[:5] == before and got[5:] == [b"after"]
    holder = ranges[after.range_index]
    assert holder.start_offset <= after.base_offset < (
        holder.end_offset if holder.end_offset >= 0 else after.base_offset + 1)


def test_the_writer_tries_the_next_range_without_the_backoff_its_failures_grew(tmp_path, caplog):
    # Long backoffs (1-2 s, then 2-4 s): the failed attempts against the unreached primary
    # used to leave the writer waiting that long before its first try in the range it had
    # just sealed its way into (the nemesis saw 8-10 s stalls made of such waits).
    config = ClientConfig(connect_timeout_s=2, request_timeout_s=5, server_timeout_ms=5000,
                          retry_backoff_ms=2000, retry_backoff_max_ms=8000,
                          retry_deadline_s=30, probe_interval_s=PROBE_S,
                          unreachable_primary_s=GIVE_UP_S)
    with cut_off_stream(tmp_path, config) as (client, sid, cut_off, proxy):
        try:
            writer = client.open_stream(sid)
            writer.append([batch_bytes(b"before")])
            proxy.deafen()
            with caplog.at_level("WARNING", logger="sbp_spark.client.writer"):
                (after,) = writer.append([batch_bytes(b"after")])
            acked = time.time()
        finally:
            proxy.close()
    [sealed] = [r for r in caplog.records if "writes go on in range" in r.getMessage()]
    assert after.stream_id == sid
    # At once in the new range, not after a backoff of 2 s or more.
    assert acked - sealed.created < 1.0, acked - sealed.created


def test_with_the_default_settings_the_seal_comes_at_the_first_unanswered_ping(tmp_path,
                                                                               caplog):
    # The default probe interval (1 s) and give-up time (2 s), counted from the append that
    # got no answer: its PING, sent 1 s in, goes unanswered until 2 s in, and by then the
    # writer has not reached the primary for the give-up time while the PD has heard it
    # since (its heartbeats every second). Counted from the failed attempt instead, the
    # writer sealed only at the next unanswered PING, about 4.2 s after the append.
    config = ClientConfig(retry_deadline_s=30)
    with cut_off_stream(tmp_path, config) as (client, sid, cut_off, proxy):
        try:
            writer = client.open_stream(sid)
            writer.append([batch_bytes(b"before")])
            proxy.deafen()
            began = time.monotonic()
            with caplog.at_level("INFO", logger="sbp_spark.client.writer"):
                (after,) = writer.append([batch_bytes(b"after")])
            took = time.monotonic() - began
            (state,) = [s for s in client.pd.range_servers()
                        if s.server.advertise_addr == cut_off]
        finally:
            proxy.close()
        ranges = client.list_ranges(sid)
        got = [bytes(batch_body(b.data)) for b in client.read(sid)]
    # Sealed: the batch whose answer was lost is found in the sealed range, stored once.
    assert [r.is_open for r in ranges] == [False, True]
    assert got == [b"before", b"after"] and after.range_index == 0
    assert state.live and 0 <= state.silent_ms < 2000  # the PD hears the server throughout
    gave_up = [r for r in caplog.records if "giving up on it" in r.getMessage()]
    assert gave_up and "has not answered for 2." in gave_up[0].getMessage()
    # Two probe intervals and the seal; not the two more a second unanswered PING takes.
    assert took < 3.5, took
