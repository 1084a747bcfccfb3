"""The range server: stores the ranges it is given and serves APPEND and FETCH for them.

It learns its ranges from the PD (SYNC_RANGES, or directly in tests), keeps them in a
:class:`~sbp_spark.server.storage.store.Storage`, and answers (``requests.py``):

* APPEND to ranges it is the primary of (open ranges only); each entry by its request_index,
  acknowledged once the fsync policy is met and every secondary stored it (``append.py``,
  ``replication.py``); on a secondary, the batches its primary forwards;
* FETCH (long poll, then streamed whole batches, see ``fetch.py``);
* SEAL_RANGES (seal only: the sealed range, end_offset = its next_offset), SYNC_RANGES,
  DESCRIBE_RANGES (live next_offset), DELETE_STREAMS (no more writes), TRIM_STREAMS (drop local
  data below an offset), HEARTBEAT (``admin.py``); PING and GOAWAY are answered by the network
  core.

``RangeServer`` is the owner: it builds the parts, hands each one what it uses and nothing
else, and runs their life cycle. Its id is kept on disk (``identity.py``); its role in each
range follows from it (``roles.py``); read cap notices go to and come from the other replicas
(``cap_notices.py``); expired data is deleted by ``retention.py``.

Run standalone (``RangeServer(RangeServerConfig(data_dir, server_id=1)).start()``), or with
``pd_addresses`` set: then ``registration.PdLink`` obtains a server id from the PD, heartbeats
with the advertised address, reports metrics and reports retention trims.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ...protocol import messages
from ..advertise import advertised
from ..auth.authorizer import Authorizer
from ..auth.rules import RANGE_SERVER
from ..dirlock import DataDirLock
from ..metrics_http import MetricsServer
from ..net import FrameServer
from ..storage.disk import Disk
from ..storage.store import Storage
from .admin import RangeAdmin
from .append import AppendPath
from .cap_notices import CapNotices
from .config import RangeServerConfig
from .exported import RangeServerCollector, RangeServerSources
from .fetch import FetchServer
from .identity import SERVER_FILE, ServerIdentity
from .metrics import Metrics
from .permissions import LearnedPermissions
from .producers import Lookups, Producers
from .registration import LinkedServer, LoadSample, PdLink, RegistrationRefused
from .replication import Replicator
from .requests import RangeServerHandler
from .retention import Retention
from .roles import Roles

log = logging.getLogger(__name__)


class RangeServer:
    """A range server process: storage, the TCP front end and background duties.

    Its two ways out of the process besides the network core can be handed in: ``disk``,
    what its storage writes and syncs through, and ``replicator``, its calls to the
    secondaries of its ranges (by default, the real ones). A test stands in a slow disk or a
    secondary that does not answer there.
    """

    def __init__(self, config: RangeServerConfig, *, disk: Disk | None = None,
                 replicator: Replicator | None = None) -> None:
        self.config = config
        os.makedirs(config.data_dir, exist_ok=True)
        # Before anything reads the directory: recovery truncates torn tails, which would cut
        # the live appends of a server already running on it.
        self.dir_lock = DataDirLock(config.data_dir, "range server")
        try:
            self.identity = ServerIdentity(config.data_dir, config.server_id)
            self.storage = Storage(os.path.join(config.data_dir, "data"), config.storage,
                                   disk)
        except BaseException:
            self.dir_lock.release()
            raise
        storage = self.storage
        self.roles = Roles(self.identity)
        self.metrics = Metrics()
        # This server's principal towards the PD and its peers (None: certificates, or open).
        self._server_token = config.auth.server_token()
        self.replicator = replicator or Replicator(tls=config.net.tls, token=self._server_token)
        self.cap_notices = CapNotices(storage, self.roles, self.replicator,
                                      storage.durability.when_durable, self._on_workers,
                                      config.cap_probe_interval_s)
        self.producers = Producers(config.producers)
        appends = AppendPath(storage.stream_ranges, storage.durability, self.roles,
                             self.replicator, self.cap_notices, self.metrics, self._on_workers,
                             config.max_batch_bytes, self.producers)
        fetches = FetchServer(storage, self.metrics, config.fetch_frame_bytes,
                              config.storage.verify_reads)
        admin = RangeAdmin(storage, lambda: self.identity.server_id, self.info,
                           self.replicator.unreachable)
        self.handler = RangeServerHandler(appends, fetches, admin, storage.notify_data,
                                          Lookups(self.producers, storage.stream_ranges))
        authenticator = config.auth.authenticator()
        # With authentication on, APPEND and FETCH are checked here against the permissions
        # learned from the PD: going straight to this port does not get around them.
        self.permissions: LearnedPermissions | None = None
        if authenticator is not None:
            self.permissions = LearnedPermissions(storage.notify_data)
            self.handler.authorizer = Authorizer(RANGE_SERVER, self.permissions.table)
        net = config.net
        net.host, net.port = config.host, config.port
        self.net = FrameServer(self.handler, net, authenticator)
        self.retention = Retention(storage.ranges, config.retention_check_interval_s)
        # Called (from the PD link's thread) when the PD refuses this server's id for good;
        # set before start() by an owner that reports the refusal itself, else it is logged.
        self.on_refusal: Callable[[RegistrationRefused], None] | None = None
        self.pd_link: PdLink | None = None
        self._started = False
        # Prometheus metrics over HTTP (``config.metrics_port``), once started.
        self.metrics_server: MetricsServer | None = None

    # -- identity --------------------------------------------------------------------------

    @property
    def server_id(self) -> int:
        """This server's id (-1 until the PD allocated one)."""
        return self.identity.server_id

    @property
    def address(self) -> tuple[str, int]:
        return self.net.address

    @property
    def advertise_addr(self) -> str:
        return advertised(self.net.address, self.config.advertise_addr,
                          self.config.advertise_host)

    def info(self) -> messages.RangeServer:
        """This server as the PD and its peers know it: its id and advertised address."""
        return messages.RangeServer(self.server_id, self.advertise_addr)

    def _on_workers(self, fn: Callable[..., object], *args: object) -> bool:
        """Run ``fn(*args)`` on the network core's worker pool (False: it has stopped)."""
        return self.net.submit(fn, *args)

    def _linked(self) -> LinkedServer:
        """This server as its PD link sees it."""
        def stream_settings(stream_id: int, retention_ms: int, deleted: bool) -> None:
            self.retention.set_period(stream_id, retention_ms)
            if deleted:
                self.storage.delete_stream(stream_id)

        def load() -> LoadSample:
            m, st = self.metrics, self.storage.stats
            return LoadSample(
                bytes_written=st.bytes_written, bytes_read=st.bytes_read, appends=m.appends,
                fetches=m.fetches, failed_appends=m.failed_appends,
                failed_fetches=m.failed_fetches, append_latency_s=m.append_latency_s,
                fetch_latency_s=m.fetch_latency_s,
                disk_free_bytes=self.storage.disk_free_bytes(),
                active_ranges=m.active_ranges())

        cfg = self.config
        return LinkedServer(
            data_dir=cfg.data_dir, server_file=os.path.join(cfg.data_dir, SERVER_FILE),
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            metrics_interval_s=cfg.metrics_interval_s,
            streams_interval_s=min(cfg.retention_check_interval_s, 60.0),
            server_id=lambda: self.server_id, set_server_id=self.identity.set,
            advertise_addr=lambda: self.advertise_addr,
            stream_ids=lambda: sorted({r.stream_id for r in self.storage.ranges()}),
            stream_settings=stream_settings, load=load,
            consumer_hold=self.retention.set_hold,
            permissions_announced=(self.permissions.announced
                                   if self.permissions is not None else None))

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> RangeServer:
        """Listen, and start the background duties (and the PD link when configured)."""
        if self._started:
            raise RuntimeError("range server already started")
        self._started = True
        self.net.start()
        if self.config.metrics_port is not None:
            self.metrics_server = MetricsServer(
                [RangeServerCollector(RangeServerSources(
                    self.metrics, self.storage.stats.fsync_seconds, self.net.stats,
                    lambda: self.net.connection_count, self.storage.ranges,
                    lambda: self.server_id))],
                self.config.metrics_host or self.config.host, self.config.metrics_port).start()
        self.retention.start()
        self.cap_notices.start()
        if self.config.pd_addresses:
            self.pd_link = PdLink(self._linked(), list(self.config.pd_addresses),
                                  tls=self.config.net.tls, token=self._server_token,
                                  on_refusal=self.on_refusal)
            self.retention.on_trim = self.pd_link.report_trim
            self.pd_link.start()
        log.info("range server %d serving on %s (data in %s, fsync %s)", self.server_id,
                 self.advertise_addr, self.config.data_dir, self.config.storage.policy.value)
        return self

    def stop(self) -> None:
        """Graceful stop: GOAWAY to clients, finish in-flight requests, sync and close."""
        self.retention.stop()
        if self.pd_link is not None:
            self.pd_link.stop()
        self.cap_notices.stop()
        self.net.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.replicator.close()
        self.retention.join(5)
        self.cap_notices.join(5)
        self.close_unstarted()

    def close_unstarted(self) -> None:
        """Close the storage and free the data directory (all ``stop()`` does for a server
        whose ``start()`` failed)."""
        self.storage.close()
        self.dir_lock.release()

    def __enter__(self) -> RangeServer:
        return self if self._started else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
