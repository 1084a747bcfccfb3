"""The PD's request handler: one method per opcode, decoding requests and encoding answers.

``PdHandler.routes`` is the PD's dispatch table (``net.Route``); each method turns a request
into calls of the PD's parts, which it sees only through the small interfaces below (what it
reads of the metadata, the stream, range and range server operations, the leader's office and
the wire forms of records), and their results (or failures) into the response. Batch opcodes
answer one result per item, in request order; a bad item fails with its own status and never
hides the others.

In a PD cluster only the leader answers: a follower refuses every opcode but
DESCRIBE_PD_CLUSTER with PD_NOT_LEADER (a SYSTEM_ERROR whose detail is the cluster, naming the
leader), and answers DESCRIBE_PD_CLUSTER with the members only (the range servers are the
leader's to report).

An answer is one frame and the protocol has no paging, so an answer whose header would not fit
in a frame (``MAX_ANSWER_HEADER``) is cut down: LIST_RANGES fails the owners whose ranges do not
fit with PAYLOAD_TOO_LARGE, saying how many ranges they hold and what to ask instead, and
answers the rest; any other answer too large (DESCRIBE_STREAMS of too many streams) fails the
whole request with PAYLOAD_TOO_LARGE saying what to ask instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import MAX_FRAME_LENGTH, MIN_FRAME_LENGTH, Opcode
from sbp_spark.protocol.errors import (
    ErrorCode,
    HeaderError,
    InvalidRequestError,
    PayloadTooLargeError,
    PdNotLeaderError,
    SbpError,
    ServerError,
)

from ..net import Connection, RequestContext, RequestHandler, Route, Runs
from .meta import RangeMeta, RetentionHold, StreamMeta
from .wire import stream_msg

# The largest answer header one frame can carry (an answer has no payload; docs/wire.md, Limits).
MAX_ANSWER_HEADER = MAX_FRAME_LENGTH - MIN_FRAME_LENGTH
# What one more result may add to a response beyond its size alone (its offset in the vector,
# alignment), so that the results kept after a cut surely fit.
_ITEM_SLACK = 16

T = TypeVar("T")


class Records(Protocol):
    """What the handler reads of the metadata as it is (``meta.MetadataStore``)."""

    def get_stream(self, stream_id: int) -> StreamMeta: ...

    def stream_named(self, name: str) -> StreamMeta: ...

    def list_streams(self, include_deleted: bool = False) -> list[StreamMeta]: ...

    def list_ranges(self, stream_id: int) -> list[RangeMeta]: ...

    def get_range(self, stream_id: int, range_index: int) -> RangeMeta: ...


class StreamChanges(Protocol):
    """Changes of streams (``streams.StreamOperations``); refusals raise ``ServerError``s."""

    def create(self, replica_nums: int = 1, retention_period_ms: int = -1,
               stream_id: int = -1, name: str = "") -> tuple[StreamMeta, RangeMeta]: ...

    def update(self, stream_id: int, replica_nums: int, retention_period_ms: int,
               hold: RetentionHold | None = None) -> StreamMeta: ...

    def delete(self, stream_id: int) -> StreamMeta: ...

    def trim(self, stream_id: int, trim_offset: int,
             timeout_s: float | None = None) -> tuple[StreamMeta, RangeMeta]: ...


class RangeChanges(Protocol):
    """Seal-and-new, the next range, a server's ranges (``ranges.RangeOperations``);
    refusals raise ``ServerError``s."""

    def on_server(self, server: m.RangeServer) -> tuple[int, list[RangeMeta]]: ...

    def seal(self, stream_id: int, range_index: int, timeout_s: float | None = None
             ) -> RangeMeta: ...

    def create(self, stream_id: int, range_index: int, timeout_s: float | None = None
               ) -> RangeMeta: ...


class Servers(Protocol):
    """The range servers this PD knows (``servers.RangeServerRegistry``); refusals raise
    ``ServerError``s."""

    def allocate_id(self, host: str = "") -> int: ...

    def heartbeat(self, server_id: int, advertise_addr: str) -> None: ...

    def stopping(self, server_id: int) -> None: ...

    def report_metrics(self, report: m.ReportMetricsRequest) -> None: ...

    def states(self) -> list[m.RangeServerState]: ...


class Office(Protocol):
    """Whether this node leads (``leader.Leadership``, or ``leader.LoneOffice``):
    ``check_leading`` raises PD_NOT_LEADER, naming the leader, unless it does."""

    def is_leader(self) -> bool: ...

    def check_leading(self) -> None: ...

    def cluster(self) -> m.PlacementDriverCluster: ...


class PermissionChanges(Protocol):
    """Grants, revocations and listings of permissions (``permissions.Permissions``)."""

    def change(self, grant: bool, permissions: Sequence[m.Permission]) -> int: ...

    def describe(self, principal: str = "") -> tuple[int, list[m.Permission]]: ...

    def view_version(self) -> int: ...


class WireForms(Protocol):
    """Range servers' addresses and ranges in their wire form (``wire.Addresses``)."""

    def of(self, server: int) -> str: ...

    def range_msg(self, rng: RangeMeta, for_servers: bool = False) -> m.Range: ...


class ConsumerAnswers(Protocol):
    """The consumer requests, each turned into its response
    (``consumer_requests.ConsumerRequests``)."""

    def join(self, req: m.JoinConsumerRequest) -> m.JoinConsumerResponse: ...

    def commit(self, req: m.CommitConsumerRequest) -> m.CommitConsumerResponse: ...

    def describe(self, req: m.DescribeConsumersRequest) -> m.DescribeConsumersResponse: ...

    def delete(self, req: m.DeleteConsumersRequest) -> m.DeleteConsumersResponse: ...

    def low_offset(self, stream_id: int) -> int:
        """The lowest position the stream's consumers committed, -1 when none did."""


def _ok_or_error(fn: Callable[..., T], *args: Any) -> tuple[T | None, m.Status]:
    """Run one item of a batch (``fn(*args)``): its value and OK, or None and the status of
    its failure."""
    try:
        return fn(*args), m.OK
    except PdNotLeaderError:
        raise  # this node stopped leading: the whole request goes to the new leader
    except ServerError as exc:
        return None, m.Status.from_error(exc)
    except SbpError as exc:  # not a status of ours: still this item's failure alone
        return None, m.Status(int(ErrorCode.UNKNOWN), f"{type(exc).__name__}: {exc}")


def _batch_item(done: bool, fn: Callable[..., T], *args: Any) -> tuple[T | None, m.Status]:
    """``_ok_or_error`` for an item of a batch that is not safe to carry out twice (create,
    delete), ``done`` telling whether an earlier item of it was carried out. Then this node
    stopping to lead fails the item alone: refusing the whole request would have the client
    send it again to the new leader, and the earlier items would be carried out twice."""
    try:
        return _ok_or_error(fn, *args)
    except PdNotLeaderError as exc:
        if not done:
            raise
        return None, m.Status.from_error(exc)


def _any_done(results: Sequence[Any]) -> bool:
    return any(r.status.code == ErrorCode.NONE for r in results)


class PdHandler(RequestHandler):
    """Decodes PD requests, runs them against the PD's parts, encodes the answers."""

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
        # Ours: named consumers (consumer_requests.py).
        Opcode.JOIN_CONSUMER: Route(m.JoinConsumerRequest, "_join_consumer"),
        Opcode.COMMIT_CONSUMER: Route(m.CommitConsumerRequest, "_commit_consumer"),
        Opcode.DESCRIBE_CONSUMERS: Route(m.DescribeConsumersRequest, "_describe_consumers"),
        Opcode.DELETE_CONSUMERS: Route(m.DeleteConsumersRequest, "_delete_consumers"),
        Opcode.GRANT_PERMISSIONS: Route(m.GrantPermissionsRequest, "_grant_permissions"),
        Opcode.REVOKE_PERMISSIONS: Route(m.RevokePermissionsRequest, "_revoke_permissions"),
        Opcode.DESCRIBE_PERMISSIONS: Route(m.DescribePermissionsRequest,
                                           "_describe_permissions"),
    }

    def __init__(self, records: Records, streams: StreamChanges, ranges: RangeChanges,
                 servers: Servers, office: Office, wire: WireForms,
                 consumers: ConsumerAnswers, permissions: PermissionChanges) -> None:
        self._records = records
        self._consumers = consumers
        self._permissions = permissions
        self._streams = streams
        self._ranges = ranges
        self._servers = servers
        self._office = office
        self._wire = wire
        # The range server whose heartbeats each connection carried: a GOAWAY on it is that
        # server saying it stops (``peer_goaway``).
        self._heartbeats_of: dict[Connection, int] = {}
        self._heartbeats_lock = threading.Lock()

    def peer_goaway(self, conn: Connection) -> None:
        with self._heartbeats_lock:
            server_id = self._heartbeats_of.pop(conn, None)
        if server_id is not None and self._office.is_leader():
            self._servers.stopping(server_id)

    def connection_closed(self, conn: Connection) -> None:
        with self._heartbeats_lock:
            self._heartbeats_of.pop(conn, None)

    def handle(self, ctx: RequestContext) -> None:
        request_cls, serve = self.route(ctx)
        if ctx.opcode != Opcode.DESCRIBE_PD_CLUSTER:
            self._office.check_leading()
        try:
            request = request_cls.from_flatbuffers(ctx.header)
        except HeaderError as exc:
            raise InvalidRequestError(str(exc)) from None
        self.authorize(ctx, request)
        answer = serve(request)
        if self.authorizer is not None and isinstance(request, m.DescribeStreamsRequest) \
                and isinstance(answer, m.DescribeStreamsResponse) \
                and not request.stream_ids and not request.by_name:
            answer = self._readable(ctx, answer)
        if isinstance(answer, m.HeartbeatResponse) and answer.range_server is not None \
                and answer.status.code == ErrorCode.NONE \
                and answer.client_role == m.ClientRole.RANGE_SERVER:
            with self._heartbeats_lock:
                self._heartbeats_of[ctx.conn] = answer.range_server.server_id
        header = answer.to_flatbuffers()
        if len(header) > MAX_ANSWER_HEADER:
            header = self._cut_to_fit(request, answer, len(header)).to_flatbuffers()
            if len(header) > MAX_ANSWER_HEADER:  # the items kept are estimated with slack
                raise PayloadTooLargeError(
                    f"the answer is {len(header)} bytes even after dropping what does not "
                    f"fit; one frame holds {MAX_ANSWER_HEADER}")
        ctx.reply_raw(header)

    def _readable(self, ctx: RequestContext, answer: m.DescribeStreamsResponse
                  ) -> m.DescribeStreamsResponse:
        """A listing of every stream cut to those the principal may see."""
        authorizer = self.authorizer
        assert authorizer is not None
        return m.DescribeStreamsResponse(describe_responses=[
            r for r in answer.describe_responses if r.stream is not None
            and authorizer.readable(ctx.principal, r.stream.stream_id, r.stream.name)])

    # -- answers too large for one frame ----------------------------------------------------

    def _cut_to_fit(self, request: Any, answer: Any, size: int) -> Any:
        """``answer`` (``size`` bytes, more than one frame holds) with the items that do not
        fit failed PAYLOAD_TOO_LARGE, or PayloadTooLargeError if its items cannot fail alone.
        Only ever runs on an answer that could not be sent at all."""
        if isinstance(answer, m.ListRangesResponse):
            return self._fit_items(answer, "list_responses", size, self._ranges_too_large,
                                   "owners")
        if isinstance(answer, m.DescribeStreamsResponse):
            # A stream's result is no larger than a failed one would be, so failing some
            # cannot make the rest fit: the request fails.
            count = len(answer.describe_responses)
            asked = (f"the {count} streams asked for" if request.stream_ids
                     else f"the {count} live streams (every stream was asked for)")
            raise PayloadTooLargeError(
                f"{asked} take {size} bytes, more than one answer holds ({MAX_ANSWER_HEADER} "
                f"bytes; DESCRIBE_STREAMS has no paging): name the streams by id, fewer per "
                f"request")
        raise PayloadTooLargeError(
            f"the answer is {size} bytes, more than one frame holds ({MAX_ANSWER_HEADER} "
            f"bytes): ask for fewer items per request")

    @staticmethod
    def _fit_items(answer: Any, name: str, size: int, fail: Callable[[Any, int, str], Any],
                   what: str) -> Any:
        """Keep the results of ``answer.<name>`` that fit, in order; ``fail(result, its size,
        why)`` replaces each of the others with a small failed result. When even the failed
        results cannot all fit, the whole request fails, its ``what`` (the items) named."""
        results = getattr(answer, name)
        cls = type(answer)
        empty = len(cls().to_flatbuffers())

        def size_of(result: Any) -> int:
            return len(cls(**{name: [result]}).to_flatbuffers()) - empty

        alone = ([size - empty] if len(results) == 1
                 else [size_of(result) for result in results])
        why = ["alone" if n > MAX_ANSWER_HEADER - empty
               else f"with the others of this request ({size} bytes in all)" for n in alone]
        failed = [fail(result, n, w) for result, n, w in zip(results, alone, why, strict=True)]
        failed_sizes = [size_of(result) for result in failed]
        # Room for every result failed, then each success takes what it adds to its failure.
        room = MAX_ANSWER_HEADER - empty - sum(failed_sizes) - len(results) * _ITEM_SLACK
        if room < 0:
            raise PayloadTooLargeError(
                f"the answer to {len(results)} {what} is {size} bytes, more than one frame "
                f"holds ({MAX_ANSWER_HEADER} bytes; there is no paging): ask for fewer "
                f"{what} per request")
        kept = []
        for result, n, fail_result, fail_size in zip(results, alone, failed, failed_sizes,
                                                     strict=True):
            if n - fail_size <= room:
                room -= max(n - fail_size, 0)
                kept.append(result)
            else:
                kept.append(fail_result)
        return cls(**{name: kept})

    @staticmethod
    def _ranges_too_large(result: m.ListRangesResult, alone: int,
                          why: str) -> m.ListRangesResult:
        owner = (f"stream {result.stream_id}" if result.range_server is None
                 else f"range server {result.range_server.server_id}")
        what = (f"ask DESCRIBE_RANGES for the ranges of {owner} you need by index"
                if why == "alone" else f"ask for {owner} in a request of its own "
                                        "(fewer owners per request)")
        status = m.Status(int(PayloadTooLargeError.code),
                          f"the {len(result.ranges)} ranges of {owner} take {alone} bytes, "
                          f"too many for one answer {why} (one frame holds "
                          f"{MAX_ANSWER_HEADER} bytes; LIST_RANGES has no paging): {what}")
        return m.ListRangesResult(stream_id=result.stream_id, status=status,
                                  range_server=result.range_server)

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
                _, status = _ok_or_error(self._servers.heartbeat, req.range_server.server_id,
                                         req.range_server.advertise_addr)
        # A range server learns here which permissions to enforce (when the PD has any).
        acl_version = -1
        if self.authorizer is not None and req.client_role == m.ClientRole.RANGE_SERVER:
            acl_version = self._permissions.view_version()
        return m.HeartbeatResponse(client_id=req.client_id, client_role=req.client_role,
                                   range_server=req.range_server, status=status,
                                   acl_version=acl_version)

    def _allocate_id(self, req: m.AllocateIdRequest) -> m.AllocateIdResponse:
        return m.AllocateIdResponse(id=self._servers.allocate_id(req.host))

    def _list_ranges(self, req: m.ListRangesRequest) -> m.ListRangesResponse:
        results = []
        for owner in req.range_owners:
            if owner.range_server is not None:
                found, status = _ok_or_error(self._ranges.on_server, owner.range_server)
                server = owner.range_server
                ranges: list[RangeMeta] = []
                if found is not None:
                    sid, ranges = found
                    server = m.RangeServer(sid, self._wire.of(sid))
                results.append(m.ListRangesResult(
                    status=status, ranges=[self._wire.range_msg(r) for r in ranges],
                    range_server=server))
            else:
                listed, status = _ok_or_error(self._records.list_ranges, owner.stream_id)
                results.append(m.ListRangesResult(
                    stream_id=owner.stream_id, status=status,
                    ranges=[self._wire.range_msg(r) for r in listed or ()]))
        return m.ListRangesResponse(list_responses=results)

    def _range_items(self, ids: Sequence[m.RangeId],
                     op: Callable[[int, int], RangeMeta]) -> list[tuple[int, m.Status,
                                                                       m.Range | None]]:
        out = []
        for rid in ids:
            rng, status = _ok_or_error(op, rid.stream_id, rid.range_index)
            out.append((rid.stream_id, status,
                        None if rng is None else self._wire.range_msg(rng)))
        return out

    def _seal_ranges(self, req: m.SealRangesRequest) -> m.SealRangesResponse:
        timeout = self._timeout_s(req)
        items = self._range_items(req.ranges,
                                  lambda s, i: self._ranges.seal(s, i, timeout))
        return m.SealRangesResponse(seal_responses=[
            m.SealRangesResult(stream_id=s, status=st, range=r) for s, st, r in items])

    def _create_range(self, req: m.CreateRangeRequest) -> m.CreateRangeResponse:
        timeout = self._timeout_s(req)
        items = self._range_items(req.ranges,
                                  lambda s, i: self._ranges.create(s, i, timeout))
        return m.CreateRangeResponse(create_responses=[
            m.CreateRangeResult(stream_id=s, status=st, range=r) for s, st, r in items])

    def _describe_ranges(self, req: m.DescribeRangesRequest) -> m.DescribeRangesResponse:
        # The PD's record, not the primary's live state: clients ask this when servers fail,
        # and must not wait for a dead primary here. So an open range's next_offset is a
        # snapshot, and the answer says so.
        items = self._range_items(req.ranges, self._records.get_range)
        return m.DescribeRangesResponse(describe_responses=[
            m.DescribeRangesResult(stream_id=s, status=st, range=r,
                                   next_offset_snapshot=r is not None and r.is_open)
            for s, st, r in items])

    def _create_streams(self, req: m.CreateStreamsRequest) -> m.CreateStreamsResponse:
        results: list[m.CreateStreamsResult] = []
        for item in req.streams:
            created, status = _batch_item(_any_done(results), self._streams.create,
                                          item.replica_nums, item.retention_period_ms,
                                          item.stream_id, item.name)
            stream = stream_msg(created[0]) if created else m.Stream(
                stream_id=item.stream_id, replica_nums=item.replica_nums,
                retention_period_ms=item.retention_period_ms, name=item.name)
            results.append(m.CreateStreamsResult(stream=stream, status=status))
        return m.CreateStreamsResponse(create_responses=results)

    def _delete_streams(self, req: m.DeleteStreamsRequest) -> m.DeleteStreamsResponse:
        results: list[m.DeleteStreamsResult] = []
        for item in req.streams:
            deleted, status = _batch_item(_any_done(results), self._streams.delete,
                                          item.stream_id)
            stream = stream_msg(deleted) if deleted else m.Stream(
                stream_id=item.stream_id)
            results.append(m.DeleteStreamsResult(deleted_stream=stream, status=status))
        return m.DeleteStreamsResponse(delete_responses=results)

    def _update_streams(self, req: m.UpdateStreamsRequest) -> m.UpdateStreamsResponse:
        results = []
        for item in req.streams:
            updated, status = _ok_or_error(
                self._streams.update, item.stream_id, item.replica_nums,
                item.retention_period_ms, RetentionHold(
                    item.retain_for_consumers, item.retain_cap_bytes, item.retain_cap_ms))
            stream = self._stream_out(updated) if updated else m.Stream(
                stream_id=item.stream_id)
            results.append(m.UpdateStreamsResult(updated_stream=stream, status=status))
        return m.UpdateStreamsResponse(update_responses=results)

    def _describe_streams(self, req: m.DescribeStreamsRequest) -> m.DescribeStreamsResponse:
        if not req.stream_ids and not req.by_name:
            # Ours: a request naming no stream asks for every stream that is not deleted
            # (`sbp streams list`); the seed leaves an empty list undefined.
            return m.DescribeStreamsResponse(describe_responses=[
                m.DescribeStreamsResult(stream=self._stream_out(s), status=m.OK)
                for s in self._records.list_streams()])
        results = []
        for stream_id in req.stream_ids:
            found, status = _ok_or_error(self._records.get_stream, stream_id)
            stream = self._stream_out(found) if found else m.Stream(stream_id=stream_id)
            results.append(m.DescribeStreamsResult(stream=stream, status=status))
        for item in req.by_name:
            # Ours: streams looked up by name, answered after the ids in the order asked.
            found, status = _ok_or_error(self._records.stream_named, item.name)
            stream = self._stream_out(found) if found else m.Stream(name=item.name)
            results.append(m.DescribeStreamsResult(stream=stream, status=status))
        return m.DescribeStreamsResponse(describe_responses=results)

    def _stream_out(self, stream: StreamMeta) -> m.Stream:
        """A stream's wire form, with its consumers' lowest position when it waits for
        them (what range servers hold their retention at)."""
        msg = stream_msg(stream)
        if stream.retain_for_consumers:
            msg.consumers_low_offset = self._consumers.low_offset(stream.stream_id)
        return msg

    def _trim_streams(self, req: m.TrimStreamsRequest) -> m.TrimStreamsResponse:
        timeout = self._timeout_s(req)
        results = []
        for item in req.trimmed_streams:
            done, status = _ok_or_error(self._streams.trim, item.stream_id, item.trim_offset,
                                        timeout)
            if done:
                stream, first = done
                results.append(m.TrimStreamsResult(trimmed_stream=stream_msg(stream),
                                                   status=status,
                                                   range=self._wire.range_msg(first)))
            else:
                results.append(m.TrimStreamsResult(
                    trimmed_stream=m.Stream(stream_id=item.stream_id), status=status))
        return m.TrimStreamsResponse(streams=results)

    def _report_metrics(self, req: m.ReportMetricsRequest) -> m.ReportMetricsResponse:
        _, status = _ok_or_error(self._servers.report_metrics, req)
        return m.ReportMetricsResponse(range_server=req.range_server, status=status)

    def _describe_pd_cluster(self, req: m.DescribePdClusterRequest
                             ) -> m.DescribePdClusterResponse:
        # A follower's view of the range servers is empty: they heartbeat to the leader.
        states = self._servers.states() if self._office.is_leader() else []
        return m.DescribePdClusterResponse(cluster=self._office.cluster(), range_servers=states)

    # -- named consumers (ours) ---------------------------------------------------------------

    def _join_consumer(self, req: m.JoinConsumerRequest) -> m.JoinConsumerResponse:
        return self._consumers.join(req)

    def _commit_consumer(self, req: m.CommitConsumerRequest) -> m.CommitConsumerResponse:
        return self._consumers.commit(req)

    def _describe_consumers(self, req: m.DescribeConsumersRequest
                            ) -> m.DescribeConsumersResponse:
        return self._consumers.describe(req)

    def _delete_consumers(self, req: m.DeleteConsumersRequest) -> m.DeleteConsumersResponse:
        return self._consumers.delete(req)

    def _grant_permissions(self, req: m.GrantPermissionsRequest) -> m.GrantPermissionsResponse:
        return m.GrantPermissionsResponse(version=self._permissions.change(True,
                                                                           req.permissions))

    def _revoke_permissions(self, req: m.RevokePermissionsRequest
                            ) -> m.RevokePermissionsResponse:
        return m.RevokePermissionsResponse(version=self._permissions.change(False,
                                                                            req.permissions))

    def _describe_permissions(self, req: m.DescribePermissionsRequest
                              ) -> m.DescribePermissionsResponse:
        version, permissions = self._permissions.describe(req.principal)
        return m.DescribePermissionsResponse(permissions=permissions, version=version)
