"""A connection that stops delivering answers without failing (a peer or a firewall in between
that silently dropped it) is set aside after a timeout: the retry goes out on a new connection
instead of waiting on the dead one again until the retries run out."""

from __future__ import annotations

import dataclasses
import time

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.records import encode_batch

from .proxies import ProxiedClient, SilencingProxy

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=0.5, retries=3,
                      retry_backoff_ms=10, retry_backoff_max_ms=50, retry_deadline_s=20)


def test_a_timed_out_connection_is_not_reused_for_the_retry(cluster):
    proxy = SilencingProxy(cluster.pd_address)
    try:
        with ConnectionPool(CONFIG) as pool:
            client = SbpClient(proxy.address, CONFIG, pool)
            client.list_streams()
            (silent,) = pool.connections().values()
            proxy.silence()
            client.list_streams()  # timed out once, answered on a new connection
            assert len(proxy.pairs) == 2
            assert pool.connections()[proxy.address] is not silent
            assert not silent.usable
    finally:
        proxy.close()


def test_frames_in_flight_on_a_silent_connection_time_out_together(cluster):
    # 20 APPEND frames in flight; each answer is due one timeout (1 s here) after it was
    # sent, so the append moves on after about one timeout, not twenty in a row.
    config = dataclasses.replace(CONFIG, server_timeout_ms=500, append_frame_bytes=100)
    address = cluster.range_server_addresses[0]
    proxy = SilencingProxy(address)
    try:
        with ConnectionPool(config) as pool:
            client = ProxiedClient(cluster.pd_address, config, pool)
            client.proxy, client.proxy_for = proxy, address
            (stream,) = client.create_streams(1)
            writer = client.open_stream(stream.stream_id)
            while writer.open_range.primary.advertise_addr != address:
                client.seal_range(stream.stream_id)  # a range on the proxied server
                writer.refresh()
            writer.append([encode_batch(b"first")])
            proxy.silence()
            began = time.monotonic()
            appended = writer.append([encode_batch(b"batch %d" % i) for i in range(20)])
            assert time.monotonic() - began < 6
            assert [a.base_offset for a in appended] == list(range(1, 21))
            stored = [bytes(b.data[28:]) for b in client.read(stream.stream_id)]
            assert stored == [b"first"] + [b"batch %d" % i for i in range(20)]
    finally:
        proxy.close()
