"""The PD's changes of streams: create, update, delete, trim.

Each writes the metadata first, then tells the range servers concerned: a new stream's range 0
is pushed to its servers; a deleted stream's servers refuse it from then on; a trimmed stream's
servers drop the data below the new start. A server that cannot be told is logged and left to
catch up (the metadata is what clients go by).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import MAX_REPLICAS
from sbp_spark.protocol.errors import InvalidRequestError, SbpError

from .meta import MetadataStore, RangeMeta, RetentionHold, StreamMeta
from .placement import Placement
from .succession import Pusher, StreamLocks
from .wire import stream_msg

log = logging.getLogger(__package__)


class StreamCalls(Protocol):
    """The requests to range servers a change of streams sends (``calls.RangeServerCalls``):
    ``next_offset`` is None when the primary cannot say, the others raise when the server could
    not be told."""

    def next_offset(self, rng: RangeMeta, timeout_s: float | None = None) -> int | None: ...

    def delete_streams(self, server_id: int, streams: Sequence[m.Stream],
                       timeout_s: float | None = None) -> None: ...

    def trim(self, server_id: int, stream_id: int, start_offset: int,
             timeout_s: float | None = None) -> None: ...


def _check_stream_settings(replica_nums: int, retention_period_ms: int) -> None:
    if not 1 <= replica_nums <= MAX_REPLICAS:
        raise InvalidRequestError(
            f"replica_nums must be between 1 and {MAX_REPLICAS}, got {replica_nums}")
    if retention_period_ms != -1 and retention_period_ms <= 0:
        raise InvalidRequestError(
            f"retention_period_ms must be -1 (keep forever) or > 0, got {retention_period_ms}")


class TrimFloor(Protocol):
    """How far consumers let a trim go (``consumer_retention.ConsumerFloor``)."""

    def allowed(self, stream: StreamMeta, trim_offset: int) -> int: ...


class StreamOperations:
    """Creates, updates, deletes and trims streams; refusals raise ``ServerError``s."""

    def __init__(self, store: MetadataStore, placement: Placement, pushes: Pusher,
                 calls: StreamCalls, locks: StreamLocks, floor: TrimFloor) -> None:
        self._store = store
        self._floor = floor
        self._placement = placement
        self._pushes = pushes
        self._calls = calls
        self._locks = locks

    def create(self, replica_nums: int = 1, retention_period_ms: int = -1,
               stream_id: int = -1, name: str = "") -> tuple[StreamMeta, RangeMeta]:
        """Create a stream with range 0 open on the least loaded live servers; ``stream_id``
        other than -1 asks for that id, ``name`` other than "" gives it that name."""
        _check_stream_settings(replica_nums, retention_period_ms)
        if stream_id != -1:
            # An asked-for id the store would refuse is refused now: no wait for servers,
            # and no NOT_ENOUGH_SERVERS hiding that the id is taken.
            self._store.check_stream_id_free(stream_id)
        if name:
            self._store.check_name_free(name)  # likewise; the store's create decides races
        stream, rng = self._placement.place(replica_nums, lambda servers: (
            self._store.create_stream(replica_nums, retention_period_ms, servers,
                                      stream_id=None if stream_id == -1 else stream_id,
                                      name=name)))
        self._pushes.push([rng])
        return stream, rng

    def update(self, stream_id: int, replica_nums: int, retention_period_ms: int,
               hold: RetentionHold | None = None) -> StreamMeta:
        """Replace a stream's settings; a new replica count applies to ranges opened later.
        ``hold``: its retention that waits for named consumers (None: as it was)."""
        _check_stream_settings(replica_nums, retention_period_ms)
        if hold is not None:
            hold.check()
        return self._store.update_stream(stream_id, replica_nums, retention_period_ms, hold)

    def delete(self, stream_id: int) -> StreamMeta:
        """Delete a stream's metadata and tell its range servers to refuse it from now on."""
        with self._locks.hold(stream_id):
            stream, ranges = self._store.delete_stream(stream_id)
        servers = {sid for rng in ranges for sid in rng.server_ids}
        for sid in sorted(servers):
            try:
                self._calls.delete_streams(sid, [stream_msg(stream)])
            except SbpError as exc:
                # The metadata is gone, so clients can no longer find the stream; the server
                # only loses the chance to refuse stragglers early.
                log.warning("range server %d was not told that stream %d is deleted: %s",
                            sid, stream_id, exc)
        return stream

    def trim(self, stream_id: int, trim_offset: int,
             timeout_s: float | None = None) -> tuple[StreamMeta, RangeMeta]:
        """Move the stream's start to ``trim_offset``; returns it and its first range.

        The metadata changes first (readers stop asking for trimmed offsets), then every range
        server holding a range of the stream is told to drop the data below the trim point. A
        stream that waits for its consumers is trimmed no further than they allow
        (``consumer_retention.ConsumerFloor``).
        """
        # Before the stream's lock: the floor may read the stream's records (its time cap).
        trim_offset = self._floor.allowed(self._store.get_stream(stream_id), trim_offset)
        with self._locks.hold(stream_id):
            ranges = self._store.list_ranges(stream_id)
            last = ranges[-1]
            end = None
            if last.is_open:
                end = self._calls.next_offset(last, timeout_s)
                if end is not None:
                    self._store.update_next_offset(stream_id, last.range_index, end)
            before = self._store.get_stream(stream_id).start_offset
            stream, first = self._store.trim_stream(stream_id, trim_offset, end)
        if stream.start_offset > before:
            holders = sorted({sid for rng in ranges for sid in rng.server_ids})
            for sid in holders:
                try:
                    self._calls.trim(sid, stream_id, stream.start_offset, timeout_s)
                except SbpError as exc:
                    # Readers already see the new start; the server only keeps its disk
                    # space a while longer (its retention pass trims on its own).
                    log.warning("range server %d was not told to trim stream %d at %d: %s",
                                sid, stream_id, stream.start_offset, exc)
        return stream, first
