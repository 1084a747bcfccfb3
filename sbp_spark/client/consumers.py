"""Named consumers (ours): the PD's record of how far readers have read each stream, and what
they are behind.

``ConsumerClient`` sends the consumer requests (JOIN_CONSUMER, COMMIT_CONSUMER,
DESCRIBE_CONSUMERS, DELETE_CONSUMERS) to the PD leader. ``consumer_lag`` puts a consumer's
record next to the streams as they are now: per stream the committed offset, the end offset,
the records behind and the time behind, from the records' own timestamps (the first unread
record's against the newest one's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sbp_spark.protocol.errors import SbpError
from sbp_spark.protocol.messages import (
    CommitConsumerRequest,
    Consumer,
    ConsumerPosition,
    DeleteConsumersRequest,
    DescribeConsumersRequest,
    JoinConsumerRequest,
    Range,
)

from ._calls import item_results, unwrap
from .types import FetchedBatch, ItemResult


class PdCalls(Protocol):
    """What the consumer calls need of the PD client (``PdClient``)."""

    def call(self, msg: Any, deadline: float | None = None, resend: bool = True) -> Any: ...


class ConsumerClient:
    """The consumer requests to the PD leader, through ``pd`` (a ``PdClient``)."""

    def __init__(self, pd: PdCalls, timeout_ms: int) -> None:
        self._pd = pd
        self._timeout_ms = timeout_ms

    def join(self, name: str) -> Consumer:
        """Start the consumer's next generation (created if new); the answer holds it and
        the positions recorded so far. Sending it again after a lost answer only skips a
        generation."""
        response = self._pd.call(JoinConsumerRequest(self._timeout_ms, name))
        consumer: Consumer = response.consumer
        return consumer

    def commit(self, name: str, generation: int, positions: Mapping[int, int]) -> Consumer:
        """Record ``positions`` (stream id -> the offset after the last record read) under
        ``generation``; ``ConsumerFencedError`` if another generation took the consumer over.
        Positions only move forward, so a resend after a lost answer changes nothing more."""
        request = CommitConsumerRequest(
            self._timeout_ms, name, generation,
            [ConsumerPosition(int(s), int(o)) for s, o in sorted(positions.items())])
        response = self._pd.call(request)
        consumer: Consumer = response.consumer
        return consumer

    def list_all(self) -> list[Consumer]:
        """Every consumer the PD records, by name."""
        response = self._pd.call(DescribeConsumersRequest(self._timeout_ms, []))
        return [r.consumer for r in response.results
                if r.status.code == 0 and r.consumer is not None]

    def describe(self, names: Sequence[str]) -> list[ItemResult[Consumer]]:
        """The consumers named, one result each (INVALID_REQUEST for a name not recorded)."""
        response = self._pd.call(DescribeConsumersRequest(
            self._timeout_ms, [Consumer(name=n) for n in names]))
        return item_results(response.results, len(names),
                            lambda r: r.consumer, "DESCRIBE_CONSUMERS")

    def get(self, name: str) -> Consumer:
        """One consumer; its error if the PD has no record of it."""
        return unwrap(self.describe([name])[0], f"consumer {name!r}")

    def delete(self, names: Sequence[str]) -> list[ItemResult[Consumer]]:
        """Forget the consumers named; each result is the consumer as it was."""
        response = self._pd.call(DeleteConsumersRequest(
            self._timeout_ms, [Consumer(name=n) for n in names]))
        return item_results(response.results, len(names),
                            lambda r: r.consumer, "DELETE_CONSUMERS")


class StreamReads(Protocol):
    """What ``consumer_lag`` reads of the streams (an ``SbpClient``)."""

    def list_ranges(self, stream_id: int | str) -> list[Range]: ...

    def open_range_end(self, range: Range) -> int: ...

    def fetch(self, range: Range, start_offset: int, end_offset: int = -1,
              max_bytes: int = ...) -> Iterable[FetchedBatch]: ...


@dataclass(frozen=True)
class StreamLag:
    """Where a consumer stands on one stream. ``time_behind_ms`` is the newest record's
    timestamp minus the first unread record's (0 when nothing is unread; -1 when the records
    could not be read, e.g. the stream was deleted); ``lost`` counts committed-but-unread
    records trimmed away before the consumer read them (its position below the stream's
    start)."""

    stream_id: int
    committed_offset: int
    end_offset: int
    records_behind: int
    time_behind_ms: int
    commit_time_ms: int
    start_offset: int = 0

    @property
    def lost(self) -> int:
        return max(0, self.start_offset - self.committed_offset)


# One batch is all a timestamp needs: ask for little.
_PROBE_BYTES = 64 * 1024


def _batch_time(client: StreamReads, rng: Range, offset: int) -> int | None:
    """The timestamp of the batch holding ``offset`` in ``rng`` (ms), or None."""
    for batch in client.fetch(rng, offset, offset + 1, max_bytes=_PROBE_BYTES):
        return batch.header.base_timestamp_ms
    return None


def _holding(ranges: Sequence[Range], ends: Sequence[int], offset: int) -> Range | None:
    for rng, end in zip(ranges, ends, strict=True):
        if rng.start_offset <= offset < end:
            return rng
    return None


def stream_lag(client: StreamReads, stream_id: int, committed: int, commit_time_ms: int
               ) -> StreamLag:
    """The lag of a consumer at ``committed`` on ``stream_id`` now."""
    try:
        ranges = client.list_ranges(stream_id)
    except SbpError:
        return StreamLag(stream_id, committed, -1, -1, -1, commit_time_ms)
    ends = [client.open_range_end(r) if r.is_open else r.end_offset for r in ranges]
    end = ends[-1] if ends else 0
    start = ranges[0].start_offset if ranges else 0
    behind = max(0, end - max(committed, start))
    time_behind = 0
    if behind:
        first = _holding(ranges, ends, max(committed, start))
        last = _holding(ranges, ends, end - 1)
        try:
            at = None if first is None else _batch_time(client, first, max(committed, start))
            newest = None if last is None else _batch_time(client, last, end - 1)
        except SbpError:
            at = newest = None
        time_behind = -1 if at is None or newest is None else max(0, newest - at)
    return StreamLag(stream_id, committed, end, max(0, end - committed), time_behind,
                     commit_time_ms, start)


def consumer_lag(client: StreamReads, consumer: Consumer) -> list[StreamLag]:
    """``stream_lag`` for every stream ``consumer`` recorded a position of."""
    return [stream_lag(client, p.stream_id, p.committed_offset, p.commit_time_ms)
            for p in consumer.positions]
