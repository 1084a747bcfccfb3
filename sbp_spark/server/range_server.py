"""The range server: stores the ranges it is given and serves APPEND and FETCH for them.

It learns its ranges from the PD (SYNC_RANGES, or directly in tests), keeps them in a
:class:`~sbp_spark.server.storage.Storage`, and answers:

* APPEND to ranges it is the primary of (open ranges only); each entry by its request_index,
  acknowledged once the fsync policy is met and every secondary stored it (``replication.py``);
  on a secondary, the batches its primary forwards;
* FETCH (long poll, then streamed whole batches, see ``fetch.py``);
* SEAL_RANGES (seal only: the sealed range, end_offset = its next_offset), SYNC_RANGES,
  DESCRIBE_RANGES (live next_offset), DELETE_STREAMS (no more writes), TRIM_STREAMS (drop local
  data below an offset), HEARTBEAT; PING and GOAWAY are answered by the network core.

Run standalone (``RangeServer(RangeServerConfig(data_dir, server_id=1)).start()``), or with
``pd_addresses`` set: then ``registration.PdLink`` obtains a server id from the PD, heartbeats
with the advertised address, reports metrics and reports retention trims.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..protocol.constants import MAX_FRAME_LENGTH, Opcode
from ..protocol.errors import (
    BatchFormatError,
    ErrorCode,
    HeaderError,
    InvalidRequestError,
    NotPrimaryError,
    PayloadTooLargeError,
    RangeNotFoundError,
    RangeSealedError,
    ReplicationFailedError,
    ServerError,
    StreamNotFoundError,
)
from ..protocol.messages import (
    AppendRequest,
    AppendResponse,
    AppendResult,
    DeleteStreamsRequest,
    DeleteStreamsResponse,
    DeleteStreamsResult,
    DescribeRangesRequest,
    DescribeRangesResponse,
    DescribeRangesResult,
    FetchRequest,
    HeartbeatRequest,
    HeartbeatResponse,
    Range,
    RangeReplica,
    SealRangesRequest,
    SealRangesResponse,
    SealRangesResult,
    Status,
    Stream,
    SyncRangesRequest,
    SyncRangesResponse,
    SyncRangesResult,
    TrimStreamsRequest,
    TrimStreamsResponse,
    TrimStreamsResult,
)
from ..protocol.messages import RangeServer as RangeServerInfo
from ..protocol.records import BatchHeader, parse_header
from .fetch import DEFAULT_FETCH_FRAME_BYTES, FetchServer
from .net import FrameServer, NetConfig, RequestContext, RequestHandler, Route, Runs
from .range_log import RangeLog, Replica
from .read_cap import CapState
from .replication import Replicator
from .segment import atomic_write
from .storage import Storage, StorageConfig

log = logging.getLogger(__name__)

# Largest record batch accepted: it must fit, with a FETCH response header, in one frame, since
# batches are never split across frames.
MAX_BATCH_BYTES = MAX_FRAME_LENGTH - 16 - 4096
# A range quiet this long after an append settled sends its secondaries a cap notice: shorter
# than a reader would notice, longer than a writer's gap between one append and the next.
CAP_NOTICE_DELAY_S = 0.02
# How often retention is applied to the stored ranges.
DEFAULT_RETENTION_CHECK_S = 30.0
_SERVER_FILE = "server.json"


@dataclass
class RangeServerConfig:
    """Everything a range server needs to run."""

    data_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    # host:port that clients should use; defaults to the bound address.
    advertise_addr: str | None = None
    # Fixed server id (tests, standalone use). -1: the id stored in data_dir, else one
    # allocated by the PD (needs pd_addresses).
    server_id: int = -1
    pd_addresses: Sequence[str] = ()
    storage: StorageConfig = field(default_factory=StorageConfig)
    net: NetConfig = field(default_factory=lambda: NetConfig(name="range-server"))
    fetch_frame_bytes: int = DEFAULT_FETCH_FRAME_BYTES
    max_batch_bytes: int = MAX_BATCH_BYTES
    heartbeat_interval_s: float = 1.0
    metrics_interval_s: float = 5.0
    retention_check_interval_s: float = DEFAULT_RETENTION_CHECK_S
    # After a restart: how often to ask unreachable secondaries again for their stored ends
    # (the cap probe, see replication.py).
    cap_probe_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.max_batch_bytes <= MAX_BATCH_BYTES:
            raise ValueError(
                f"max_batch_bytes={self.max_batch_bytes} must be in [1, {MAX_BATCH_BYTES}]")
        if not 4096 <= self.fetch_frame_bytes <= MAX_BATCH_BYTES:
            raise ValueError(
                f"fetch_frame_bytes={self.fetch_frame_bytes} must be in "
                f"[4096, {MAX_BATCH_BYTES}]")
        for name in ("heartbeat_interval_s", "metrics_interval_s",
                     "retention_check_interval_s", "cap_probe_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.server_id < -1:
            raise ValueError(f"server_id={self.server_id} must be >= 0, or -1 for automatic")


class DelayedCalls:
    """Calls ``fn(value)`` once per key, ``delay_s`` after the last ``schedule`` of that key,
    from one background thread (started on first use)."""

    def __init__(self, delay_s: float, fn: Callable[[object], None], name: str) -> None:
        self.delay_s = delay_s
        self._fn = fn
        self._name = name
        self._due: dict[object, tuple[float, object]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def schedule(self, key: object, value: object) -> None:
        with self._cond:
            if self._closed:
                return
            self._due[key] = (time.monotonic() + self.delay_s, value)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._due:
                    self._cond.wait()
                if self._closed:
                    return
                now = time.monotonic()
                ready = [k for k, (when, _) in self._due.items() if when <= now]
                if not ready:
                    self._cond.wait(min(when for when, _ in self._due.values()) - now)
                    continue
                values = [self._due.pop(k)[1] for k in ready]
            for value in values:
                try:
                    self._fn(value)
                except Exception:
                    log.exception("%s: a delayed call failed", self._name)


class Metrics:
    """Counters behind REPORT_METRICS (rates are computed by whoever samples them)."""

    def __init__(self) -> None:
        self.appends = 0
        self.failed_appends = 0
        self.append_latency_s = 0.0
        self.fetches = 0
        self.failed_fetches = 0
        self.fetch_latency_s = 0.0
        self.active: dict[tuple[int, int], float] = {}  # range -> last use (monotonic)

    def touch(self, rlog: RangeLog) -> None:
        self.active[(rlog.stream_id, rlog.range_index)] = time.monotonic()

    def active_ranges(self, window_s: float = 60.0) -> int:
        cutoff = time.monotonic() - window_s
        return sum(1 for t in list(self.active.values()) if t >= cutoff)


def range_view(rlog: RangeLog, stopped: bool = False) -> Range:
    """The wire form of a local range; next_offset is how far readers may see here.

    A range sealed here whose end the PD has not recorded yet (fenced, see read_cap.py) is
    shown open: its end is not final, and the PD may end it lower. ``stopped`` (the answer to
    SEAL_RANGES) shows it with end_offset = where this replica stopped taking appends, which
    is what the PD needs to choose the end.
    """
    end = rlog.end_offset
    if not stopped and rlog.cap.state is CapState.FENCED:
        end = -1
    return Range(
        stream_id=rlog.stream_id,
        range_index=rlog.range_index,
        start_offset=rlog.start_offset,
        next_offset=rlog.readable_offset,
        end_offset=end,
        servers=[RangeReplica(RangeServerInfo(r.server_id, r.advertise_addr), r.is_primary)
                 for r in rlog.replicas],
    )


def _status(exc: ServerError) -> Status:
    return Status(int(exc.code), exc.message, bytes(exc.detail))


def _limit(rlog: RangeLog) -> int:
    return rlog.end_offset if rlog.sealed else rlog.next_offset


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class RangeServer:
    """A range server process: storage, the TCP front end and background duties."""

    def __init__(self, config: RangeServerConfig) -> None:
        self.config = config
        os.makedirs(config.data_dir, exist_ok=True)
        self.storage = Storage(os.path.join(config.data_dir, "data"), config.storage)
        self.metrics = Metrics()
        self.fetcher = FetchServer(self.storage, config.fetch_frame_bytes,
                                   config.storage.verify_reads)
        self.handler = RangeServerHandler(self)
        self.replicator = Replicator(lambda: self._server_id, tls=config.net.tls)
        net = config.net
        net.host, net.port = config.host, config.port
        self.net = FrameServer(self.handler, net)
        self._server_id = self._initial_server_id()
        # stream_id -> retention_period_ms, learned from the PD (or set by tests).
        self.retention: dict[int, int] = {}
        # Called with (stream_id, new_start_offset) when retention deleted data; the PD link
        # forwards it to the PD as TRIM_STREAMS.
        self.on_trim: Callable[[int, int], None] | None = None
        self._stop = threading.Event()
        self._maintenance: threading.Thread | None = None
        self._cap_prober: threading.Thread | None = None
        self._notices = DelayedCalls(CAP_NOTICE_DELAY_S,
                                     lambda rlog: self.net.submit(self.send_cap_notice, rlog),
                                     name="range-server-cap-notices")
        self.pd_link = None
        self._started = False

    # -- identity --------------------------------------------------------------------------

    def _initial_server_id(self) -> int:
        path = os.path.join(self.config.data_dir, _SERVER_FILE)
        stored = -1
        try:
            with open(path, "rb") as f:
                stored = int(json.loads(f.read())["server_id"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"{path} is unreadable: {exc}") from exc
        wanted = self.config.server_id
        if wanted >= 0:
            if stored >= 0 and stored != wanted:
                log.warning("data dir %s belonged to server %d; now server %d",
                            self.config.data_dir, stored, wanted)
            if stored != wanted:
                self.set_server_id(wanted)
            return wanted
        return stored

    @property
    def server_id(self) -> int:
        """This server's id (-1 until the PD allocated one)."""
        return self._server_id

    def set_server_id(self, server_id: int) -> None:
        """Adopt ``server_id`` and keep it on disk for restarts."""
        atomic_write(os.path.join(self.config.data_dir, _SERVER_FILE),
                     json.dumps({"server_id": server_id}).encode())
        self._server_id = server_id

    @property
    def address(self) -> tuple[str, int]:
        return self.net.address

    @property
    def advertise_addr(self) -> str:
        return self.config.advertise_addr or self.net.address_str

    def info(self) -> RangeServerInfo:
        return RangeServerInfo(self._server_id, self.advertise_addr)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> RangeServer:
        """Listen, and start the background duties (and the PD link when configured)."""
        if self._started:
            raise RuntimeError("range server already started")
        self._started = True
        self.net.start()
        self._maintenance = threading.Thread(target=self._maintenance_loop,
                                             name="range-server-maintenance", daemon=True)
        self._maintenance.start()
        self._cap_prober = threading.Thread(target=self._cap_probe_loop,
                                            name="range-server-cap-probe", daemon=True)
        self._cap_prober.start()
        if self.config.pd_addresses:
            from .registration import PdLink

            self.pd_link = PdLink(self, list(self.config.pd_addresses),
                                  tls=self.config.net.tls)
            self.pd_link.start()
        log.info("range server %d serving on %s (data in %s, fsync %s)", self._server_id,
                 self.advertise_addr, self.config.data_dir, self.config.storage.fsync.value)
        return self

    def stop(self) -> None:
        """Graceful stop: GOAWAY to clients, finish in-flight requests, sync and close."""
        self._stop.set()
        if self.pd_link is not None:
            self.pd_link.stop()
        self._notices.close()
        self.net.stop()
        self.replicator.close()
        if self._maintenance is not None:
            self._maintenance.join(5)
        if self._cap_prober is not None:
            self._cap_prober.join(5)
        self.storage.close()

    def __enter__(self) -> RangeServer:
        return self if self._started else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- local roles -----------------------------------------------------------------------

    def is_replica(self, rlog: RangeLog) -> bool:
        """Whether this server holds a copy of ``rlog`` (primary or secondary)."""
        return any(r.server_id == self._server_id for r in rlog.replicas)

    def is_primary(self, rlog: RangeLog) -> bool:
        """Whether appends for ``rlog`` belong here (a range with no replica list is local)."""
        if not rlog.replicas:
            return True
        return any(r.is_primary and r.server_id == self._server_id for r in rlog.replicas)

    def apply_retention(self, now_ms: int | None = None) -> list[tuple[int, int]]:
        """Delete expired segments; returns (stream_id, new start) for each stream that moved."""
        moved: dict[int, int] = {}
        for rlog in self.storage.ranges():
            retention = self.retention.get(rlog.stream_id, -1)
            if retention < 0:
                continue
            new_start = rlog.expire(retention, now_ms)
            if new_start is not None:
                moved[rlog.stream_id] = max(moved.get(rlog.stream_id, 0), new_start)
        for sid, start in moved.items():
            log.info("retention trimmed stream %d to offset %d", sid, start)
            if self.on_trim is not None:
                try:
                    self.on_trim(sid, start)
                except Exception:
                    log.exception("reporting the trim of stream %d failed", sid)
        return sorted(moved.items())

    # -- read caps of open replicated ranges (see replication.py) ---------------------------

    def settled(self, rlog: RangeLog, end: int) -> None:
        """An append of ``rlog`` up to ``end`` is on every secondary: once it is durable here
        too, and the range stayed quiet for ``CAP_NOTICE_DELAY_S`` (a writer sending one
        append after another would make the next forward carry the cap anyway), tell the
        secondaries the new cap."""
        def durable(exc: BaseException | None) -> None:
            if exc is None:
                self._notices.schedule((rlog.stream_id, rlog.range_index), rlog)

        self.storage.when_durable(rlog, end, durable)

    def send_cap_notice(self, rlog: RangeLog) -> None:
        """Send the secondaries of ``rlog`` its cap if nothing is pending and they do not
        have it yet. Best effort: the next forward carries the cap anyway."""
        committed = rlog.cap.notice_due(rlog.next_offset)
        if committed is None:
            return
        for answer in self.replicator.notify(rlog, committed):
            if answer.problem is not None:
                log.debug("range %d/%d: cap notice (%d) to secondary %d not taken: %s",
                          rlog.stream_id, rlog.range_index, committed,
                          answer.replica.server_id, answer.problem)

    def _probe_due(self, rlog: RangeLog) -> bool:
        # A primary's open replicated range whose readers miss records durable here, with no
        # append under way (one that settles raises the cap by itself).
        cap = rlog.cap
        return (cap.state is CapState.CAPPED and not rlog.deleted
                and rlog.readable_offset < rlog.next_offset and self.is_primary(rlog)
                and bool(self.replicator.secondaries(rlog)) and not cap.pending)

    def probe_read_cap(self, rlog: RangeLog) -> bool:
        """Ask every secondary of ``rlog`` how far it stored the range, and let readers see
        what every replica holds. False when a secondary did not answer (try again later)."""
        durable = rlog.next_offset
        ends = [durable]
        for answer in self.replicator.notify(rlog, -1):
            if answer.problem is not None or answer.stored_end is None:
                log.info("range %d/%d: secondary %d did not say how far it stored the range "
                         "(%s); its readers stay at offset %s for now", rlog.stream_id,
                         rlog.range_index, answer.replica.server_id, answer.problem,
                         rlog.read_cap)
                return False
            ends.append(answer.stored_end)
        if rlog.cap.settle(min(ends)):
            log.info("range %d/%d: every replica holds it up to %d; readers see that far",
                     rlog.stream_id, rlog.range_index, rlog.read_cap)
        self.send_cap_notice(rlog)
        return True

    def _cap_probe_loop(self) -> None:
        # Once the id is known, probe every range that needs it; retry the ones whose
        # secondaries did not answer until none is left.
        done: set[tuple[int, int]] = set()
        while not self._stop.is_set():
            wait = 0.2
            if self._server_id >= 0:
                left = 0
                for rlog in self.storage.ranges():
                    key = (rlog.stream_id, rlog.range_index)
                    if key in done or not self._probe_due(rlog):
                        continue
                    try:
                        ok = self.probe_read_cap(rlog)
                    except Exception:
                        log.exception("cap probe of range %s failed", rlog)
                        ok = False
                    if ok:
                        done.add(key)
                    else:
                        left += 1
                if not left:
                    return
                wait = self.config.cap_probe_interval_s
            self._stop.wait(wait)

    def _maintenance_loop(self) -> None:
        while not self._stop.wait(self.config.retention_check_interval_s):
            try:
                self.apply_retention()
            except Exception:
                log.exception("retention pass failed")


class RangeServerHandler(RequestHandler):
    """Request handlers of the range server."""

    role = "range server"
    # FETCH long-polls and streams; SEAL, SYNC, DELETE and TRIM fsync metadata or data. The
    # rest run in arrival order on the connection's handler thread: the reader receives and
    # checksums the next APPEND frame while the previous one is stored and answered.
    routes = {
        Opcode.APPEND: Route(AppendRequest, "_append", Runs.ORDERED),
        Opcode.FETCH: Route(FetchRequest, "_fetch", Runs.POOL),
        Opcode.SEAL_RANGES: Route(SealRangesRequest, "_seal", Runs.POOL),
        Opcode.SYNC_RANGES: Route(SyncRangesRequest, "_sync", Runs.POOL),
        Opcode.DESCRIBE_RANGES: Route(DescribeRangesRequest, "_describe", Runs.ORDERED),
        Opcode.DELETE_STREAMS: Route(DeleteStreamsRequest, "_delete", Runs.POOL),
        Opcode.TRIM_STREAMS: Route(TrimStreamsRequest, "_trim", Runs.POOL),
        Opcode.HEARTBEAT: Route(HeartbeatRequest, "_heartbeat", Runs.ORDERED),
    }

    def __init__(self, server: RangeServer) -> None:
        self.server = server
        self.storage = server.storage

    def handle(self, ctx: RequestContext) -> None:
        request_cls, serve = self.route(ctx)
        try:
            req = request_cls.from_flatbuffers(ctx.header)
        except HeaderError as exc:
            raise InvalidRequestError(str(exc)) from exc
        serve(ctx, req)

    def server_stopping(self) -> None:
        self.storage.notify_data()  # long polls notice the stop and answer at once

    # -- APPEND ----------------------------------------------------------------------------

    def _open_range_for(self, stream_id: int, header: BatchHeader) -> tuple[RangeLog, bool]:
        """The open range an entry goes to, and whether it is a replicated write (a batch
        from the range's primary, which already carries its base offset)."""
        ranges = self.storage.stream_ranges(stream_id)
        if not ranges:
            raise RangeNotFoundError(f"stream {stream_id} has no range on this server")
        last = ranges[-1]
        if last.deleted:
            raise StreamNotFoundError(f"stream {stream_id} was deleted")
        if last.sealed:
            raise RangeSealedError(
                f"range {stream_id}/{last.range_index} is sealed at {last.end_offset}")
        if self.server.is_primary(last):
            return last, False
        if header.base_offset >= 0 and self.server.is_replica(last):
            return last, True
        primary = next((r for r in last.replicas if r.is_primary), None)
        where = f" (primary: {primary.advertise_addr})" if primary else ""
        raise NotPrimaryError(
            f"server {self.server.server_id} is not the primary of range "
            f"{stream_id}/{last.range_index}{where}")

    def _append(self, ctx: RequestContext, req: AppendRequest) -> None:
        started = time.monotonic()
        metrics = self.server.metrics
        entries = req.append_requests
        payload = memoryview(ctx.payload)
        if (entries and payload.nbytes == 0 and req.committed_offset >= -1
                and all(e.batch_length == 0 for e in entries)):
            self._cap_notice(ctx, req)
            return
        n = len(entries)
        metrics.appends += n
        total = sum(e.batch_length for e in entries)
        problem = None
        if any(e.batch_length < 0 for e in entries) or total != payload.nbytes:
            problem = (f"the entries' batch_length values add up to {total} bytes but the "
                       f"payload holds {payload.nbytes}")
        elif req.committed_offset < -1:
            problem = (f"committed_offset {req.committed_offset} must be >= 0, or -1 when not "
                       f"set")
        if problem is not None:
            status = Status(ErrorCode.INVALID_REQUEST, problem)
            metrics.failed_appends += n
            ctx.reply(AppendResponse(status=status, append_responses=[
                AppendResult(e.stream_id, e.request_index, -1, 0, status) for e in entries]))
            return
        now = _now_ms()
        results: list[AppendResult | None] = [None] * n
        # (range, replicated) -> (indexes of its entries, their batches), in arrival order
        groups: dict[tuple[int, bool], tuple[RangeLog, bool, list[int], list]] = {}
        pos = 0
        for i, e in enumerate(entries):
            view = payload[pos:pos + e.batch_length]
            pos += e.batch_length
            try:
                header = self._check_batch(e.stream_id, e.batch_length, view)
                rlog, replicated = self._open_range_for(e.stream_id, header)
            except ServerError as exc:
                results[i] = AppendResult(e.stream_id, e.request_index, -1, 0, _status(exc))
                continue
            group = groups.setdefault((id(rlog), replicated), (rlog, replicated, [], []))
            group[2].append(i)
            group[3].append((header, view))
        # Each pending part ends in done(indexes, error): local durability, replication.
        parts: list[tuple[str, RangeLog, object, list[int]]] = []
        replicator = self.server.replicator
        # A forward from a primary says how far every replica holds its (one) range: once its
        # batches are stored here, readers of this secondary may see that far.
        committed = req.committed_offset
        if committed >= 0 and sum(1 for g in groups.values() if g[1]) != 1:
            committed = -1  # not one range: the offset names none of them
        # A frame of one batch: its payload checksum, checked on arrival, is the batch's.
        crcs = [ctx.frame.payload_crc] if n == 1 else None
        for rlog, replicated, indexes, batches in groups.values():
            forwards = None
            try:
                if replicated or not replicator.secondaries(rlog):
                    bases, target = rlog.append(batches, now, replicated=replicated,
                                                crcs=crcs)
                    if replicated and committed >= 0:
                        rlog.cap.learn(committed, rlog.written_offset)
                else:
                    stored: list = []
                    with replicator.order_lock(rlog):
                        # Readers wait for the secondaries (see replication.py).
                        start = rlog.written_offset
                        rlog.cap.hold(start)
                        try:
                            bases, target = rlog.append(batches, now, stored=stored,
                                                        crcs=crcs)
                        except BaseException:
                            rlog.cap.release(start, None)
                            raise
                        forwards = replicator.send(rlog, stored, req.timeout_ms)
            except ServerError as exc:
                for i in indexes:
                    e = entries[i]
                    results[i] = AppendResult(e.stream_id, e.request_index, -1, 0, _status(exc))
                continue
            metrics.touch(rlog)
            for i, base in zip(indexes, bases, strict=True):
                e = entries[i]
                results[i] = AppendResult(e.stream_id, e.request_index, base, now)
            if rlog.next_offset < target:
                parts.append(("durable", rlog, target, indexes))
            if forwards:
                parts.append(("replicated", rlog, (forwards, start, target), indexes))
        if not parts:
            self._finish_append(ctx, results, started)
            return
        # Answer once every part is done. Durability is signalled by the fsync thread and
        # replication is awaited on the worker pool; the answer always leaves from the pool.
        ctx.defer()
        lock = threading.Lock()
        left = [len(parts)]

        def done(indexes: list[int], exc: BaseException | None) -> None:
            if exc is not None:
                status = (_status(exc) if isinstance(exc, ServerError)
                          else Status(ErrorCode.STORAGE_FULL, str(exc)))
                for i in indexes:
                    r = results[i]
                    results[i] = AppendResult(r.stream_id, r.request_index, -1, 0, status)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.server.net.submit(self._finish_append, ctx, results, started)

        for kind, rlog, what, indexes in parts:
            if kind == "durable":
                self.storage.when_durable(rlog, what, lambda exc, idx=indexes: done(idx, exc))
            else:
                self.server.net.submit(self._await_replicas, rlog, what, indexes, done)

    def _cap_notice(self, ctx: RequestContext, req: AppendRequest) -> None:
        """A cap notice from a range's primary (see replication.py): raise the read cap to
        ``committed_offset`` (when set, and the entries name one stream) and answer each entry
        with the stored end of the stream's open range here."""
        entries = req.append_requests
        committed = req.committed_offset
        if len({e.stream_id for e in entries}) != 1:
            committed = -1  # one offset cannot name the ends of several ranges
        now = _now_ms()
        results = []
        for e in entries:
            try:
                rlog = self._noticed_range(e.stream_id)
            except ServerError as exc:
                results.append(AppendResult(e.stream_id, e.request_index, -1, 0, _status(exc)))
                continue
            if committed >= 0:
                rlog.cap.learn(committed, rlog.written_offset)
            results.append(AppendResult(e.stream_id, e.request_index, rlog.written_offset, now))
        ctx.reply(AppendResponse(append_responses=results))

    def _noticed_range(self, stream_id: int) -> RangeLog:
        """The open range a cap notice entry for ``stream_id`` names; INVALID_REQUEST saying
        why when this server is not a secondary of one."""
        me = self.server.server_id
        ranges = self.storage.stream_ranges(stream_id) if stream_id >= 0 else []
        last = ranges[-1] if ranges else None
        if stream_id < 0:
            why = f"stream_id {stream_id} must be >= 0"
        elif last is None:
            why = f"server {me} holds no range of stream {stream_id}"
        elif last.deleted:
            why = f"stream {stream_id} was deleted"
        elif last.sealed:
            why = (f"range {stream_id}/{last.range_index} is sealed at {last.end_offset} "
                   f"(a sealed range has no read cap)")
        elif self.server.is_primary(last):
            why = (f"server {me} is the primary of range {stream_id}/{last.range_index}, "
                   f"and only a secondary takes notices")
        elif not self.server.is_replica(last):
            why = f"server {me} holds no replica of range {stream_id}/{last.range_index}"
        else:
            return last
        raise InvalidRequestError(
            f"stream {stream_id}: a 0-byte entry holds no record batch; with an empty payload "
            f"it is a read cap notice from a range's primary to its secondaries, but {why}")

    def _await_replicas(self, rlog: RangeLog, shipment, indexes: list[int], done) -> None:
        forwards, start, end = shipment
        replicator = self.server.replicator
        problem = replicator.wait(forwards)
        if problem is None:
            rlog.cap.release(start, end)
            self.server.settled(rlog, end)
            done(indexes, None)
            return
        log.warning("range %d/%d: replication failed (%s); sealing it so writers move on",
                    rlog.stream_id, rlog.range_index, problem)
        try:
            rlog.seal()
        except (OSError, ServerError) as exc:
            log.error("sealing range %d/%d after a replication failure failed: %s",
                      rlog.stream_id, rlog.range_index, exc)
        rlog.cap.release(start, None)
        done(indexes, ReplicationFailedError(f"not stored on every replica: {problem}"))

    def _finish_append(self, ctx: RequestContext, results: list, started: float) -> None:
        metrics = self.server.metrics
        metrics.failed_appends += sum(1 for r in results if r.status.code)
        metrics.append_latency_s += time.monotonic() - started
        ctx.reply(AppendResponse(append_responses=results))

    def _check_batch(self, stream_id: int, batch_length: int, view: memoryview):
        if stream_id < 0:
            raise InvalidRequestError(f"stream_id {stream_id} must be >= 0")
        limit = self.server.config.max_batch_bytes
        if batch_length > limit:
            raise PayloadTooLargeError(
                f"batch of {batch_length} bytes for stream {stream_id} exceeds the "
                f"{limit}-byte batch limit")
        try:
            header = parse_header(view)
        except BatchFormatError as exc:
            raise InvalidRequestError(f"stream {stream_id}: {exc}") from exc
        if header.batch_length != batch_length:
            raise InvalidRequestError(
                f"stream {stream_id}: entry batch_length {batch_length} but the batch "
                f"envelope says {header.batch_length} bytes")
        return header

    # -- FETCH -----------------------------------------------------------------------------

    def _fetch(self, ctx: RequestContext, req: FetchRequest) -> None:
        metrics = self.server.metrics
        started = time.monotonic()
        metrics.fetches += 1
        try:
            self.server.fetcher.serve(ctx, req)
        except BaseException:
            metrics.failed_fetches += 1
            raise
        finally:
            metrics.fetch_latency_s += time.monotonic() - started
        for fe in req.fetch_requests:
            rlog = self.storage.find_range(fe.stream_id, fe.fetch_offset)
            if rlog is not None:
                metrics.touch(rlog)

    # -- range administration --------------------------------------------------------------

    def _seal(self, ctx: RequestContext, req: SealRangesRequest) -> None:
        out = []
        for rid in req.ranges:
            try:
                rlog = self._local_range(rid.stream_id, rid.range_index)
                rlog.seal()
                log.info("range %d/%d sealed here at %d (durable to %d, readers see up to %d, "
                         "read cap %s)", rid.stream_id, rid.range_index, rlog.end_offset,
                         rlog.next_offset, rlog.readable_offset, rlog.cap.state.value)
                out.append(SealRangesResult(rid.stream_id,
                                            range=range_view(rlog, stopped=True)))
            except ServerError as exc:
                out.append(SealRangesResult(rid.stream_id, _status(exc)))
        ctx.reply(SealRangesResponse(seal_responses=out))

    def _describe(self, ctx: RequestContext, req: DescribeRangesRequest) -> None:
        out = []
        for rid in req.ranges:
            try:
                if rid.range_index == -1:  # the stream's newest range here
                    ranges = self.storage.stream_ranges(rid.stream_id)
                    if not ranges:
                        raise RangeNotFoundError(
                            f"stream {rid.stream_id} has no range on this server")
                    rlog = ranges[-1]
                else:
                    rlog = self._local_range(rid.stream_id, rid.range_index)
                out.append(DescribeRangesResult(rid.stream_id, range=range_view(rlog)))
            except ServerError as exc:
                out.append(DescribeRangesResult(rid.stream_id, _status(exc)))
        ctx.reply(DescribeRangesResponse(describe_responses=out))

    def _local_range(self, stream_id: int, range_index: int) -> RangeLog:
        if stream_id < 0 or range_index < 0:
            raise InvalidRequestError(
                f"range {stream_id}/{range_index}: stream_id and range_index must be >= 0")
        rlog = self.storage.get_range(stream_id, range_index)
        if rlog is None:
            raise RangeNotFoundError(
                f"range {stream_id}/{range_index} is not on server {self.server.server_id}")
        return rlog

    def _sync(self, ctx: RequestContext, req: SyncRangesRequest) -> None:
        out = []
        for sr in req.stream_ranges:
            try:
                ranges = [self._adopt_range(sr.stream_id, r) for r in sr.ranges]
                out.append(SyncRangesResult(sr.stream_id, ranges=[
                    range_view(r) for r in ranges if r is not None]))
            except ServerError as exc:
                out.append(SyncRangesResult(sr.stream_id, _status(exc)))
        ctx.reply(SyncRangesResponse(sync_responses=out))

    def _adopt_range(self, stream_id: int, r: Range) -> RangeLog | None:
        """Create or update the local copy of ``r``; None when this server holds no replica."""
        sid = r.stream_id if r.stream_id != -1 else stream_id
        if sid != stream_id:
            raise InvalidRequestError(
                f"range {r.stream_id}/{r.range_index} listed under stream {stream_id}")
        if sid < 0 or r.range_index < 0 or r.start_offset < 0:
            raise InvalidRequestError(
                f"range {sid}/{r.range_index} starting at {r.start_offset}: ids and offsets "
                f"must be >= 0")
        if r.end_offset < -1 or (r.end_offset >= 0 and r.end_offset < r.start_offset):
            raise InvalidRequestError(
                f"range {sid}/{r.range_index}: end_offset {r.end_offset} is invalid for start "
                f"{r.start_offset}")
        replicas = [Replica(rep.server.server_id, rep.server.advertise_addr, rep.is_primary)
                    for rep in r.servers]
        mine = self.server.server_id
        if replicas and not any(rep.server_id == mine for rep in replicas):
            return None
        if sum(1 for rep in replicas if rep.is_primary) > 1:
            raise InvalidRequestError(f"range {sid}/{r.range_index} names several primaries")
        existing = self.storage.get_range(sid, r.range_index)
        if existing is not None and existing.deleted:
            raise StreamNotFoundError(f"stream {sid} was deleted")
        return self.storage.create_range(sid, r.range_index, r.start_offset, r.end_offset,
                                         replicas)

    def _delete(self, ctx: RequestContext, req: DeleteStreamsRequest) -> None:
        out = []
        for s in req.streams:
            if s.stream_id < 0:
                out.append(DeleteStreamsResult(status=Status(
                    ErrorCode.INVALID_REQUEST, f"stream_id {s.stream_id} must be >= 0")))
            elif self.storage.delete_stream(s.stream_id):
                out.append(DeleteStreamsResult(Stream(stream_id=s.stream_id, deleted=True)))
            else:
                out.append(DeleteStreamsResult(status=Status(
                    ErrorCode.STREAM_NOT_FOUND,
                    f"stream {s.stream_id} has no range on this server")))
        ctx.reply(DeleteStreamsResponse(delete_responses=out))

    def _trim(self, ctx: RequestContext, req: TrimStreamsRequest) -> None:
        out = []
        for t in req.trimmed_streams:
            ranges = self.storage.stream_ranges(t.stream_id)
            if t.stream_id < 0 or t.trim_offset < 0:
                out.append(TrimStreamsResult(status=Status(
                    ErrorCode.INVALID_REQUEST,
                    f"stream_id {t.stream_id} and trim_offset {t.trim_offset} must be >= 0")))
                continue
            if not ranges:
                out.append(TrimStreamsResult(status=Status(
                    ErrorCode.STREAM_NOT_FOUND,
                    f"stream {t.stream_id} has no range on this server")))
                continue
            for rlog in ranges:
                rlog.trim(t.trim_offset)
            # The first range still holding data (or the newest, if none does).
            first = next((r for r in ranges if r.start_offset < _limit(r)), ranges[-1])
            out.append(TrimStreamsResult(
                Stream(stream_id=t.stream_id, start_offset=first.start_offset),
                range=range_view(first)))
        ctx.reply(TrimStreamsResponse(streams=out))

    def _heartbeat(self, ctx: RequestContext, req: HeartbeatRequest) -> None:
        ctx.reply(HeartbeatResponse(req.client_id, req.client_role, self.server.info()))

