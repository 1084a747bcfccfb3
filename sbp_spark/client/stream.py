"""The stream-level API the connector and the CLI use: streams, ranges, reads and writes.

``SbpClient`` hides placement: it asks the PD where ranges live, reads from a range's primary
(falling back to its replicas), and writes to the primary of the stream's open range,
following seals to the next range.
"""

from __future__ import annotations

import bisect
import logging
import struct
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import replace

from sbp_spark.protocol.errors import (
    BatchFormatError,
    ConnectError,
    ConnectTimeoutError,
    DataCorruptError,
    HistoryRewrittenError,
    PdUnreachableError,
    ProtocolError,
    RangeNotFoundError,
    RangeSealedError,
    ReadTimeoutError,
    ReplicaBehindError,
    ReplicationFailedError,
    SbpError,
    SbpTimeoutError,
    ServerError,
    TlsHandshakeTimeoutError,
    TransportError,
    WriteTimeoutError,
)
from sbp_spark.protocol.messages import Range, RangeId, RangeReplica, RangeServer, Stream
from sbp_spark.protocol.records import BATCH_MAGIC, ENVELOPE_SIZE, BatchHeader, BodyFormat

from .config import DEFAULT_FETCH_MAX_BYTES, ClientConfig
from .pd import PdClient
from .pool import ConnectionPool
from .range_server import BatchLike, RangeServerClient, batch_buffers
from .retry import Retrier, call_with_retries, is_retriable
from .timesearch import TimeSearch, range_end
from .types import Appended, FetchedBatch, ItemResult, Replica

_log = logging.getLogger(__name__)



def known_range(stream_id: int, range_index: int, replicas: Sequence[Replica], start: int = 0,
                end: int = -1, is_open: bool = True) -> Range:
    """The client's description of a range known from an earlier look-up, for ``fetch`` and
    ``TimeSearch`` (no PD round trip): open ranges read up to ``end`` as their
    ``next_offset``, sealed ones end there."""
    return Range(stream_id=stream_id, range_index=range_index, start_offset=start,
                 next_offset=max(end, start), end_offset=-1 if is_open else end,
                 servers=[RangeReplica(RangeServer(r.server_id, r.address), r.is_primary)
                          for r in replicas])

class SbpClient:
    """Stream-level operations against the cluster whose PD is at ``pd``.

    ``pd`` is ``"host:port[,host:port]"``, a list of addresses, or a ``PdClient``.
    Connections come from the process-wide pool unless ``pool`` is given.
    """

    def __init__(self, pd: str | Sequence[str] | PdClient, config: ClientConfig | None = None,
                 pool: ConnectionPool | None = None) -> None:
        if isinstance(pd, PdClient):
            self.pd = pd
            self.config = config if config is not None else pd.config
        else:
            self.config = config if config is not None else ClientConfig()
            self.pd = PdClient(pd, self.config, pool)
        self.pool = self.pd.pool if pool is None else pool
        # stream id -> the last range that stored a batch of this client's writers: the range
        # has reached its primary (see ``StreamWriter._send``).
        self._took: dict[int, int] = {}

    def __repr__(self) -> str:
        return f"SbpClient(pd={','.join(self.pd.addresses)!r})"

    def range_server(self, address: str) -> RangeServerClient:
        """A client for the range server at ``address`` sharing this client's pool."""
        return RangeServerClient(address, self.config, self.pool)

    def close(self) -> None:
        """Nothing to release: connections belong to the pool (kept for the next task)."""

    def __enter__(self) -> SbpClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- streams ---------------------------------------------------------------------------

    def create_streams(self, count: int = 1, replicas: int = 1, retention_ms: int = -1
                       ) -> list[Stream]:
        """Create ``count`` streams; raises the first failure."""
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count={count!r}: must be an integer >= 1")
        if not isinstance(replicas, int) or not 1 <= replicas <= 127:
            raise ValueError(f"replicas={replicas!r}: must be an integer in 1..127")
        if not isinstance(retention_ms, int) or (retention_ms < 1 and retention_ms != -1):
            raise ValueError(f"retention_ms={retention_ms!r}: must be > 0, or -1 (forever)")
        streams = [Stream(replica_nums=replicas, retention_period_ms=retention_ms)
                   for _ in range(count)]
        return [r.unwrap() for r in self.pd.create_streams(streams)]

    def describe_streams(self, ids: Sequence[int]) -> list[Stream]:
        """Metadata of streams, in the order asked; raises ``StreamNotFoundError`` for a
        missing one."""
        results = self.pd.describe_streams(ids)
        return [_unwrap(r, f"stream {s}") for s, r in zip(ids, results, strict=True)]

    def list_streams(self) -> list[Stream]:
        """Every stream that is not deleted, in id order."""
        return self.pd.list_streams()

    def describe_stream(self, stream_id: int) -> Stream:
        """Metadata of one stream."""
        return self.describe_streams([stream_id])[0]

    def delete_streams(self, ids: Sequence[int]) -> list[Stream]:
        """Delete streams; returns them as deleted; raises the first failure."""
        results = self.pd.delete_streams(ids)
        return [_unwrap(r, f"stream {s}") for s, r in zip(ids, results, strict=True)]

    def trim_stream(self, stream_id: int, offset: int) -> Stream:
        """Drop the records of ``stream_id`` below ``offset``; returns the stream after the
        trim (its ``start_offset`` is the new first offset)."""
        (result,) = self.pd.trim_streams([(stream_id, offset)])
        trimmed = _unwrap(result, f"stream {stream_id}")
        if trimmed.trimmed_stream is not None:
            return trimmed.trimmed_stream
        return self.describe_stream(stream_id)

    def update_stream(self, stream_id: int, replicas: int | None = None,
                      retention_ms: int | None = None) -> Stream:
        """Change a stream's replica count and/or retention (None keeps the current value);
        returns the updated stream."""
        if replicas is not None and (not isinstance(replicas, int) or not 1 <= replicas <= 127):
            raise ValueError(f"replicas={replicas!r}: must be an integer in 1..127")
        if retention_ms is not None and (
                not isinstance(retention_ms, int) or (retention_ms < 1 and retention_ms != -1)):
            raise ValueError(f"retention_ms={retention_ms!r}: must be > 0, or -1 (forever)")
        current = self.describe_stream(stream_id)
        wanted = Stream(
            stream_id=stream_id,
            replica_nums=current.replica_nums if replicas is None else replicas,
            retention_period_ms=(current.retention_period_ms if retention_ms is None
                                 else retention_ms))
        (result,) = self.pd.update_streams([wanted])
        return _unwrap(result, f"stream {stream_id}")

    # -- ranges ----------------------------------------------------------------------------

    def seal_range(self, stream_id: int) -> Range:
        """Seal the stream's open range (the PD seals it where its primary stopped) and
        return the new open range."""
        ranges = self.list_ranges(stream_id)
        if not ranges:
            raise RangeNotFoundError(f"stream {stream_id} has no range to seal")
        last = ranges[-1]
        (result,) = self.pd.seal_ranges([last])
        error = result.exception()
        if error is None:
            return result.unwrap()
        # The PD seals first and opens the next range after (NOT_ENOUGH_SERVERS when too few
        # servers are live): say so when the seal went through, not that it failed.
        sealed = next((r for r in self._ranges_if_known(stream_id)
                       if r.range_index == last.range_index and not r.is_open), None)
        if last.is_open and sealed is not None:
            raise _with_context(error, f"range {last.range_index} of stream {stream_id} was "
                                       f"sealed at offset {sealed.end_offset}, but no range "
                                       f"could be opened after it (appends wait for one)")
        raise _with_context(error, f"sealing range {last.range_index} of stream {stream_id}")

    def _ranges_if_known(self, stream_id: int) -> list[Range]:
        """``list_ranges``, or [] when the PD does not answer."""
        try:
            return self.list_ranges(stream_id)
        except SbpError:
            return []

    def list_ranges(self, stream_id: int) -> list[Range]:
        """The ranges of a stream, in order (only the last may be open)."""
        (result,) = self.pd.list_ranges([stream_id])
        return _unwrap(result, f"stream {stream_id}")

    def locate(self, appended: Sequence[Appended], deadline: float | None = None
               ) -> list[Appended]:
        """``appended`` (what appends returned), each with the range that holds it by the
        PD's ranges: ``Appended.range_index`` is the range a batch was sent to, which a
        range server may have answered from the next range (see ``Appended``). One PD
        request (its errors raise; ``deadline``, a ``time.monotonic()`` value, ends its
        retries sooner); a batch below the first range the PD lists (trimmed away) keeps
        the range it was sent to."""
        sids = list(dict.fromkeys(a.stream_id for a in appended))
        if not sids:
            return []
        ranges: dict[int, tuple[list[int], list[int]]] = {}
        for sid, result in zip(sids, self.pd.list_ranges(sids, deadline), strict=True):
            listed = sorted((r.start_offset, r.range_index)
                            for r in _unwrap(result, f"stream {sid}"))
            ranges[sid] = ([start for start, _ in listed], [index for _, index in listed])
        out = []
        for item in appended:
            starts, indexes = ranges[item.stream_id]
            at = bisect.bisect_right(starts, item.base_offset) - 1
            holder = indexes[at] if at >= 0 else item.range_index
            out.append(item if holder == item.range_index else replace(item, range_index=holder))
        return out

    def open_range_end(self, range: Range) -> int:
        """The offset after the last record of ``range`` now: its end if sealed, else the
        live next_offset from its primary (DESCRIBE_RANGES).

        Only the primary knows how far an open replicated range is acknowledged: a secondary
        may learn it a little later. While the primary does not answer, this keeps asking it
        and the PD (which seals the range after a failover) with the client's retry policy;
        only when that gives up does it settle for what a secondary vouches for, with a
        warning: records acknowledged just before the primary failed may then be missing
        from this read (not from the stream).
        """
        if not range.is_open:
            return range.end_offset
        replicas = _Replicas(self, range)
        deadline = time.monotonic() + self.config.retry_deadline_s
        vouched: int | None = None  # the most a secondary vouched for

        def attempt() -> int:
            nonlocal vouched
            if replicas.sealed_end is not None:
                return replicas.sealed_end  # sealed meanwhile (the PD said so)
            last_error: SbpError | None = None
            for address in list(replicas.servers):
                try:
                    (result,) = self.range_server(address).describe_ranges([range])
                    described = result.unwrap()
                except SbpError as exc:
                    if not is_retriable(exc):
                        raise
                    last_error = exc
                    continue
                if described is None:
                    last_error = ProtocolError(
                        f"{address} described range {range.stream_id}/{range.range_index} "
                        f"without its state")
                    continue
                if not described.is_open:
                    return described.end_offset
                if replicas.primary is None or address == replicas.primary:
                    return described.next_offset
                vouched = max(vouched or 0, described.next_offset)
            if vouched is not None:
                raise ReplicaBehindError(
                    f"the primary {replicas.primary} of range {range.range_index} of stream "
                    f"{range.stream_id} did not answer ({last_error}); its secondaries hold "
                    f"records up to at least {vouched} but cannot vouch for more until it "
                    f"answers or the PD seals the range")
            assert last_error is not None
            raise last_error

        # Every replica failed: ask the PD where they are now (a restart on a new port, or a
        # seal after a failover) and try again at once if something changed.
        try:
            return call_with_retries(attempt, self.config, deadline=deadline,
                                     on_error=lambda _: replicas.refresh(deadline))
        except ReplicaBehindError as exc:
            if vouched is None:
                raise
            _log.warning("%s; reading up to %d, what its secondaries vouch for", exc, vouched)
            return vouched

    # -- reading ---------------------------------------------------------------------------

    def retained_start(self, stream_id: int, range_index: int, addresses: Iterable[str]
                       ) -> int | None:
        """The first offset of range ``stream_id``/``range_index`` that its replicas at
        ``addresses`` still hold (the highest any of them reports), or None when none answers.
        Range servers delete trimmed and expired records first and tell the PD a moment later,
        so this can be past the start the PD lists."""
        starts = []
        for address in addresses:
            try:
                (result,) = self.range_server(address).describe_ranges([(stream_id,
                                                                          range_index)])
                described = result.unwrap()
            except SbpError:
                continue
            if described is not None:
                starts.append(described.start_offset)
        return max(starts, default=None)

    def fetch(
        self,
        range: Range,
        start_offset: int,
        end_offset: int = -1,
        max_bytes: int = DEFAULT_FETCH_MAX_BYTES,
        max_wait_ms: int = 0,
        min_bytes: int = 0,
    ) -> Generator[FetchedBatch, None, None]:
        """Stream the batches of ``range`` from ``start_offset`` up to ``end_offset`` (-1: no
        bound) with one FETCH, from the primary first, then the other replicas.

        Batches are whole: the first may begin before ``start_offset`` and the last may run
        past ``end_offset``; the reader keeps the records it asked for. If a server fails
        mid-way, the read resumes on the next replica after the last batch received, so no
        batch is yielded twice. ``max_bytes`` bounds the bytes of the whole answer.
        """
        if start_offset < 0:
            raise ValueError(f"start_offset={start_offset}: must be >= 0")
        if end_offset != -1 and end_offset < start_offset:
            raise ValueError(f"end_offset={end_offset} is below start_offset={start_offset}")
        if not range.is_open and (end_offset == -1 or end_offset > range.end_offset):
            end_offset = range.end_offset
        return self._fetch(range, start_offset, end_offset, max_bytes, max_wait_ms, min_bytes)

    def fetch_from_replicas(
        self,
        stream_id: int,
        range_index: int,
        replicas: Sequence[Replica],
        start_offset: int,
        end_offset: int = -1,
        sealed_end: int = -1,
        max_bytes: int = DEFAULT_FETCH_MAX_BYTES,
        max_wait_ms: int = 0,
    ) -> Generator[FetchedBatch, None, None]:
        """``fetch`` for a range known from an earlier look-up (no PD round trip): range
        ``range_index`` of ``stream_id`` on ``replicas``, open unless ``sealed_end`` (its end
        offset) is given. A stale replica list is refreshed from the PD as in ``fetch``."""
        rng = known_range(stream_id, range_index, replicas, end=sealed_end,
                          is_open=sealed_end < 0)
        return self.fetch(rng, start_offset, end_offset, max_bytes=max_bytes,
                          max_wait_ms=max_wait_ms)

    def _fetch(self, range: Range, start: int, end: int, max_bytes: int, max_wait_ms: int,
               min_bytes: int) -> Generator[FetchedBatch, None, None]:
        stream_id, range_index = range.stream_id, range.range_index
        replicas = _Replicas(self, range)
        position, budget = start, max_bytes
        # Servers that answered DATA_CORRUPT at ``position``: server -> its message.
        corrupt: dict[str, str] = {}
        corrupt_at = position
        retrier = Retrier(self.config, on_error=lambda exc: replicas.after_failure(
            exc, retrier.deadline))
        failed_at = position  # where the last failure (or the read) began
        while True:
            address = replicas.current()
            try:
                asked_at = position
                batches = self.range_server(address).fetch(
                    stream_id, position, end, budget, max_wait_ms, min_bytes)
                for header, data in batches:
                    yield FetchedBatch(stream_id, range_index, header, data, address)
                    if header.end_offset > position:
                        position = header.end_offset
                    budget = max(budget - header.batch_length, 0)
                if end == -1 or position >= end or budget == 0:
                    return
                if position > asked_at:
                    continue  # the server ended its answer early: ask for the rest
                # The caller knows the range holds [position, end) (an end it was told), yet
                # this replica served none of it: it lags (an open range's secondary learns
                # what every replica holds one append later) or lost it. Never end the read
                # short in silence: another replica, the PD (a seal) or time will serve it.
                raise ReplicaBehindError(
                    f"{address} served nothing of range {range_index} of stream {stream_id} "
                    f"at offset {position}, though the range holds records up to {end}")
            except SbpError as exc:
                if end != -1 and position >= end:
                    return  # everything asked for arrived before the failure
                if isinstance(exc, DataCorruptError):
                    if corrupt_at != position:
                        corrupt, corrupt_at = {}, position
                    corrupt[address] = exc.message
                    if corrupt.keys() >= set(replicas.servers):
                        raise _corrupt_everywhere(stream_id, range_index, position,
                                                  corrupt) from exc
                if position > failed_at:
                    # Records arrived since: a read that has been going on for longer than
                    # the retry deadline (a slow consumer) still fails over.
                    retrier.progressed()
                failed_at = position
                retrier.retry_after(exc)
                sealed = replicas.sealed_end
                if sealed is not None:
                    # The PD says the range ended (sealed while being read): stop there. An
                    # end the caller was told the range holds lies never past its final end,
                    # unless the range's history was rewritten: say so instead of ending short.
                    if end != -1 and sealed < end and position >= sealed:
                        raise HistoryRewrittenError.for_range(stream_id, range_index, sealed,
                                                           end) from exc
                    end = sealed if end == -1 else min(end, sealed)
                    if position >= end:
                        return

    def read(self, stream_id: int, start: int = 0, end: int = -1) -> Iterator[FetchedBatch]:
        """Every batch of ``stream_id`` holding offsets in ``[start, end)`` (``end`` -1: what
        the stream holds now), walking its ranges in order.

        A ``start`` below the stream's first stored offset (after a trim) reads from that
        first offset. Batches are whole, as in ``fetch``.
        """
        if start < 0:
            raise ValueError(f"start={start}: must be >= 0")
        if end != -1 and end < start:
            raise ValueError(f"end={end} is below start={start}")
        return self._read(stream_id, start, end)

    def _read(self, stream_id: int, start: int, end: int) -> Iterator[FetchedBatch]:
        for range in self.list_ranges(stream_id):
            if end != -1 and range.start_offset >= end:
                return
            range_end = self.open_range_end(range) if range.is_open else range.end_offset
            low = max(start, range.start_offset)
            high = range_end if end == -1 else min(end, range_end)
            # A server may end an answer early (byte budget): ask again from where it stopped.
            while low < high:
                progressed = low
                for batch in self.fetch(range, low, high):
                    yield batch
                    progressed = max(progressed, batch.header.end_offset)
                if progressed == low:
                    break  # nothing more is stored below high (the range ends earlier)
                low = progressed

    def offset_for_time(self, stream_id: int, timestamp_ms: int) -> int | None:
        """The first offset of ``stream_id`` whose record timestamp is at or after
        ``timestamp_ms`` (ms since the epoch), or None when no stored record is; a search of
        O(log n) one-batch FETCHes (see ``client.timesearch`` for what it returns when
        timestamps run back in time)."""
        ranges = [replace(r, next_offset=self.open_range_end(r)) if r.is_open else r
                  for r in self.list_ranges(stream_id)]
        start = self.describe_stream(stream_id).start_offset
        end = range_end(ranges[-1]) if ranges else start
        return TimeSearch(self, ranges).first_at_or_after(timestamp_ms, start, end).offset

    # -- writing ---------------------------------------------------------------------------

    def open_stream(self, stream_id: int) -> StreamWriter:
        """A writer appending to ``stream_id``."""
        return StreamWriter(self, stream_id)

    def append(self, stream_id: int, batches: Sequence[BatchLike]) -> list[Appended]:
        """Append batches to a stream (see ``StreamWriter.append``)."""
        return self.open_stream(stream_id).append(batches)


# Given the indexes of batches about to be sent again, those already stored, with where.
ResendCheck = Callable[[list[int]], dict[int, Appended]]


class StreamWriter:
    """Appends record batches to one stream, wherever its open range lives.

    Finds the open range's primary through the PD, sends the batches there (packed into frames
    within the frame limit, several frames in flight), follows seals to the next range and
    retries what may be retried. Thread-safe; not ordered across concurrent ``append`` calls.
    """

    def __init__(self, client: SbpClient, stream_id: int) -> None:
        self.client = client
        self.stream_id = int(stream_id)
        self._lock = threading.Lock()
        self._range: Range | None = None
        # The range a range server last answered RANGE_SEALED for.
        self._sealed_index: int | None = None

    def __repr__(self) -> str:
        return f"StreamWriter(stream_id={self.stream_id})"

    @property
    def open_range(self) -> Range:
        """The range appends go to now (asked from the PD when unknown)."""
        with self._lock:
            if self._range is None:
                self._range = self._find_open_range()
            return self._range

    def refresh(self) -> None:
        """Forget the cached open range; the next append asks the PD again."""
        with self._lock:
            self._range = None

    def _find_open_range(self) -> Range:
        ranges = self.client.list_ranges(self.stream_id)
        if ranges and ranges[-1].is_open:
            last = ranges[-1]
            if last.range_index != self._sealed_index:
                return last
            # Its primary sealed it on its own (a secondary failed to store a batch) and the PD
            # has not heard of it: ask the PD to seal it where the primary ended and to open
            # the next range (seal-and-new).
            (result,) = self.client.pd.seal_ranges([last])
            return _unwrap(result, f"sealing range {last.range_index} of stream "
                                   f"{self.stream_id} after its primary sealed it")
        # No open range (sealed without a successor): open the next.
        next_index = ranges[-1].range_index + 1 if ranges else 0
        (created,) = self.client.pd.create_range([RangeId(self.stream_id, next_index)])
        if created.ok and created.value is not None:
            return created.value
        # Someone else may have opened it meanwhile: look again once.
        ranges = self.client.list_ranges(self.stream_id)
        if ranges and ranges[-1].is_open:
            return ranges[-1]
        raise RangeSealedError(
            f"stream {self.stream_id} has no open range and opening range {next_index} "
            f"failed: {created.exception()}")

    def append(self, batches: Sequence[BatchLike],
               before_resend: ResendCheck | None = None) -> list[Appended]:
        """Append record batches (bytes-like, or buffer lists as ``encode_batch`` makes);
        returns where each landed, in input order.

        Batches failing with a retriable status are sent again (after a PD look-up when the
        range was sealed or moved) until they land or the retry policy gives up; a
        non-retriable failure raises at once, naming the batch. Delivery is at least once: a
        batch whose answer was lost may be stored twice, unless ``before_resend`` is given:
        it is called with the indexes of the batches about to be sent again and returns those
        it finds already stored (index -> where), which are then not sent again (the
        idempotent streaming sink looks for its write tags).
        """
        items = [_describe_batch(i, b) for i, b in enumerate(batches)]
        results: list[Appended | None] = [None] * len(items)
        pending = list(range(len(items)))
        if not pending:
            return []
        attempts = [0]

        def attempt() -> None:
            attempts[0] += 1
            # The open range first: after a failed append the PD ends the range it went to
            # (seal-and-new), and only then is what that range holds final. Until then a
            # replica fenced by a failed replication hides a tail that may stay in the range,
            # so a check before the seal would miss batches that then land twice.
            target = self.open_range
            if attempts[0] > 1 and before_resend is not None:
                for index, appended in before_resend(list(pending)).items():
                    if index in pending:
                        results[index] = appended
                        pending.remove(index)
                if not pending:
                    return
            primary = target.primary
            if primary is None or not primary.advertise_addr:
                self.refresh()
                raise RangeSealedError(
                    f"open range {self.stream_id}/{target.range_index} lists no primary")
            outcomes = self._send(target, primary.advertise_addr,
                                  [(self.stream_id, items[i][0]) for i in pending])
            failed: list[int] = []
            retry_error: SbpError | None = None
            for index, outcome in zip(pending, outcomes, strict=True):
                error = outcome.exception()
                if error is None:
                    _, length, count = items[index]
                    results[index] = Appended(self.stream_id, target.range_index,
                                              outcome.unwrap().base_offset, count, length)
                    self.client._took[self.stream_id] = target.range_index
                    continue
                if isinstance(error, (RangeSealedError, ReplicationFailedError)):
                    # The primary sealed the range (a replica failed to store a batch).
                    self._sealed_index = target.range_index
                if not is_retriable(error):
                    raise _with_context(error, f"append of batch {index} to stream "
                                               f"{self.stream_id} at {primary.advertise_addr}")
                failed.append(index)
                if retry_error is None:
                    retry_error = error
            pending[:] = failed
            if retry_error is not None:
                raise retry_error

        self._retried(attempt, attempts, results)
        landed = [appended for appended in results if appended is not None]
        if len(landed) != len(results):
            # call_with_retries returns only once no batch is pending: this would be a bug.
            raise RuntimeError(
                f"append to stream {self.stream_id}: batches "
                f"{[i for i, r in enumerate(results) if r is None]} got no answer")
        return landed

    def _retried(self, attempt: Callable[[], None], attempts: list[int],
                 results: Sequence[Appended | None]) -> None:
        """Run ``attempt`` under the retry policy; when it gives up, its error says what gave
        up and how far it got (``attempts[0]``: attempts made; ``results``: what landed)."""
        started = time.monotonic()
        try:
            call_with_retries(attempt, self.client.config, on_error=self._on_error)
        except SbpError as exc:
            if not is_retriable(exc):
                raise  # named the batch already, or the PD's answer says what failed
            done = sum(1 for r in results if r is not None)
            raise _with_context(exc, (
                f"append to stream {self.stream_id} gave up after {attempts[0]} attempts in "
                f"{time.monotonic() - started:.1f} s, with {done} of {len(results)} batches "
                f"of the call stored (is the range server up? a stream with replicas > 1 "
                f"moves to live servers once the PD notices; more retries wait longer)"
            )) from exc

    def _send(self, target: Range, address: str, entries: list[tuple[int, list]]
              ) -> list[ItemResult]:
        """APPEND ``entries`` to ``target``'s primary; one outcome per entry, in order.

        The frames of one call are in flight together, so their order holds only if the
        server refuses every frame after one it refused. Within a range it does (a seal
        refuses all that follow), but not before the range reached it: the PD records a range
        before it tells the range's servers, so a writer may learn of it first; the frames
        served before it arrived were refused, those served after stored, and the refused
        ones, sent again, landed after them. So the first batch to a range goes alone, and
        the rest once the range took it.
        """
        server = self.client.range_server(address)

        def still_primary() -> bool:
            return self._still_primary(target, address)

        if self.client._took.get(self.stream_id) == target.range_index or len(entries) == 1:
            return server.append(entries, still_primary=still_primary)
        (first,) = server.append(entries[:1], still_primary=still_primary)
        if first.exception() is not None:
            return [first] * len(entries)  # the rest was not sent: it fails the same way
        self.client._took[self.stream_id] = target.range_index
        return [first, *server.append(entries[1:], still_primary=still_primary)]

    def _still_primary(self, target: Range, address: str) -> bool:
        """Asked when ``address``, appended to as ``target``'s primary, lets a PING go
        unanswered: True while the PD still lists ``target`` open with that primary.

        A stopped server and a busy one whose reader holds back (its backpressure, while a
        slow disk holds the requests queued before the PING) look alike from here, and the
        batches in flight, sent again, could be stored twice. Sending them elsewhere helps
        only once the PD has moved the range (after the server's heartbeats stopped), so until
        then the writer keeps waiting; a PD that cannot be asked counts as a yes."""
        try:
            ranges = self.client.list_ranges(self.stream_id)
        except SbpError as exc:
            _log.debug("stream %d: asking the PD whether %s is still the primary failed: %s",
                      self.stream_id, address, exc)
            return True
        for rng in ranges:
            if rng.range_index == target.range_index:
                primary = rng.primary
                return rng.is_open and primary is not None and \
                    primary.advertise_addr == address
        return False

    def _on_error(self, error: SbpError) -> bool:
        # The flag, not a list of classes: a primary that went silent (a timeout) may have
        # been failed over, and only the PD knows where the open range is now.
        if error.invalid_metadata:
            self.refresh()
        # A seal is routine, not a fault: retry at once against the new open range.
        return isinstance(error, RangeSealedError)


_ENVELOPE = struct.Struct(">BBHqiqi")


def _describe_batch(index: int, batch: BatchLike) -> tuple[list, int, int]:
    """(buffers, batch_length, record_count) of one batch, after checking its envelope."""
    buffers = batch_buffers(batch)
    length = sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in buffers)
    first = memoryview(buffers[0]).cast("B") if buffers else memoryview(b"")
    head = first if first.nbytes >= ENVELOPE_SIZE else b"".join(bytes(b) for b in buffers)
    if len(head) < ENVELOPE_SIZE:
        raise BatchFormatError(
            f"batch {index}: {length} bytes cannot hold the {ENVELOPE_SIZE}-byte envelope")
    header = BatchHeader(*_ENVELOPE.unpack_from(head, 0)[1:])
    if head[0] != BATCH_MAGIC:
        raise BatchFormatError(f"batch {index}: magic {head[0]:#04x} is not {BATCH_MAGIC:#04x}")
    if header.body_format not in (BodyFormat.OPAQUE, BodyFormat.ARROW):
        raise BatchFormatError(f"batch {index}: body_format {header.body_format} is unknown")
    if header.record_count < 1:
        raise BatchFormatError(f"batch {index}: record_count {header.record_count} is below 1")
    if header.batch_length != length:
        raise BatchFormatError(
            f"batch {index}: the envelope says {header.batch_length} bytes, the batch has "
            f"{length}")
    return buffers, length, header.record_count


class _Replicas:
    """Where one read of a range goes: its replicas, primary first, moving to the next one
    after each failure and asking the PD again where they live when a failure says the
    address may be stale (a server restarted on another port, the range moved or was sealed).
    """

    def __init__(self, client: SbpClient, range: Range) -> None:
        self.client = client
        self.range = range
        self.servers = _servers_of(range)
        self.primary = _primary_of(range)
        self.index = 0
        self.sealed_end: int | None = None if range.is_open else range.end_offset
        if not self.servers:
            # Planned without a replica (every server was gone): the PD may know one now.
            self.refresh(None)
        if not self.servers:
            raise RangeNotFoundError(
                f"range {range.stream_id}/{range.range_index} lists no range server to read "
                f"from")

    def current(self) -> str:
        return self.servers[self.index % len(self.servers)]

    def after_failure(self, error: SbpError, deadline: float) -> bool:
        """Move on after ``error`` (a ``Retrier`` hook): True to try again at once (another
        replica, or new addresses from the PD), False to back off first."""
        self.index += 1
        round_done = self.index % len(self.servers) == 0
        if isinstance(error, DataCorruptError):
            # The same server would send the same bytes: the next replica, without waiting.
            return True
        if (error.invalid_metadata or round_done) and self.refresh(deadline):
            return True
        return not round_done

    def refresh(self, deadline: float | None) -> bool:
        """Ask the PD for the range's replicas; True when it said something new (other
        addresses, or that the range is sealed)."""
        rng = self.range
        try:
            (result,) = self.client.pd.describe_ranges([rng], deadline=deadline)
        except SbpError as exc:
            # The PD is unreachable too: keep reading from the addresses known so far.
            _log.debug("re-resolving range %d/%d from the PD failed: %s", rng.stream_id,
                       rng.range_index, exc)
            return False
        error = result.exception()
        if error is not None:
            if is_retriable(error):
                return False
            # Deleted meanwhile, say: reading on would only fail the same way.
            raise _with_context(error, f"range {rng.range_index} of stream {rng.stream_id}")
        fresh = result.value
        if fresh is None:
            return False
        learned = False
        if not fresh.is_open and self.sealed_end != fresh.end_offset:
            self.sealed_end, learned = fresh.end_offset, True
        servers = _servers_of(fresh)
        self.primary = _primary_of(fresh) or self.primary
        if not servers or servers == self.servers:
            return learned
        _log.info("range %d/%d: replicas now at %s (were %s)", rng.stream_id, rng.range_index,
                  ", ".join(servers), ", ".join(self.servers) or "none")
        self.servers, self.index = servers, 0
        return True


def _corrupt_everywhere(stream_id: int, range_index: int, offset: int,
                        reports: dict[str, str]) -> ServerError:
    """The error of a read whose every replica holds a corrupt copy at ``offset``."""
    detail = "; ".join(f"{address}: {message}" for address, message in reports.items())
    return DataCorruptError(
        f"stream {stream_id} range {range_index}: offset {offset} is corrupt on every replica "
        f"({', '.join(reports)}), no sound copy to read: {detail}")


def _servers_of(range: Range) -> list[str]:
    """Addresses to read ``range`` from: the primary first, then the other replicas."""
    replicas = sorted(range.servers, key=lambda r: not r.is_primary)
    return [r.server.advertise_addr for r in replicas if r.server.advertise_addr]


def _primary_of(range: Range) -> str | None:
    """The primary's address (None when the range names none)."""
    return next((r.server.advertise_addr for r in range.servers
                 if r.is_primary and r.server.advertise_addr), None)


def _unwrap(result: ItemResult, what: str):
    error = result.exception()
    if error is not None:
        raise _with_context(error, what)
    return result.value


def _with_context(error: SbpError, context: str) -> SbpError:
    if isinstance(error, ServerError):
        message = f"{context}: {error.message}" if error.message else context
        fresh = ServerError.for_status(error.code, message, error.detail)
        return fresh
    if type(error) in _CONTEXTUAL:  # the same class (and so flags), the message in context
        return type(error)(f"{context}: {error}")
    return error


# Client-side errors whose only state is their message.
_CONTEXTUAL = (TransportError, ConnectError, PdUnreachableError, SbpTimeoutError,
               ConnectTimeoutError, TlsHandshakeTimeoutError, ReadTimeoutError,
               WriteTimeoutError, ReplicaBehindError)


