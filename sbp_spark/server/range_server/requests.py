"""The requests a range server serves: its dispatch table, and the range administration
(SEAL_RANGES, SYNC_RANGES, DESCRIBE_RANGES, DELETE_STREAMS, TRIM_STREAMS, HEARTBEAT).

APPEND is served by ``append.py`` and FETCH by ``fetch.py``; PING and GOAWAY by the network
core.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ...protocol.constants import Opcode
from ...protocol.errors import (
    ErrorCode,
    HeaderError,
    InvalidRequestError,
    RangeNotFoundError,
    ServerError,
    StreamNotFoundError,
)
from ...protocol.messages import (
    AppendRequest,
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
from ..net import RequestContext, RequestHandler, Route, Runs
from ..storage.range_log import RangeLog
from ..storage.read_cap import CapState
from .append import AppendPath

if TYPE_CHECKING:
    from .server import RangeServer

log = logging.getLogger(__name__)

# APPEND frames up to this size (header and payload) are served on the connection's reader
# when its handler thread is idle: storing a small append costs less than handing it to
# another thread, which was most of a lone writer's round trip. Larger frames still go to the
# handler thread, so the reader receives the next one while they are stored.
INLINE_APPEND_BYTES = 64 * 1024


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
        servers=list(rlog.replicas),
    )


def _limit(rlog: RangeLog) -> int:
    return rlog.end_offset if rlog.sealed else rlog.next_offset


class RangeServerHandler(RequestHandler):
    """Request handlers of the range server."""

    role = "range server"
    # FETCH long-polls and streams; SEAL, SYNC, DELETE and TRIM fsync metadata or data. The
    # rest run in arrival order on the connection's handler thread: the reader receives and
    # checksums the next APPEND frame while the previous one is stored and answered. A small
    # APPEND with nothing queued before it is stored by the reader itself.
    routes = {
        Opcode.APPEND: Route(AppendRequest, "_append", Runs.ORDERED, INLINE_APPEND_BYTES),
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
        self.appends = AppendPath(server)

    def handle(self, ctx: RequestContext) -> None:
        request_cls, serve = self.route(ctx)
        try:
            req = request_cls.from_flatbuffers(ctx.header)
        except HeaderError as exc:
            raise InvalidRequestError(str(exc)) from exc
        serve(ctx, req)

    def server_stopping(self) -> None:
        self.storage.notify_data()  # long polls notice the stop and answer at once

    def _append(self, ctx: RequestContext, req: AppendRequest) -> None:
        self.appends.serve(ctx, req)

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
                out.append(SealRangesResult(rid.stream_id, Status.from_error(exc)))
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
                out.append(DescribeRangesResult(rid.stream_id, Status.from_error(exc)))
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
                out.append(SyncRangesResult(sr.stream_id, Status.from_error(exc)))
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
        replicas = r.servers
        mine = self.server.server_id
        if replicas and not any(rep.server.server_id == mine for rep in replicas):
            return None
        if sum(1 for rep in replicas if rep.is_primary) > 1:
            raise InvalidRequestError(f"range {sid}/{r.range_index} names several primaries")
        # Any range of the stream, not only this one: a range the PD opened just before the
        # stream's deletion may reach this server after the DELETE_STREAMS (ids never return).
        if any(rlog.deleted for rlog in self.storage.stream_ranges(sid)):
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

