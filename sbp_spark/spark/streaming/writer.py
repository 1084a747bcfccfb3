"""``df.writeStream.format("sbp")``: the streaming sink.

Each micro-batch's tasks append exactly as a batch write does (``SbpBatchWriter``: per-stream
batching, APPEND frames in flight, sealed ranges followed). Spark builds a fresh writer on the
driver for every micro-batch (``streamWriter``), pickles it to that micro-batch's tasks, and
calls ``commit(messages, batchId)`` on yet another instance when they all succeeded.

Delivery:

- default: at least once. Records a task appended stay when the task or the micro-batch fails,
  and Spark runs the micro-batch again (a task retry, or a replay after the query restarts).
- ``idempotent=true``: every record batch is tagged with (query id, micro-batch id, partition
  id, sequence) and a retried task skips the batches an earlier attempt landed (see
  ``idempotent``), so a replayed micro-batch adds nothing twice. docs/streaming.md says exactly
  what is guaranteed.

How the rows arrive depends on the pyspark (``pyspark_api``): as Arrow batches where it has
the Arrow stream writer (``arrow_writer.SbpStreamWriter``, pyspark 4.1 and later), else as
``Row`` objects (``SbpStreamRowWriter``), which are packed back into Arrow batches first
(``rows.RowBatches``). Everything after that is the same code. ``sink.stream_writer`` picks
the class and checks the options.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from sbp_spark.client import Appended, ResendCheck, SbpClient
from sbp_spark.protocol.errors import BatchFormatError
from sbp_spark.protocol.records import ENVELOPE_SIZE, BodyFormat

from .. import cluster_access
from ..encode import EncodedBatch, RowEncoder, encode_batches
from ..options import StreamWriteOptions, WriteOptions
from ..rows import RowBatches
from ..writer import SbpBatchWriter, SbpCommitMessage, _StreamSink, _TaskAppends, summarize
from .idempotent import (
    DEFAULT_LOOKBACK_RECORDS,
    Landed,
    WriteTag,
    find_landed,
    tag_batch,
    tag_of_body,
)

log = logging.getLogger(__name__)

# Local properties Spark sets on every task of a micro-batch.
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"


@dataclass
class IdempotentCommitMessage(SbpCommitMessage):
    """A task's appends plus, per stream, what it skipped as already written."""

    query_id: str = ""
    batch_id: int = -1
    partition_id: int = -1
    # stream_id -> (record batches skipped, records skipped)
    skipped: dict[int, tuple[int, int]] = field(default_factory=dict)
    # streams where the check for earlier attempts was cut short by the lookback bound
    bounded: list[int] = field(default_factory=list)


class MicroBatchWriter(DataSourceStreamWriter):
    """What both stream writers do: append each micro-batch (Arrow batches, ``write_batches``);
    with ``idempotent`` set, at most once per record batch. The two subclasses add ``write``
    for the form in which their pyspark hands the rows over."""

    def __init__(self, options: StreamWriteOptions, encoder: RowEncoder,
                 stream: int | None, schema: StructType) -> None:
        self.options = options
        self.encoder = encoder
        self.stream = stream
        self.schema = schema

    def write_batches(self, iterator: Iterator[pa.RecordBatch]) -> SbpCommitMessage:
        """Append one task's share of a micro-batch."""
        if not self.options.idempotent:
            return SbpBatchWriter(self.options.write, self.encoder, self.stream).write(iterator)
        query_id, batch_id, partition_id = _task_identity()
        writer = _IdempotentBatchWriter(self.options.write, self.encoder, self.stream,
                                        query_id, batch_id, partition_id)
        return writer.write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        for line in summarize(messages):
            log.info("sbp micro-batch %d written: %s", batchId, line)
        for message in messages:
            if isinstance(message, IdempotentCommitMessage):
                for sid, (batches, records) in sorted(message.skipped.items()):
                    log.info("sbp micro-batch %d partition %d: stream %d already held %d "
                             "records in %d batches from an earlier attempt; not written again",
                             batchId, message.partition_id, sid, records, batches)
                for sid in message.bounded:
                    log.warning("sbp micro-batch %d partition %d: the check of stream %d for "
                                "an earlier attempt's records was bounded by the lookback",
                                batchId, message.partition_id, sid)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        lines = summarize(messages)
        failed = sum(1 for m in messages if m is None)
        log.warning("sbp micro-batch %d aborted (%d of %d tasks failed); records the other "
                    "tasks appended stay in the streams (Spark will run the micro-batch again%s)"
                    ": %s", batchId, failed, len(messages),
                    "; idempotent mode skips them then" if self.options.idempotent else "",
                    "; ".join(lines) or "nothing")


class SbpStreamRowWriter(MicroBatchWriter):
    """The stream writer for a pyspark that hands a sink ``Row`` objects (4.0)."""

    def write(self, iterator: Iterator[Any]) -> SbpCommitMessage:
        return self.write_batches(RowBatches(self.schema).batches(iterator))


def _task_identity() -> tuple[str, int, int]:
    """(query id, micro-batch id, partition id) of the running task."""
    from pyspark import TaskContext

    context = TaskContext.get()
    query_id = context.getLocalProperty(QUERY_ID_PROPERTY) if context else None
    batch_id = context.getLocalProperty(BATCH_ID_PROPERTY) if context else None
    if context is None or not query_id or batch_id is None:
        raise RuntimeError(
            "idempotent=true needs the streaming query's id and micro-batch id, which Spark "
            f"sets as task properties '{QUERY_ID_PROPERTY}' and '{BATCH_ID_PROPERTY}'; they "
            "are missing, so this is not a micro-batch task of a streaming query")
    return query_id, int(batch_id), context.partitionId()


class _IdempotentBatchWriter(SbpBatchWriter):
    """The batch writer with tagging sinks, for one task of one micro-batch."""

    ON_RETRY = "a retry of the task finds them by their tags and does not append them again"

    def __init__(self, options: WriteOptions, encoder: RowEncoder, stream: int | None,
                 query_id: str, batch_id: int, partition_id: int) -> None:
        super().__init__(options, encoder, stream)
        self.query_id = query_id
        self.batch_id = batch_id
        self.partition_id = partition_id
        self.sinks: list[_IdempotentSink] = []

    def _open_sink(self, client: SbpClient, stream_id: int, appends: _TaskAppends
                   ) -> _StreamSink:
        sink = _IdempotentSink(client, stream_id, self.options, appends, self)
        self.sinks.append(sink)
        return sink

    def write(self, iterator: Iterator[pa.RecordBatch]) -> IdempotentCommitMessage:
        message = super().write(iterator)
        return IdempotentCommitMessage(
            spans=message.spans, query_id=self.query_id, batch_id=self.batch_id,
            partition_id=self.partition_id,
            skipped={s.stream_id: (s.skipped_batches, s.skipped_records)
                     for s in self.sinks if s.skipped_batches},
            bounded=[s.stream_id for s in self.sinks if not s.landed.complete])


class _IdempotentSink(_StreamSink):
    """A stream sink that tags each record batch and drops those an earlier attempt landed."""

    def __init__(self, client: SbpClient, stream_id: int, options: WriteOptions,
                 appends: _TaskAppends, owner: _IdempotentBatchWriter) -> None:
        super().__init__(client, stream_id, options, appends)
        self.client = client
        self.owner = owner
        self.seq = 0
        # Pending encoded batches (by id) -> their sequence numbers, for resend checks.
        self._seqs: dict[int, int] = {}
        self.skipped_batches = 0
        self.skipped_records = 0
        self.landed = _landed(client, stream_id, owner)
        if self.landed.seqs:
            log.info("sbp idempotent write: query %s micro-batch %d partition %d finds %d of its "
                     "record batches already in stream %d (an earlier attempt); skipping them",
                     owner.query_id, owner.batch_id, owner.partition_id,
                     len(self.landed.seqs), stream_id)

    def _encode(self, batches: list[pa.RecordBatch]) -> None:
        for batch in batches:
            for encoded in self._encode_tagged(batch):
                self.pending.append(encoded)
                self.pending_bytes += encoded.nbytes

    def _encode_tagged(self, batch: pa.RecordBatch) -> list[EncodedBatch]:
        """``batch`` as tagged record batches, one sequence number each, minus those that
        already landed. Split in halves (as ``encode_batches`` does) until each fits a frame,
        so every stored batch has its own sequence number."""
        tag = WriteTag(self.owner.query_id, self.owner.batch_id, self.owner.partition_id,
                       self.seq)
        encoded = encode_batches(tag_batch(batch, tag), self.options.compression)
        if len(encoded) > 1:
            half = batch.num_rows // 2
            return (self._encode_tagged(batch.slice(0, half))
                    + self._encode_tagged(batch.slice(half)))
        self.seq += 1
        if tag.seq in self.landed.seqs:
            self.skipped_batches += 1
            self.skipped_records += batch.num_rows
            return []
        self._seqs[id(encoded[0])] = tag.seq
        return encoded

    def _resend_check(self, batches: list[EncodedBatch]) -> ResendCheck:
        """Before batches whose answer was lost are sent again (within this attempt), look
        for their tags in the stream: those that landed are not sent twice."""
        seqs = [self._seqs.pop(id(b)) for b in batches]

        def check(indexes: list[int]) -> dict[int, Appended]:
            located: dict[int, Appended] = {}
            _landed(self.client, self.stream_id, self.owner, located)
            found = {i: located[seqs[i]] for i in indexes if seqs[i] in located}
            if found:
                log.info("sbp idempotent write: %d of %d record batches whose APPEND answer was "
                         "lost are in stream %d already; not sending them again", len(found),
                         len(indexes), self.stream_id)
            return found

        return check


def _landed(client: SbpClient, stream_id: int, owner: _IdempotentBatchWriter,
            located: dict[int, Appended] | None = None) -> Landed:
    """What attempts of the owner's (query, batch, partition) left in the stream; ``located``
    (when given) receives where each of its batches is, by sequence number."""
    pd = owner.options.client.pd
    (layout,) = cluster_access.stream_layouts(client, [stream_id], pd)

    def read_window(low: int, high: int) -> Iterator[tuple[int, WriteTag | None]]:
        for fetched in client.read(stream_id, low, high):
            header = fetched.header
            if header.body_format != BodyFormat.ARROW:
                yield header.base_offset, None
                continue
            body = fetched.data[ENVELOPE_SIZE:ENVELOPE_SIZE + header.body_length]
            try:
                tag = tag_of_body(body)
            except BatchFormatError:
                tag = None  # not a batch this connector wrote
            if located is not None and tag is not None and (
                    tag.query_id, tag.batch_id, tag.partition_id) == (
                    owner.query_id, owner.batch_id, owner.partition_id):
                located[tag.seq] = Appended(stream_id, fetched.range_index,
                                            header.base_offset, header.record_count,
                                            header.batch_length)
            yield header.base_offset, tag

    return find_landed(read_window, layout.start_offset, layout.end_offset, owner.query_id,
                       owner.batch_id, owner.partition_id, DEFAULT_LOOKBACK_RECORDS)

