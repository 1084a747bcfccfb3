"""The PD's calls to range servers: seals, range pushes (SYNC_RANGES) and resyncs.

``RangeServerCalls`` holds the PD's connection pool to its range servers and what it owes
them: a server whose push failed, or that (re)appeared, is owed a full resync of every range it
holds, sent on its next heartbeat. Every call is one request with one retry on a fresh
connection (a pooled connection may have died with a server restart); a server that does not
answer fails the call with the retriable REQUEST_TIMEOUT naming it.

A seal's and a failover's pushes run under the stream's lock (a seal right behind must find
the range on its servers); a new stream's push runs after the stream was created, so a
DELETE_STREAMS can overtake one and reach a server that holds no range of the stream yet:
nothing there remembers it, and the push would
then create a range of a deleted stream that acknowledges appends nobody can read. So a push
leaves out streams already deleted, and after a server took the push, every stream in it that
was deleted meanwhile is deleted on that server again (now it holds the range and marks it).
Deletion is written to the metadata before any DELETE_STREAMS goes out, so one of the two
always reaches the server after the range.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sbp_spark.client.config import ClientConfig
from sbp_spark.client.pool import ConnectionPool
from sbp_spark.client.tls import TlsConfig
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import (
    RequestTimeoutError,
    SbpError,
    ServerError,
    StreamNotFoundError,
    UnknownError,
)

from .sqlite_store import RangeMeta

if TYPE_CHECKING:
    from .driver import PlacementDriver

log = logging.getLogger("sbp_spark.server.pd")

# Ranges per SYNC_RANGES frame when the PD pushes a server everything it holds: keeps one frame
# far below the 16 MiB limit however many ranges a server has.
SYNC_BATCH_RANGES = 2000


# Above this many streams, which of them are deleted is read from one listing of the streams.
_LOOKUPS_BEFORE_LISTING = 16

class RangeServerCalls:
    """Requests from the PD to its range servers, and the resyncs it owes them."""

    def __init__(self, pd: PlacementDriver, tls: TlsConfig | None) -> None:
        self.pd = pd
        timeout = pd.config.range_server_timeout_s
        # Calls to range servers speak TLS like this PD's port, presenting its certificate.
        self._pool = ConnectionPool(ClientConfig(
            connect_timeout_s=min(5.0, timeout), request_timeout_s=timeout,
            retries=1).with_tls(tls))
        self._owed: set[int] = set()  # servers owed a full SYNC_RANGES
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.close()

    def forget_owed(self) -> None:
        """Owe no server a resync (a PD taking or leaving office starts over: servers that
        heartbeat to a new leader are resynced as newly seen)."""
        with self._lock:
            self._owed.clear()

    def resync_owed(self, server_id: int) -> bool:
        """Whether ``server_id`` is owed a full resync."""
        with self._lock:
            return server_id in self._owed

    def call(self, server_id: int, msg: Any, timeout_s: float | None = None) -> Any:
        """One request to a range server: its response.

        A SYSTEM_ERROR answer raises its ``ServerError``; a server that cannot be reached or
        does not answer in time raises ``RequestTimeoutError`` (retriable) naming it.
        """
        addr = self.pd.address_of(server_id)
        if not addr:
            raise RequestTimeoutError(
                f"range server {server_id} has never announced an address")
        timeout = self.pd.config.range_server_timeout_s if timeout_s is None else timeout_s
        failure: SbpError | None = None
        # Two tries: a pooled connection may have died with a server restart.
        for _ in range(2):
            conn = None
            try:
                conn = self._pool.get(addr)
                response, _ = conn.call(msg, timeout=timeout)
                return response
            except ServerError:
                raise
            except SbpError as exc:
                failure = exc
                if conn is not None:
                    self._pool.discard(conn)
        raise RequestTimeoutError(
            f"range server {server_id} at {addr} did not answer: {failure}") from failure

    def seal_on_servers(self, rng: RangeMeta, timeout_s: float | None) -> int:
        """Seal ``rng`` on its primary, which must answer, then on its secondaries; the range
        ends at the smallest end the replicas that answered report.

        Every acknowledged record, and every record a reader may have seen, is on every
        replica, so that end keeps them all. Records past it reached some replicas only
        (their appends failed), so no reader saw them and their writers retry them.
        """
        request = m.SealRangesRequest(
            timeout_ms=int((timeout_s or self.pd.config.range_server_timeout_s) * 1000),
            ranges=[m.RangeId(rng.stream_id, rng.range_index)])
        primary = rng.primary
        if primary is None:
            raise UnknownError(f"range {rng.range_index} of stream {rng.stream_id} "
                               "has no primary in the metadata")
        ends = {primary: self.seal_one(primary, request, rng, timeout_s)}
        for sid in rng.server_ids:
            if sid == primary:
                continue
            try:
                ends[sid] = self.seal_one(sid, request, rng, timeout_s)
            except SbpError as exc:
                log.warning("secondary %d of range %d of stream %d did not seal: %s", sid,
                            rng.range_index, rng.stream_id, exc)
        if len(set(ends.values())) > 1:
            log.info("range %d of stream %d: replicas stopped at %s; it ends at the smallest",
                     rng.range_index, rng.stream_id, ends)
        return min(ends.values())

    def seal_one(self, server_id: int, request: m.SealRangesRequest, rng: RangeMeta,
                  timeout_s: float | None) -> int:
        response = self.call(server_id, request, timeout_s)
        response.status.raise_for_status()
        results = response.seal_responses
        if len(results) != 1 or results[0].range is None:
            if results:
                results[0].status.raise_for_status()
            raise UnknownError(f"range server {server_id} answered SEAL_RANGES for range "
                               f"{rng.range_index} of stream {rng.stream_id} without the range")
        results[0].status.raise_for_status()
        end = results[0].range.end_offset
        if end < rng.start_offset:
            raise UnknownError(f"range server {server_id} sealed range {rng.range_index} of "
                               f"stream {rng.stream_id} at {end}, below its start "
                               f"{rng.start_offset}")
        return end

    def live_next_offset(self, rng: RangeMeta, timeout_s: float | None) -> int | None:
        """The open range's next_offset from its primary; None if the primary cannot say."""
        primary = rng.primary
        if primary is None:
            return None
        try:
            response = self.call(primary, m.DescribeRangesRequest(
                ranges=[m.RangeId(rng.stream_id, rng.range_index)]), timeout_s)
            response.status.raise_for_status()
            result = response.describe_responses[0]
            result.status.raise_for_status()
        except (SbpError, IndexError) as exc:
            log.warning("could not read the end of range %d of stream %d from server %d; "
                        "using the PD's snapshot: %s", rng.range_index, rng.stream_id, primary,
                        exc)
            return None
        if result.range is None:
            return None
        self.pd.store.update_next_offset(rng.stream_id, rng.range_index, result.range.next_offset)
        return result.range.next_offset

    def push_ranges(self, ranges: Iterable[RangeMeta], timeout_s: float | None = None,
                     skip: Iterable[int] = ()) -> None:
        """SYNC_RANGES ``ranges`` to the servers holding them; failures, and the servers in
        ``skip`` (known to be down), are owed a resync.

        Secondaries hear first: a primary that learned of a new range before its secondaries
        would forward its first appends to servers that do not hold the range yet, fail them
        and seal the range at once."""
        by_server: dict[int, list[RangeMeta]] = defaultdict(list)
        leaders: set[int] = set()  # primaries of open ranges: pushed last
        ranges = list(ranges)
        gone = self._deleted({rng.stream_id for rng in ranges})
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
        """SYNC_RANGES ``ranges`` to one server. Raises when the server could not be reached
        or refused the whole request; a refused stream is logged (sending it again would be
        refused again)."""
        for start in range(0, len(ranges), SYNC_BATCH_RANGES):
            chunk = ranges[start:start + SYNC_BATCH_RANGES]
            by_stream: dict[int, list[m.Range]] = defaultdict(list)
            for rng in chunk:
                by_stream[rng.stream_id].append(self.pd.range_msg(rng, for_servers=True))
            request = m.SyncRangesRequest(
                timeout_ms=int((timeout_s or self.pd.config.range_server_timeout_s) * 1000),
                stream_ranges=[m.StreamRanges(sid, rs) for sid, rs in by_stream.items()])
            response = self.call(server_id, request, timeout_s)
            response.status.raise_for_status()
            for result in response.sync_responses:
                if not result.status.ok:
                    log.warning("range server %d refused the ranges of stream %d: %s",
                                server_id, result.stream_id, result.status.message)
            gone = self._deleted(by_stream)
            if gone:
                self._tell_deleted(server_id, gone, timeout_s)

    def _deleted(self, stream_ids: Iterable[int]) -> set[int]:
        """The streams of ``stream_ids`` that are deleted in the metadata: one lookup each for
        a few (a create, a seal), one listing for many (a server's resync; on etcd every
        lookup is a round trip)."""
        stream_ids = set(stream_ids)
        if len(stream_ids) > _LOOKUPS_BEFORE_LISTING:
            try:
                live = {s.stream_id for s in self.pd.store.list_streams()}
            except SbpError as exc:  # the metadata cannot say now: push as before
                log.warning("could not tell which of %d streams are deleted: %s",
                            len(stream_ids), exc)
                return set()
            return stream_ids - live
        gone = set()
        for stream_id in stream_ids:
            try:
                self.pd.store.get_stream(stream_id)
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
            self.call(server_id, m.DeleteStreamsRequest(streams=[
                m.Stream(stream_id=sid, deleted=True) for sid in ids]), timeout_s)
        except SbpError as exc:
            log.warning("range server %d was not told that streams %s are deleted: %s",
                        server_id, ids, exc)

    def owe_resync(self, server_id: int) -> None:
        with self._lock:
            self._owed.add(server_id)

    def resync_server(self, server_id: int) -> None:
        """Push a server every range it holds (runs on the worker pool)."""
        with self._lock:
            if server_id not in self._owed:
                return
            self._owed.discard(server_id)
        try:
            ranges = self.pd.store.ranges_on_server(server_id)
            if ranges:
                self.sync_to(server_id, ranges)
            log.debug("range server %d synced with %d ranges", server_id, len(ranges))
        except SbpError as exc:
            log.warning("resync of range server %d failed (retried on its next heartbeat): %s",
                        server_id, exc)
            self.owe_resync(server_id)
