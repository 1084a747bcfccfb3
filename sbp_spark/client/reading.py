"""Reading one range, through failures: ``RangeRead`` streams its batches from one replica
after another, ``RangeEnd`` finds how far an open range is acknowledged now. Each is the state
of one call, driven by a ``Retrier``; ``SbpClient.fetch`` and ``SbpClient.open_range_end`` use
them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator

from sbp_spark.protocol.errors import (
    DataCorruptError,
    HistoryRewrittenError,
    ProtocolError,
    ReplicaBehindError,
    SbpError,
)
from sbp_spark.protocol.messages import Range

from .config import ClientConfig
from .pd import PdClient
from .range_server import RangeServerClient
from .replicas import ReplicaCursor, corrupt_everywhere
from .retry import Retrier, is_retriable
from .types import FetchedBatch

_log = logging.getLogger(__name__)

RangeServers = Callable[[str], RangeServerClient]
"""How to reach the range server at an address (``SbpClient.range_server``)."""


class RangeRead:
    """One fetch of a range from ``start`` up to ``end`` (-1: no bound): the primary first,
    then the other replicas, resuming after the last batch received; where it is, what is
    left of its byte budget, and which replicas answered DATA_CORRUPT at its position."""

    def __init__(self, pd: PdClient, range_servers: RangeServers, config: ClientConfig,
                 range: Range, start: int, end: int, max_bytes: int, max_wait_ms: int,
                 min_bytes: int) -> None:
        self.pd = pd
        self.range_servers = range_servers
        self.range = range
        self.position = start
        self.end = end
        self.budget = max_bytes
        self.max_wait_ms = max_wait_ms
        self.min_bytes = min_bytes
        # Servers that answered DATA_CORRUPT at ``corrupt_at``: server -> its message.
        self.corrupt: dict[str, str] = {}
        self.corrupt_at = start
        self.failed_at = start  # where the last failure (or the read) began
        self.retrier = Retrier(config, on_error=self._after_failure)
        self.replicas: ReplicaCursor | None = None  # made when the read starts

    def batches(self) -> Generator[FetchedBatch, None, None]:
        """The batches, as they arrive (a failed replica is left for the next one, retrying
        until the deadline)."""
        self.replicas = ReplicaCursor(self.pd, self.range)
        while True:
            address = self.replicas.current()
            try:
                yield from self._from(address)
                return
            except SbpError as exc:
                if self._done_despite(exc, address):
                    return

    def _from(self, address: str) -> Generator[FetchedBatch, None, None]:
        """Read from ``address`` until the end, the budget, or a failure (raised)."""
        stream_id, range_index = self.range.stream_id, self.range.range_index
        while True:
            asked_at = self.position
            batches = self.range_servers(address).fetch(
                stream_id, self.position, self.end, self.budget, self.max_wait_ms,
                self.min_bytes)
            for header, data in batches:
                yield FetchedBatch(stream_id, range_index, header, data, address)
                if header.end_offset > self.position:
                    self.position = header.end_offset
                self.budget = max(self.budget - header.batch_length, 0)
            if self.end == -1 or self.position >= self.end or self.budget == 0:
                return
            if self.position == asked_at:
                # The caller knows the range holds [position, end) (an end it was told), yet
                # this replica served none of it: it lags (an open range's secondary learns
                # what every replica holds one append later) or lost it. Never end the read
                # short in silence: another replica, the PD (a seal) or time will serve it.
                raise ReplicaBehindError(
                    f"{address} served nothing of range {range_index} of stream {stream_id} "
                    f"at offset {self.position}, though the range holds records up to "
                    f"{self.end}")
            # The server ended its answer early: ask for the rest.

    def _done_despite(self, exc: SbpError, address: str) -> bool:
        """After ``exc`` from ``address``: True when the read is complete all the same;
        otherwise waits until another attempt may start, or raises."""
        assert self.replicas is not None
        stream_id, range_index = self.range.stream_id, self.range.range_index
        if self.end != -1 and self.position >= self.end:
            return True  # everything asked for arrived before the failure
        if isinstance(exc, DataCorruptError):
            if self.corrupt_at != self.position:
                self.corrupt, self.corrupt_at = {}, self.position
            self.corrupt[address] = exc.message
            if self.corrupt.keys() >= set(self.replicas.servers):
                raise corrupt_everywhere(stream_id, range_index, self.position,
                                         self.corrupt) from exc
        if self.position > self.failed_at:
            # Records arrived since: a read that has been going on for longer than the retry
            # deadline (a slow consumer) still fails over.
            self.retrier.progressed()
        self.failed_at = self.position
        self.retrier.retry_after(exc)
        sealed = self.replicas.sealed_end
        if sealed is None:
            return False
        # The PD says the range ended (sealed while being read): stop there. An end the caller
        # was told the range holds lies never past its final end, unless the range's history
        # was rewritten: say so instead of ending short.
        if self.end != -1 and sealed < self.end and self.position >= sealed:
            raise HistoryRewrittenError.for_range(stream_id, range_index, sealed,
                                                  self.end) from exc
        self.end = sealed if self.end == -1 else min(self.end, sealed)
        return self.position >= self.end

    def _after_failure(self, error: SbpError) -> bool:
        assert self.replicas is not None
        return self.replicas.after_failure(error, self.retrier.deadline)


class RangeEnd:
    """One look at how far an open range is acknowledged now: the replicas it asks (the
    primary knows; a secondary may learn it a little later), and the most a secondary vouched
    for meanwhile."""

    def __init__(self, pd: PdClient, range_servers: RangeServers, config: ClientConfig,
                 range: Range) -> None:
        self.range = range
        self.range_servers = range_servers
        self.deadline = time.monotonic() + config.retry_deadline_s
        self.replicas = ReplicaCursor(pd, range)
        self.vouched: int | None = None
        self.retrier = Retrier(config, deadline=self.deadline, on_error=self._after_failure)

    def find(self) -> int:
        """The offset after the range's last acknowledged record. While the primary does not
        answer, keeps asking it and the PD (which seals the range after a failover) until the
        deadline; only then settles for what a secondary vouches for, with a warning: records
        acknowledged just before the primary failed may be missing from this read (not from
        the stream)."""
        try:
            return self.retrier.run(self.attempt)
        except ReplicaBehindError as exc:
            if self.vouched is None:
                raise
            _log.warning("%s; reading up to %d, what its secondaries vouch for", exc,
                         self.vouched)
            return self.vouched

    def attempt(self) -> int:
        """Ask each replica, the primary first."""
        rng, replicas = self.range, self.replicas
        if replicas.sealed_end is not None:
            return replicas.sealed_end  # sealed meanwhile (the PD said so)
        last_error: SbpError | None = None
        for address in list(replicas.servers):
            try:
                (result,) = self.range_servers(address).describe_ranges([rng])
                described = result.unwrap()
            except SbpError as exc:
                if not is_retriable(exc):
                    raise
                last_error = exc
                continue
            if described is None:
                last_error = ProtocolError(
                    f"{address} described range {rng.stream_id}/{rng.range_index} without "
                    f"its state")
                continue
            if not described.is_open:
                return described.end_offset
            if replicas.primary is None or address == replicas.primary:
                return described.next_offset
            self.vouched = max(self.vouched or 0, described.next_offset)
        if self.vouched is not None:
            raise ReplicaBehindError(
                f"the primary {replicas.primary} of range {rng.range_index} of stream "
                f"{rng.stream_id} did not answer ({last_error}); its secondaries hold records "
                f"up to at least {self.vouched} but cannot vouch for more until it answers or "
                f"the PD seals the range")
        assert last_error is not None
        raise last_error

    def _after_failure(self, error: SbpError) -> bool:
        # Every replica failed: ask the PD where they are now (a restart on a new port, or a
        # seal after a failover) and try again at once if something changed.
        return self.replicas.refresh(self.deadline)


__all__ = ["RangeEnd", "RangeRead", "RangeServers"]
