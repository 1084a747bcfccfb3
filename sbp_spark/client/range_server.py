"""Client of one range server: pipelined APPEND, streamed FETCH, seal and describe ranges."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass

from sbp_spark.protocol.constants import CHECKSUM_SIZE, FIXED_HEADER_SIZE, Opcode
from sbp_spark.protocol.errors import (
    PayloadTooLargeError,
    ProtocolError,
    SbpError,
    SbpTimeoutError,
    ServerError,
)
from sbp_spark.protocol.frame import encode_frame
from sbp_spark.protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResponse,
    AppendResult,
    DescribeRangesRequest,
    FetchEntry,
    FetchRequest,
    FetchResponse,
    LookupSequencesRequest,
    ProducerSequence,
    Range,
    RangeId,
    SealRangesRequest,
    Status,
    decode_response,
    request_frame,
)
from sbp_spark.protocol.records import BatchHeader, iter_batches

from ._calls import checked_call, item_results
from .config import DEFAULT_FETCH_MAX_BYTES, ClientConfig
from .connection import Connection, ResponseStream
from .pool import ConnectionPool, get_pool
from .types import ItemResult, status_error

Buffer = bytes | bytearray | memoryview
BatchLike = Buffer | list[Buffer] | tuple[Buffer, ...]
"""One record batch: a bytes-like object, or the list (or tuple) of buffers it is made of
(``encode_batch``)."""

# An APPEND header is a small table plus one 16-byte struct per entry. These bounds are above
# what the encoder writes (checked after encoding), so a planned frame never breaks the limit.
_APPEND_HEADER_BASE = 64
_APPEND_HEADER_PER_ENTRY = 16
# An idempotent append's entry also carries its producer and sequence (16 bytes more).
_APPEND_HEADER_PER_PRODUCED_ENTRY = 32
_FRAME_OVERHEAD = FIXED_HEADER_SIZE - 4 + CHECKSUM_SIZE  # counted in frame_length
_INT32_MAX = (1 << 31) - 1
# A frame's answer that is already due is still given this long: it may be in the socket,
# not read yet.
_MIN_WAIT_S = 0.05


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def batch_buffers(batch: BatchLike) -> list[Buffer]:
    """The buffers of one batch, whatever form it was given in."""
    if isinstance(batch, (bytes, bytearray, memoryview)):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return list(batch)
    try:
        return [memoryview(batch)]  # pyarrow.Buffer and other buffer-protocol objects
    except TypeError:
        raise TypeError(
            f"a record batch must be bytes-like or a list of buffers, not "
            f"{type(batch).__name__}") from None


def plan_append_frames(lengths: Sequence[int], max_frame_bytes: int,
                       target_frame_bytes: int | None = None,
                       per_entry: int = _APPEND_HEADER_PER_ENTRY
                       ) -> tuple[list[list[int]], list[int]]:
    """Group batch indices, in order, into APPEND frames whose frame_length stays within
    ``max_frame_bytes``; also returns the indices of batches too large for any frame.

    A frame is closed once adding the next batch would pass ``target_frame_bytes`` (default:
    the limit), so several smaller frames can be in flight; a batch larger than the target
    still gets a frame of its own. ``per_entry``: the header bytes each entry adds.
    """
    target = max_frame_bytes if target_frame_bytes is None else min(
        target_frame_bytes, max_frame_bytes)
    frames: list[list[int]] = []
    too_large: list[int] = []
    current: list[int] = []
    size = _FRAME_OVERHEAD + _APPEND_HEADER_BASE
    for index, length in enumerate(lengths):
        alone = _FRAME_OVERHEAD + _APPEND_HEADER_BASE + per_entry + length
        if alone > max_frame_bytes:
            too_large.append(index)
            continue
        added = per_entry + length
        if current and size + added > target:
            frames.append(current)
            current, size = [], _FRAME_OVERHEAD + _APPEND_HEADER_BASE
        current.append(index)
        size += added
    if current:
        frames.append(current)
    return frames, too_large


@dataclass(slots=True)
class FetchChunk:
    """The batches one fetch entry received in one response frame."""

    request_index: int
    stream_id: int
    status: Status
    payload: memoryview  # whole batches laid end to end (may be empty)

    def batches(self) -> Iterator[tuple[BatchHeader, memoryview]]:
        """(envelope, view of the whole batch) for each batch, without copying."""
        return iter_batches(self.payload)


class RangeServerClient:
    """Talks to the range server at ``address`` over the pooled connection.

    Each call is one attempt: failures come back as errors (or per-entry results) and the
    caller, which knows the range's other replicas and the PD, decides how to retry.
    """

    def __init__(self, address: str, config: ClientConfig | None = None,
                 pool: ConnectionPool | None = None) -> None:
        self.address = address
        self.config = config if config is not None else ClientConfig()
        self.pool = pool if pool is not None else get_pool()

    def __repr__(self) -> str:
        return f"RangeServerClient({self.address!r})"

    def connection(self) -> Connection:
        """The pooled connection to this server (opened if needed)."""
        return self.pool.get(self.address, self.config)

    # -- APPEND ----------------------------------------------------------------------------

    def append(
        self,
        entries: Sequence[tuple[int, BatchLike]],
        timeout_ms: int | None = None,
        max_inflight_frames: int | None = None,
        still_primary: Callable[[float], bool] | None = None,
        producers: Sequence[ProducerSequence] | None = None,
    ) -> list[ItemResult[AppendResult]]:
        """Append ``(stream_id, batch)`` entries; one result per entry, in input order.
        ``producers``: None, or each entry's producer and sequence (idempotent appends).

        Entries are packed in order into APPEND frames within ``config.max_frame_bytes``, and
        up to ``max_inflight_frames`` frames are in flight at once. Answers are matched to
        entries by request_index (the entry's position), whatever frame or order they come
        in. Nothing is retried here: a failed entry says why in its result, and whether it
        may have been stored all the same (``ItemResult.outcome``).

        An answer ``config.probe_interval_s`` late PINGs the server; when the PING goes
        unanswered, the frames in flight fail at once (retriable), unless ``still_primary``
        (asked then, with the time since which the server has been silent) says the server
        is still where the entries belong: then they are waited for up to the request timeout
        (see ``Connection.late_answer``).
        """
        count = len(entries)
        if count > _INT32_MAX:
            raise ValueError(f"{count} entries exceed the int32 request_index range")
        timeout_ms = self.config.server_timeout_ms if timeout_ms is None else timeout_ms
        wait = self.config.request_timeout_s + timeout_ms / 1000.0  # for each frame's answer
        probe_s = min(self.config.probe_interval_s, wait)
        inflight_limit = max_inflight_frames or self.config.max_inflight_frames
        buffers = [batch_buffers(batch) for _, batch in entries]
        lengths = [sum(_nbytes(b) for b in bufs) for bufs in buffers]
        results: list[ItemResult[AppendResult] | None] = [None] * count
        per_entry = _APPEND_HEADER_PER_PRODUCED_ENTRY if producers else \
            _APPEND_HEADER_PER_ENTRY
        frames, too_large = plan_append_frames(lengths, self.config.max_frame_bytes,
                                               self.config.append_frame_bytes, per_entry)
        for index in too_large:
            results[index] = ItemResult(None, error=PayloadTooLargeError(
                f"batch {index} of {lengths[index]} bytes does not fit in one APPEND frame "
                f"(limit {self.config.max_frame_bytes} bytes including the header)"))
        if frames:
            try:
                conn = self.connection()
            except SbpError as exc:
                for indices in frames:
                    self._fail(results, indices, exc)
                frames = []
            # (answer stream, entry indices, when its answer is due)
            inflight: deque[tuple[ResponseStream, list[int], float]] = deque()
            next_frame = 0
            while next_frame < len(frames) or inflight:
                while next_frame < len(frames) and len(inflight) < inflight_limit:
                    indices = frames[next_frame]
                    next_frame += 1
                    try:
                        stream = self._send_append(conn, entries, buffers, lengths, indices,
                                                   timeout_ms, wait, producers)
                    except SbpError as exc:
                        self._fail(results, indices, exc)
                        if isinstance(exc, ProtocolError):
                            continue
                        # The connection is gone: nothing more can be sent on it.
                        for rest in frames[next_frame:]:
                            self._fail(results, rest, exc)
                        next_frame = len(frames)
                        break
                    inflight.append((stream, indices, time.monotonic() + wait))
                if inflight:
                    stream, indices, due = inflight.popleft()
                    error = self._collect_append(conn, stream, indices, results, due, wait,
                                                 probe_s, still_primary=still_primary)
                    if isinstance(error, SbpTimeoutError) and conn.unanswered:
                        # Nothing came back since: the connection may be dead, or the server
                        # stopped (it let a PING go unanswered). Frames not sent yet stay
                        # unsent, and those in flight keep only answers already received:
                        # they all fail with the timeout and may be retried at once.
                        for rest in frames[next_frame:]:
                            self._fail(results, rest, error)
                        next_frame = len(frames)
                        while inflight:
                            stream, indices, _ = inflight.popleft()
                            self._collect_append(conn, stream, indices, results, 0.0, wait,
                                                 probe_s, lost=error)
        return [r if r is not None else ItemResult(None, error=ProtocolError(
            f"{self.address} did not answer append entry {i}"), in_doubt=True)
            for i, r in enumerate(results)]

    def _send_append(self, conn: Connection, entries, buffers, lengths, indices,
                     timeout_ms: int, wait: float,
                     producers: Sequence[ProducerSequence] | None) -> ResponseStream:
        msg = AppendRequest(timeout_ms, [
            AppendEntry(entries[i][0], i, lengths[i]) for i in indices],
            producers=[producers[i] for i in indices] if producers else [])
        payload = [b for i in indices for b in buffers[i]]
        header = msg.to_flatbuffers()
        planned = _APPEND_HEADER_BASE + (_APPEND_HEADER_PER_PRODUCED_ENTRY if producers else
                                         _APPEND_HEADER_PER_ENTRY) * len(indices)
        if len(header) > planned:
            raise ProtocolError(
                f"APPEND header of {len(header)} bytes is over the {planned} bytes planned")
        return conn.start(
            Opcode.APPEND,
            lambda sid: encode_frame(Opcode.APPEND, 0, sid, header, payload), wait)

    def _collect_append(self, conn: Connection, stream: ResponseStream, indices: list[int],
                        results: list, due: float, wait: float, probe_s: float,
                        lost: SbpError | None = None,
                        still_primary: Callable[[float], bool] | None = None) -> SbpError | None:
        """Read one frame's answer into ``results``; returns the error that failed it, if
        any. The first answer frame is awaited only until ``due`` (``wait`` after the frame
        was sent, not after the frames before it were answered: on a dead connection, frames
        in flight time out together instead of one after another). An answer ``probe_s``
        late PINGs the server (``Connection.late_answer``): one that answers no PING either
        fails the frame at once. ``lost``: the connection is taken as dead, with that error;
        only an answer already received counts."""
        count = len(results)
        top: Status | None = None
        try:
            if lost is None:
                first = min(probe_s, max(due - time.monotonic(), _MIN_WAIT_S))
                frame = stream.poll(first)
                if frame is None:
                    frame = conn.late_answer(stream, probe_s, due, first, still_primary)
            else:
                frame = stream.poll(0.0)
                if frame is None:
                    stream.close()
                    self._fail(results, indices, lost, sent=True)
                    return lost
            while True:
                response = decode_response(frame, AppendResponse)
                if response.throttle_time_ms > 0:
                    conn.throttle(response.throttle_time_ms)
                if response.status.code:
                    top = response.status
                for result in response.append_responses:
                    index = result.request_index
                    if 0 <= index < count and results[index] is None:
                        results[index] = ItemResult(result, result.status)
                if stream.done:
                    break
                frame = stream.poll(probe_s)  # the answer's next frame
                if frame is None:
                    frame = conn.late_answer(stream, probe_s,
                                             time.monotonic() - probe_s + wait, probe_s,
                                             still_primary)
        except SbpError as exc:  # SYSTEM_ERROR (a ServerError) or a failed connection
            self._fail(results, indices, exc, sent=True)
            return exc
        if top is not None:
            for index in indices:
                if results[index] is None:
                    results[index] = ItemResult(None, top)
        return None

    @staticmethod
    def _fail(results: list, indices: Sequence[int], error: SbpError, sent: bool = False
              ) -> None:
        """Fail the entries ``indices`` that have no result yet with ``error``: a server's
        answer (its status), or a failure of the connection, after their frame was ``sent``
        (their outcome is unknown) or before (never sent: a frame cut off while sending is
        incomplete, which the server stores nothing of)."""
        for index in indices:
            if results[index] is None:
                if isinstance(error, ServerError):
                    results[index] = ItemResult(None, Status.from_error(error))
                else:
                    results[index] = ItemResult(None, error=error, in_doubt=sent)

    # -- FETCH -----------------------------------------------------------------------------

    def fetch_many(
        self,
        entries: Sequence[FetchEntry],
        max_wait_ms: int = 0,
        min_bytes: int = 0,
        timeout: float | None = None,
    ) -> Generator[FetchChunk, None, None]:
        """Send one FETCH with ``entries`` and yield each entry's batches as frames arrive.

        A failed entry comes out as a chunk with a non-OK ``status`` (and no batches); the
        other entries go on. ``timeout`` bounds the wait for each frame; ``max_wait_ms`` is
        added to it.
        """
        for entry in entries:
            if not 0 <= entry.batch_max_bytes <= _INT32_MAX:
                raise ValueError(
                    f"batch_max_bytes={entry.batch_max_bytes}: must be in 0..{_INT32_MAX}")
        msg = FetchRequest(max_wait_ms, min_bytes, list(entries))
        wait = (self.config.request_timeout_s if timeout is None else timeout) \
            + max_wait_ms / 1000.0
        conn = self.connection()
        stream = conn.start(Opcode.FETCH, lambda sid: request_frame(sid, msg), wait)
        return self._fetch_chunks(conn, stream, max_wait_ms / 1000.0,
                                  min(self.config.probe_interval_s, wait))

    def wait_for_records(self, positions: Sequence[tuple[int, int]], max_wait_ms: int
                         ) -> list[int]:
        """One FETCH long poll over ``positions`` ((stream_id, offset) pairs): returns, once
        any holds a record or ``max_wait_ms`` passed, the indexes of the positions that hold
        one now. A position the server refuses counts as empty; a failed request raises."""
        entries = [FetchEntry(stream_id, index, offset, 1)
                   for index, (stream_id, offset) in enumerate(positions)]
        found: set[int] = set()
        with closing(self.fetch_many(entries, max_wait_ms=max_wait_ms, min_bytes=1)) as chunks:
            for chunk in chunks:
                if chunk.status.code == 0 and chunk.payload.nbytes > 0:
                    found.add(chunk.request_index)
        return sorted(found)

    def _fetch_chunks(self, conn: Connection, stream: ResponseStream, long_poll_s: float,
                      probe_s: float) -> Generator[FetchChunk, None, None]:
        """The chunks of a FETCH's answer as its frames arrive. A frame ``probe_s`` late (the
        first: beyond the ``long_poll_s`` the server may hold the answer back) PINGs the
        server, and one that answers no PING either fails the read at once
        (``Connection.late_answer``): it goes on from another replica."""
        with stream:
            wait = long_poll_s + probe_s
            while not stream.done:
                frame = stream.poll(wait)
                if frame is None:
                    frame = conn.late_answer(stream, probe_s,
                                             time.monotonic() - wait + stream.timeout, wait)
                wait = probe_s
                response = decode_response(frame, FetchResponse)
                if response.throttle_time_ms > 0:
                    conn.throttle(response.throttle_time_ms)
                if response.status.code:
                    raise status_error(response.status, response.throttle_time_ms,
                                       f"FETCH from {self.address}")
                payload = frame.payload
                if not isinstance(payload, memoryview):
                    payload = memoryview(payload)
                pos, size = 0, payload.nbytes
                for result in response.fetch_responses:
                    end = pos + result.batch_length
                    if result.batch_length < 0 or end > size:
                        raise ProtocolError(
                            f"FETCH answer from {self.address}: entry {result.request_index} "
                            f"claims {result.batch_length} bytes at {pos} of a {size}-byte "
                            f"payload")
                    yield FetchChunk(result.request_index, result.stream_id, result.status,
                                     payload[pos:end])
                    pos = end

    def fetch(
        self,
        stream_id: int,
        fetch_offset: int,
        end_offset: int = -1,
        batch_max_bytes: int = DEFAULT_FETCH_MAX_BYTES,
        max_wait_ms: int = 0,
        min_bytes: int = 0,
        timeout: float | None = None,
    ) -> Generator[tuple[BatchHeader, memoryview], None, None]:
        """Stream the batches of ``stream_id`` from ``fetch_offset`` (up to ``end_offset``,
        -1 = no bound) with one FETCH request; ``batch_max_bytes`` bounds the whole answer.

        Yields (envelope, view of the whole batch) as frames arrive; raises the entry's
        ``ServerError`` if the server refuses it.
        """
        entry = FetchEntry(stream_id, 0, fetch_offset, batch_max_bytes, end_offset)
        chunks = self.fetch_many([entry], max_wait_ms, min_bytes, timeout)
        return self._single_fetch(chunks, stream_id)

    def _single_fetch(self, chunks: Generator[FetchChunk, None, None], stream_id: int
                      ) -> Generator[tuple[BatchHeader, memoryview], None, None]:
        try:
            for chunk in chunks:
                if chunk.status.code:
                    raise status_error(chunk.status, 0,
                                       f"FETCH of stream {stream_id} from {self.address}")
                yield from iter_batches(chunk.payload)
        finally:
            chunks.close()

    # -- ranges ----------------------------------------------------------------------------

    def _call(self, msg, probe: bool = False):
        # One attempt, like append and fetch: callers that know the range's other replicas
        # (SbpClient) decide where to retry. ``probe``: for requests that change nothing, a
        # server that answers late and lets a PING go unanswered fails the call at once.
        return checked_call(self.connection(), msg,
                            probe_s=self.config.probe_interval_s if probe else None)

    def seal(self, ranges: Sequence[RangeId | tuple[int, int]]) -> list[ItemResult[Range]]:
        """Seal ranges on this server (SEAL_RANGES); each result is the sealed range."""
        ids = [_range_id(r) for r in ranges]
        response = self._call(SealRangesRequest(self.config.server_timeout_ms, ids))
        return item_results(response.seal_responses, len(ids), lambda a: a.range,
                            f"SEAL_RANGES to {self.address}")

    def describe_ranges(self, ranges: Sequence[RangeId | Range | tuple[int, int]]
                        ) -> list[ItemResult[Range | None]]:
        """Live state of ranges on this server (an open range's next_offset); a success
        whose answer left the range out has the value None."""
        ids = [_range_id(r) for r in ranges]
        response = self._call(DescribeRangesRequest(self.config.server_timeout_ms, ids),
                              probe=True)
        return item_results(response.describe_responses, len(ids), lambda a: a.range,
                            f"DESCRIBE_RANGES to {self.address}")

    def lookup_sequences(self, rid: RangeId, producer_id: int, sequences: Sequence[int]
                         ) -> list[int]:
        """Where the sealed range ``rid`` holds each of ``sequences`` of ``producer_id``
        (LOOKUP_SEQUENCES, ours): its base offset, or -1 when the range does not hold it.
        Raises the server's refusal (``SequencePendingError``: ask again or another replica;
        ``UnknownProducerError``: it cannot tell)."""
        response = self._call(LookupSequencesRequest(rid, producer_id, list(sequences)),
                              probe=True)
        response.status.raise_for_status()
        if len(response.base_offsets) != len(sequences):
            raise ProtocolError(
                f"LOOKUP_SEQUENCES to {self.address} answered {len(response.base_offsets)} "
                f"offsets for {len(sequences)} sequences")
        return list(response.base_offsets)

    def ping(self) -> float:
        """Round-trip time of a PING to this server, in seconds."""
        return self.connection().ping()


def _range_id(value: RangeId | Range | tuple[int, int]) -> RangeId:
    if isinstance(value, RangeId):
        return value
    if isinstance(value, Range):
        return RangeId(value.stream_id, value.range_index)
    try:
        stream_id, range_index = value
    except (TypeError, ValueError):
        raise TypeError(
            f"a range is named by RangeId, Range or (stream_id, range_index), not {value!r}"
        ) from None
    return RangeId(int(stream_id), int(range_index))


__all__ = ["BatchLike", "FetchChunk", "RangeServerClient", "batch_buffers",
           "plan_append_frames"]
