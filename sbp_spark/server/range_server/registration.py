"""A range server's link to the PD: registration, heartbeats, metrics, retention and trims.

``PdLink`` runs one background thread that

* obtains a server id (ALLOCATE_ID) when the data directory has none, and keeps it on disk;
* sends HEARTBEAT every ``heartbeat_interval_s`` with the server's current advertise address,
  so the PD learns a new port after a restart;
* sends REPORT_METRICS every ``metrics_interval_s``;
* learns each local stream's retention_period_ms (DESCRIBE_STREAMS) for the retention pass,
  and marks streams the PD reports deleted;
* reports the new start of streams whose old segments retention deleted (TRIM_STREAMS).

All PD calls go through ``sbp_spark.client.pd.PdClient`` (leader redirects, retries). The link
sees its range server only through ``LinkedServer``: what it needs of it, and nothing else.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...client.config import ClientConfig
from ...client.pd import PdClient
from ...client.pool import ConnectionPool
from ...protocol import messages
from ...protocol.errors import InvalidRequestError, SbpError
from ...protocol.messages import ClientRole, HeartbeatRequest, Permission, ReportMetricsRequest
from ...transport.tls import TlsConfig
from ..pd.meta import UNKNOWN_SERVER_ID
from ..pd_outage import PdOutage
from ..storage.range_log import ConsumerHold

log = logging.getLogger(__name__)

# PD calls from the link fail fast: a late heartbeat is worth less than the next one.
_LINK_CLIENT = ClientConfig(connect_timeout_s=2.0, request_timeout_s=5.0, retries=1,
                            retry_deadline_s=5.0)
# Retry period of a failed registration: doubling from the first to the most, so a PD that
# is down for long does not get (nor the log show) several attempts a second.
_REGISTER_BACKOFF_S = 0.2
_REGISTER_BACKOFF_MAX_S = 5.0
# After a failed HEARTBEAT the next comes this soon, not a whole interval later: while a PD
# cluster elects a leader every heartbeat fails, and the new leader knows nothing of this
# server (it places no range here, and sends the ranges it owes no resync) until one reaches
# it. A new leader then hears every server within a quarter second of taking office, where it
# took up to a heartbeat interval; a writer that waited for it to seal its range, and then
# for the new range to reach its servers, waited that long more (the nemesis saw it).
HEARTBEAT_RETRY_S = 0.25
_INT16_MAX = (1 << 15) - 1


def _server_name(server: LinkedServer) -> str:
    """How log lines name the server: by its id, or before it has one by its data."""
    server_id = server.server_id()
    if server_id < 0:
        return f"range server with data in {server.data_dir} (no server id yet)"
    return f"range server {server_id}"


class RegistrationRefused(RuntimeError):
    """The PD refuses this range server for good: its data directory holds an id the PD never
    issued. Retrying does not help (unlike a PD that is down or not the leader)."""


def _clamp16(value: float) -> int:
    return max(0, min(_INT16_MAX, int(value)))


def rss_bytes() -> int:
    """Resident memory of this process (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class LoadSample:
    """Running totals of a range server's work, and its disk and range figures, at one time."""

    bytes_written: int
    bytes_read: int
    appends: int
    fetches: int
    failed_appends: int
    failed_fetches: int
    append_latency_s: float
    fetch_latency_s: float
    disk_free_bytes: int
    active_ranges: int


@dataclass(frozen=True)
class LinkedServer:
    """What the PD link needs of its range server."""

    data_dir: str
    # Where the server keeps its id (named when the PD refuses the id).
    server_file: str
    heartbeat_interval_s: float
    metrics_interval_s: float
    # How often to ask the PD for the settings of the streams held here.
    streams_interval_s: float
    server_id: Callable[[], int]
    # Adopt an id the PD allocated (and keep it on disk).
    set_server_id: Callable[[int], None]
    advertise_addr: Callable[[], str]
    # Ids of the streams with a range here: their settings are asked for.
    stream_ids: Callable[[], list[int]]
    # (stream_id, retention_period_ms, deleted) as the PD reports them.
    stream_settings: Callable[[int, int, bool], None]
    load: Callable[[], LoadSample]
    # What a stream's named consumers still need kept (None: nothing, the period decides).
    consumer_hold: Callable[[int, ConsumerHold | None], None] = lambda stream_id, hold: None
    # The PD announced the version of the permissions in force (a heartbeat answer's
    # acl_version), with the call that fetches them; None: the server enforces none.
    permissions_announced: Callable[[int, Callable[[], tuple[int, list[Permission]]]],
                                    None] | None = None

    def info(self) -> messages.RangeServer:
        """The server as the PD knows it: id and advertised address."""
        return messages.RangeServer(self.server_id(), self.advertise_addr())


class PdLink:
    """Keeps one range server registered with, and reporting to, the PD."""

    def __init__(self, server: LinkedServer, pd_addresses: list[str],
                 client_config: ClientConfig | None = None, tls: TlsConfig | None = None,
                 token: str | None = None,
                 on_refusal: Callable[[RegistrationRefused], None] | None = None,
                 stop: threading.Event | None = None) -> None:
        self.server = server
        # Who tells the operator when the PD refuses this server for good (see ``_refused``):
        # without one, the refusal is logged as an error.
        self.on_refusal = on_refusal
        # With TLS, the PD is called with the range server's own certificate.
        config = (client_config or _LINK_CLIENT).with_tls(tls).with_token(token)
        self.pool = ConnectionPool(config)
        # A heartbeat stuck waiting out an election would reach the new leader later than
        # the next one does: the link's calls fail fast instead.
        self.pd = PdClient(pd_addresses, config, pool=self.pool, wait_for_election=False)
        # Set to end the link; its pauses (between attempts, between duties) wait on it.
        self._stop = stop if stop is not None else threading.Event()
        self._trims: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="range-server-pd-link",
                                        daemon=True)
        self.registered = threading.Event()
        self.heartbeats = 0
        # Set once the PD refused this server's id for good (see ``_refused``): the link has
        # stopped, and the server cannot serve that PD's cluster.
        self.refusal: RegistrationRefused | None = None
        self._last_sample: tuple[float, dict[str, float]] | None = None
        # Failed PD calls are logged once per outage, with reminders, not once per call.
        self.outage = PdOutage(lambda: _server_name(server), log)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop reporting, and tell the PD: a GOAWAY on the connection of the heartbeats makes
        it count this server out at once, not once the heartbeats are overdue."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(10)
        reason = f"range server {self.server.server_id()} stopping"
        for conn in self.pool.connections().values():
            conn.send_goaway(reason)
        self.pool.close()

    def report_trim(self, stream_id: int, start_offset: int) -> None:
        """Queue a TRIM_STREAMS for the PD (sent from the link thread)."""
        self._trims.put((stream_id, start_offset))

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        if not self._register():
            return
        cfg = self.server
        next_heartbeat = next_metrics = next_streams = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_heartbeat:
                beat = self._guarded("HEARTBEAT", self._heartbeat)
                if self.refusal is not None:
                    return
                next_heartbeat = now + (cfg.heartbeat_interval_s if beat else
                                        min(cfg.heartbeat_interval_s, HEARTBEAT_RETRY_S))
            if now >= next_metrics:
                next_metrics = now + cfg.metrics_interval_s
                self._guarded("REPORT_METRICS", self._report_metrics)
            if now >= next_streams:
                next_streams = now + cfg.streams_interval_s
                self._guarded("DESCRIBE_STREAMS", self._refresh_streams)
            self._send_trims()
            wake = min(next_heartbeat, next_metrics, next_streams) - time.monotonic()
            self._stop.wait(max(0.0, min(wake, 0.5)))

    def _guarded(self, what: str, fn) -> bool:
        """Run the PD call ``fn``; a failure is logged (once per outage), not raised.
        Whether it succeeded."""
        try:
            fn()
        except SbpError as exc:
            self.outage.failed(what, exc)
        except Exception:
            log.exception("range server %d: %s to the PD failed", self.server.server_id(),
                          what)
        else:
            self.outage.succeeded(what)
            return True
        return False

    def _register(self) -> bool:
        """Make sure the server has an id; False if stopped first."""
        backoff = _REGISTER_BACKOFF_S
        while self.server.server_id() < 0:
            try:
                server_id = self.pd.allocate_id(socket.gethostname())
                if server_id < 0:
                    raise SbpError(f"the PD allocated no id ({server_id})")
                self.server.set_server_id(server_id)
                log.info("range server registered as server %d", server_id)
            except SbpError as exc:
                # A PD not up yet is retried with a growing wait, said once per outage (with
                # reminders), as every other PD call is.
                self.outage.failed("ALLOCATE_ID", exc)
                if self._stop.wait(backoff):
                    return False
                backoff = min(backoff * 2, _REGISTER_BACKOFF_MAX_S)
        self.outage.succeeded("ALLOCATE_ID")
        self.registered.set()
        return True

    def _heartbeat(self) -> None:
        info = self.server.info()
        try:
            answer = self.pd.heartbeat(HeartbeatRequest(
                client_id=f"range-server-{info.server_id}",
                client_role=ClientRole.RANGE_SERVER, range_server=info))
        except InvalidRequestError as exc:
            if exc.detail != UNKNOWN_SERVER_ID:
                raise
            self._refused(exc)
            return
        self.heartbeats += 1
        announced = self.server.permissions_announced
        if announced is not None and answer.acl_version >= 0:
            announced(answer.acl_version, self.pd.describe_permissions)

    def _refused(self, exc: InvalidRequestError) -> None:
        """The PD does not know this server's id: the data directory belongs to another
        cluster (or the PD's metadata was reset). That will not change by retrying, and taking
        a new id on our own would orphan the ranges stored under the old one, so the link
        stops and ``refusal`` says what the operator can do; the process exits on it."""
        server_id, data_dir = self.server.server_id(), self.server.data_dir
        self.refusal = RegistrationRefused(
            f"range server data directory {data_dir} holds server id {server_id} "
            f"(in {self.server.server_file}), and the PD refuses it: {exc.message}. The data "
            f"in {data_dir} belongs to the cluster that issued id {server_id}: point --pd at "
            f"that cluster's PD, or start this server with an empty --data-dir to join the "
            f"PD's cluster as a new range server")
        if self.on_refusal is not None:  # its owner reports it (``sbp range-server`` exits
            self.on_refusal(self.refusal)  # with it as its error): said once, not twice
        else:
            log.error("%s", self.refusal)
        self._stop.set()

    def metrics_request(self) -> ReportMetricsRequest:
        """Current load figures (rates since the previous call)."""
        load = self.server.load()
        now = time.monotonic()
        counters = {
            "in": load.bytes_written, "out": load.bytes_read, "appends": load.appends,
            "fetches": load.fetches, "failed_appends": load.failed_appends,
            "failed_fetches": load.failed_fetches, "append_s": load.append_latency_s,
            "fetch_s": load.fetch_latency_s,
        }
        last_t, last = self._last_sample or (now, counters)
        self._last_sample = (now, counters)
        dt = max(now - last_t, 1e-3)

        def rate(key: str) -> float:
            return (counters[key] - last[key]) / dt if last is not counters else 0.0

        def avg_ms(total: str, count: str) -> float:
            n = counters[count] - last[count]
            return 1000.0 * (counters[total] - last[total]) / n if n > 0 else 0.0

        return ReportMetricsRequest(
            range_server=self.server.info(),
            disk_in_rate=int(rate("in")),
            disk_out_rate=int(rate("out")),
            disk_free_space=load.disk_free_bytes,
            disk_unindexed_data_size=0,
            memory_used=rss_bytes(),
            network_append_rate=_clamp16(rate("appends")),
            network_fetch_rate=_clamp16(rate("fetches")),
            network_failed_append_rate=_clamp16(rate("failed_appends")),
            network_failed_fetch_rate=_clamp16(rate("failed_fetches")),
            network_append_avg_latency=_clamp16(avg_ms("append_s", "appends")),
            network_fetch_avg_latency=_clamp16(avg_ms("fetch_s", "fetches")),
            range_missing_replica_cnt=0,
            range_active_cnt=_clamp16(load.active_ranges),
        )

    def _report_metrics(self) -> None:
        self.pd.report_metrics(self.metrics_request())

    def _refresh_streams(self) -> None:
        ids = sorted(self.server.stream_ids())
        if not ids:
            return
        for sid, result in zip(ids, self.pd.describe_streams(ids), strict=True):
            if result.ok and result.value is not None:
                stream = result.value
                self.server.stream_settings(sid, stream.retention_period_ms, stream.deleted)
                self.server.consumer_hold(sid, ConsumerHold(
                    stream.consumers_low_offset, stream.retain_cap_bytes, stream.retain_cap_ms)
                    if stream.retain_for_consumers and stream.consumers_low_offset >= 0
                    else None)

    def _send_trims(self) -> None:
        latest: dict[int, int] = {}
        while True:
            try:
                sid, start = self._trims.get_nowait()
            except queue.Empty:
                break
            latest[sid] = max(latest.get(sid, 0), start)
        if not latest:
            return
        try:
            results = self.pd.trim_streams(sorted(latest.items()))
        except SbpError as exc:
            # retried at the next turn of the loop
            self.outage.failed("TRIM_STREAMS", exc)
            for item in latest.items():
                self._trims.put(item)
            return
        self.outage.succeeded("TRIM_STREAMS")
        for (sid, start), result in zip(sorted(latest.items()), results, strict=True):
            if not result.ok:
                log.warning("the PD refused the trim of stream %d at %d: %s", sid, start,
                            result.exception())
