"""The placement driver (PD): owner of stream and range metadata and of range placement.

This module holds the PD's metadata operations (``PlacementDriver``); its request handler is
``handler.py``, its calls to range servers ``calls.py`` and its liveness sweep and
failover ``failover.py``.

A PD runs alone, its metadata in SQLite (``sqlite_store``; the default, nothing to set up), or as
one node of a PD cluster whose metadata lives in etcd (``PdConfig.etcd``; ``etcd_store``). In a
cluster the nodes elect a leader through etcd (``leader``); only the leader answers
metadata requests and runs the liveness sweep and failover, and followers answer
PD_NOT_LEADER naming it. A PD serves the admin opcodes over the shared frame server core
(``net.FrameServer``); which range servers are alive comes from their heartbeats to the leader
(``placement.Liveness``). The PD calls range servers itself, with
the ordinary client, to seal ranges (SEAL_RANGES) and to tell them about new or changed ranges
(SYNC_RANGES).

Batch opcodes answer one result per item, in request order; a bad item fails with its own
status and never hides the others. Whole-request problems (a header that does not parse) are
SYSTEM_ERROR frames.

Decisions the specification leaves open, made here:

* CREATE_STREAMS: a stream_id other than -1 asks for that id (importing metadata); taken or
  once-used ids fail with STREAM_ALREADY_EXISTS. Range 0 opens at once on the least loaded
  live servers; too few live servers fail the item with NOT_ENOUGH_SERVERS.
* UPDATE_STREAMS replaces replica_nums and retention_period_ms (both are validated); a new
  replica count applies to ranges opened later.
* SEAL_RANGES (seal-and-new) on a range that is already sealed answers the open range that
  followed it, so writers racing on one seal all land on the same range; if the seal was
  recorded but no successor could be opened then, it is opened now.
* CREATE_RANGE repeated for a range that is already open returns it (a retried create).
* TRIM_STREAMS below the current start changes nothing; beyond the stream's end (the open
  range's live next_offset, asked from its primary) fails with OFFSET_OUT_OF_RANGE.
* DESCRIBE_STREAMS with no ids lists every live stream; DESCRIBE_PD_CLUSTER also lists the
  range servers this PD knows, with liveness, load and their last REPORT_METRICS.
* A range server that cannot be reached fails only the items that needed it, with the
  retriable REQUEST_TIMEOUT naming the server.
* A RANGE_SERVER HEARTBEAT must carry an id this PD issued (ALLOCATE_ID; the ids live in the
  metadata store, so they survive a PD restart). Any other id is refused with INVALID_REQUEST
  naming it (detail ``meta.UNKNOWN_SERVER_ID``) and the server never becomes live here.
* Failover: when a range server stops heartbeating, each open range with a replica on it is
  sealed on its live replicas, at the smallest end they report (every acknowledged record is on
  every replica, so none is lost; records past that end were never acknowledged), and the next
  range opens on live servers; writers find it when they ask the PD again. A range with no
  live replica left (always the case for R = 1) stays open and waits for its server: its
  acknowledged records exist only there. A new range needs replica_nums live servers; with
  fewer, the range is sealed and the next one opens once enough servers are live.

Range servers learn about their ranges in two ways: the PD pushes each new range to its servers
when it opens it, and whenever a server (re)appears (its first heartbeat after a PD start, a new
address after a restart, or a heartbeat after silence past the liveness timeout) or a push to it
failed, the PD pushes it every range it holds. So a server that missed a push catches up within
one heartbeat.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sbp_spark.client.connection import parse_address
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import MAX_REPLICAS
from sbp_spark.protocol.errors import (
    InvalidRequestError,
    RangeNotFoundError,
    SbpError,
    ServerError,
)

from ..advertise import advertised, check_advertised
from ..dirlock import DataDirLock
from ..etcd_client import EtcdClient
from ..net import FrameServer, NetConfig
from ..peer_tls import check_peer_tls
from .calls import RangeServerCalls
from .etcd_store import DEFAULT_PREFIX, EtcdStore
from .failover import Failover
from .handler import _PdHandler
from .leader import DEFAULT_LEASE_TTL_S, Leadership, Member
from .meta import MetadataStore
from .placement import Liveness, choose_servers
from .sqlite_store import UNKNOWN_SERVER_ID, PdStore, RangeMeta, ServerMeta, StreamMeta

__all__ = ["PdConfig", "PlacementDriver", "RangeServerInfo", "_PdHandler"]

log = logging.getLogger("sbp_spark.server.pd")

# File name of the metadata database inside the PD's data directory.
PD_DB_NAME = "pd.sqlite"
# Range servers heartbeat this often by default; the PD's liveness timeout is a multiple of it.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 3 * DEFAULT_HEARTBEAT_INTERVAL_S
# Bound on one call from the PD to a range server when the request carries no timeout_ms. Long
# enough for a seal behind a slow fsync, short enough that an admin call on a hung server fails.
DEFAULT_RANGE_SERVER_TIMEOUT_S = 10.0


@dataclass
class PdConfig:
    """Where the PD keeps its data and listens, and its timing rules."""

    # Where the SQLite metadata lives (unused with ``etcd``).
    data_dir: str | Path | None
    host: str = "127.0.0.1"
    port: int = 0
    # host:port that clients should use, when it differs from the bound address (containers);
    # or only the host, with the bound port (see advertise.py). Neither: the bound address.
    advertise_addr: str = ""
    advertise_host: str = ""
    name: str = "pd-1"
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    range_server_timeout_s: float = DEFAULT_RANGE_SERVER_TIMEOUT_S
    fsync: bool = True
    net: NetConfig | None = field(default=None, repr=False)
    # etcd client endpoints (host:port): the metadata lives there and this PD is one node of a
    # cluster that elects its leader there; empty: a lone PD on SQLite in data_dir.
    etcd: Sequence[str] = ()
    # Keys of this cluster in etcd start with this (several clusters may share one etcd).
    etcd_prefix: str = DEFAULT_PREFIX
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S

    def __post_init__(self) -> None:
        if not self.etcd and not self.data_dir:
            raise ValueError("PdConfig needs a data_dir (SQLite metadata) or etcd endpoints")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(
                f"PdConfig.heartbeat_timeout_s={self.heartbeat_timeout_s!r} must be > 0")
        if self.range_server_timeout_s <= 0:
            raise ValueError(
                f"PdConfig.range_server_timeout_s={self.range_server_timeout_s!r} must be > 0")
        check_advertised(self.host, self.advertise_addr, self.advertise_host,
                         f"PD {self.name}")
        # Range servers may dial the PD by another name than it advertises (a load balancer):
        # its name is not checked, only what the servers check of each other's certificates.
        check_peer_tls(self.net.tls if self.net is not None else None, None, f"PD {self.name}")


@dataclass(frozen=True)
class RangeServerInfo:
    """A range server as the PD sees it (for describe calls and the CLI)."""

    server_id: int
    advertise_addr: str
    live: bool
    last_heartbeat_ms: int
    open_ranges: int
    metrics: dict[str, int]
    metrics_ms: int


def _check_stream_settings(replica_nums: int, retention_period_ms: int) -> None:
    if not 1 <= replica_nums <= MAX_REPLICAS:
        raise InvalidRequestError(
            f"replica_nums must be between 1 and {MAX_REPLICAS}, got {replica_nums}")
    if retention_period_ms != -1 and retention_period_ms <= 0:
        raise InvalidRequestError(
            f"retention_period_ms must be -1 (keep forever) or > 0, got {retention_period_ms}")


class PlacementDriver:
    """A running PD node: ``start()``, then ``address``; ``stop()`` shuts it down gracefully.

    The public methods below are the PD's operations; the wire handlers call them, and
    in-process users (tests, the embedded cluster) may too. They raise ``ServerError``
    subclasses for requests they refuse.
    """

    def __init__(self, config: PdConfig) -> None:
        self.config = config
        self.liveness = Liveness(config.heartbeat_timeout_s)
        net = config.net or NetConfig()
        net.host, net.port, net.name = config.host, config.port, config.name
        self._server = FrameServer(_PdHandler(self), net)
        self.calls = RangeServerCalls(self, net.tls)
        self.failover = Failover(self)
        self.leadership: Leadership | None = None
        self._etcd: EtcdClient | None = None
        self.store: MetadataStore
        self._dir_lock: DataDirLock | None = None
        if config.etcd:
            self.data_dir: Path | None = None
            self._etcd = EtcdClient(config.etcd)
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
        # Serialises placement decisions, so concurrent creates see each other's load.
        self.placement_lock = threading.Lock()
        self._stream_locks: defaultdict[int, threading.Lock] = defaultdict(threading.Lock)
        self._stream_locks_guard = threading.Lock()
        self._refused: set[tuple[int, str]] = set()  # unknown ids already logged
        self._started = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> PlacementDriver:
        """Listen and start serving."""
        try:
            self._server.start()
        except BaseException:
            self.calls.close()
            self._close_store()
            raise
        self._started = True
        if self._etcd is not None:
            # The advertised address is known once the port is bound.
            self.leadership = Leadership(
                self._etcd, self.config.etcd_prefix, Member(self.config.name, self.address),
                self.config.lease_ttl_s, on_elected=self._took_office,
                on_deposed=self._left_office)
            self.store = EtcdStore(self._etcd, self.config.etcd_prefix, fence=self.leadership)
            self.leadership.start()
        self.failover.start()
        where = self.data_dir if self._etcd is None else f"etcd {','.join(self.config.etcd)}"
        log.info("PD %s serving on %s (metadata in %s)", self.config.name, self.address, where)
        return self

    def stop(self) -> None:
        """GOAWAY to every peer, let in-flight requests finish, close the metadata store."""
        self.failover.stop()
        if self.leadership is not None:
            self.leadership.stop()
        if self._started:
            self._server.stop()
        self.calls.close()
        self._close_store()

    def _close_store(self) -> None:
        if self._etcd is not None:
            self._etcd.close()
        else:
            self.store.close()
            if self._dir_lock is not None:
                self._dir_lock.release()

    # -- leadership ---------------------------------------------------------------------------

    def is_leader(self) -> bool:
        """Whether this node answers metadata requests now (a lone PD always does)."""
        return self.leadership is None or self.leadership.is_leader()

    def not_leader(self) -> ServerError:
        """The PD_NOT_LEADER refusal of a follower, naming the cluster and its leader."""
        assert self.leadership is not None
        return self.leadership.not_leader()

    def _took_office(self) -> None:
        # Heartbeats went to the old leader until now: start liveness afresh, and give every
        # server one liveness timeout (from when the first reaches this node) to find it
        # before failing it over.
        self.liveness.clear()
        self.calls.forget_owed()
        self.failover.took_office()

    def _left_office(self) -> None:
        self.liveness.clear()
        self.calls.forget_owed()
        self.failover.left_office()

    def __enter__(self) -> PlacementDriver:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``host:port`` that clients use (the advertised address, else the bound one)."""
        return advertised(self._server.address, self.config.advertise_addr,
                          self.config.advertise_host)

    @property
    def bound_address(self) -> str:
        return self._server.address_str

    # -- streams ----------------------------------------------------------------------------

    def create_stream(self, replica_nums: int = 1, retention_period_ms: int = -1,
                      stream_id: int = -1) -> tuple[StreamMeta, RangeMeta]:
        """Create a stream with range 0 open on the least loaded live servers."""
        _check_stream_settings(replica_nums, retention_period_ms)
        if stream_id != -1:
            # An asked-for id the store would refuse is refused now: no wait for servers,
            # and no NOT_ENOUGH_SERVERS hiding that the id is taken.
            self.store.check_stream_id_free(stream_id)
        self._await_live(replica_nums)
        with self.placement_lock:
            servers = self._choose(replica_nums)
            stream, rng = self.store.create_stream(
                replica_nums, retention_period_ms, servers,
                stream_id=None if stream_id == -1 else stream_id)
        self.calls.push_ranges([rng])
        return stream, rng

    def describe_stream(self, stream_id: int) -> StreamMeta:
        return self.store.get_stream(stream_id)

    def update_stream(self, stream_id: int, replica_nums: int,
                      retention_period_ms: int) -> StreamMeta:
        """Replace a stream's settings; a new replica count applies to ranges opened later."""
        _check_stream_settings(replica_nums, retention_period_ms)
        return self.store.update_stream(stream_id, replica_nums, retention_period_ms)

    def delete_stream(self, stream_id: int) -> StreamMeta:
        """Delete a stream's metadata and tell its range servers to refuse it from now on."""
        with self.stream_lock(stream_id):
            stream, ranges = self.store.delete_stream(stream_id)
        servers = {sid for rng in ranges for sid in rng.server_ids}
        request = m.DeleteStreamsRequest(streams=[self.stream_msg(stream)])
        for sid in sorted(servers):
            try:
                self.calls.call(sid, request)
            except SbpError as exc:
                # The metadata is gone, so clients can no longer find the stream; the server
                # only loses the chance to refuse stragglers early.
                log.warning("range server %d was not told that stream %d is deleted: %s",
                            sid, stream_id, exc)
        return stream

    def trim_stream(self, stream_id: int, trim_offset: int,
                    timeout_s: float | None = None) -> tuple[StreamMeta, RangeMeta]:
        """Move the stream's start to ``trim_offset``; returns it and its first range.

        The metadata changes first (readers stop asking for trimmed offsets), then every range
        server holding a range of the stream is told to drop the data below the trim point.
        """
        with self.stream_lock(stream_id):
            ranges = self.store.list_ranges(stream_id)
            last = ranges[-1]
            end = None
            if last.is_open:
                end = self.calls.live_next_offset(last, timeout_s)
            before = self.store.get_stream(stream_id).start_offset
            stream, first = self.store.trim_stream(stream_id, trim_offset, end)
        if stream.start_offset > before:
            holders = sorted({sid for rng in ranges for sid in rng.server_ids})
            request = m.TrimStreamsRequest(trimmed_streams=[
                m.TrimmedStream(stream_id, stream.start_offset)])
            for sid in holders:
                try:
                    self.calls.call(sid, request, timeout_s)
                except SbpError as exc:
                    # Readers already see the new start; the server only keeps its disk
                    # space a while longer (its retention pass trims on its own).
                    log.warning("range server %d was not told to trim stream %d at %d: %s",
                                sid, stream_id, stream.start_offset, exc)
        return stream, first

    # -- ranges -----------------------------------------------------------------------------

    def list_ranges(self, stream_id: int) -> list[RangeMeta]:
        return self.store.list_ranges(stream_id)

    def ranges_on_server(self, server: m.RangeServer) -> tuple[int, list[RangeMeta]]:
        """The server's id (looked up by address when the id is unset) and its ranges."""
        sid = server.server_id
        if sid < 0:
            if not server.advertise_addr:
                raise InvalidRequestError("range_server needs a server_id or an advertise_addr")
            matches = [s.server_id for s in self.store.list_servers()
                       if s.advertise_addr == server.advertise_addr]
            if not matches:
                raise InvalidRequestError(
                    f"no range server has advertised address {server.advertise_addr}")
            sid = matches[-1]
        elif self.store.get_server(sid) is None:
            raise InvalidRequestError(f"no range server has id {sid} (this PD never issued it)")
        return sid, self.store.ranges_on_server(sid)

    def describe_range(self, stream_id: int, range_index: int) -> RangeMeta:
        return self.store.get_range(stream_id, range_index)

    def seal_range(self, stream_id: int, range_index: int,
                   timeout_s: float | None = None) -> RangeMeta:
        """Seal-and-new: seal the open range where its primary stopped, open the next one.

        Returns the stream's new open range. Asking to seal a range that is already sealed
        returns the open range that followed it (so racing writers all land on the same one);
        if none was opened yet (no server was live then), it is opened now.
        """
        with self.stream_lock(stream_id):
            ranges = self.store.list_ranges(stream_id)
            last = ranges[-1]
            if range_index < 0 or range_index > last.range_index:
                raise RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
            if range_index < last.range_index or not last.is_open:
                if last.is_open:
                    return last
                return self._open_next(stream_id, timeout_s)
            end_offset = self.calls.seal_on_servers(last, timeout_s)
            stream = self.store.get_stream(stream_id)
            self._await_live(stream.replica_nums)
            with self.placement_lock:
                servers: list[int] | None = None
                try:
                    servers = self._choose(stream.replica_nums)
                except ServerError as exc:
                    unplaced = exc  # sealed all the same: no write can be acknowledged on it
                sealed, new = self.store.seal_range(stream_id, range_index, end_offset,
                                                    servers)
            if new is not None:
                log.info("sealed range %d of stream %d at %d; range %d open on %s",
                         range_index, stream_id, end_offset, new.range_index, new.server_ids)
            # The sealed range's replicas are fenced until they hear its end (read_cap.py).
            # Pushed before the stream's lock is released: a seal right behind this one (a
            # script sealing in a loop, racing writers) would otherwise reach the new range's
            # primary before the range did, and fail with RANGE_NOT_FOUND.
            self.calls.push_ranges([sealed] if new is None else [sealed, new], timeout_s)
        if new is None:
            raise unplaced
        return new

    def create_range(self, stream_id: int, range_index: int,
                     timeout_s: float | None = None) -> RangeMeta:
        """Open range ``range_index`` of a stream whose last range is sealed.

        ``range_index`` must be the last index + 1. Repeating a create whose range is already
        open (a retry after a lost answer) returns that range.
        """
        with self.stream_lock(stream_id):
            last = self.store.last_range(stream_id)
            if range_index == last.range_index and last.is_open:
                return last
            if last.is_open:
                raise InvalidRequestError(
                    f"cannot create range {range_index} of stream {stream_id}: its last range "
                    f"{last.range_index} is still open; seal it (SEAL_RANGES opens range "
                    f"{last.range_index + 1}) before creating the next one")
            if range_index != last.range_index + 1:
                raise InvalidRequestError(
                    f"cannot create range {range_index} of stream {stream_id}: its last range "
                    f"{last.range_index} is sealed, so the next range is "
                    f"{last.range_index + 1}")
            return self._open_next(stream_id, timeout_s)

    def _open_next(self, stream_id: int, timeout_s: float | None) -> RangeMeta:
        stream = self.store.get_stream(stream_id)
        self._await_live(stream.replica_nums)
        with self.placement_lock:
            servers = self._choose(stream.replica_nums)
            new = self.store.open_next_range(stream_id, servers)
        self.calls.push_ranges([new], timeout_s)
        return new

    # -- range servers ----------------------------------------------------------------------

    def allocate_id(self, host: str = "") -> int:
        """A server id never handed out before."""
        sid = self.store.allocate_server_id(host)
        log.info("allocated server id %d to %s", sid, host or "an unnamed host")
        return sid

    def heartbeat(self, server_id: int, advertise_addr: str) -> None:
        """Record a range server's heartbeat and its current address."""
        if server_id < 0:
            raise InvalidRequestError(f"range server heartbeat without a server_id ({server_id})")
        try:
            parse_address(advertise_addr)
        except ValueError as exc:
            raise InvalidRequestError(f"range server {server_id}: {exc}") from None
        before = self.store.get_server(server_id)
        try:
            self.store.record_heartbeat(server_id, advertise_addr)
        except InvalidRequestError as exc:
            key = (server_id, advertise_addr)
            if exc.detail == UNKNOWN_SERVER_ID and key not in self._refused:
                self._refused.add(key)  # once per server: it keeps heartbeating
                log.warning("refusing heartbeats of range server id %d at %s: %s", server_id,
                            advertise_addr, exc.message)
            raise
        arrived = self.liveness.beat(server_id, advertise_addr)
        previous = before.advertise_addr if before is not None else ""
        moved = previous not in ("", advertise_addr)
        if moved:
            log.info("range server %d is live at %s (was %s)", server_id, advertise_addr,
                     previous)
        elif arrived:
            log.info("range server %d is live at %s", server_id, advertise_addr)
        # New, back from silence, or restarted elsewhere: it may have missed pushes.
        if arrived or moved:
            self.calls.owe_resync(server_id)
        if self.calls.resync_owed(server_id) and self._started:
            self._server.submit(self.calls.resync_server, server_id)

    def range_server_stopping(self, server_id: int) -> None:
        """A range server said it stops (GOAWAY on the connection of its heartbeats): not
        live from now on, so no new range is placed on it, and its open ranges are failed
        over on the next sweep instead of after the heartbeat timeout. Its next heartbeat
        (it restarted) makes it live again."""
        if not self.liveness.is_live(server_id):
            return
        self.liveness.forget(server_id)
        self.failover.owe(server_id, stopped=True)
        log.info("range server %d is stopping: not live", server_id)

    def report_metrics(self, server_id: int, metrics: dict[str, int]) -> None:
        self.store.record_metrics(server_id, metrics)

    def range_servers(self) -> list[RangeServerInfo]:
        """Every range server that ever heartbeated, with liveness, load and metrics."""
        load = self.store.open_range_counts()
        out = []
        for s in self.store.list_servers():
            if not s.registered:
                continue
            out.append(RangeServerInfo(
                server_id=s.server_id, advertise_addr=self.address_of(s),
                live=self.liveness.is_live(s.server_id), last_heartbeat_ms=s.last_heartbeat_ms,
                open_ranges=load.get(s.server_id, 0), metrics=dict(s.metrics),
                metrics_ms=s.metrics_ms))
        return out

    def cluster(self) -> m.PlacementDriverCluster:
        """The PD's membership and its leader (a lone PD: one node, the leader)."""
        if self.leadership is not None:
            return self.leadership.cluster()
        return m.PlacementDriverCluster(members=[m.PlacementDriverNode(
            name=self.config.name, advertise_addr=self.address, is_leader=True)])

    # -- helpers ----------------------------------------------------------------------------

    @contextmanager
    def stream_lock(self, stream_id: int) -> Iterator[None]:
        with self._stream_locks_guard:
            lock = self._stream_locks[stream_id]
        with lock:
            yield

    def _await_live(self, count: int) -> None:
        """Before placing ``count`` replicas: a PD that just started or took office has not
        heard yet from every server that is alive (their heartbeats went elsewhere, or not yet
        anywhere); the registered servers it has not heard from get the rest of one liveness
        timeout to find it (``Liveness.wait_for_live``). ``_choose`` decides after that."""
        if len(self.liveness.live()) >= count:
            return
        known = [s.server_id for s in self.store.list_servers() if s.registered]
        self.liveness.wait_for_live(count, known)

    def _choose(self, count: int) -> list[int]:
        live = [s.server_id for s in self.liveness.live()]
        return choose_servers(live, self.store.open_range_counts(), count)

    def address_of(self, server: ServerMeta | int) -> str:
        sid = server if isinstance(server, int) else server.server_id
        addr = self.liveness.address(sid)
        if addr:
            return addr
        meta = self.store.get_server(sid) if isinstance(server, int) else server
        return meta.advertise_addr if meta is not None else ""

    def range_msg(self, rng: RangeMeta, for_servers: bool = False) -> m.Range:
        """The wire form of a range. Range servers know a range by where it began before any
        trim (``for_servers``); clients see its current start."""
        return m.Range(
            stream_id=rng.stream_id, range_index=rng.range_index,
            start_offset=rng.base_start_offset if for_servers else rng.start_offset,
            next_offset=rng.next_offset,
            end_offset=rng.end_offset,
            servers=[m.RangeReplica(m.RangeServer(r.server_id, self.address_of(r.server_id)),
                                    r.is_primary) for r in rng.replicas])

    @staticmethod
    def stream_msg(stream: StreamMeta) -> m.Stream:
        return m.Stream(stream_id=stream.stream_id, replica_nums=stream.replica_nums,
                        retention_period_ms=stream.retention_period_ms,
                        start_offset=stream.start_offset, deleted=stream.deleted)

    def list_streams(self) -> list[StreamMeta]:
        """Every stream that is not deleted, in id order."""
        return self.store.list_streams()

    # -- failover (failover.py) and pushes to range servers (calls.py) ----------------------

    def run_failovers(self) -> None:
        """Fail over the open ranges of every server owed a failover (``Failover``)."""
        self.failover.run_failovers()

    def fail_over_server(self, server_id: int) -> bool:
        """Fail over the open ranges of the dead ``server_id`` (``Failover``)."""
        return self.failover.fail_over_server(server_id)

    def _push_ranges(self, ranges: Iterable[RangeMeta], timeout_s: float | None = None,
                     skip: Iterable[int] = ()) -> None:
        self.calls.push_ranges(ranges, timeout_s, skip)
