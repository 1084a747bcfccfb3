"""The range administration a range server answers: SEAL_RANGES, SYNC_RANGES,
DESCRIBE_RANGES, DELETE_STREAMS, TRIM_STREAMS and HEARTBEAT.

Each request becomes its response here, with no network in between (``requests.py`` receives
and answers them). ``RangeAdmin`` sees the local ranges as ``AdminRanges`` and the server as
its id and how the PD knows it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from ...protocol import messages
from ...protocol.errors import (
    ErrorCode,
    InvalidRequestError,
    RangeNotFoundError,
    ServerError,
    StreamNotFoundError,
)
from ...protocol.messages import (
    DeleteStreamsRequest,
    DeleteStreamsResponse,
    DeleteStreamsResult,
    DescribeRangesRequest,
    DescribeRangesResponse,
    DescribeRangesResult,
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
from ..storage.range_log import RangeLog
from ..storage.read_cap import CapState

log = logging.getLogger(__name__)


class AdminRanges(Protocol):
    """The local ranges, as range administration finds, creates and deletes them (the
    storage)."""

    def get_range(self, stream_id: int, range_index: int) -> RangeLog | None: ...

    def stream_ranges(self, stream_id: int) -> list[RangeLog]: ...

    def create_range(self, stream_id: int, range_index: int, start_offset: int,
                     end_offset: int = -1, replicas: Sequence[RangeReplica] = ()
                     ) -> RangeLog: ...

    def delete_stream(self, stream_id: int) -> bool: ...


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


class RangeAdmin:
    """Answers the range administration requests of one range server."""

    def __init__(self, ranges: AdminRanges, server_id: Callable[[], int],
                 info: Callable[[], messages.RangeServer],
                 unreachable: Callable[[int, int], Sequence[int]]) -> None:
        self._ranges = ranges
        self._server_id = server_id  # this server's current id (-1 until it has one)
        self._info = info  # this server as the PD knows it: id and advertised address
        # The secondaries of a range this server (its primary) could not reach lately
        # (``Replicator.unreachable``): a seal's answer names them, for the PD's placement.
        self._unreachable = unreachable

    def seal(self, req: SealRangesRequest) -> SealRangesResponse:
        out = []
        for rid in req.ranges:
            try:
                rlog = self._local_range(rid.stream_id, rid.range_index)
                rlog.seal()
                log.info("range %d/%d sealed here at %d (durable to %d, readers see up to %d, "
                         "read cap %s)", rid.stream_id, rid.range_index, rlog.end_offset,
                         rlog.next_offset, rlog.readable_offset, rlog.cap.state.value)
                out.append(SealRangesResult(
                    rid.stream_id, range=range_view(rlog, stopped=True),
                    unreachable=list(self._unreachable(rid.stream_id, rid.range_index))))
            except ServerError as exc:
                out.append(SealRangesResult(rid.stream_id, Status.from_error(exc)))
        return SealRangesResponse(seal_responses=out)

    def describe(self, req: DescribeRangesRequest) -> DescribeRangesResponse:
        out = []
        for rid in req.ranges:
            try:
                if rid.range_index == -1:  # the stream's newest range here
                    ranges = self._ranges.stream_ranges(rid.stream_id)
                    if not ranges:
                        raise RangeNotFoundError(
                            f"stream {rid.stream_id} has no range on this server")
                    rlog = ranges[-1]
                else:
                    rlog = self._local_range(rid.stream_id, rid.range_index)
                out.append(DescribeRangesResult(rid.stream_id, range=range_view(rlog)))
            except ServerError as exc:
                out.append(DescribeRangesResult(rid.stream_id, Status.from_error(exc)))
        return DescribeRangesResponse(describe_responses=out)

    def _local_range(self, stream_id: int, range_index: int) -> RangeLog:
        if stream_id < 0 or range_index < 0:
            raise InvalidRequestError(
                f"range {stream_id}/{range_index}: stream_id and range_index must be >= 0")
        rlog = self._ranges.get_range(stream_id, range_index)
        if rlog is None:
            raise RangeNotFoundError(
                f"range {stream_id}/{range_index} is not on server {self._server_id()}")
        return rlog

    def sync(self, req: SyncRangesRequest) -> SyncRangesResponse:
        out = []
        for sr in req.stream_ranges:
            try:
                ranges = [self._adopt_range(sr.stream_id, r) for r in sr.ranges]
                out.append(SyncRangesResult(sr.stream_id, ranges=[
                    range_view(r) for r in ranges if r is not None]))
            except ServerError as exc:
                out.append(SyncRangesResult(sr.stream_id, Status.from_error(exc)))
        return SyncRangesResponse(sync_responses=out)

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
        mine = self._server_id()
        if replicas and not any(rep.server.server_id == mine for rep in replicas):
            return None
        if sum(1 for rep in replicas if rep.is_primary) > 1:
            raise InvalidRequestError(f"range {sid}/{r.range_index} names several primaries")
        # Any range of the stream, not only this one: a range the PD opened just before the
        # stream's deletion may reach this server after the DELETE_STREAMS (ids never return).
        if any(rlog.deleted for rlog in self._ranges.stream_ranges(sid)):
            raise StreamNotFoundError(f"stream {sid} was deleted")
        return self._ranges.create_range(sid, r.range_index, r.start_offset, r.end_offset,
                                         replicas)

    def delete(self, req: DeleteStreamsRequest) -> DeleteStreamsResponse:
        out = []
        for s in req.streams:
            if s.stream_id < 0:
                out.append(DeleteStreamsResult(status=Status(
                    ErrorCode.INVALID_REQUEST, f"stream_id {s.stream_id} must be >= 0")))
            elif self._ranges.delete_stream(s.stream_id):
                out.append(DeleteStreamsResult(Stream(stream_id=s.stream_id, deleted=True)))
            else:
                out.append(DeleteStreamsResult(status=Status(
                    ErrorCode.STREAM_NOT_FOUND,
                    f"stream {s.stream_id} has no range on this server")))
        return DeleteStreamsResponse(delete_responses=out)

    def trim(self, req: TrimStreamsRequest) -> TrimStreamsResponse:
        out = []
        for t in req.trimmed_streams:
            ranges = self._ranges.stream_ranges(t.stream_id)
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
        return TrimStreamsResponse(streams=out)

    def heartbeat(self, req: HeartbeatRequest) -> HeartbeatResponse:
        return HeartbeatResponse(req.client_id, req.client_role, self._info())
