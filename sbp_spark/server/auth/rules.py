"""What every opcode needs: the one table the authorizer reads (docs/wire.md, "Who may do
what").

``RULES`` maps every opcode the protocol defines to a ``Rule``: a function from the decoded
request and the role serving it (the PD, or a range server) to the ``Need``s the principal must
meet, all of them. A ``Need`` is met by any one of its ``operations``: a stream operation
(read, write, admin) on its stream, ``create``, or one of the roles below. An opcode missing
here is refused whenever authentication is on (fail closed); a test checks that every opcode
of ``protocol.constants.Opcode`` has an entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import Opcode

from .acl import ADMIN, CREATE, READ, WRITE

# Roles a Need may ask for besides the permissions of acl.py.
SERVER = "server"  # a range server or a PD (the server role)
SUPERUSER = "superuser"
ANYONE = "anyone"  # any authenticated principal
SELF = "self"  # the principal the request names is the one asking


class Need(NamedTuple):
    """One of ``operations`` on ``stream_id`` (or the stream named ``name``); ``principal``:
    the principal a SELF need names."""

    operations: tuple[str, ...]
    stream_id: int | None = None
    name: str = ""
    principal: str = ""


PD, RANGE_SERVER = "pd", "range server"
_WRITE = (WRITE,)
_SERVER_ONLY = (SERVER,)
# Looking a stream up (its ranges, its record): any permission on it, as a writer finds the
# open range and a stream's id by its name before it appends.
_LOOK = (READ, WRITE, ADMIN)
Rule = Callable[[Any, str], list[Need]]


def _core(_request: Any, _role: str) -> list[Need]:
    # Served by the network core before any authorizer is asked (PING, GOAWAY,
    # AUTHENTICATE): never reaches it.
    return []


def _anyone(_request: Any, _role: str) -> list[Need]:
    return [Need((ANYONE,))]


def _server(_request: Any, _role: str) -> list[Need]:
    return [Need((SERVER,))]


def _superuser(_request: Any, _role: str) -> list[Need]:
    return [Need((SUPERUSER,))]


def _on_streams(operations: tuple[str, ...], ids: Callable[[Any], list[int]],
                on_range_server: tuple[str, ...] | None = None) -> Rule:
    """Each stream ``ids(request)`` names needs one of ``operations``; on a range server one
    of ``on_range_server`` when given (what the PD alone sends there)."""
    def rule(request: Any, role: str) -> list[Need]:
        if role == RANGE_SERVER and on_range_server is not None:
            return [Need(on_range_server)]
        return [Need(operations, stream_id) for stream_id in sorted(set(ids(request)))]
    return rule


def _heartbeat(request: m.HeartbeatRequest, role: str) -> list[Need]:
    if role == PD and request.client_role == m.ClientRole.RANGE_SERVER:
        return [Need((SERVER,))]  # registering as a range server
    return [Need((ANYONE,))]


def _append(request: m.AppendRequest, _role: str) -> list[Need]:
    # A primary's forwards and cap notices carry what only primaries set.
    if request.range_index >= 0 or request.committed_offset >= 0 \
            or request.cap_notice is not None:
        return [Need(_SERVER_ONLY)]
    entries = request.append_requests
    if len(entries) == 1:  # the common case, on every APPEND: no set, no sort
        return [Need(_WRITE, entries[0].stream_id)]
    return [Need(_WRITE, s) for s in sorted({e.stream_id for e in entries})]


def _list_ranges(request: m.ListRangesRequest, _role: str) -> list[Need]:
    needs = []
    for owner in request.range_owners:
        needs.append(Need((SERVER,)) if owner.range_server is not None
                     else Need(_LOOK, owner.stream_id))
    return needs


def _describe_streams(request: m.DescribeStreamsRequest, _role: str) -> list[Need]:
    # A request naming no stream lists the live streams: answered with those the principal
    # may read (``Authorizer.readable``).
    return ([Need(_LOOK, s) for s in sorted(set(request.stream_ids))]
            + [Need(_LOOK, None, s.name) for s in request.by_name])


def _describe_permissions(request: m.DescribePermissionsRequest, _role: str) -> list[Need]:
    return [Need((SUPERUSER, SERVER, SELF), principal=request.principal or "*")]


def _range_ids(request: Any) -> list[int]:
    return [r.stream_id for r in request.ranges]


def _stream_ids(request: Any) -> list[int]:
    return [s.stream_id for s in request.streams]


RULES: dict[int, Rule] = {
    Opcode.PING: _core,
    Opcode.GOAWAY: _core,
    Opcode.AUTHENTICATE: _core,
    Opcode.HEARTBEAT: _heartbeat,
    Opcode.ALLOCATE_ID: _server,
    Opcode.APPEND: _append,
    Opcode.FETCH: _on_streams((READ,), lambda r: [e.stream_id for e in r.fetch_requests]),
    # A writer asks which of its batches in doubt a sealed range holds: part of writing.
    Opcode.LOOKUP_SEQUENCES: _on_streams(
        _WRITE, lambda r: [] if r.range is None else [r.range.stream_id]),
    Opcode.LIST_RANGES: _list_ranges,
    # A writer seals the range whose primary failed and goes on in the next: part of writing.
    Opcode.SEAL_RANGES: _on_streams((WRITE, ADMIN), _range_ids, on_range_server=(SERVER,)),
    Opcode.SYNC_RANGES: _server,
    Opcode.CREATE_RANGE: _on_streams((WRITE, ADMIN), _range_ids),
    Opcode.DESCRIBE_RANGES: _on_streams(_LOOK, _range_ids),
    Opcode.CREATE_STREAMS: lambda _r, _role: [Need((CREATE,))],
    Opcode.DELETE_STREAMS: _on_streams((ADMIN,), _stream_ids, on_range_server=(SERVER,)),
    Opcode.UPDATE_STREAMS: _on_streams((ADMIN,), _stream_ids),
    Opcode.DESCRIBE_STREAMS: _describe_streams,
    Opcode.TRIM_STREAMS: _on_streams((ADMIN,), lambda r: [t.stream_id
                                                           for t in r.trimmed_streams],
                                      on_range_server=(SERVER,)),
    Opcode.REPORT_METRICS: _server,
    Opcode.DESCRIBE_PD_CLUSTER: _anyone,
    Opcode.GRANT_PERMISSIONS: _superuser,
    Opcode.REVOKE_PERMISSIONS: _superuser,
    Opcode.DESCRIBE_PERMISSIONS: _describe_permissions,
    # Named consumers: a position is recorded by a reader of the stream. Consumer names are no
    # resource of their own (as Kafka's groups are): any authenticated principal may join one
    # or look at the records, and deleting one, which may let retention trim what it waited
    # for, is the superusers'.
    Opcode.JOIN_CONSUMER: _anyone,
    Opcode.COMMIT_CONSUMER: _on_streams((READ,), lambda r: [p.stream_id for p in r.positions]),
    Opcode.DESCRIBE_CONSUMERS: _anyone,
    Opcode.DELETE_CONSUMERS: _superuser,
}


__all__ = ["ANYONE", "PD", "RANGE_SERVER", "RULES", "SELF", "SERVER", "SUPERUSER", "Need",
           "Rule"]
