"""A writer with the client's default settings rides out what a cluster goes through: its
primary killed, or paused for longer than the PD's liveness timeout. Retries are bounded by
time (``ClientConfig.retry_deadline_s``), not by a count that a failover of a few seconds used
up. A call that can never succeed still ends: at its deadline, naming the last cause.

The failover cases run ``sbp`` processes with their default timings (heartbeats every second,
a server silent for 3 s failed over).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, PdClient, SbpClient
from sbp_spark.protocol.errors import PdUnreachableError, SbpError, TransportError
from sbp_spark.protocol.records import batch_body, batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster, ProcessCluster

from .private_cluster import client_of
from .test_frozen_range_server import freeze

DEFAULTS = ClientConfig()
# How long a failover may hold a writer up: the PD notices a silent server within 3 s, then
# seals its ranges and opens new ones; far from the deadline of a minute either way.
FAILOVER_BOUND_S = 20.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[ProcessCluster]:
    with ProcessCluster(tmp_path_factory.mktemp("ride-out"), range_servers=3) as started:
        yield started


class Writer(threading.Thread):
    """Appends numbered batches, four per call, until stopped; keeps what was acknowledged
    and every call that failed."""

    def __init__(self, client: SbpClient, stream_id: int) -> None:
        super().__init__(name=f"writer-{stream_id}", daemon=True)
        self.writer = client.open_stream(stream_id)
        self.acked: dict[int, bytes] = {}  # base_offset -> body
        self.failures: list[SbpError] = []
        self.halt = threading.Event()
        self._seq = 0

    def run(self) -> None:
        while not self.halt.is_set():
            bodies = [b"batch %08d" % (self._seq + i) for i in range(4)]
            self._seq += 4
            try:
                done = self.writer.append([batch_bytes(b) for b in bodies])
            except SbpError as exc:
                self.failures.append(exc)
                continue
            for appended, body in zip(done, bodies, strict=True):
                self.acked[appended.base_offset] = body
            self.halt.wait(0.01)

    def wait_for(self, more: int, timeout: float) -> float:
        """Wait until ``more`` batches more were acknowledged; the seconds it took."""
        began = time.monotonic()
        target = len(self.acked) + more
        while len(self.acked) < target:
            assert not self.failures, self.failures
            assert time.monotonic() - began < timeout, (
                f"{len(self.acked)} of {target} batches acknowledged after {timeout:g} s")
            time.sleep(0.02)
        return time.monotonic() - began

    def finish(self) -> None:
        self.halt.set()
        self.join(60)
        assert not self.is_alive()


def _primary_index(cluster: ProcessCluster, client: SbpClient, stream_id: int) -> int:
    primary = client.list_ranges(stream_id)[-1].primary
    assert primary is not None
    return next(i for i, p in enumerate(cluster.range_servers)
                if p is not None and p.info["range_server"] == primary.advertise_addr)


def _check(client: SbpClient, stream_id: int, writer: Writer) -> None:
    """Every acknowledged batch is stored at the offset its acknowledgement named."""
    stored = {b.header.base_offset: bytes(batch_body(b.data)) for b in client.read(stream_id)}
    assert {o: stored.get(o) for o in writer.acked} == writer.acked


def test_appends_with_default_settings_ride_out_the_death_of_their_primary(cluster):
    with client_of(cluster, DEFAULTS) as client:
        (stream,) = client.create_streams(1, replicas=2)
        sid = stream.stream_id
        writer = Writer(client, sid)
        writer.start()
        try:
            writer.wait_for(40, timeout=30)
            victim = _primary_index(cluster, client, sid)
            cluster.kill_range_server(victim)
            took = writer.wait_for(40, timeout=FAILOVER_BOUND_S)
        finally:
            writer.finish()
        try:
            assert writer.failures == []
            ranges = client.list_ranges(sid)
            assert len(ranges) >= 2 and not ranges[0].is_open
            _check(client, sid, writer)
            assert took < FAILOVER_BOUND_S
        finally:
            cluster.start_range_server(victim)


def test_appends_with_default_settings_ride_out_a_pause_past_the_liveness_timeout(cluster):
    with client_of(cluster, DEFAULTS) as client:
        (stream,) = client.create_streams(1, replicas=2)
        sid = stream.stream_id
        writer = Writer(client, sid)
        writer.start()
        pid = None
        try:
            writer.wait_for(40, timeout=30)
            victim = _primary_index(cluster, client, sid)
            process = cluster.range_servers[victim]
            assert process is not None
            pid = process.pid
            freeze(pid)
            # Paused past the PD's liveness timeout (3 s): the PD fails it over meanwhile,
            # and the writer follows.
            writer.wait_for(40, timeout=FAILOVER_BOUND_S)
            assert len(client.list_ranges(sid)) >= 2
            os.kill(pid, signal.SIGCONT)
            pid = None
            writer.wait_for(40, timeout=30)
        finally:
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
            writer.finish()
        assert writer.failures == []
        _check(client, sid, writer)


# -- calls that can never succeed ------------------------------------------------------------


def test_an_append_that_cannot_succeed_fails_at_its_deadline_naming_the_last_cause(tmp_path):
    config = ClientConfig(retry_deadline_s=3.0)  # the default, but for the deadline
    with EmbeddedCluster(str(tmp_path / "cluster"), range_servers=1) as cluster, \
            client_of(cluster, config) as client:
        sid = client.create_streams(1)[0].stream_id
        writer = client.open_stream(sid)
        writer.append([batch_bytes(b"before")])
        cluster.stop_range_server(0)  # its only replica: the range stays open, unreachable
        began = time.monotonic()
        with pytest.raises(TransportError) as failure:
            writer.append([batch_bytes(b"never %d" % i) for i in range(2)])
        took = time.monotonic() - began
    message = str(failure.value)
    assert config.retry_deadline_s <= took < config.retry_deadline_s + 2.0, took
    assert message.startswith(f"append to stream {sid} gave up after "), message
    assert "(its deadline passed), with 0 of 2 batches of the call stored" in message
    assert "the other 2 were not; the last failure: cannot connect to" in message


def test_a_pd_call_that_cannot_succeed_fails_at_its_deadline_naming_the_last_cause():
    config = ClientConfig(retry_deadline_s=1.5)
    with ConnectionPool(config) as pool:
        pd = PdClient(["127.0.0.1:1"], config, pool)  # nothing listens on port 1
        began = time.monotonic()
        with pytest.raises(PdUnreachableError) as failure:
            pd.list_streams()
        took = time.monotonic() - began
    assert config.retry_deadline_s <= took < config.retry_deadline_s + 1.0, took
    message = str(failure.value)
    assert "no PD answered at 127.0.0.1:1" in message
    assert "gave up after" in message and "(its deadline passed)" in message
    assert "cannot connect to 127.0.0.1:1" in message
