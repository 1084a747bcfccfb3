"""The PD's records in their wire form, naming each range server by its current address."""

from __future__ import annotations

from collections.abc import Callable

from sbp_spark.protocol import messages as m

from .meta import RangeMeta, ServerMeta, StreamMeta


class Addresses:
    """Where each range server is now: the address of its last heartbeat to this PD (``heard``),
    else the one on record (``recorded``: a server not heard from since this PD started)."""

    def __init__(self, heard: Callable[[int], str | None],
                 recorded: Callable[[int], ServerMeta | None]) -> None:
        self._heard = heard
        self._recorded = recorded

    def of(self, server: ServerMeta | int) -> str:
        """The address of ``server`` (its id or its record); "" if it never announced one."""
        sid = server if isinstance(server, int) else server.server_id
        addr = self._heard(sid)
        if addr:
            return addr
        meta = self._recorded(sid) if isinstance(server, int) else server
        return meta.advertise_addr if meta is not None else ""

    def range_msg(self, rng: RangeMeta, for_servers: bool = False) -> m.Range:
        """The wire form of a range. Range servers know a range by where it began before any
        trim (``for_servers``); clients see its current start."""
        return m.Range(
            stream_id=rng.stream_id, range_index=rng.range_index,
            start_offset=rng.base_start_offset if for_servers else rng.start_offset,
            next_offset=rng.next_offset,
            end_offset=rng.end_offset,
            servers=[m.RangeReplica(m.RangeServer(r.server_id, self.of(r.server_id)),
                                    r.is_primary) for r in rng.holders])


def stream_msg(stream: StreamMeta) -> m.Stream:
    """The wire form of a stream."""
    return m.Stream(stream_id=stream.stream_id, replica_nums=stream.replica_nums,
                    retention_period_ms=stream.retention_period_ms,
                    start_offset=stream.start_offset, deleted=stream.deleted,
                    name=stream.name, retain_for_consumers=stream.retain_for_consumers,
                    retain_cap_bytes=stream.retain_cap_bytes,
                    retain_cap_ms=stream.retain_cap_ms)
