"""Batch writing: ``df.write.format("sbp").mode("append").save()``.

Each task turns Spark's Arrow batches into record batches (``encode``) and hands them to the
client's stream writer, which packs many into each APPEND frame, keeps several frames in flight
and follows sealed ranges. The client appends idempotently (one producer per process's
client, docs/reliability.md "Duplicates"), so its own resends through failovers store no
duplicate. Delivery across Spark's retries is at least once: SBP streams are append-only, so
records appended by a task whose job later fails stay in the stream, and the retried task is
a new producer.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage

from sbp_spark.client import Appended, ResendCheck, SbpClient, StreamWriter
from sbp_spark.protocol.errors import SbpError
from sbp_spark.protocol.names import check_name

from . import cluster_access, stream_names
from .encode import Batcher, EncodedBatch, RowEncoder, encode_batches
from .evolution import check_backward
from .options import WriteOptions
from .resolve import case_duplicates, groups_text
from .settings import case_sensitive
from .zones import session_time_zone

log = logging.getLogger(__name__)

# Encoded bytes a task gathers for one stream before handing them to the client in one call
# (the client packs them into frames and keeps several in flight).
APPEND_CALL_BYTES = 16 * 1024 * 1024
# Append calls a task lets wait behind the one being sent; bounds a task's buffered bytes to
# about (1 + APPENDS_QUEUED) * APPEND_CALL_BYTES.
APPENDS_QUEUED = 2
# How long a failing task asks the PD where its batches landed, for its error's note.
PARTIAL_LOCATE_S = 3.0


@dataclass
class AppendedSpan:
    """What one task appended to one range of one stream."""

    stream_id: int
    range_index: int
    first_offset: int
    last_offset: int  # inclusive
    records: int
    bytes: int
    batches: int

    def add(self, appended: Appended) -> None:
        self.first_offset = min(self.first_offset, appended.base_offset)
        self.last_offset = max(self.last_offset, appended.end_offset - 1)
        self.records += appended.record_count
        self.bytes += appended.batch_length
        self.batches += 1


@dataclass
class SbpCommitMessage(WriterCommitMessage):
    """A task's appends, per (stream, range)."""

    spans: list[AppendedSpan] = field(default_factory=list)


class _TaskAppends:
    """One task's append calls and what they appended (as spans per range, see ``message``).

    Calls go out from one background thread, in order, so that encoding the next batches
    overlaps sending the previous ones; a failure surfaces in the task's thread at the next
    ``submit`` or at ``finish``.
    """

    def __init__(self, client: SbpClient | None = None) -> None:
        self.client = client  # asked where the batches landed (None: not asked)
        self.appended: list[Appended] = []
        self._thread: ThreadPoolExecutor | None = None
        self._calls: deque[Future] = deque()

    def submit(self, writer: StreamWriter, batches: list[list],
               before_resend: ResendCheck | None = None) -> None:
        """Append ``batches`` (encoded record batches) to ``writer``'s stream
        (``before_resend``: see ``StreamWriter.append``)."""
        while len(self._calls) > APPENDS_QUEUED:
            self.record(self._calls.popleft().result())
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="sbp-append")
        self._calls.append(self._thread.submit(writer.append, batches, before_resend))

    def finish(self) -> None:
        """Wait for every call; raises the first failure."""
        while self._calls:
            self.record(self._calls.popleft().result())

    def close(self) -> None:
        """Stop the background thread (calls not yet started are dropped) and record what the
        calls that ran to the end appended (after a failure, ``spans`` is then what the task
        left in the streams, but for the part of a failed call that landed)."""
        for call in self._calls:
            call.cancel()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        while self._calls:
            call = self._calls.popleft()
            if not call.cancelled() and call.exception() is None:
                self.record(call.result())

    def record(self, appended: list[Appended]) -> None:
        self.appended += appended

    def message(self, locate_within_s: float | None = None) -> SbpCommitMessage:
        """The task's appends per (stream, range). An append reports the range it was sent
        to, and a range sealed by someone else meanwhile leaves the batches that followed in
        the next range on the same server (see ``Appended``): the ranges are taken from the
        PD here, in one request per task (``locate_within_s`` bounds its retries; the
        ranges as sent when the PD does not answer)."""
        appended = self.appended
        if appended and self.client is not None:
            deadline = None if locate_within_s is None else time.monotonic() + locate_within_s
            try:
                appended = self.client.locate(appended, deadline)
            except SbpError as exc:
                log.debug("sbp write: the PD did not list the ranges written to (%s); commit "
                          "messages name the ranges the batches were sent to", exc)
        spans: dict[tuple[int, int], AppendedSpan] = {}
        for item in appended:
            key = (item.stream_id, item.range_index)
            span = spans.get(key)
            if span is None:
                span = AppendedSpan(item.stream_id, item.range_index, item.base_offset,
                                    item.end_offset - 1, 0, 0, 0)
                spans[key] = span
            span.add(item)
        return SbpCommitMessage(sorted(spans.values(), key=lambda s: (s.stream_id, s.range_index)))


class _StreamSink:
    """One target stream of one task: batching, encoding and appending."""

    def __init__(self, client: SbpClient, stream_id: int, options: WriteOptions,
                 appends: _TaskAppends) -> None:
        self.stream_id = stream_id
        self.options = options
        self.appends = appends
        self.writer = client.open_stream(stream_id)
        self.batcher = Batcher(options.batch_max_records, options.batch_max_bytes)
        self.pending: list[EncodedBatch] = []
        self.pending_bytes = 0

    def add(self, body: pa.RecordBatch) -> None:
        self._encode(self.batcher.add(body))
        if self.pending_bytes >= APPEND_CALL_BYTES:
            self._append()

    def finish(self) -> None:
        self._encode(self.batcher.flush())
        self._append()

    def _encode(self, batches: list[pa.RecordBatch]) -> None:
        for batch in batches:
            for encoded in encode_batches(batch, self.options.compression):
                self.pending.append(encoded)
                self.pending_bytes += encoded.nbytes

    def _append(self) -> None:
        if not self.pending:
            return
        batches, self.pending, self.pending_bytes = self.pending, [], 0
        self.appends.submit(self.writer, [b.buffers for b in batches],
                            self._resend_check(batches))

    def _resend_check(self, batches: list[EncodedBatch]) -> ResendCheck | None:
        """How a resend of ``batches`` finds those already stored (None: it does not)."""
        return None


class SbpBatchWriter(DataSourceArrowWriter):
    """Appends a DataFrame to SBP streams (built on the driver, pickled to every task)."""

    def __init__(self, options: WriteOptions, encoder: RowEncoder, stream: int | None,
                 created: bool = False) -> None:
        self.options = options
        self.encoder = encoder
        self.stream = stream
        self.created = created

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SbpCommitMessage:
        encoder = self.encoder
        if encoder.payload == "arrow" and not case_sensitive():
            # Checked in the task: only tasks see the session's setting.
            groups = case_duplicates(n for n in encoder.names if n != "stream_id")
            if groups:
                raise ValueError(
                    f"payload=arrow cannot write this DataFrame: columns {groups_text(groups)} "
                    "differ only by case, and with spark.sql.caseSensitive=false (Spark's "
                    "default, and this session's) they name one column, so no read could tell "
                    "them apart; "
                    "rename one of them, or set spark.sql.caseSensitive=true")
        client = cluster_access.get_client(self.options.client)
        if encoder.wall_clock_timestamp:
            encoder = encoder.with_time_zone(self.options.time_zone or session_time_zone())
        appends = _TaskAppends(client)
        sinks: dict[int, _StreamSink] = {}
        named: dict[str, int] = {}  # stream_name values looked up by this task
        try:
            for batch in iterator:
                for target, body in encoder.bodies(batch, self.stream):
                    stream_id = (target if isinstance(target, int)
                                 else self._named(client, target, named))
                    sink = sinks.get(stream_id)
                    if sink is None:
                        if self.stream is None and self.options.schema_compatibility != "none":
                            # Rows route themselves: the target is known only now, before
                            # anything is appended to it.
                            check_backward(client, stream_id, self.options.client.pd,
                                           body.schema)
                        sink = self._open_sink(client, stream_id, appends)
                        sinks[stream_id] = sink
                    sink.add(body)
            for sink in sinks.values():
                sink.finish()
            appends.finish()
        except Exception as exc:
            appends.close()
            self._report_partial(exc, appends)
            raise
        finally:
            appends.close()
        return appends.message()

    def _named(self, client: SbpClient, name: str, named: dict[str, int]) -> int:
        """The id of the stream a row names in its stream_name (created under createIfMissing
        when none has the name), looked up once per task."""
        stream_id = named.get(name)
        if stream_id is None:
            def missing() -> Exception:
                return ValueError(
                    f"rows have stream_name {name!r}, which no stream has at pd "
                    f"{','.join(self.options.client.pd)}: create it (`sbp streams create "
                    f"--name {name}`), or set createIfMissing=true")

            try:
                check_name(name)
            except ValueError as exc:
                raise ValueError(f"rows have stream_name {name!r}: {exc}") from None
            stream_id, _ = stream_names.named_stream(client, name, self.options, missing)
            self.encoder.check_route(stream_id, name)
            named[name] = stream_id
        return stream_id

    # What happens to the records a failed attempt appended when Spark runs the task again.
    ON_RETRY = "a retry of the task appends them again (delivery is at least once)"

    def _report_partial(self, exc: Exception, appends: _TaskAppends) -> None:
        """Say what a failing task leaves in the streams: Spark's abort hears nothing from a
        failed task, so without this its records are nowhere reported. Logged on the
        executor and, where Python has notes (3.11+), added to the error the user sees."""
        # The failure may be the cluster's: its PD is given a few seconds, not the retries.
        lines = summarize([appends.message(locate_within_s=PARTIAL_LOCATE_S)], tasks=False)
        if not lines:
            return
        note = (f"sbp: before it failed, this task had appended to {'; '.join(lines)}; streams "
                f"are append-only, so these records stay, and {self.ON_RETRY}")
        log.warning("%s (the failure: %s: %s)", note, type(exc).__name__, exc)
        add_note = getattr(exc, "add_note", None)
        if add_note is not None:
            add_note(note)

    def _open_sink(self, client: SbpClient, stream_id: int, appends: _TaskAppends
                   ) -> _StreamSink:
        """The sink of one target stream (the idempotent streaming writer tags batches
        there)."""
        return _StreamSink(client, stream_id, self.options, appends)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        for line in summarize(messages):
            log.info("sbp write committed: %s", line)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        lines = summarize(messages)
        failed = sum(1 for m in messages if m is None)
        log.warning("sbp write aborted (%d of %d tasks failed); streams are append-only, so "
                    "records the successful tasks appended stay: %s; a failed task's records "
                    "stay too (its error says what it had appended)", failed, len(messages),
                    "; ".join(lines) or "nothing")


def summarize(messages: list[WriterCommitMessage | None], tasks: bool = True) -> list[str]:
    """One line per stream: records, bytes, batches, offsets and ranges, and (``tasks``) from
    how many tasks."""
    per_stream: dict[int, list[tuple[int, AppendedSpan]]] = {}
    for task, message in enumerate(messages):
        if isinstance(message, SbpCommitMessage):
            for span in message.spans:
                per_stream.setdefault(span.stream_id, []).append((task, span))
    lines = []
    for stream_id in sorted(per_stream):
        entries = per_stream[stream_id]
        spans = [s for _, s in entries]
        ranges = sorted({s.range_index for s in spans})
        lines.append(
            f"stream {stream_id}: {sum(s.records for s in spans)} records, "
            f"{sum(s.bytes for s in spans)} bytes in {sum(s.batches for s in spans)} batches, "
            f"offsets {min(s.first_offset for s in spans)}-{max(s.last_offset for s in spans)}"
            f" in range{'s' if len(ranges) > 1 else ''} {','.join(map(str, ranges))}"
            + (f", from {len({t for t, _ in entries})} tasks" if tasks else ""))
    return lines


__all__ = ["AppendedSpan", "SbpBatchWriter", "SbpCommitMessage", "summarize"]
