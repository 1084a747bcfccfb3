"""What the PD tells range servers about their ranges: pushes (SYNC_RANGES) and resyncs.

``RangePushes`` pushes each new or changed range to the servers holding it, and remembers what
it owes them: a server whose push failed, or that (re)appeared, is owed a full resync of every
range it holds, sent on its next heartbeat.

A seal's and a failover's pushes run under the stream's lock (a seal right behind must find
the range on its servers: ``succession.py``); a new stream's push runs after the stream was
created, so a DELETE_STREAMS can overtake one and reach a server that holds no range of the
stream yet: nothing there remembers it, and the push would then create a range of a deleted
stream that acknowledges appends nobody can read. So a push leaves out streams already deleted,
and after a server took the push, every stream in it that was deleted meanwhile is deleted on
that server again (now it holds the range and marks it). Deletion is written to the metadata
before any DELETE_STREAMS goes out, so one of the two always reaches the server after the
range.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Protocol

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import SbpError, StreamNotFoundError

from .meta import RangeMeta, StreamMeta

log = logging.getLogger(__package__)

# Ranges per SYNC_RANGES frame when the PD pushes a server everything it holds: keeps one frame
# far below the 16 MiB limit however many ranges a server has.
SYNC_BATCH_RANGES = 2000

# Above this many streams, which of them are deleted is read from one listing of the streams.
_LOOKUPS_BEFORE_LISTING = 16


class PushLink(Protocol):
    """The requests a push sends (``calls.RangeServerCalls``), each raising when the server
    did not take it."""

    def sync(self, server_id: int, ranges: Sequence[RangeMeta],
             timeout_s: float | None = None) -> None: ...

    def delete_streams(self, server_id: int, streams: Sequence[m.Stream],
                       timeout_s: float | None = None) -> None: ...


class StreamRecords(Protocol):
    """What pushes read of the metadata."""

    def get_stream(self, stream_id: int) -> StreamMeta: ...

    def list_streams(self, include_deleted: bool = False) -> list[StreamMeta]: ...

    def ranges_on_server(self, server_id: int) -> list[RangeMeta]: ...


class RangePushes:
    """Pushes of ranges to their servers through ``link``, and the resyncs owed."""

    def __init__(self, link: PushLink, records: StreamRecords) -> None:
        self.link = link
        self._records = records
        self._owed: set[int] = set()  # servers owed a full SYNC_RANGES
        self._lock = threading.Lock()

    def push(self, ranges: Iterable[RangeMeta], timeout_s: float | None = None,
             skip: Iterable[int] = ()) -> None:
        """SYNC_RANGES ``ranges`` to the servers holding them; failures, and the servers in
        ``skip`` (known to be down), are owed a resync.

        Secondaries hear first: a primary that learned of a new range before its secondaries
        would forward its first appends to servers that do not hold the range yet, fail them
        and seal the range at once."""
        by_server: dict[int, list[RangeMeta]] = defaultdict(list)
        leaders: set[int] = set()  # primaries of open ranges: pushed last
        ranges = list(ranges)
        gone = self.deleted({rng.stream_id for rng in ranges})
        for rng in ranges:
            if rng.stream_id in gone:
                continue
            for sid in rng.server_ids:
                by_server[sid].append(rng)
            if rng.is_open and rng.primary is not None:
                leaders.add(rng.primary)
        for sid in set(skip) & by_server.keys():
            del by_server[sid]
            self.owe_resync(sid)
        for sid, held in sorted(by_server.items(), key=lambda item: item[0] in leaders):
            try:
                self.sync_to(sid, held, timeout_s)
            except SbpError as exc:
                log.warning("SYNC_RANGES to range server %d failed; it will be resynced on "
                            "its next heartbeat: %s", sid, exc)
                self.owe_resync(sid)

    def sync_to(self, server_id: int, ranges: Sequence[RangeMeta],
                timeout_s: float | None = None) -> None:
        """SYNC_RANGES ``ranges`` to one server, ``SYNC_BATCH_RANGES`` a request, then delete
        there again the streams deleted meanwhile. Raises when the server could not be reached
        or refused a whole request."""
        for start in range(0, len(ranges), SYNC_BATCH_RANGES):
            chunk = ranges[start:start + SYNC_BATCH_RANGES]
            self.link.sync(server_id, chunk, timeout_s)
            gone = self.deleted({rng.stream_id for rng in chunk})
            if gone:
                self._tell_deleted(server_id, gone, timeout_s)

    def deleted(self, stream_ids: Iterable[int]) -> set[int]:
        """The streams of ``stream_ids`` that are deleted in the metadata: one lookup each for
        a few (a create, a seal), one listing for many (a server's resync; on etcd every
        lookup is a round trip)."""
        stream_ids = set(stream_ids)
        if len(stream_ids) > _LOOKUPS_BEFORE_LISTING:
            try:
                live = {s.stream_id for s in self._records.list_streams()}
            except SbpError as exc:  # the metadata cannot say now: push as before
                log.warning("could not tell which of %d streams are deleted: %s",
                            len(stream_ids), exc)
                return set()
            return stream_ids - live
        gone = set()
        for stream_id in stream_ids:
            try:
                self._records.get_stream(stream_id)
            except StreamNotFoundError:
                gone.add(stream_id)
            except SbpError as exc:  # the metadata cannot say now: push as before
                log.warning("could not tell whether stream %d is deleted: %s", stream_id, exc)
        return gone

    def _tell_deleted(self, server_id: int, stream_ids: Iterable[int],
                      timeout_s: float | None) -> None:
        """DELETE_STREAMS to a server just pushed ranges of streams deleted during the push."""
        ids = sorted(stream_ids)
        log.info("streams %s were deleted while range server %d was pushed their ranges; "
                 "deleting them there again", ids, server_id)
        try:
            self.link.delete_streams(
                server_id, [m.Stream(stream_id=sid, deleted=True) for sid in ids], timeout_s)
        except SbpError as exc:
            log.warning("range server %d was not told that streams %s are deleted: %s",
                        server_id, ids, exc)

    # -- resyncs owed ------------------------------------------------------------------------

    def owe_resync(self, server_id: int) -> None:
        """``server_id`` may have missed pushes: push it every range it holds (``resync``)."""
        with self._lock:
            self._owed.add(server_id)

    def resync_owed(self, server_id: int) -> bool:
        """Whether ``server_id`` is owed a full resync."""
        with self._lock:
            return server_id in self._owed

    def forget_owed(self) -> None:
        """Owe no server a resync (a PD taking or leaving office starts over: servers that
        heartbeat to a new leader are resynced as newly seen)."""
        with self._lock:
            self._owed.clear()

    def resync(self, server_id: int) -> None:
        """Push a server owed a resync every range it holds (runs on the worker pool)."""
        with self._lock:
            if server_id not in self._owed:
                return
            self._owed.discard(server_id)
        try:
            ranges = self._records.ranges_on_server(server_id)
            if ranges:
                self.sync_to(server_id, ranges)
            log.debug("range server %d synced with %d ranges", server_id, len(ranges))
        except SbpError as exc:
            log.warning("resync of range server %d failed (retried on its next heartbeat): %s",
                        server_id, exc)
            self.owe_resync(server_id)
