"""The PD's requests to its range servers: seals, range pushes, deletions, trims, range ends.

``RangeServerCalls`` holds the PD's connection pool to its range servers. Every call is one
request with one retry on a fresh connection (a pooled connection may have died with a server
restart); a server that does not answer fails the call with the retriable REQUEST_TIMEOUT
naming it. What to send when is for the other parts: ``pushes.py`` (which ranges each server
is told about), ``ranges.py`` and ``failover.py`` (which replicas a seal asks).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sbp_spark.client.config import ClientConfig
from sbp_spark.client.pool import ConnectionPool
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import RequestTimeoutError, SbpError, ServerError, UnknownError
from sbp_spark.transport.tls import TlsConfig

from .meta import RangeMeta, SealedEnd

log = logging.getLogger(__package__)


class RangeServerCalls:
    """Requests from the PD to range servers, found by ``address_of``; ``range_msg`` is the
    wire form of a range for its servers, ``timeout_s`` the bound of a call that names none."""

    def __init__(self, address_of: Callable[[int], str],
                 range_msg: Callable[[RangeMeta], m.Range], timeout_s: float,
                 tls: TlsConfig | None, token: str | None = None) -> None:
        self._address_of = address_of
        self._range_msg = range_msg
        self._timeout_s = timeout_s
        # Calls to range servers speak TLS like this PD's port, presenting its certificate.
        self._pool = ConnectionPool(ClientConfig(
            connect_timeout_s=min(5.0, timeout_s), request_timeout_s=timeout_s,
            retries=1).with_tls(tls).with_token(token))

    def close(self) -> None:
        self._pool.close()

    def _bounded(self, left: float) -> ClientConfig:
        """The pool's settings with connects (and TLS handshakes) bounded by ``left``."""
        config = self._pool.config
        if config.connect_timeout_s <= left:
            return config
        return dataclasses.replace(config, connect_timeout_s=left)

    def _timeout_ms(self, timeout_s: float | None) -> int:
        """The timeout_ms a request carries: the server's share of the call's bound."""
        return int((timeout_s or self._timeout_s) * 1000)

    def call(self, server_id: int, msg: Any, timeout_s: float | None = None) -> Any:
        """One request to a range server: its response.

        A SYSTEM_ERROR answer raises its ``ServerError``; a server that cannot be reached or
        does not answer in time raises ``RequestTimeoutError`` (retriable) naming it.
        """
        addr = self._address_of(server_id)
        if not addr:
            raise RequestTimeoutError(
                f"range server {server_id} has never announced an address")
        timeout = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        failure: SbpError | None = None
        # Two tries: a pooled connection may have died with a server restart. Both within
        # the one bound: a server that let the first try time out (stopped, cut off) would
        # only hold the caller, often under a stream's lock, as long again.
        for _ in range(2):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn = None
            try:
                conn = self._pool.get(addr, self._bounded(left))
                response, _ = conn.call(msg, timeout=left)
                return response
            except ServerError:
                raise
            except SbpError as exc:
                failure = exc
                if conn is not None:
                    self._pool.discard(conn)
        raise RequestTimeoutError(
            f"range server {server_id} at {addr} did not answer: {failure}") from failure

    def seal_on_servers(self, rng: RangeMeta, timeout_s: float | None = None,
                        skip: Iterable[int] = ()) -> SealedEnd:
        """Seal ``rng`` on its primary, which must answer, then on its secondaries at once
        (``skip``: those not to ask, known to be down); the range ends at the smallest end
        the replicas that answered report. The secondaries the primary says it could not
        reach come back with it, and those that did not seal (asked or not).

        Every acknowledged record, and every record a reader may have seen, is on every
        replica, so that end keeps them all. Records past it reached some replicas only
        (their appends failed), so no reader saw them and their writers retry them. A
        secondary that did not seal stays capped until it hears the end (the push, or its
        resync), so it shows nothing past it meanwhile.
        """
        primary = rng.primary
        if primary is None:
            raise UnknownError(f"range {rng.range_index} of stream {rng.stream_id} "
                               "has no primary in the metadata")
        on_primary = self.seal(primary, rng, timeout_s)
        ends = {primary: on_primary.end}
        skip = set(skip)
        asked = [sid for sid in rng.server_ids if sid != primary and sid not in skip]
        missed = [sid for sid in rng.server_ids if sid != primary and sid in skip]
        # One thread each: a stopped secondary costs the seal one timeout, not one per
        # secondary, while the caller holds the stream's lock.
        with ThreadPoolExecutor(max_workers=max(1, len(asked)),
                                thread_name_prefix="pd-seal") as pool:
            tries = {sid: pool.submit(self.seal, sid, rng, timeout_s) for sid in asked}
        for sid, done in tries.items():
            try:
                ends[sid] = done.result().end
            except SbpError as exc:
                missed.append(sid)
                log.warning("secondary %d of range %d of stream %d did not seal: %s", sid,
                            rng.range_index, rng.stream_id, exc)
        if len(set(ends.values())) > 1:
            log.info("range %d of stream %d: replicas stopped at %s; it ends at the smallest",
                     rng.range_index, rng.stream_id, ends)
        if on_primary.unreachable:
            log.info("range %d of stream %d: its primary %d could not reach secondaries %s",
                     rng.range_index, rng.stream_id, primary, list(on_primary.unreachable))
        return SealedEnd(min(ends.values()), on_primary.unreachable, tuple(missed))

    def seal(self, server_id: int, rng: RangeMeta, timeout_s: float | None = None
             ) -> SealedEnd:
        """Seal ``rng`` on one of its replicas: where that replica ended it, and which of
        the range's other replicas it could not reach (a primary's answer)."""
        request = m.SealRangesRequest(timeout_ms=self._timeout_ms(timeout_s),
                                      ranges=[m.RangeId(rng.stream_id, rng.range_index)])
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
        others = set(rng.server_ids) - {server_id}
        return SealedEnd(end, tuple(sid for sid in results[0].unreachable if sid in others))

    def next_offset(self, rng: RangeMeta, timeout_s: float | None = None) -> int | None:
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
        return result.range.next_offset

    def sync(self, server_id: int, ranges: Sequence[RangeMeta],
             timeout_s: float | None = None) -> None:
        """One SYNC_RANGES of ``ranges`` to a server. Raises when the server could not be
        reached or refused the whole request; a refused stream is logged (sending it again
        would be refused again)."""
        by_stream: dict[int, list[m.Range]] = defaultdict(list)
        for rng in ranges:
            by_stream[rng.stream_id].append(self._range_msg(rng))
        request = m.SyncRangesRequest(
            timeout_ms=self._timeout_ms(timeout_s),
            stream_ranges=[m.StreamRanges(sid, rs) for sid, rs in by_stream.items()])
        response = self.call(server_id, request, timeout_s)
        response.status.raise_for_status()
        for result in response.sync_responses:
            if not result.status.ok:
                log.warning("range server %d refused the ranges of stream %d: %s",
                            server_id, result.stream_id, result.status.message)

    def delete_streams(self, server_id: int, streams: Sequence[m.Stream],
                       timeout_s: float | None = None) -> None:
        """DELETE_STREAMS ``streams`` on a server (raises when it could not be told)."""
        self.call(server_id, m.DeleteStreamsRequest(streams=list(streams)), timeout_s)

    def trim(self, server_id: int, stream_id: int, start_offset: int,
             timeout_s: float | None = None) -> None:
        """Tell a server that ``stream_id`` now starts at ``start_offset`` (raises when it
        could not be told)."""
        self.call(server_id, m.TrimStreamsRequest(trimmed_streams=[
            m.TrimmedStream(stream_id, start_offset)]), timeout_s)
