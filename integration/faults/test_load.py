"""Load, soak and backpressure against one cluster (``sbp server``: PD and range server in one
child process, so its memory can be read from /proc on its own).

* 64 appending and 64 tailing clients (each with its own connections) for a bounded time: no
  errors, every stream intact, server RSS sampled throughout, throughput reported.
  ``test_load_short`` (10 s) runs by default; ``test_soak`` (60 s) is marked slow.
* A peer that sends FETCH requests and never reads the answers must not make the server's
  memory grow without bound, and must not stop other clients from being served.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from pathlib import Path

import pytest

from sbp_spark.bench.procmem import hwm_kib, rss_kib
from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import ServerProcess

from .helpers import RIDE_OUT, Tail, Writer, check_stream, make_body, wait_until

CLIENTS = 64
BODY = 1024
BATCHES_PER_APPEND = 8
# The server's memory may grow with the load, but not without bound: its limits (in-flight
# requests per connection, bytes queued per connection, fetch frames of about 1 MiB) keep
# 128 clients well inside this.
RSS_GROWTH_LIMIT_MIB = 768
LOAD_CONFIG = ClientConfig(connect_timeout_s=5, request_timeout_s=30, retries=5,
                           retry_deadline_s=60)


class Server:
    """``sbp server`` in a child process, with an RSS sampler."""

    def __init__(self, tmp_path: Path) -> None:
        self.proc = ServerProcess(
            ["server", "--data-dir", str(tmp_path / "data"), "--port", "0",
             "--fsync", "interval"],
            tmp_path / "server.ready", tmp_path / "server.log")
        self.pd = str(self.proc.info["pd"])
        self.range_server = str(self.proc.info["range_servers"][0])
        self.samples: list[int] = []  # KiB
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            kib = rss_kib(self.proc.pid)
            if kib is not None:
                self.samples.append(kib)

    def cpu_s(self) -> float:
        """User + system CPU seconds the server process has used."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        return (rss_kib(self.proc.pid) or 0) / 1024

    def peak_mib(self) -> float:
        return max([*self.samples, hwm_kib(self.proc.pid) or 0]) / 1024

    def stop(self) -> None:
        self._stop.set()
        self._sampler.join(2)
        code = self.proc.terminate()
        assert code == 0, self.proc.log_tail()


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    try:
        yield srv
    finally:
        srv.stop()


def run_load(server: Server, seconds: float, figures: dict) -> None:
    pools = [ConnectionPool(LOAD_CONFIG) for _ in range(2 * CLIENTS)]
    admin_pool = ConnectionPool(RIDE_OUT)
    try:
        admin = SbpClient(server.pd, RIDE_OUT, admin_pool)
        streams = [s.stream_id for s in admin.create_streams(CLIENTS)]
        writers = [Writer(SbpClient(server.pd, LOAD_CONFIG, pools[i]), sid,
                          BATCHES_PER_APPEND, BODY, light=True)
                   for i, sid in enumerate(streams)]
        tails = [Tail(SbpClient(server.pd, LOAD_CONFIG, pools[CLIENTS + i]), sid,
                      wait_ms=500, light=True) for i, sid in enumerate(streams)]
        baseline = server.rss_mib()
        began = time.monotonic()
        cpu_before = server.cpu_s(), resource.getrusage(resource.RUSAGE_SELF)
        for t in [*writers, *tails]:
            t.start()
        deadline = began + seconds
        while time.monotonic() < deadline:
            time.sleep(0.5)
            assert all(w.is_alive() for w in writers), "a writer died"
            assert all(t.fatal is None for t in tails), [t.fatal for t in tails if t.fatal]
        for w in writers:
            w.stop.set()
        for w in writers:
            w.finish()
        elapsed = time.monotonic() - began
        own, then = resource.getrusage(resource.RUSAGE_SELF), cpu_before[1]
        client_cpu = own.ru_utime + own.ru_stime - then.ru_utime - then.ru_stime
        figures["CPU while loaded"] = (
            f"server {(server.cpu_s() - cpu_before[0]) / elapsed:.0%}, clients "
            f"{client_cpu / elapsed:.0%} (of one core; 2 cores in all)")
        ends = {w.stream_id: check_stream(admin, w.stream_id, w.acked) for w in writers}
        try:
            for t in tails:
                t.caught_up_to(ends[t.stream_id].end)
        finally:
            for t in tails:
                t.stop.set()
            for t in tails:
                t.join(30)
        caught_up = time.monotonic() - began
        appended = sum(w.acked_bytes for w in writers)
        batches = sum(len(w.acked) for w in writers)
        read = sum(t.bytes_read for t in tails)
        figures["clients"] = f"{CLIENTS} appending + {CLIENTS} tailing, {seconds:g} s"
        figures["appended"] = (f"{appended / elapsed / 1e6:.1f} MB/s, "
                               f"{batches / elapsed:,.0f} batches/s of {BODY} B")
        figures["tails read"] = f"{read / caught_up / 1e6:.1f} MB/s"
        figures["server RSS"] = (f"{baseline:.0f} MiB before, peak {server.peak_mib():.0f} "
                                 f"MiB, {server.rss_mib():.0f} MiB after")
        failures = [f for w in writers for f in w.failures]
        tail_errors = [e for t in tails for e in t.errors]
        figures["errors"] = len(failures) + len(tail_errors)
        assert not failures, failures[:3]
        assert not tail_errors, tail_errors[:3]
        for check in ends.values():
            assert check.ok and not check.duplicates, check.summary()
        for t in tails:
            seen = t.check({})
            assert seen.ok and not seen.duplicates, seen.summary()
        assert server.peak_mib() - baseline < RSS_GROWTH_LIMIT_MIB, figures["server RSS"]
    finally:
        for pool in pools:
            pool.close()
        admin_pool.close()


@pytest.mark.timeout(300)
@pytest.mark.fault_case(
    "load: 64 appenders + 64 tails, 10 s",
    "64 clients append 8 x 1 KiB batches per call to their own streams while 64 clients "
    "long-poll them, each client on its own connections",
    "no errors, every stream intact and fully seen by its tail; server RSS growth under "
    f"{RSS_GROWTH_LIMIT_MIB} MiB")
def test_load_short(server, figures):
    run_load(server, 10, figures)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "soak: 64 appenders + 64 tails, 60 s",
    "as the 10 s load case, for 60 s",
    "no errors, every stream intact and fully seen by its tail; server RSS growth under "
    f"{RSS_GROWTH_LIMIT_MIB} MiB")
def test_soak(server, figures):
    run_load(server, 60, figures)


# -- backpressure --------------------------------------------------------------------------


def _fill(client: SbpClient, stream_id: int, batches: int, size: int) -> None:
    writer = client.open_stream(stream_id)
    per_call = max(1, (1 << 20) // size)
    for start in range(0, batches, per_call):
        writer.append([batch_bytes(make_body(stream_id, i, size))
                       for i in range(start, min(start + per_call, batches))])


def _flood_fetches(address: str, stream_id: int, stall_s: float) -> tuple[socket.socket, int]:
    """Connect and send FETCH requests for the whole stream, never reading an answer, until
    the server has stopped taking them for ``stall_s``; returns the socket and the count."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # read nothing, buffer little
    sock.setblocking(False)
    request = m.FetchRequest(max_wait_ms=0, min_bytes=0, fetch_requests=[
        m.FetchEntry(stream_id, 0, 0, (1 << 31) - 1, -1)])
    sent, pending = 0, b""
    stalled_since = None
    while True:
        if not pending:
            sent += 1
            pending = b"".join(bytes(b) for b in m.request_frame(sent, request))
        try:
            n = sock.send(pending)
        except BlockingIOError:
            n = 0
        pending = pending[n:]
        if n:
            stalled_since = None
            continue
        now = time.monotonic()
        stalled_since = stalled_since or now
        if now - stalled_since > stall_s:
            return sock, sent - 1
        time.sleep(0.01)


@pytest.mark.timeout(180)
@pytest.mark.fault_case(
    "backpressure: a client that never reads its FETCH answers",
    "one raw connection sends FETCH requests for a whole 32 MiB stream of 4 KiB batches (read "
    "into memory, not sendfile) until the server stops reading them, and never reads",
    "server RSS stays bounded while it is stuck; another client still appends and reads; "
    "closing the connection frees the server")
def test_client_that_never_reads_does_not_grow_server_memory(server, figures):
    with ConnectionPool(RIDE_OUT) as pool:
        client = SbpClient(server.pd, RIDE_OUT, pool)
        [stream] = client.create_streams(1)
        _fill(client, stream.stream_id, 8192, 4096)
        baseline = server.rss_mib()
        sock, sent = _flood_fetches(server.range_server, stream.stream_id, stall_s=2.0)
        try:
            # Let the stuck answers pile up as far as the server lets them.
            samples = []
            for _ in range(20):
                time.sleep(0.25)
                samples.append(server.rss_mib())
            stuck_peak = max(samples)
            # Someone else is still served.
            [other] = client.create_streams(1)
            began = time.monotonic()
            [a] = client.open_stream(other.stream_id).append(
                [batch_bytes(make_body(other.stream_id, 1))])
            assert [b.header.base_offset for b in client.read(other.stream_id)] == [0]
            other_latency = time.monotonic() - began
        finally:
            sock.close()
        figures["requests sent before the server stopped reading"] = sent
        figures["server RSS"] = (f"{baseline:.0f} MiB before, {stuck_peak:.0f} MiB peak while "
                                 f"stuck (growth {stuck_peak - baseline:.0f} MiB)")
        figures["another client's append + read meanwhile"] = f"{other_latency * 1000:.0f} ms"
        wait_until(lambda: server.rss_mib() < stuck_peak + 64, 30, "memory to settle")
        assert sent < 100_000, "the server kept reading requests it could not answer"
        assert stuck_peak - baseline < 256, figures["server RSS"]
        assert a.base_offset == 0
        # The stream is intact and the server fine after the flood.
        check = check_stream(client, stream.stream_id)
        assert check.ok and check.batches == 8192, check.summary()
        assert os.path.exists(f"/proc/{server.proc.pid}")


@pytest.mark.timeout(180)
@pytest.mark.fault_case(
    "client memory while a reader pauses mid-read",
    "read a 256 MiB stream (1 MiB batches) with SbpClient.read, take one batch, then stop "
    "consuming for 3 s",
    "the client process's memory grows by less than 96 MiB while the reader pauses")
def test_paused_reader_does_not_buffer_the_whole_answer(server, figures):
    with ConnectionPool(RIDE_OUT) as pool:
        client = SbpClient(server.pd, RIDE_OUT, pool)
        [stream] = client.create_streams(1)
        writer = client.open_stream(stream.stream_id)
        body = make_body(stream.stream_id, 0, 1 << 20)
        for _ in range(16):
            writer.append([batch_bytes(body)] * 16)
        baseline = (rss_kib(os.getpid()) or 0) / 1024
        batches = client.read(stream.stream_id)
        next(batches)
        time.sleep(3)  # the reader is busy elsewhere: what piles up in the client meanwhile
        paused = (rss_kib(os.getpid()) or 0) / 1024
        rest = sum(1 for _ in batches)
        figures["client RSS growth while paused"] = f"{paused - baseline:.0f} MiB"
        assert rest == 255
        assert paused - baseline < 96, figures["client RSS growth while paused"]
