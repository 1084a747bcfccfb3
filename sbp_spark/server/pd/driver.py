"""The PD node as one owner: builds its parts, wires them, starts and stops them.

Each part gets only what it uses (see the package doc for the parts); the owner holds them and
their life cycle: the metadata store (SQLite in the data directory, or etcd), the frame server
that serves the handler, the election while in a PD cluster, the liveness sweep, and the pool
of connections to range servers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.client.config import ClientConfig
from sbp_spark.client.consumers import StreamLag, stream_lag
from sbp_spark.protocol.errors import SbpError

from ..advertise import advertised
from ..auth.authorizer import Authorizer
from ..auth.rules import PD
from ..dirlock import DataDirLock
from ..etcd_client import EtcdClient
from ..metrics_http import MetricsServer
from ..net import FrameServer, NetConfig
from .calls import RangeServerCalls
from .config import PdConfig
from .consumer_requests import ConsumerRequests
from .consumer_retention import ConsumerFloor
from .consumers import ConsumerStore
from .etcd_consumers import EtcdConsumers
from .etcd_store import EtcdStore
from .exported import PdCollector, PdCounters, PdSources
from .failover import Failover, RangeFailover
from .handler import Office, PdHandler
from .leader import Leadership, LoneOffice
from .meta import MetadataStore
from .permissions import Permissions
from .placement import Liveness, Placement
from .pushes import RangePushes
from .ranges import RangeOperations
from .servers import RangeServerRegistry
from .sqlite_consumers import SqliteConsumers
from .sqlite_store import PdStore
from .streams import StreamOperations
from .succession import StreamLocks, Succession
from .wire import Addresses

log = logging.getLogger(__package__)

# File name of the metadata database inside the PD's data directory.
PD_DB_NAME = "pd.sqlite"
# How the metrics exporter reads consumers' lag from the cluster: a scrape waits for it, so
# a range server that does not answer costs seconds, not the client's default minute.
_LAG_CLIENT_CONFIG = ClientConfig(connect_timeout_s=1.0, request_timeout_s=2.0, retries=1,
                                  retry_deadline_s=3.0)


class PlacementDriver:
    """A running PD node: ``start()``, then ``address``; ``stop()`` shuts it down gracefully.

    In-process users (tests, the embedded cluster) reach its parts as attributes: ``streams``
    and ``ranges`` (the operations, raising ``ServerError`` subclasses for requests they
    refuse), ``servers`` (the range servers it knows), ``store``, ``consumers`` (the named
    consumers' record, ``consumers.ConsumerStore``), ``liveness``, ``office``,
    ``pushes``, ``succession`` with ``locks``, and ``failover``.
    """

    def __init__(self, config: PdConfig) -> None:
        self.config = config
        net = config.net or NetConfig()
        net.host, net.port, net.name = config.host, config.port, config.name
        self._net = net
        self.liveness = Liveness(config.heartbeat_timeout_s)
        self.leadership: Leadership | None = None
        self._etcd: EtcdClient | None = None
        self._dir_lock: DataDirLock | None = None
        self._sqlite_consumers: SqliteConsumers | None = None
        self.counters = PdCounters()
        self.metrics_server: MetricsServer | None = None
        self._lag_client: SbpClient | None = None
        self._lag_pool: ConnectionPool | None = None
        self.data_dir: Path | None = None
        self.store: MetadataStore
        self.consumers: ConsumerStore
        self.office: Office
        if config.etcd:
            self._etcd = EtcdClient(config.etcd)
            # The address is asked once the node campaigns, after start() bound the port.
            self.leadership = Leadership(
                self._etcd, config.etcd_prefix, config.name, self._advertised,
                config.lease_ttl_s, on_elected=self._took_office, on_deposed=self._left_office)
            etcd_store = EtcdStore(self._etcd, config.etcd_prefix, fence=self.leadership)
            self.store = etcd_store
            self.consumers = EtcdConsumers(etcd_store)
            self.office = self.leadership
        else:
            assert config.data_dir is not None
            self.data_dir = Path(config.data_dir)
            self.data_dir.mkdir(parents=True, exist_ok=True)
            # Two lone PDs on one database would each allocate the same ids.
            lock = self._dir_lock = DataDirLock(self.data_dir, "PD")
            try:
                self.store = PdStore(self.data_dir / PD_DB_NAME, fsync=config.fsync)
            except BaseException:
                lock.release()
                raise
            try:
                self.consumers = self._sqlite_consumers = SqliteConsumers(
                    self.data_dir / PD_DB_NAME, fsync=config.fsync)
            except BaseException:
                self.store.close()
                lock.release()
                raise
            self.office = LoneOffice(config.name, self._advertised)

        try:
            self._server = self._wire(net)
        except BaseException:  # a PD that could not be built leaves its data directory free
            self._close_store()
            raise
        self._started = False

    def _wire(self, net: NetConfig) -> FrameServer:
        """Build the parts on the store and the office, each given what it uses; the frame
        server that serves their handler."""
        addresses = Addresses(self.liveness.address, self.store.get_server)
        auth = self.config.auth
        # The PD calls range servers as a server principal (its --server-token, or one made
        # from the shared secret): only servers may seal, sync, trim and delete there.
        self._calls = RangeServerCalls(
            addresses.of, functools.partial(addresses.range_msg, for_servers=True),
            self.config.range_server_timeout_s, net.tls, auth.server_token())
        self.pushes = RangePushes(self._calls, self.store)
        placement = Placement(self.liveness, self.store)
        self.locks = StreamLocks()
        self.succession = Succession(self.store, placement, self.pushes)
        self.streams = StreamOperations(
            self.store, placement, self.pushes, self._calls, self.locks,
            ConsumerFloor(self.consumers, self._offset_for_time, self._retained_start))
        self.ranges = RangeOperations(self.store, self._calls, self.succession, self.locks,
                                      self.liveness.went_silent)
        range_failover = RangeFailover(self.store, self.liveness.is_live, self._calls,
                                       self.succession, self.locks)

        def fail_over_server(server_id: int, stopped: bool = False) -> bool:
            done = range_failover.fail_over_server(server_id, stopped)
            if done:  # counted once per server failed over, not per attempt
                self.counters.range_server_failovers += 1
            return done

        self.failover = Failover(
            self.liveness, self.store.list_servers, fail_over_server,
            self.office.is_leader, self.config.heartbeat_timeout_s, self.config.name)
        self.servers = RangeServerRegistry(
            self.store, self.liveness, self.pushes, self._run_soon,
            functools.partial(self.failover.owe, stopped=True), addresses.of)
        self.permissions = Permissions(self.store)
        handler = PdHandler(self.store, self.streams, self.ranges, self.servers, self.office,
                            addresses, ConsumerRequests(self.consumers), self.permissions)
        authenticator = auth.authenticator()
        if authenticator is not None:
            handler.authorizer = Authorizer(PD, self.permissions.table, self.permissions)
        return FrameServer(handler, net, authenticator)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> PlacementDriver:
        """Listen and start serving."""
        try:
            self._server.start()
        except BaseException:
            self._calls.close()
            self._close_store()
            raise
        self._started = True
        if self.leadership is not None:
            self.leadership.start()
        else:
            self.counters.took_office += 1
            self.failover.took_office()  # a lone PD leads from its start
        if self.config.metrics_port is not None:
            self.metrics_server = MetricsServer(
                [PdCollector(PdSources(self._server.stats, lambda: self._server.connection_count,
                                       self.office.is_leader, self.counters, self.store,
                                       self.liveness.is_live, self.consumers.list_all,
                                       self._stream_lag))],
                self.config.metrics_host or self.config.host, self.config.metrics_port).start()
        self.failover.start()
        where = self.data_dir if self._etcd is None else f"etcd {','.join(self.config.etcd)}"
        log.info("PD %s serving on %s (metadata in %s)", self.config.name, self.address, where)
        return self

    def stop(self) -> None:
        """GOAWAY to every peer, let in-flight requests finish, close the metadata store."""
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self._lag_pool is not None:
            self._lag_pool.close()
        self.failover.stop()
        if self.leadership is not None:
            self.leadership.stop()
        if self._started:
            self._server.stop()
        self._calls.close()
        self._close_store()

    def _close_store(self) -> None:
        if self._etcd is not None:
            self._etcd.close()
        else:
            self.store.close()
            if self._sqlite_consumers is not None:
                self._sqlite_consumers.close()
            if self._dir_lock is not None:
                self._dir_lock.release()

    def __enter__(self) -> PlacementDriver:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- leadership ---------------------------------------------------------------------------

    def _took_office(self) -> None:
        self.counters.took_office += 1
        # Heartbeats went to the old leader until now: start liveness afresh, and give every
        # server one liveness timeout (from when the first reaches this node) to find it
        # before failing it over.
        self.liveness.clear()
        self.pushes.forget_owed()
        self.permissions.forget()  # the old leader's grants are enforced from the first request
        self.failover.took_office()

    def _left_office(self) -> None:
        self.liveness.clear()
        self.pushes.forget_owed()
        self.failover.left_office()

    # -- wiring -------------------------------------------------------------------------------

    def _stream_lag(self, stream_id: int, committed: int, commit_time_ms: int) -> StreamLag:
        """A consumer's lag on a stream, read through this PD's own address as a client
        reads it (the stream's live end from its primary, timestamps from its records)."""
        return stream_lag(self._lag_reader(), stream_id, committed, commit_time_ms)

    def _lag_reader(self) -> SbpClient:
        """A client of this PD's own address, for what the PD reads of streams' records."""
        if self._lag_client is None:
            self._lag_pool = ConnectionPool(_LAG_CLIENT_CONFIG.with_tls(self._net.tls))
            self._lag_client = SbpClient(self.address, pool=self._lag_pool,
                                         config=_LAG_CLIENT_CONFIG.with_tls(self._net.tls))
        return self._lag_client

    def _offset_for_time(self, stream_id: int, timestamp_ms: int) -> int | None:
        """The first offset of the stream whose record is at or after ``timestamp_ms``."""
        return self._lag_reader().offset_for_time(stream_id, timestamp_ms)

    def _retained_start(self, stream_id: int) -> int | None:
        """The first offset the replicas of the stream's first range still hold (None: not
        known now; the trim then stays where the consumers are)."""
        reader = self._lag_reader()
        try:
            first = reader.list_ranges(stream_id)[0]
            return reader.retained_start(stream_id, first.range_index,
                                         [r.server.advertise_addr for r in first.servers])
        except SbpError as exc:
            log.warning("stream %d: the start its replicas hold is unknown: %s", stream_id, exc)
            return None

    def _run_soon(self, fn: Callable[[int], None], server_id: int) -> None:
        """Run ``fn(server_id)`` on the frame server's worker pool."""
        self._server.submit(fn, server_id)

    def _advertised(self) -> str:
        return self.address

    @property
    def address(self) -> str:
        """``host:port`` that clients use (the advertised address, else the bound one)."""
        return advertised(self._server.address, self.config.advertise_addr,
                          self.config.advertise_host)

    @property
    def bound_address(self) -> str:
        return self._server.address_str
