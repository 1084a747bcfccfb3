"""The placement driver (PD): owner of stream and range metadata and of range placement.

One PD node (always the leader) serves the admin opcodes over the shared frame server core
(``net.FrameServer``). Metadata lives in SQLite (``pd_store``); which range servers are alive
comes from their heartbeats (``placement.Liveness``). The PD calls range servers itself, with
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
  naming it (detail ``pd_store.UNKNOWN_SERVER_ID``) and the server never becomes live here.
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
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sbp_spark.client.config import ClientConfig
from sbp_spark.client.connection import parse_address
from sbp_spark.client.pool import ConnectionPool
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import Opcode
from sbp_spark.protocol.errors import (
    ErrorCode,
    HeaderError,
    InvalidRequestError,
    RangeNotFoundError,
    RequestTimeoutError,
    SbpError,
    ServerError,
    UnknownError,
)

from .net import FrameServer, NetConfig, RequestContext, RequestHandler, Route, Runs
from .pd_store import UNKNOWN_SERVER_ID, PdStore, RangeMeta, ServerMeta, StreamMeta
from .placement import Liveness, choose_servers

log = logging.getLogger(__name__)

# File name of the metadata database inside the PD's data directory.
PD_DB_NAME = "pd.sqlite"
# Range servers heartbeat this often by default; the PD's liveness timeout is a multiple of it.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 3 * DEFAULT_HEARTBEAT_INTERVAL_S
# Bound on one call from the PD to a range server when the request carries no timeout_ms. Long
# enough for a seal behind a slow fsync, short enough that an admin call on a hung server fails.
DEFAULT_RANGE_SERVER_TIMEOUT_S = 10.0
# replica_nums is an int8 on the wire.
MAX_REPLICAS = 127
# Ranges per SYNC_RANGES frame when the PD pushes a server everything it holds: keeps one frame
# far below the 16 MiB limit however many ranges a server has.
SYNC_BATCH_RANGES = 2000

# Names of the ReportMetricsRequest fields kept as a server's metrics.
METRIC_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(m.ReportMetricsRequest) if f.name != "range_server")


@dataclass
class PdConfig:
    """Where the PD keeps its data and listens, and its timing rules."""

    data_dir: str | Path
    host: str = "127.0.0.1"
    port: int = 0
    # host:port that clients should use, when it differs from the bound address (containers).
    advertise_addr: str = ""
    name: str = "pd-1"
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    range_server_timeout_s: float = DEFAULT_RANGE_SERVER_TIMEOUT_S
    fsync: bool = True
    net: NetConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(
                f"PdConfig.heartbeat_timeout_s={self.heartbeat_timeout_s!r} must be > 0")
        if self.range_server_timeout_s <= 0:
            raise ValueError(
                f"PdConfig.range_server_timeout_s={self.range_server_timeout_s!r} must be > 0")
        if self.advertise_addr:
            parse_address(self.advertise_addr)


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


def _ok_or_error(fn: Callable[[], Any]) -> tuple[Any, m.Status]:
    """Run one item of a batch: its value and OK, or None and the status of its failure."""
    try:
        return fn(), m.OK
    except ServerError as exc:
        return None, m.Status.from_error(exc)
    except SbpError as exc:  # not a status of ours: still this item's failure alone
        return None, m.Status(int(ErrorCode.UNKNOWN), f"{type(exc).__name__}: {exc}")


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
        self.data_dir = Path(config.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = PdStore(self.data_dir / PD_DB_NAME, fsync=config.fsync)
        self.liveness = Liveness(config.heartbeat_timeout_s)
        net = config.net or NetConfig()
        net.host, net.port, net.name = config.host, config.port, config.name
        self._server = FrameServer(_PdHandler(self), net)
        # Calls to range servers speak TLS like this PD's port, presenting its certificate.
        self._pool = ConnectionPool(ClientConfig(
            connect_timeout_s=min(5.0, config.range_server_timeout_s),
            request_timeout_s=config.range_server_timeout_s, retries=1).with_tls(net.tls))
        # Serialises placement decisions, so concurrent creates see each other's load.
        self._placement_lock = threading.Lock()
        self._stream_locks: defaultdict[int, threading.Lock] = defaultdict(threading.Lock)
        self._stream_locks_guard = threading.Lock()
        self._resync: set[int] = set()  # servers owed a full SYNC_RANGES
        self._resync_lock = threading.Lock()
        self._failover: set[int] = set()  # gone servers whose open ranges await a failover
        self._refused: set[tuple[int, str]] = set()  # unknown ids already logged
        self._failover_lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._started = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> PlacementDriver:
        """Listen and start serving."""
        try:
            self._server.start()
        except BaseException:
            self._pool.close()
            self.store.close()
            raise
        self._started = True
        self._sweeper = threading.Thread(target=self._sweep_liveness, daemon=True,
                                         name=f"{self.config.name}-liveness")
        self._sweeper.start()
        log.info("PD %s serving on %s (data in %s)", self.config.name, self.address,
                 self.data_dir)
        return self

    def stop(self) -> None:
        """GOAWAY to every peer, let in-flight requests finish, close the metadata store."""
        self._stop.set()
        if self._started:
            self._server.stop()
        if self._sweeper is not None:
            self._sweeper.join(2.0)
        self._pool.close()
        self.store.close()

    def __enter__(self) -> PlacementDriver:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``host:port`` that clients use (the advertised address, else the bound one)."""
        return self.config.advertise_addr or self._server.address_str

    @property
    def bound_address(self) -> str:
        return self._server.address_str

    # -- streams ----------------------------------------------------------------------------

    def create_stream(self, replica_nums: int = 1, retention_period_ms: int = -1,
                      stream_id: int = -1) -> tuple[StreamMeta, RangeMeta]:
        """Create a stream with range 0 open on the least loaded live servers."""
        _check_stream_settings(replica_nums, retention_period_ms)
        with self._placement_lock:
            servers = self._choose(replica_nums)
            stream, rng = self.store.create_stream(
                replica_nums, retention_period_ms, servers,
                stream_id=None if stream_id == -1 else stream_id)
        self._push_ranges([rng])
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
        with self._stream_lock(stream_id):
            stream, ranges = self.store.delete_stream(stream_id)
        servers = {sid for rng in ranges for sid in rng.server_ids}
        request = m.DeleteStreamsRequest(streams=[self._stream_msg(stream)])
        for sid in sorted(servers):
            try:
                self._call_server(sid, request)
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
        with self._stream_lock(stream_id):
            ranges = self.store.list_ranges(stream_id)
            last = ranges[-1]
            end = None
            if last.is_open:
                end = self._live_next_offset(last, timeout_s)
            before = self.store.get_stream(stream_id).start_offset
            stream, first = self.store.trim_stream(stream_id, trim_offset, end)
        if stream.start_offset > before:
            holders = sorted({sid for rng in ranges for sid in rng.server_ids})
            request = m.TrimStreamsRequest(trimmed_streams=[
                m.TrimmedStream(stream_id, stream.start_offset)])
            for sid in holders:
                try:
                    self._call_server(sid, request, timeout_s)
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
        with self._stream_lock(stream_id):
            ranges = self.store.list_ranges(stream_id)
            last = ranges[-1]
            if range_index < 0 or range_index > last.range_index:
                raise RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
            if range_index < last.range_index or not last.is_open:
                if last.is_open:
                    return last
                return self._open_next(stream_id, timeout_s)
            end_offset = self._seal_on_servers(last, timeout_s)
            stream = self.store.get_stream(stream_id)
            with self._placement_lock:
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
        self._push_ranges([sealed] if new is None else [sealed, new], timeout_s)
        if new is None:
            raise unplaced
        return new

    def create_range(self, stream_id: int, range_index: int,
                     timeout_s: float | None = None) -> RangeMeta:
        """Open range ``range_index`` of a stream whose last range is sealed.

        ``range_index`` must be the last index + 1. Repeating a create whose range is already
        open (a retry after a lost answer) returns that range.
        """
        with self._stream_lock(stream_id):
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
        with self._placement_lock:
            servers = self._choose(stream.replica_nums)
            new = self.store.open_next_range(stream_id, servers)
        self._push_ranges([new], timeout_s)
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
        moved = before is not None and before.advertise_addr not in ("", advertise_addr)
        if moved:
            log.info("range server %d is live at %s (was %s)", server_id, advertise_addr,
                     before.advertise_addr)
        elif arrived:
            log.info("range server %d is live at %s", server_id, advertise_addr)
        # New, back from silence, or restarted elsewhere: it may have missed pushes.
        if arrived or moved:
            self._owe_resync(server_id)
        with self._resync_lock:
            owed = server_id in self._resync
        if owed and self._started:
            self._server.submit(self._resync_server, server_id)

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
                server_id=s.server_id, advertise_addr=self._address_of(s),
                live=self.liveness.is_live(s.server_id), last_heartbeat_ms=s.last_heartbeat_ms,
                open_ranges=load.get(s.server_id, 0), metrics=dict(s.metrics),
                metrics_ms=s.metrics_ms))
        return out

    def cluster(self) -> m.PlacementDriverCluster:
        """This PD's membership: one node, the leader."""
        return m.PlacementDriverCluster(members=[m.PlacementDriverNode(
            name=self.config.name, advertise_addr=self.address, is_leader=True)])

    # -- helpers ----------------------------------------------------------------------------

    @contextmanager
    def _stream_lock(self, stream_id: int) -> Iterator[None]:
        with self._stream_locks_guard:
            lock = self._stream_locks[stream_id]
        with lock:
            yield

    def _choose(self, count: int) -> list[int]:
        live = [s.server_id for s in self.liveness.live()]
        return choose_servers(live, self.store.open_range_counts(), count)

    def _address_of(self, server: ServerMeta | int) -> str:
        sid = server if isinstance(server, int) else server.server_id
        addr = self.liveness.address(sid)
        if addr:
            return addr
        meta = self.store.get_server(sid) if isinstance(server, int) else server
        return meta.advertise_addr if meta is not None else ""

    def _range_msg(self, rng: RangeMeta, for_servers: bool = False) -> m.Range:
        """The wire form of a range. Range servers know a range by where it began before any
        trim (``for_servers``); clients see its current start."""
        return m.Range(
            stream_id=rng.stream_id, range_index=rng.range_index,
            start_offset=rng.base_start_offset if for_servers else rng.start_offset,
            next_offset=rng.next_offset,
            end_offset=rng.end_offset,
            servers=[m.RangeReplica(m.RangeServer(r.server_id, self._address_of(r.server_id)),
                                    r.is_primary) for r in rng.replicas])

    @staticmethod
    def _stream_msg(stream: StreamMeta) -> m.Stream:
        return m.Stream(stream_id=stream.stream_id, replica_nums=stream.replica_nums,
                        retention_period_ms=stream.retention_period_ms,
                        start_offset=stream.start_offset, deleted=stream.deleted)

    def _call_server(self, server_id: int, msg: Any, timeout_s: float | None = None) -> Any:
        """One request to a range server: its response.

        A SYSTEM_ERROR answer raises its ``ServerError``; a server that cannot be reached or
        does not answer in time raises ``RequestTimeoutError`` (retriable) naming it.
        """
        addr = self._address_of(server_id)
        if not addr:
            raise RequestTimeoutError(
                f"range server {server_id} has never announced an address")
        timeout = self.config.range_server_timeout_s if timeout_s is None else timeout_s
        failure: SbpError | None = None
        # Two tries: a pooled connection may have died with a server restart.
        for _ in range(2):
            conn = None
            try:
                conn = self._pool.get(addr)
                response, _ = conn.call(msg, timeout=timeout)
                return response
            except ServerError:
                raise
            except SbpError as exc:
                failure = exc
                if conn is not None:
                    self._pool.discard(conn)
        raise RequestTimeoutError(
            f"range server {server_id} at {addr} did not answer: {failure}") from failure

    def _seal_on_servers(self, rng: RangeMeta, timeout_s: float | None) -> int:
        """Seal ``rng`` on its primary, which must answer, then on its secondaries; the range
        ends at the smallest end the replicas that answered report.

        Every acknowledged record, and every record a reader may have seen, is on every
        replica, so that end keeps them all. Records past it reached some replicas only
        (their appends failed), so no reader saw them and their writers retry them.
        """
        request = m.SealRangesRequest(
            timeout_ms=int((timeout_s or self.config.range_server_timeout_s) * 1000),
            ranges=[m.RangeId(rng.stream_id, rng.range_index)])
        primary = rng.primary
        if primary is None:
            raise UnknownError(f"range {rng.range_index} of stream {rng.stream_id} "
                               "has no primary in the metadata")
        ends = {primary: self._seal_one(primary, request, rng, timeout_s)}
        for sid in rng.server_ids:
            if sid == primary:
                continue
            try:
                ends[sid] = self._seal_one(sid, request, rng, timeout_s)
            except SbpError as exc:
                log.warning("secondary %d of range %d of stream %d did not seal: %s", sid,
                            rng.range_index, rng.stream_id, exc)
        if len(set(ends.values())) > 1:
            log.info("range %d of stream %d: replicas stopped at %s; it ends at the smallest",
                     rng.range_index, rng.stream_id, ends)
        return min(ends.values())

    def _seal_one(self, server_id: int, request: m.SealRangesRequest, rng: RangeMeta,
                  timeout_s: float | None) -> int:
        response = self._call_server(server_id, request, timeout_s)
        response.status.raise_for_status()
        results = response.seal_responses
        if len(results) != 1 or results[0].range is None:
            if results:
                results[0].status.raise_for_status()
            raise UnknownError(f"range server {server_id} answered SEAL_RANGES for range "
                               f"{rng.range_index} of stream {rng.stream_id} without the range")
        results[0].status.raise_for_status()
        end = results[0].range.end_offset
        if end < rng.start_offset:
            raise UnknownError(f"range server {server_id} sealed range {rng.range_index} of "
                               f"stream {rng.stream_id} at {end}, below its start "
                               f"{rng.start_offset}")
        return end

    def _live_next_offset(self, rng: RangeMeta, timeout_s: float | None) -> int | None:
        """The open range's next_offset from its primary; None if the primary cannot say."""
        primary = rng.primary
        if primary is None:
            return None
        try:
            response = self._call_server(primary, m.DescribeRangesRequest(
                ranges=[m.RangeId(rng.stream_id, rng.range_index)]), timeout_s)
            response.status.raise_for_status()
            result = response.describe_responses[0]
            result.status.raise_for_status()
        except (SbpError, IndexError) as exc:
            log.warning("could not read the end of range %d of stream %d from server %d; "
                        "using the PD's snapshot: %s", rng.range_index, rng.stream_id, primary,
                        exc)
            return None
        if result.range is None:
            return None
        self.store.update_next_offset(rng.stream_id, rng.range_index, result.range.next_offset)
        return result.range.next_offset

    def _push_ranges(self, ranges: Iterable[RangeMeta], timeout_s: float | None = None,
                     skip: Iterable[int] = ()) -> None:
        """SYNC_RANGES ``ranges`` to the servers holding them; failures, and the servers in
        ``skip`` (known to be down), are owed a resync.

        Secondaries hear first: a primary that learned of a new range before its secondaries
        would forward its first appends to servers that do not hold the range yet, fail them
        and seal the range at once."""
        by_server: dict[int, list[RangeMeta]] = defaultdict(list)
        leaders: set[int] = set()  # primaries of open ranges: pushed last
        for rng in ranges:
            for sid in rng.server_ids:
                by_server[sid].append(rng)
            if rng.is_open and rng.primary is not None:
                leaders.add(rng.primary)
        for sid in set(skip) & by_server.keys():
            del by_server[sid]
            self._owe_resync(sid)
        for sid, held in sorted(by_server.items(), key=lambda item: item[0] in leaders):
            try:
                self._sync_to(sid, held, timeout_s)
            except SbpError as exc:
                log.warning("SYNC_RANGES to range server %d failed; it will be resynced on "
                            "its next heartbeat: %s", sid, exc)
                self._owe_resync(sid)

    def _sync_to(self, server_id: int, ranges: Sequence[RangeMeta],
                 timeout_s: float | None = None) -> None:
        """SYNC_RANGES ``ranges`` to one server. Raises when the server could not be reached
        or refused the whole request; a refused stream is logged (sending it again would be
        refused again)."""
        for start in range(0, len(ranges), SYNC_BATCH_RANGES):
            chunk = ranges[start:start + SYNC_BATCH_RANGES]
            by_stream: dict[int, list[m.Range]] = defaultdict(list)
            for rng in chunk:
                by_stream[rng.stream_id].append(self._range_msg(rng, for_servers=True))
            request = m.SyncRangesRequest(
                timeout_ms=int((timeout_s or self.config.range_server_timeout_s) * 1000),
                stream_ranges=[m.StreamRanges(sid, rs) for sid, rs in by_stream.items()])
            response = self._call_server(server_id, request, timeout_s)
            response.status.raise_for_status()
            for result in response.sync_responses:
                if not result.status.ok:
                    log.warning("range server %d refused the ranges of stream %d: %s",
                                server_id, result.stream_id, result.status.message)

    def _owe_resync(self, server_id: int) -> None:
        with self._resync_lock:
            self._resync.add(server_id)

    def _resync_server(self, server_id: int) -> None:
        """Push a server every range it holds (runs on the worker pool)."""
        with self._resync_lock:
            if server_id not in self._resync:
                return
            self._resync.discard(server_id)
        try:
            ranges = self.store.ranges_on_server(server_id)
            if ranges:
                self._sync_to(server_id, ranges)
            log.debug("range server %d synced with %d ranges", server_id, len(ranges))
        except SbpError as exc:
            log.warning("resync of range server %d failed (retried on its next heartbeat): %s",
                        server_id, exc)
            self._owe_resync(server_id)

    def _sweep_liveness(self) -> None:
        """Notice range servers that stopped heartbeating and fail their ranges over.

        Servers that were registered before this PD started but never heartbeated to it are
        treated as gone once one liveness timeout has passed since the start.
        """
        interval = max(0.05, self.config.heartbeat_timeout_s / 3)
        started = time.monotonic()
        checked_absent = False
        while not self._stop.wait(interval):
            for gone in self.liveness.expire():
                log.warning("range server %d (%s) missed heartbeats for %.1f s: not live",
                            gone.server_id, gone.advertise_addr, self.config.heartbeat_timeout_s)
                self._owe_failover(gone.server_id)
            if not checked_absent and \
                    time.monotonic() - started > self.config.heartbeat_timeout_s:
                checked_absent = True
                for server in self.store.list_servers():
                    if server.registered and not self.liveness.is_live(server.server_id):
                        log.warning("range server %d (%s) has not heartbeated since this PD "
                                    "started: not live", server.server_id,
                                    server.advertise_addr)
                        self._owe_failover(server.server_id)
            self.run_failovers()

    # -- failover ---------------------------------------------------------------------------

    def _owe_failover(self, server_id: int) -> None:
        with self._failover_lock:
            self._failover.add(server_id)

    def run_failovers(self) -> None:
        """Fail over the open ranges of every server owed a failover that is still not live.

        Runs on the liveness thread; a failover that could not finish (a surviving replica did
        not answer) is tried again on the next sweep.
        """
        with self._failover_lock:
            owed = sorted(self._failover)
        for server_id in owed:
            if self._stop.is_set():
                return
            done = True
            if not self.liveness.is_live(server_id):
                try:
                    done = self.fail_over_server(server_id)
                except SbpError as exc:
                    log.warning("failover of range server %d not finished (retried): %s",
                                server_id, exc)
                    done = False
            if done:
                with self._failover_lock:
                    self._failover.discard(server_id)

    def fail_over_server(self, server_id: int) -> bool:
        """Seal every open range that has a replica on the dead ``server_id`` and open its
        successor on live servers. True when nothing is left to do for this server.

        Where a range survives on other live replicas, those are sealed first (so a primary
        that is only cut off from the PD can no longer get appends acknowledged: its forwards
        are refused), and the range ends at the smallest end they report. Every acknowledged
        record is on every replica (the primary acknowledges only what all secondaries
        stored), so that end keeps all of them; records past it were never acknowledged.

        A range whose every replica is down is left open: for R = 1 the acknowledged records
        exist only on the dead server, and sealing it anywhere else would either lose them or
        let new records take their offsets. Its writers wait (retriable errors) until the
        server returns and carries on where it stopped.
        """
        finished = True
        for rng in self.store.ranges_on_server(server_id):
            if not rng.is_open:
                continue
            try:
                finished &= self._fail_over_range(rng.stream_id, rng.range_index, server_id)
            except ServerError as exc:
                if exc.code == ErrorCode.STREAM_NOT_FOUND:
                    continue  # deleted meanwhile
                raise
        return finished

    def _fail_over_range(self, stream_id: int, range_index: int, dead: int) -> bool:
        """One range of ``fail_over_server``: True when handled (or left for the server to
        return), False when it should be tried again."""
        with self._stream_lock(stream_id):
            rng = self.store.get_range(stream_id, range_index)
            if not rng.is_open or dead not in rng.server_ids or self.liveness.is_live(dead):
                return True
            survivors = [sid for sid in rng.server_ids
                         if sid != dead and self.liveness.is_live(sid)]
            if not survivors:
                log.warning("range %d of stream %d has no live replica (servers %s): it stays "
                            "open until one of them returns", range_index, stream_id,
                            rng.server_ids)
                return True
            request = m.SealRangesRequest(
                timeout_ms=int(self.config.range_server_timeout_s * 1000),
                ranges=[m.RangeId(stream_id, range_index)])
            ends = {sid: self._seal_one(sid, request, rng, None) for sid in survivors}
            end = min(ends.values())
            stream = self.store.get_stream(stream_id)
            with self._placement_lock:
                try:
                    servers = self._choose(stream.replica_nums)
                except ServerError as exc:
                    # Not enough live servers for a new range: seal anyway (no write could be
                    # acknowledged on this one); writers open the next range when they can.
                    log.warning("range %d of stream %d: no successor yet (%s)", range_index,
                                stream_id, exc.message)
                    servers = None
                sealed, new = self.store.seal_range(stream_id, range_index, end, servers)
        log.warning("failover: range %d of stream %d (server %d gone) sealed at %d from "
                    "replicas %s%s", range_index, stream_id, dead, end, ends,
                    "" if new is None else f"; range {new.range_index} open on "
                    f"{new.server_ids}")
        self._push_ranges([sealed] if new is None else [sealed, new], skip={dead})
        return True

class _PdHandler(RequestHandler):
    """Decodes PD requests, runs them against the ``PlacementDriver``, encodes the answers."""

    role = "placement driver"
    # Requests that call range servers run on the worker pool and never stall a reader.
    routes = {
        Opcode.HEARTBEAT: Route(m.HeartbeatRequest, "_heartbeat"),
        Opcode.ALLOCATE_ID: Route(m.AllocateIdRequest, "_allocate_id"),
        Opcode.LIST_RANGES: Route(m.ListRangesRequest, "_list_ranges"),
        Opcode.SEAL_RANGES: Route(m.SealRangesRequest, "_seal_ranges", Runs.POOL),
        Opcode.CREATE_RANGE: Route(m.CreateRangeRequest, "_create_range", Runs.POOL),
        Opcode.DESCRIBE_RANGES: Route(m.DescribeRangesRequest, "_describe_ranges"),
        Opcode.CREATE_STREAMS: Route(m.CreateStreamsRequest, "_create_streams", Runs.POOL),
        Opcode.DELETE_STREAMS: Route(m.DeleteStreamsRequest, "_delete_streams", Runs.POOL),
        Opcode.UPDATE_STREAMS: Route(m.UpdateStreamsRequest, "_update_streams"),
        Opcode.DESCRIBE_STREAMS: Route(m.DescribeStreamsRequest, "_describe_streams"),
        Opcode.TRIM_STREAMS: Route(m.TrimStreamsRequest, "_trim_streams", Runs.POOL),
        Opcode.REPORT_METRICS: Route(m.ReportMetricsRequest, "_report_metrics"),
        Opcode.DESCRIBE_PD_CLUSTER: Route(m.DescribePdClusterRequest, "_describe_pd_cluster"),
    }

    def __init__(self, pd: PlacementDriver) -> None:
        self.pd = pd

    def handle(self, ctx: RequestContext) -> None:
        request_cls, serve = self.route(ctx)
        try:
            request = request_cls.from_flatbuffers(ctx.header)
        except HeaderError as exc:
            raise InvalidRequestError(str(exc)) from None
        ctx.reply(serve(request))

    @staticmethod
    def _timeout_s(request: Any) -> float | None:
        ms = getattr(request, "timeout_ms", 0)
        return ms / 1000.0 if ms > 0 else None

    # -- one method per opcode --------------------------------------------------------------

    def _heartbeat(self, req: m.HeartbeatRequest) -> m.HeartbeatResponse:
        status = m.OK
        if req.client_role == m.ClientRole.RANGE_SERVER:
            if req.range_server is None:
                status = m.Status(int(InvalidRequestError.code),
                                  "a RANGE_SERVER heartbeat must carry range_server "
                                  "(client_role RANGE_SERVER = 0 is the default: an SDK "
                                  "client sends CLIENT = 1)")
            else:
                _, status = _ok_or_error(lambda: self.pd.heartbeat(
                    req.range_server.server_id, req.range_server.advertise_addr))
        return m.HeartbeatResponse(client_id=req.client_id, client_role=req.client_role,
                                   range_server=req.range_server, status=status)

    def _allocate_id(self, req: m.AllocateIdRequest) -> m.AllocateIdResponse:
        return m.AllocateIdResponse(id=self.pd.allocate_id(req.host))

    def _list_ranges(self, req: m.ListRangesRequest) -> m.ListRangesResponse:
        results = []
        for owner in req.range_owners:
            if owner.range_server is not None:
                found, status = _ok_or_error(lambda o=owner: self.pd.ranges_on_server(
                    o.range_server))
                server = owner.range_server
                ranges: list[RangeMeta] = []
                if found is not None:
                    sid, ranges = found
                    server = m.RangeServer(sid, self.pd._address_of(sid))
                results.append(m.ListRangesResult(
                    status=status, ranges=[self.pd._range_msg(r) for r in ranges],
                    range_server=server))
            else:
                ranges, status = _ok_or_error(lambda o=owner: self.pd.list_ranges(o.stream_id))
                results.append(m.ListRangesResult(
                    stream_id=owner.stream_id, status=status,
                    ranges=[self.pd._range_msg(r) for r in ranges or ()]))
        return m.ListRangesResponse(list_responses=results)

    def _range_items(self, ids: Sequence[m.RangeId],
                     op: Callable[[int, int], RangeMeta]) -> list[tuple[int, m.Status,
                                                                       m.Range | None]]:
        out = []
        for rid in ids:
            rng, status = _ok_or_error(lambda r=rid: op(r.stream_id, r.range_index))
            out.append((rid.stream_id, status, None if rng is None else self.pd._range_msg(rng)))
        return out

    def _seal_ranges(self, req: m.SealRangesRequest) -> m.SealRangesResponse:
        timeout = self._timeout_s(req)
        items = self._range_items(req.ranges,
                                  lambda s, i: self.pd.seal_range(s, i, timeout))
        return m.SealRangesResponse(seal_responses=[
            m.SealRangesResult(stream_id=s, status=st, range=r) for s, st, r in items])

    def _create_range(self, req: m.CreateRangeRequest) -> m.CreateRangeResponse:
        timeout = self._timeout_s(req)
        items = self._range_items(req.ranges,
                                  lambda s, i: self.pd.create_range(s, i, timeout))
        return m.CreateRangeResponse(create_responses=[
            m.CreateRangeResult(stream_id=s, status=st, range=r) for s, st, r in items])

    def _describe_ranges(self, req: m.DescribeRangesRequest) -> m.DescribeRangesResponse:
        # The PD's record, not the primary's live state: clients ask this when servers fail,
        # and must not wait for a dead primary here. So an open range's next_offset is a
        # snapshot, and the answer says so.
        items = self._range_items(req.ranges, self.pd.describe_range)
        return m.DescribeRangesResponse(describe_responses=[
            m.DescribeRangesResult(stream_id=s, status=st, range=r,
                                   next_offset_snapshot=r is not None and r.is_open)
            for s, st, r in items])

    def _create_streams(self, req: m.CreateStreamsRequest) -> m.CreateStreamsResponse:
        results = []
        for item in req.streams:
            created, status = _ok_or_error(lambda s=item: self.pd.create_stream(
                s.replica_nums, s.retention_period_ms, s.stream_id))
            stream = self.pd._stream_msg(created[0]) if created else m.Stream(
                stream_id=item.stream_id, replica_nums=item.replica_nums,
                retention_period_ms=item.retention_period_ms)
            results.append(m.CreateStreamsResult(stream=stream, status=status))
        return m.CreateStreamsResponse(create_responses=results)

    def _delete_streams(self, req: m.DeleteStreamsRequest) -> m.DeleteStreamsResponse:
        results = []
        for item in req.streams:
            deleted, status = _ok_or_error(lambda s=item: self.pd.delete_stream(s.stream_id))
            stream = self.pd._stream_msg(deleted) if deleted else m.Stream(
                stream_id=item.stream_id)
            results.append(m.DeleteStreamsResult(deleted_stream=stream, status=status))
        return m.DeleteStreamsResponse(delete_responses=results)

    def _update_streams(self, req: m.UpdateStreamsRequest) -> m.UpdateStreamsResponse:
        results = []
        for item in req.streams:
            updated, status = _ok_or_error(lambda s=item: self.pd.update_stream(
                s.stream_id, s.replica_nums, s.retention_period_ms))
            stream = self.pd._stream_msg(updated) if updated else m.Stream(
                stream_id=item.stream_id)
            results.append(m.UpdateStreamsResult(updated_stream=stream, status=status))
        return m.UpdateStreamsResponse(update_responses=results)

    def _describe_streams(self, req: m.DescribeStreamsRequest) -> m.DescribeStreamsResponse:
        if not req.stream_ids:
            # Ours: a request naming no stream asks for every stream that is not deleted
            # (`sbp streams list`); the seed leaves an empty list undefined.
            return m.DescribeStreamsResponse(describe_responses=[
                m.DescribeStreamsResult(stream=self.pd._stream_msg(s), status=m.OK)
                for s in self.pd.store.list_streams()])
        results = []
        for stream_id in req.stream_ids:
            found, status = _ok_or_error(lambda s=stream_id: self.pd.describe_stream(s))
            stream = self.pd._stream_msg(found) if found else m.Stream(stream_id=stream_id)
            results.append(m.DescribeStreamsResult(stream=stream, status=status))
        return m.DescribeStreamsResponse(describe_responses=results)

    def _trim_streams(self, req: m.TrimStreamsRequest) -> m.TrimStreamsResponse:
        timeout = self._timeout_s(req)
        results = []
        for item in req.trimmed_streams:
            done, status = _ok_or_error(lambda t=item: self.pd.trim_stream(
                t.stream_id, t.trim_offset, timeout))
            if done:
                stream, first = done
                results.append(m.TrimStreamsResult(trimmed_stream=self.pd._stream_msg(stream),
                                                   status=status,
                                                   range=self.pd._range_msg(first)))
            else:
                results.append(m.TrimStreamsResult(
                    trimmed_stream=m.Stream(stream_id=item.stream_id), status=status))
        return m.TrimStreamsResponse(streams=results)

    def _report_metrics(self, req: m.ReportMetricsRequest) -> m.ReportMetricsResponse:
        metrics = {name: int(getattr(req, name)) for name in METRIC_FIELDS}
        _, status = _ok_or_error(lambda: self.pd.report_metrics(
            req.range_server.server_id, metrics))
        return m.ReportMetricsResponse(range_server=req.range_server, status=status)

    def _describe_pd_cluster(self, req: m.DescribePdClusterRequest
                             ) -> m.DescribePdClusterResponse:
        states = []
        for info in self.pd.range_servers():
            metrics = None
            if info.metrics_ms >= 0:
                known = {k: v for k, v in info.metrics.items() if k in METRIC_FIELDS}
                metrics = m.ReportMetricsRequest(
                    range_server=m.RangeServer(info.server_id, info.advertise_addr), **known)
            states.append(m.RangeServerState(
                server=m.RangeServer(info.server_id, info.advertise_addr), live=info.live,
                last_heartbeat_ms=info.last_heartbeat_ms, open_ranges=info.open_ranges,
                metrics=metrics, metrics_ms=info.metrics_ms))
        return m.DescribePdClusterResponse(cluster=self.pd.cluster(), range_servers=states)
