"""The requests a range server serves: its dispatch table, and which part serves each.

APPEND goes to the APPEND path (``append.py``), FETCH to ``fetch.py`` and the range
administration (SEAL_RANGES, SYNC_RANGES, DESCRIBE_RANGES, DELETE_STREAMS, TRIM_STREAMS,
HEARTBEAT) to ``admin.py``, LOOKUP_SEQUENCES (ours) to ``producers.py``; PING and GOAWAY are
answered by the network core.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from ...protocol.constants import Opcode
from ...protocol.errors import HeaderError, InvalidRequestError
from ...protocol.messages import (
    AppendRequest,
    DeleteStreamsRequest,
    DescribeRangesRequest,
    FetchRequest,
    HeartbeatRequest,
    LookupSequencesRequest,
    LookupSequencesResponse,
    SealRangesRequest,
    SyncRangesRequest,
    TrimStreamsRequest,
)
from ..net import RequestContext, RequestHandler, Route, Runs
from .admin import RangeAdmin

# APPEND frames up to this size (header and payload) are served on the connection's reader
# when its handler thread is idle: storing a small append costs less than handing it to
# another thread, which was most of a lone writer's round trip. Larger frames still go to the
# handler thread, so the reader receives the next one while they are stored.
INLINE_APPEND_BYTES = 64 * 1024

R = TypeVar("R", contravariant=True)
A = TypeVar("A", covariant=True)


class Serves(Protocol[R]):
    """A part that answers requests of one kind itself (one frame or a stream of them)."""

    def serve(self, ctx: RequestContext, req: R) -> None: ...


class Answers(Protocol[R, A]):
    """A part that turns requests of one kind into their one-frame answer."""

    def answer(self, req: R) -> A: ...


class RangeServerHandler(RequestHandler):
    """The range server's request table: each request to the part that serves it."""

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
        Opcode.LOOKUP_SEQUENCES: Route(LookupSequencesRequest, "_lookup", Runs.POOL),
    }

    def __init__(self, appends: Serves[AppendRequest], fetches: Serves[FetchRequest],
                 admin: RangeAdmin, wake_long_polls: Callable[[], None],
                 lookups: Answers[LookupSequencesRequest, LookupSequencesResponse]) -> None:
        self.appends = appends
        self.lookups = lookups
        self.fetches = fetches
        self.admin = admin
        self._wake_long_polls = wake_long_polls

    def handle(self, ctx: RequestContext) -> None:
        request_cls, serve = self.route(ctx)
        try:
            req = request_cls.from_flatbuffers(ctx.header)
        except HeaderError as exc:
            raise InvalidRequestError(str(exc)) from exc
        self.authorize(ctx, req)
        serve(ctx, req)

    def server_stopping(self) -> None:
        self._wake_long_polls()  # they notice the stop and answer at once

    def _append(self, ctx: RequestContext, req: AppendRequest) -> None:
        self.appends.serve(ctx, req)

    def _fetch(self, ctx: RequestContext, req: FetchRequest) -> None:
        self.fetches.serve(ctx, req)

    def _seal(self, ctx: RequestContext, req: SealRangesRequest) -> None:
        ctx.reply(self.admin.seal(req))

    def _sync(self, ctx: RequestContext, req: SyncRangesRequest) -> None:
        ctx.reply(self.admin.sync(req))

    def _describe(self, ctx: RequestContext, req: DescribeRangesRequest) -> None:
        ctx.reply(self.admin.describe(req))

    def _delete(self, ctx: RequestContext, req: DeleteStreamsRequest) -> None:
        ctx.reply(self.admin.delete(req))

    def _trim(self, ctx: RequestContext, req: TrimStreamsRequest) -> None:
        ctx.reply(self.admin.trim(req))

    def _heartbeat(self, ctx: RequestContext, req: HeartbeatRequest) -> None:
        ctx.reply(self.admin.heartbeat(req))

    def _lookup(self, ctx: RequestContext, req: LookupSequencesRequest) -> None:
        ctx.reply(self.lookups.answer(req))
