"""Typed SBP extended headers: one dataclass per FlatBuffers table of ``schemas/*.fbs``.

Callers build and read these classes; they never touch FlatBuffers builders or the generated
code. Every table class has ``to_flatbuffers() -> bytes`` and
``from_flatbuffers(buf) -> instance``; the latter verifies the whole buffer first and raises
``HeaderError`` (naming the table) for anything malformed. Request and response classes carry
their ``OPCODE``; ``REQUESTS`` and ``RESPONSES`` map opcodes to them, and ``request_frame``,
``response_frame``, ``system_error_frame``, ``decode_request`` and ``decode_response`` go
between messages and frames.

Field names are the specification's; field ids, types and defaults are the schema's: the codec
of every class is built from ``_generated/wire_tables.py`` (schemas/generate.py makes it from
``schemas/*.fbs``), and building it fails, naming the field, if a class here disagrees with its
table. Scalars are Python ints (enum fields decode to the enum member when known, the plain
int otherwise), strings are ``str``, byte vectors ``bytes``, vectors ``list``. Every
``status`` is written, success included; an absent one (from peers built on earlier schemas)
reads as success (``OK``). Optional nested tables are ``None`` when absent.

APPEND and FETCH headers travel once per data frame, so their four classes declare hand-written
codecs (``CODEC_TYPE``, from ``_fastpath``) that write one fixed layout of the same format and
read any layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar, TypeVar, overload

from ._fastpath import PackedEntriesCodec, RowsCodec
from ._flatbuf import Codec, build_codecs
from ._generated import wire_tables
from .constants import HEADER_FORMAT_FLATBUFFERS, Flags, Opcode
from .errors import ErrorCode, HeaderError, ServerError
from .frame import Buffer, Frame, encode_frame

__all__ = [
    "ClientRole", "Status", "SystemError", "RangeServer", "RangeReplica", "Range", "RangeId",
    "Stream", "PlacementDriverNode", "PlacementDriverCluster",
    "PingRequest", "PingResponse", "GoAwayRequest", "GoAwayResponse",
    "HeartbeatRequest", "HeartbeatResponse", "AllocateIdRequest", "AllocateIdResponse",
    "AuthenticateRequest", "AuthenticateResponse",
    "AppendEntry", "ProducerSequence", "AppendRequest", "LookupSequencesRequest",
    "LookupSequencesResponse", "AppendResult", "AppendResponse",
    "FetchEntry", "FetchRequest", "FetchResult", "FetchResponse",
    "RangeOwner", "ListRangesRequest", "ListRangesResult", "ListRangesResponse",
    "SealRangesRequest", "SealRangesResult", "SealRangesResponse",
    "StreamRanges", "SyncRangesRequest", "SyncRangesResult", "SyncRangesResponse",
    "CreateRangeRequest", "CreateRangeResult", "CreateRangeResponse",
    "DescribeRangesRequest", "DescribeRangesResult", "DescribeRangesResponse",
    "CreateStreamsRequest", "CreateStreamsResult", "CreateStreamsResponse",
    "DeleteStreamsRequest", "DeleteStreamsResult", "DeleteStreamsResponse",
    "UpdateStreamsRequest", "UpdateStreamsResult", "UpdateStreamsResponse",
    "DescribeStreamsRequest", "DescribeStreamsResult", "DescribeStreamsResponse",
    "TrimmedStream", "TrimStreamsRequest", "TrimStreamsResult", "TrimStreamsResponse",
    "ReportMetricsRequest", "ReportMetricsResponse",
    "DescribePdClusterRequest", "DescribePdClusterResponse", "RangeServerState",
    "ConsumerPosition", "Consumer", "JoinConsumerRequest", "JoinConsumerResponse",
    "CommitConsumerRequest", "CommitConsumerResponse", "DescribeConsumersRequest",
    "ConsumerResult", "DescribeConsumersResponse", "DeleteConsumersRequest",
    "DeleteConsumersResponse",
    "Permission", "GrantPermissionsRequest", "GrantPermissionsResponse",
    "RevokePermissionsRequest", "RevokePermissionsResponse", "DescribePermissionsRequest",
    "DescribePermissionsResponse",
    "REQUESTS", "RESPONSES", "TABLES",
    "request_frame", "response_frame", "system_error_frame", "decode_request",
    "decode_response",
]

M = TypeVar("M", bound="Message")

_ERROR_CODES = {int(c): c for c in ErrorCode}


class ClientRole(IntEnum):
    """Who sends a HEARTBEAT, in the specification's order. RANGE_SERVER is the schema's
    default: an SDK client says CLIENT."""

    RANGE_SERVER = 0
    CLIENT = 1


class Message:
    """Base of every table class: FlatBuffers encoding and verified decoding."""

    __slots__ = ()
    # The codec class this table uses: the generic one, unless a class names a faster one.
    CODEC_TYPE: ClassVar[type[Codec]] = Codec
    _CODEC: ClassVar[Codec]
    # Request and response tables name their opcode (the other tables have none).
    OPCODE: ClassVar[Opcode]
    # Ping and GoAway frames from other implementations may carry no header at all.
    _EMPTY_HEADER_OK: ClassVar[bool] = False

    def to_flatbuffers(self) -> bytes:
        """This message as a FlatBuffers root table (the frame's extended header)."""
        return self._CODEC.encode(self)

    @classmethod
    def from_flatbuffers(cls: type[M], buf: Buffer) -> M:
        """Decode and verify ``buf``; raise ``HeaderError`` if it is not a valid ``cls``."""
        if cls._EMPTY_HEADER_OK and not len(buf):
            return cls()
        return cls._CODEC.decode(buf)


# ---- shared tables ---------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Status(Message):
    """Outcome of a request or of one item. ``code`` 0 (NONE) is success."""

    code: int = 0
    message: str = ""
    detail: bytes = b""

    @property
    def ok(self) -> bool:
        return self.code == 0

    def raise_for_status(self) -> None:
        """Raise the ``ServerError`` subclass for this code unless it is success."""
        if self.code:
            raise ServerError.for_status(self.code, self.message, self.detail)

    @classmethod
    def from_error(cls, exc: ServerError) -> Status:
        """The status that reports ``exc`` to a peer."""
        return cls(int(exc.code), exc.message, bytes(exc.detail))

    @property
    def error_code(self) -> ErrorCode | None:
        """The code as an ``ErrorCode``, or None for a code this version does not know."""
        return _ERROR_CODES.get(self.code)


OK = Status()


@dataclass(slots=True)
class SystemError(Message):
    """Header of a SYSTEM_ERROR response frame (replaces the opcode's response table)."""

    status: Status = OK


@dataclass(slots=True)
class RangeServer(Message):
    server_id: int = -1
    advertise_addr: str = ""


@dataclass(slots=True)
class RangeReplica(Message):
    server: RangeServer = field(default_factory=RangeServer)
    is_primary: bool = False


@dataclass(slots=True)
class Range(Message):
    """Offsets [start_offset, end_offset) of a stream; end_offset is -1 while open."""

    stream_id: int = -1
    range_index: int = -1
    start_offset: int = 0
    next_offset: int = 0
    end_offset: int = -1
    servers: list[RangeReplica] = field(default_factory=list)

    @property
    def is_open(self) -> bool:
        """Whether the range still accepts appends."""
        return self.end_offset == -1

    @property
    def primary(self) -> RangeServer | None:
        """The replica that takes appends, if the range lists one."""
        for replica in self.servers:
            if replica.is_primary:
                return replica.server
        return None


@dataclass(slots=True)
class RangeId(Message):
    stream_id: int = -1
    range_index: int = -1


@dataclass(slots=True)
class Stream(Message):
    stream_id: int = -1
    replica_nums: int = 1
    retention_period_ms: int = -1  # -1 keeps records forever
    start_offset: int = 0  # first offset still stored, after trims
    deleted: bool = False
    name: str = ""  # ours: unique among live streams; "" = none (protocol/names.py)
    # Ours: retention that waits for named consumers (schemas/common.fbs), -1 caps: none.
    retain_for_consumers: bool = False
    retain_cap_bytes: int = -1
    retain_cap_ms: int = -1
    consumers_low_offset: int = -1  # in the PD's answers: the consumers' lowest position


@dataclass(slots=True)
class PlacementDriverNode(Message):
    name: str = ""
    advertise_addr: str = ""
    is_leader: bool = False


@dataclass(slots=True)
class PlacementDriverCluster(Message):
    """PD membership; also the detail of a PD_NOT_LEADER status."""

    members: list[PlacementDriverNode] = field(default_factory=list)

    @property
    def leader(self) -> PlacementDriverNode | None:
        for member in self.members:
            if member.is_leader:
                return member
        return None


# ---- control frames --------------------------------------------------------------------


@dataclass(slots=True)
class PingRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.PING
    _EMPTY_HEADER_OK: ClassVar[bool] = True


@dataclass(slots=True)
class PingResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.PING
    _EMPTY_HEADER_OK: ClassVar[bool] = True


@dataclass(slots=True)
class GoAwayRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.GOAWAY
    _EMPTY_HEADER_OK: ClassVar[bool] = True

    message: str = ""


@dataclass(slots=True)
class GoAwayResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.GOAWAY
    _EMPTY_HEADER_OK: ClassVar[bool] = True


@dataclass(slots=True)
class HeartbeatRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.HEARTBEAT

    client_id: str = ""
    client_role: int = ClientRole.RANGE_SERVER  # an SDK client must say CLIENT
    range_server: RangeServer | None = None  # required when client_role is RANGE_SERVER


@dataclass(slots=True)
class HeartbeatResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.HEARTBEAT

    client_id: str = ""
    client_role: int = ClientRole.RANGE_SERVER
    range_server: RangeServer | None = None
    status: Status = OK
    acl_version: int = -1  # ours: the permissions a range server must enforce


@dataclass(slots=True)
class AllocateIdRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.ALLOCATE_ID

    timeout_ms: int = 0
    host: str = ""


@dataclass(slots=True)
class AllocateIdResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.ALLOCATE_ID

    id: int = -1
    status: Status = OK


@dataclass(slots=True)
class AuthenticateRequest(Message):
    """Ours: the connection's credential (``method`` "token": ``data`` is a signed JWT).
    Its repr leaves the credential out, so it never reaches a log."""

    OPCODE: ClassVar[Opcode] = Opcode.AUTHENTICATE

    method: str = ""
    data: bytes = field(default=b"", repr=False)


@dataclass(slots=True)
class AuthenticateResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.AUTHENTICATE

    principal: str = ""
    status: Status = OK


@dataclass(slots=True)
class ReportMetricsRequest(Message):
    """A range server's load: rates per second, latencies in ms, sizes in bytes."""

    OPCODE: ClassVar[Opcode] = Opcode.REPORT_METRICS

    range_server: RangeServer = field(default_factory=RangeServer)
    disk_in_rate: int = 0
    disk_out_rate: int = 0
    disk_free_space: int = 0
    disk_unindexed_data_size: int = 0
    memory_used: int = 0
    uring_task_rate: int = 0
    uring_inflight_task_cnt: int = 0
    uring_pending_task_cnt: int = 0
    uring_task_avg_latency: int = 0
    network_append_rate: int = 0
    network_fetch_rate: int = 0
    network_failed_append_rate: int = 0
    network_failed_fetch_rate: int = 0
    network_append_avg_latency: int = 0
    network_fetch_avg_latency: int = 0
    range_missing_replica_cnt: int = 0
    range_active_cnt: int = 0


@dataclass(slots=True)
class ReportMetricsResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.REPORT_METRICS

    range_server: RangeServer = field(default_factory=RangeServer)
    status: Status = OK


@dataclass(slots=True)
class DescribePdClusterRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_PD_CLUSTER

    range_server: RangeServer | None = None  # the asking range server; None for SDK clients
    timeout_ms: int = 0


@dataclass(slots=True)
class RangeServerState(Message):
    """Ours: a range server as the PD sees it (liveness, load, its last metrics report)."""

    server: RangeServer = field(default_factory=RangeServer)
    live: bool = False
    last_heartbeat_ms: int = -1
    open_ranges: int = 0
    metrics: ReportMetricsRequest | None = None  # None before its first report
    metrics_ms: int = -1
    # How long ago the PD leader last heard the server (its own monotonic clock, so no clocks
    # are compared); -1 when it has not heard it since it took office.
    silent_ms: int = -1


@dataclass(slots=True)
class DescribePdClusterResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_PD_CLUSTER

    status: Status = OK
    cluster: PlacementDriverCluster | None = None
    range_servers: list[RangeServerState] = field(default_factory=list)  # ours


# ---- APPEND / FETCH ----------------------------------------------------------------------


@dataclass(slots=True)
class AppendEntry:
    """One record batch of an APPEND payload (a FlatBuffers struct, not a table)."""

    stream_id: int
    request_index: int
    batch_length: int


@dataclass(slots=True)
class ProducerSequence:
    """Ours: the producer of an entry's batch, the batch's sequence number in one range, and
    that range (a FlatBuffers struct; ``AppendRequest.producers`` holds one per entry, or
    none)."""

    producer_id: int
    sequence: int
    range_index: int


@dataclass(slots=True)
class AppendRequest(Message):
    """Payload: the entries' batches laid end to end, in the order of ``append_requests``."""

    OPCODE: ClassVar[Opcode] = Opcode.APPEND
    CODEC_TYPE = PackedEntriesCodec

    timeout_ms: int = 0
    append_requests: list[AppendEntry] = field(default_factory=list)
    # Set only by a range's primary (forwards, cap notices): every replica holds every record
    # of the range below this offset (-1: a client's append, or nothing known).
    committed_offset: int = -1
    # Set only on a primary's forwards: the range they belong to; a secondary applies them to
    # no other (-1: a client's append).
    range_index: int = -1
    # Set only on a read cap notice from a range's primary to a secondary: the range it is
    # about (then there are no entries and no payload; see schemas/data.fbs).
    cap_notice: RangeId | None = None
    # Ours: empty, or each entry's producer and sequence (idempotent appends), in entry order.
    producers: list[ProducerSequence] = field(default_factory=list)


@dataclass(slots=True)
class LookupSequencesRequest(Message):
    """Ours: which batches of ``producer_id`` the sealed ``range`` holds, by sequence."""

    OPCODE: ClassVar[Opcode] = Opcode.LOOKUP_SEQUENCES

    range: RangeId | None = None
    producer_id: int = -1
    sequences: list[int] = field(default_factory=list)


@dataclass(slots=True)
class LookupSequencesResponse(Message):
    """``base_offsets``: per sequence asked, where the range holds that batch, -1 if not."""

    OPCODE: ClassVar[Opcode] = Opcode.LOOKUP_SEQUENCES

    status: Status = OK
    base_offsets: list[int] = field(default_factory=list)


@dataclass(slots=True)
class AppendResult(Message):
    stream_id: int = -1
    request_index: int = 0
    base_offset: int = -1  # -1 when the batch was not stored
    stream_append_time_ms: int = 0
    status: Status = OK


@dataclass(slots=True)
class AppendResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.APPEND
    CODEC_TYPE = RowsCodec

    throttle_time_ms: int = 0
    status: Status = OK
    append_responses: list[AppendResult] = field(default_factory=list)


@dataclass(slots=True)
class FetchEntry(Message):
    """Read ``stream_id`` from ``fetch_offset``; ``batch_max_bytes`` bounds this entry's bytes
    over the whole response; ``end_offset`` (ours) stops before that offset, -1 = no bound."""

    stream_id: int = -1
    request_index: int = 0
    fetch_offset: int = 0
    batch_max_bytes: int = 0
    end_offset: int = -1


@dataclass(slots=True)
class FetchRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.FETCH
    CODEC_TYPE = RowsCodec

    max_wait_ms: int = 0
    min_bytes: int = 0
    fetch_requests: list[FetchEntry] = field(default_factory=list)


@dataclass(slots=True)
class FetchResult(Message):
    """``batch_length`` bytes of the frame's payload hold whole batches for this entry."""

    stream_id: int = -1
    request_index: int = 0
    batch_length: int = 0
    status: Status = OK


@dataclass(slots=True)
class FetchResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.FETCH
    CODEC_TYPE = RowsCodec

    throttle_time_ms: int = 0
    status: Status = OK
    fetch_responses: list[FetchResult] = field(default_factory=list)


# ---- ranges ------------------------------------------------------------------------------


@dataclass(slots=True)
class RangeOwner(Message):
    """Whose ranges to list: exactly one of ``stream_id`` (not -1) and ``range_server``."""

    stream_id: int = -1
    range_server: RangeServer | None = None

    def _problem(self) -> str | None:
        if (self.stream_id != -1) == (self.range_server is not None):
            return "RangeOwner must set exactly one of stream_id and range_server"
        return None


@dataclass(slots=True)
class ListRangesRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.LIST_RANGES

    timeout_ms: int = 0
    range_owners: list[RangeOwner] = field(default_factory=list)


@dataclass(slots=True)
class ListRangesResult(Message):
    stream_id: int = -1
    status: Status = OK
    ranges: list[Range] = field(default_factory=list)
    range_server: RangeServer | None = None  # the owner of a by-server listing


@dataclass(slots=True)
class ListRangesResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.LIST_RANGES

    throttle_time_ms: int = 0
    status: Status = OK
    list_responses: list[ListRangesResult] = field(default_factory=list)


@dataclass(slots=True)
class SealRangesRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.SEAL_RANGES

    timeout_ms: int = 0
    ranges: list[RangeId] = field(default_factory=list)


@dataclass(slots=True)
class SealRangesResult(Message):
    """From the PD: the new open range; from a range server: the sealed range, and the
    secondaries its primary could not reach lately (``unreachable``, ours)."""

    stream_id: int = -1
    status: Status = OK
    range: Range | None = None
    unreachable: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SealRangesResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.SEAL_RANGES

    throttle_time_ms: int = 0
    status: Status = OK
    seal_responses: list[SealRangesResult] = field(default_factory=list)


@dataclass(slots=True)
class StreamRanges(Message):
    stream_id: int = -1
    ranges: list[Range] = field(default_factory=list)


@dataclass(slots=True)
class SyncRangesRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.SYNC_RANGES

    timeout_ms: int = 0
    stream_ranges: list[StreamRanges] = field(default_factory=list)


@dataclass(slots=True)
class SyncRangesResult(Message):
    stream_id: int = -1
    status: Status = OK
    ranges: list[Range] = field(default_factory=list)


@dataclass(slots=True)
class SyncRangesResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.SYNC_RANGES

    throttle_time_ms: int = 0
    status: Status = OK
    sync_responses: list[SyncRangesResult] = field(default_factory=list)


@dataclass(slots=True)
class CreateRangeRequest(Message):
    """Open range ``range_index`` (last index + 1; the last range must be sealed)."""

    OPCODE: ClassVar[Opcode] = Opcode.CREATE_RANGE

    timeout_ms: int = 0
    ranges: list[RangeId] = field(default_factory=list)


@dataclass(slots=True)
class CreateRangeResult(Message):
    stream_id: int = -1
    status: Status = OK
    range: Range | None = None


@dataclass(slots=True)
class CreateRangeResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.CREATE_RANGE

    throttle_time_ms: int = 0
    status: Status = OK
    create_responses: list[CreateRangeResult] = field(default_factory=list)


@dataclass(slots=True)
class DescribeRangesRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_RANGES

    timeout_ms: int = 0
    ranges: list[RangeId] = field(default_factory=list)


@dataclass(slots=True)
class DescribeRangesResult(Message):
    """``next_offset_snapshot``: ``range.next_offset`` is the PD's record of an open range,
    which may lag; the range's primary knows the live value."""

    stream_id: int = -1
    status: Status = OK
    range: Range | None = None
    next_offset_snapshot: bool = False


@dataclass(slots=True)
class DescribeRangesResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_RANGES

    throttle_time_ms: int = 0
    status: Status = OK
    describe_responses: list[DescribeRangesResult] = field(default_factory=list)


# ---- streams -----------------------------------------------------------------------------


@dataclass(slots=True)
class CreateStreamsRequest(Message):
    """Streams to create. A stream_id of -1 lets the PD choose; any other asks for that id
    (STREAM_ALREADY_EXISTS if a stream has or had it)."""

    OPCODE: ClassVar[Opcode] = Opcode.CREATE_STREAMS

    timeout_ms: int = 0
    streams: list[Stream] = field(default_factory=list)


@dataclass(slots=True)
class CreateStreamsResult(Message):
    stream: Stream | None = None
    status: Status = OK


@dataclass(slots=True)
class CreateStreamsResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.CREATE_STREAMS

    throttle_time_ms: int = 0
    status: Status = OK
    create_responses: list[CreateStreamsResult] = field(default_factory=list)


@dataclass(slots=True)
class DeleteStreamsRequest(Message):
    """Only each stream's stream_id is read."""

    OPCODE: ClassVar[Opcode] = Opcode.DELETE_STREAMS

    timeout_ms: int = 0
    streams: list[Stream] = field(default_factory=list)


@dataclass(slots=True)
class DeleteStreamsResult(Message):
    deleted_stream: Stream | None = None
    status: Status = OK


@dataclass(slots=True)
class DeleteStreamsResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DELETE_STREAMS

    throttle_time_ms: int = 0
    status: Status = OK
    delete_responses: list[DeleteStreamsResult] = field(default_factory=list)


@dataclass(slots=True)
class UpdateStreamsRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.UPDATE_STREAMS

    timeout_ms: int = 0
    streams: list[Stream] = field(default_factory=list)


@dataclass(slots=True)
class UpdateStreamsResult(Message):
    updated_stream: Stream | None = None
    status: Status = OK


@dataclass(slots=True)
class UpdateStreamsResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.UPDATE_STREAMS

    throttle_time_ms: int = 0
    status: Status = OK
    update_responses: list[UpdateStreamsResult] = field(default_factory=list)


@dataclass(slots=True)
class DescribeStreamsRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_STREAMS

    timeout_ms: int = 0
    stream_ids: list[int] = field(default_factory=list)
    by_name: list[Stream] = field(default_factory=list)  # ours: looked up by their name


@dataclass(slots=True)
class DescribeStreamsResult(Message):
    stream: Stream | None = None
    status: Status = OK


@dataclass(slots=True)
class DescribeStreamsResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_STREAMS

    throttle_time_ms: int = 0
    status: Status = OK
    describe_responses: list[DescribeStreamsResult] = field(default_factory=list)


@dataclass(slots=True)
class TrimmedStream(Message):
    stream_id: int = -1
    trim_offset: int = 0


@dataclass(slots=True)
class TrimStreamsRequest(Message):
    """Drop each stream's records below its trim_offset."""

    OPCODE: ClassVar[Opcode] = Opcode.TRIM_STREAMS

    timeout_ms: int = 0
    trimmed_streams: list[TrimmedStream] = field(default_factory=list)


@dataclass(slots=True)
class TrimStreamsResult(Message):
    trimmed_stream: Stream | None = None
    status: Status = OK
    range: Range | None = None  # the stream's first range after the trim


@dataclass(slots=True)
class TrimStreamsResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.TRIM_STREAMS

    throttle_time_ms: int = 0
    status: Status = OK
    streams: list[TrimStreamsResult] = field(default_factory=list)


# ---- named consumers (ours, schemas/consumers.fbs) ---------------------------------------


@dataclass(slots=True)
class ConsumerPosition(Message):
    """Every record of ``stream_id`` below ``committed_offset`` is read."""

    stream_id: int = -1
    committed_offset: int = -1
    commit_time_ms: int = -1  # when the PD recorded it; -1 in requests


@dataclass(slots=True)
class Consumer(Message):
    """A named consumer: its generation (0: never joined) and positions, per stream."""

    name: str = ""
    generation: int = 0
    positions: list[ConsumerPosition] = field(default_factory=list)
    created_ms: int = -1


@dataclass(slots=True)
class JoinConsumerRequest(Message):
    """Start the consumer's next generation (creating the consumer if need be)."""

    OPCODE: ClassVar[Opcode] = Opcode.JOIN_CONSUMER

    timeout_ms: int = 0
    name: str = ""


@dataclass(slots=True)
class JoinConsumerResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.JOIN_CONSUMER

    throttle_time_ms: int = 0
    status: Status = OK
    consumer: Consumer | None = None


@dataclass(slots=True)
class CommitConsumerRequest(Message):
    """Record positions under ``generation`` (CONSUMER_FENCED unless it is the current one)."""

    OPCODE: ClassVar[Opcode] = Opcode.COMMIT_CONSUMER

    timeout_ms: int = 0
    name: str = ""
    generation: int = 0
    positions: list[ConsumerPosition] = field(default_factory=list)


@dataclass(slots=True)
class CommitConsumerResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.COMMIT_CONSUMER

    throttle_time_ms: int = 0
    status: Status = OK
    consumer: Consumer | None = None


@dataclass(slots=True)
class DescribeConsumersRequest(Message):
    """The consumers named (only ``name`` is read); none named: every consumer."""

    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_CONSUMERS

    timeout_ms: int = 0
    consumers: list[Consumer] = field(default_factory=list)


@dataclass(slots=True)
class ConsumerResult(Message):
    consumer: Consumer | None = None
    status: Status = OK


@dataclass(slots=True)
class DescribeConsumersResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_CONSUMERS

    throttle_time_ms: int = 0
    status: Status = OK
    results: list[ConsumerResult] = field(default_factory=list)


@dataclass(slots=True)
class DeleteConsumersRequest(Message):
    """Forget the consumers named (only ``name`` is read)."""

    OPCODE: ClassVar[Opcode] = Opcode.DELETE_CONSUMERS

    timeout_ms: int = 0
    consumers: list[Consumer] = field(default_factory=list)


@dataclass(slots=True)
class DeleteConsumersResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DELETE_CONSUMERS

    throttle_time_ms: int = 0
    status: Status = OK
    results: list[ConsumerResult] = field(default_factory=list)
# ---- permissions (ours) -------------------------------------------------------------------

@dataclass(slots=True)
class Permission(Message):
    """``principal`` may do ``operation`` on ``stream`` (an id in digits, a name, ``*``; ""
    for ``create``); ``stream_id``: in answers, the live stream ``stream`` names (-1: none)."""

    principal: str = ""
    operation: str = ""
    stream: str = ""
    stream_id: int = -1


@dataclass(slots=True)
class GrantPermissionsRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.GRANT_PERMISSIONS

    permissions: list[Permission] = field(default_factory=list)


@dataclass(slots=True)
class GrantPermissionsResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.GRANT_PERMISSIONS

    status: Status = OK
    version: int = -1


@dataclass(slots=True)
class RevokePermissionsRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.REVOKE_PERMISSIONS

    permissions: list[Permission] = field(default_factory=list)


@dataclass(slots=True)
class RevokePermissionsResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.REVOKE_PERMISSIONS

    status: Status = OK
    version: int = -1


@dataclass(slots=True)
class DescribePermissionsRequest(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_PERMISSIONS

    principal: str = ""


@dataclass(slots=True)
class DescribePermissionsResponse(Message):
    OPCODE: ClassVar[Opcode] = Opcode.DESCRIBE_PERMISSIONS

    status: Status = OK
    permissions: list[Permission] = field(default_factory=list)
    version: int = -1


# ---- codecs and registries ---------------------------------------------------------------

TABLES: dict[str, type[Message]] = {
    cls.__name__: cls for cls in Message.__subclasses__()  # every table class, by name
}
_CODECS = build_codecs(wire_tables, {**TABLES, "AppendEntry": AppendEntry,
                                          "ProducerSequence": ProducerSequence},
                       {"ErrorCode": ErrorCode, "ClientRole": ClientRole})
for _name, _cls in TABLES.items():
    _cls._CODEC = _CODECS[_name]
del _name, _cls

REQUESTS: dict[int, type[Message]] = {
    cls.OPCODE: cls for cls in TABLES.values() if cls.__name__.endswith("Request")
}
RESPONSES: dict[int, type[Message]] = {
    cls.OPCODE: cls for cls in TABLES.values() if cls.__name__.endswith("Response")
}


# ---- frames ------------------------------------------------------------------------------

# Plain ints: an operation on the IntFlag members builds a new member each time.
_RESPONSE = int(Flags.RESPONSE)
_RESPONSE_END = int(Flags.RESPONSE | Flags.END)


def request_frame(stream_id: int, msg: Message, payload: Buffer | Sequence[Buffer] = b""
                  ) -> list[Buffer]:
    """A request frame for ``msg`` as buffers for ``socket.sendmsg``."""
    return encode_frame(msg.OPCODE, 0, stream_id, msg.to_flatbuffers(), payload)


def response_frame(stream_id: int, msg: Message, payload: Buffer | Sequence[Buffer] = b"",
                   end: bool = True) -> list[Buffer]:
    """A response frame for ``msg``; ``end=False`` for all but the last frame of a sequence."""
    return encode_frame(msg.OPCODE, _RESPONSE_END if end else _RESPONSE, stream_id,
                        msg.to_flatbuffers(), payload)


def system_error_frame(stream_id: int, opcode: int, status: Status) -> list[Buffer]:
    """A SYSTEM_ERROR response ending the sequence of request ``stream_id``."""
    flags = Flags.RESPONSE | Flags.END | Flags.SYSTEM_ERROR
    return encode_frame(opcode, flags, stream_id, SystemError(status).to_flatbuffers())


def _header_of(frame: Frame) -> Any:
    if frame.header_format != HEADER_FORMAT_FLATBUFFERS:
        raise HeaderError(f"header_format {frame.header_format} is not supported "
                          "(only 1, FlatBuffers)")
    return frame.header


def decode_request(frame: Frame) -> Message:
    """The typed header of a request frame; ``HeaderError`` if it is not one."""
    if frame.is_response:
        raise HeaderError(f"frame on stream_id {frame.stream_id} is a response, not a request")
    cls = REQUESTS.get(frame.opcode)
    if cls is None:
        raise HeaderError(f"no request table for opcode {frame.opcode:#06x}")
    return cls.from_flatbuffers(_header_of(frame))


@overload
def decode_response(frame: Frame) -> Message: ...


@overload
def decode_response(frame: Frame, expected: type[M]) -> M: ...


def decode_response(frame: Frame, expected: type[Message] | None = None) -> Message:
    """The typed header of a response frame: ``SystemError`` when the frame has that flag.

    With ``expected``, any other table (a SYSTEM_ERROR's too) raises ``HeaderError`` naming
    both, so the caller gets the fields it asked for."""
    if not frame.is_response:
        raise HeaderError(f"frame on stream_id {frame.stream_id} is a request, not a response")
    if frame.is_system_error:
        msg: Message = SystemError.from_flatbuffers(_header_of(frame))
    else:
        cls = RESPONSES.get(frame.opcode)
        if cls is None:
            raise HeaderError(f"no response table for opcode {frame.opcode:#06x}")
        msg = cls.from_flatbuffers(_header_of(frame))
    if expected is not None and not isinstance(msg, expected):
        raise HeaderError(
            f"response on stream_id {frame.stream_id} is a {type(msg).__name__}, "
            f"not the {expected.__name__} expected")
    return msg
