"""What the PD's metadata is, whichever store keeps it: records, rules and the store interface.

The records (``StreamMeta``, ``RangeMeta`` with its ``RangeHolder``s, ``ServerMeta``) are small
frozen dataclasses the PD turns into wire messages. The rules every store applies the same way
(what a new range needs, when a seal or a trim is refused, and the errors that say so) are
functions here, so the SQLite store (``sqlite_store.py``) and the etcd store
(``etcd_store.py``) refuse the same requests with the same messages. ``MetadataStore`` is the
interface both implement.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from sbp_spark.protocol.errors import (
    InvalidRequestError,
    OffsetOutOfRangeError,
    RangeNotFoundError,
    RangeSealedError,
    StreamAlreadyExistsError,
    StreamNotFoundError,
)
from sbp_spark.protocol.names import name_problem

from ..auth.acl import AclEntry

# Status detail of a HEARTBEAT refused because this PD never issued the server id (the range
# server's PD link tells it apart from other refusals by it).
UNKNOWN_SERVER_ID = b"unknown-server-id"


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """A stream as the PD records it. ``start_offset`` is the trim point; ``name`` is "" for
    a stream without one."""

    stream_id: int
    replica_nums: int
    retention_period_ms: int
    start_offset: int = 0
    deleted: bool = False
    name: str = ""
    # Retention that waits for named consumers, with its caps (-1: none).
    retain_for_consumers: bool = False
    retain_cap_bytes: int = -1
    retain_cap_ms: int = -1


@dataclass(frozen=True, slots=True)
class RangeHolder:
    """A range server that holds a copy of a range, as the PD records it: its id, and whether
    it is the range's primary."""

    server_id: int
    is_primary: bool


@dataclass(frozen=True, slots=True)
class RangeMeta:
    """A range of a stream: offsets ``[start_offset, end_offset)``; ``end_offset`` -1 = open.

    ``next_offset`` is the PD's snapshot; for an open range the primary knows the live value.
    ``base_start_offset`` is where the range began before any trim: range servers know a range
    by it, while ``start_offset`` moves up with trims.
    """

    stream_id: int
    range_index: int
    start_offset: int
    end_offset: int
    next_offset: int
    holders: tuple[RangeHolder, ...] = ()
    base_start_offset: int = -1

    def __post_init__(self) -> None:
        if self.base_start_offset < 0:
            object.__setattr__(self, "base_start_offset", self.start_offset)

    @property
    def is_open(self) -> bool:
        return self.end_offset < 0

    @property
    def primary(self) -> int | None:
        """Server id of the primary replica, if any."""
        for r in self.holders:
            if r.is_primary:
                return r.server_id
        return None

    @property
    def server_ids(self) -> list[int]:
        return [r.server_id for r in self.holders]


@dataclass(frozen=True, slots=True)
class ServerMeta:
    """A range server known to the PD (its id was allocated here or it announced itself)."""

    server_id: int
    host: str
    advertise_addr: str
    last_heartbeat_ms: int
    metrics: dict[str, int] = field(default_factory=dict)
    metrics_ms: int = -1

    @property
    def registered(self) -> bool:
        """True once the server has heartbeated at least once."""
        return self.last_heartbeat_ms >= 0


@dataclass(frozen=True, slots=True)
class RetentionHold:
    """A stream's retention that waits for its named consumers: on or off, and its caps in
    bytes and in ms (-1: none)."""

    retain_for_consumers: bool = False
    retain_cap_bytes: int = -1
    retain_cap_ms: int = -1

    def check(self) -> None:
        """Refuse caps that are neither -1 nor positive."""
        for name, value in (("retain_cap_bytes", self.retain_cap_bytes),
                            ("retain_cap_ms", self.retain_cap_ms)):
            if value < -1 or value == 0:
                raise InvalidRequestError(f"{name} must be -1 (no cap) or > 0, got {value}")


# Highest stream id CREATE_STREAMS may ask for. The PD chooses the highest id so far + 1, so an
# asked-for id near the top of the (signed 64-bit) id space would leave it none to choose.
MAX_ASKED_STREAM_ID = (1 << 62) - 1


# -- the rules ----------------------------------------------------------------------------


def check_new_stream(replica_nums: int, servers: Sequence[int], stream_id: int | None,
                     name: str = "") -> None:
    """A new stream needs one server per replica; an asked-for id must be >= 0 and at most
    ``MAX_ASKED_STREAM_ID``; a name must be valid (``protocol.names``)."""
    if len(servers) != replica_nums:
        raise InvalidRequestError(
            f"range 0 needs {replica_nums} servers, {len(servers)} given")
    if stream_id is not None:
        check_asked_stream_id(stream_id)
    check_stream_name(name)


def check_stream_name(name: str) -> None:
    """Refuse a name that is not valid; "" (no name) is accepted."""
    if name:
        problem = name_problem(name)
        if problem is not None:
            raise InvalidRequestError(problem)


def name_taken(name: str, stream_id: int) -> StreamAlreadyExistsError:
    """The error for creating a stream under a name a live stream has."""
    return StreamAlreadyExistsError(f"stream name {name!r} is taken by stream {stream_id}")


def name_missing(name: str) -> StreamNotFoundError:
    """The error for a name no live stream has."""
    return StreamNotFoundError(f"no stream is named {name!r}")


def check_asked_stream_id(stream_id: int) -> None:
    """An id a create asks for must be >= 0 and at most ``MAX_ASKED_STREAM_ID``."""
    if stream_id < 0:
        raise InvalidRequestError(f"stream_id must be >= 0, got {stream_id}")
    if stream_id > MAX_ASKED_STREAM_ID:
        raise InvalidRequestError(
            f"stream_id {stream_id} is above {MAX_ASKED_STREAM_ID}, the highest a create may "
            f"ask for: the ids above it are left for the PD to choose")


def stream_taken(stream_id: int, deleted: bool) -> StreamAlreadyExistsError:
    """The error for creating a stream whose id exists or once existed."""
    state = "was deleted; ids are never reused" if deleted else "exists"
    return StreamAlreadyExistsError(f"stream {stream_id} {state}")


def stream_missing(stream_id: int, deleted: bool = False) -> StreamNotFoundError:
    """The error for a stream that never existed, or was deleted."""
    if deleted:
        return StreamNotFoundError(f"stream {stream_id} was deleted")
    return StreamNotFoundError(f"stream {stream_id} does not exist")


def range_missing(stream_id: int, range_index: int) -> RangeNotFoundError:
    return RangeNotFoundError(f"stream {stream_id} has no range {range_index}")


def new_range(stream_id: int, range_index: int, start_offset: int,
              servers: Sequence[int]) -> RangeMeta:
    """An open range on ``servers`` (the first is the primary), checked."""
    if not servers:
        raise InvalidRequestError("a range needs at least one server")
    if len(set(servers)) != len(servers):
        raise InvalidRequestError(f"a range's servers must differ, got {list(servers)}")
    return RangeMeta(stream_id, range_index, start_offset, -1, start_offset,
                     tuple(RangeHolder(sid, i == 0) for i, sid in enumerate(servers)))


def next_range(last: RangeMeta, servers: Sequence[int]) -> RangeMeta:
    """The range after ``last``, which must be sealed."""
    if last.is_open:
        raise InvalidRequestError(
            f"range {last.range_index} of stream {last.stream_id} is still open; seal it first")
    return new_range(last.stream_id, last.range_index + 1, last.end_offset, servers)


def sealed_range(rng: RangeMeta, end_offset: int) -> RangeMeta:
    """``rng`` sealed at ``end_offset``: a retried seal at the same end is accepted; another
    end of a sealed range, or an end below its start, is refused."""
    if not rng.is_open and rng.end_offset != end_offset:
        raise RangeSealedError(
            f"range {rng.range_index} of stream {rng.stream_id} is already sealed at "
            f"{rng.end_offset}")
    if end_offset < rng.start_offset:
        raise InvalidRequestError(
            f"end offset {end_offset} is below the start {rng.start_offset} of range "
            f"{rng.range_index} of stream {rng.stream_id}")
    return replace(rng, end_offset=end_offset, next_offset=end_offset)


def check_trim(stream_id: int, trim_offset: int, last: RangeMeta, end_offset: int | None) -> None:
    """Refuse a negative trim point, or one beyond the stream's end (``end_offset`` when the
    caller knows the open range's live end, else the PD's record of it)."""
    if trim_offset < 0:
        raise InvalidRequestError(f"trim_offset must be >= 0, got {trim_offset}")
    if end_offset is None:
        end_offset = last.end_offset if not last.is_open else last.next_offset
    if trim_offset > end_offset:
        raise OffsetOutOfRangeError(
            f"cannot trim stream {stream_id} at {trim_offset}: it ends at {end_offset}")


def trimmed_ranges(ranges: Sequence[RangeMeta], trim_offset: int
                   ) -> tuple[list[RangeMeta], list[RangeMeta]]:
    """(ranges dropped, ranges changed) by a trim at ``trim_offset`` above the stream's start.

    Ranges wholly below the trim point go, except the last (a stream always has a range to
    continue from); a range that starts below it starts there now (its next_offset too, when
    it was below)."""
    dropped = [r for r in ranges[:-1] if r.end_offset <= trim_offset]
    changed = [replace(r, start_offset=trim_offset, next_offset=max(r.next_offset, trim_offset))
               for r in ranges if r not in dropped and r.start_offset < trim_offset]
    return dropped, changed


def unknown_server(server_id: int, advertise_addr: str, issued: int) -> InvalidRequestError:
    """The refusal of a heartbeat from a server id this PD never issued (``issued`` ids so
    far). Accepting it would let a server of another cluster, or one whose id this PD's (reset
    or restored) metadata never issued, take ranges under an id that may later be handed to a
    different server."""
    return InvalidRequestError(
        f"range server id {server_id} (at {advertise_addr}) was never issued by this PD, which "
        f"has issued {issued} id{'s' if issued != 1 else ''}: the server's data directory "
        f"belongs to another cluster, or this PD's metadata was reset or restored from an "
        f"older copy", detail=UNKNOWN_SERVER_ID)


def not_registered(server_id: int) -> InvalidRequestError:
    return InvalidRequestError(f"range server {server_id} is not registered")


# -- the interface ------------------------------------------------------------------------


class MetadataStore(Protocol):
    """The PD's durable metadata, as ``PdStore`` (SQLite) and ``EtcdStore`` keep it.

    Every change is atomic: a reader sees the state before it or after it, never half of a
    seal or a stream without its first range. Refusals raise ``ServerError`` subclasses.
    """

    def close(self) -> None: ...

    def create_stream(self, replica_nums: int, retention_period_ms: int,
                      servers: Sequence[int], stream_id: int | None = None,
                      name: str = "") -> tuple[StreamMeta, RangeMeta]: ...

    def check_stream_id_free(self, stream_id: int) -> None: ...

    def check_name_free(self, name: str) -> None: ...

    def get_stream(self, stream_id: int) -> StreamMeta: ...

    def stream_named(self, name: str) -> StreamMeta: ...

    def list_streams(self, include_deleted: bool = False) -> list[StreamMeta]: ...

    def update_stream(self, stream_id: int, replica_nums: int,
                      retention_period_ms: int, hold: RetentionHold | None = None
                      ) -> StreamMeta: ...

    def delete_stream(self, stream_id: int) -> tuple[StreamMeta, list[RangeMeta]]: ...

    def trim_stream(self, stream_id: int, trim_offset: int,
                    end_offset: int | None = None) -> tuple[StreamMeta, RangeMeta]: ...

    def list_ranges(self, stream_id: int) -> list[RangeMeta]: ...

    def ranges_on_server(self, server_id: int) -> list[RangeMeta]: ...

    def get_range(self, stream_id: int, range_index: int) -> RangeMeta: ...

    def last_range(self, stream_id: int) -> RangeMeta: ...

    def open_range_counts(self) -> dict[int, int]: ...

    def seal_range(self, stream_id: int, range_index: int, end_offset: int,
                   next_servers: Sequence[int] | None = None
                   ) -> tuple[RangeMeta, RangeMeta | None]: ...

    def open_next_range(self, stream_id: int, servers: Sequence[int]) -> RangeMeta: ...

    def update_next_offset(self, stream_id: int, range_index: int, next_offset: int) -> None: ...

    def allocate_server_id(self, host: str = "") -> int: ...

    def record_heartbeat(self, server_id: int, advertise_addr: str,
                         now_ms: int | None = None) -> ServerMeta: ...

    def record_metrics(self, server_id: int, metrics: dict[str, int],
                       now_ms: int | None = None) -> None: ...

    def get_server(self, server_id: int) -> ServerMeta | None: ...

    def list_servers(self) -> list[ServerMeta]: ...

    def acl(self) -> tuple[int, list[AclEntry]]: ...

    def change_acl(self, grant: bool, entries: Sequence[AclEntry]) -> int: ...


@dataclass(frozen=True, slots=True)
class SealedEnd:
    """Where a seal ended a range, the secondaries its primary could not reach lately
    (``SealRangesResult.unreachable``: why the primary had sealed the range itself), and the
    secondaries that did not seal (down, or not answering in time): pushes skip them, and
    they are resynced when they next heartbeat."""

    end: int
    unreachable: tuple[int, ...] = ()
    missed: tuple[int, ...] = ()
