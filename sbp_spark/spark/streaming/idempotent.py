"""Idempotent streaming writes: tag every record batch, and skip what a previous attempt landed.

Every SBP record batch a streaming write with ``idempotent=true`` appends carries, in the Arrow
IPC schema metadata of its body (the envelope is untouched), the tag

    ``sbp.write.query``      the streaming query's id (stable across restarts of the query)
    ``sbp.write.batch``      the micro-batch id
    ``sbp.write.partition``  the Spark partition id of the writing task
    ``sbp.write.seq``        the number of this record batch among that task's batches for the
                             target stream (0, 1, 2, ...)

Before a task of micro-batch ``b`` appends its first batch to a stream, it reads the stream's
tail backwards (``find_landed``) and collects the ``seq`` of every batch already tagged with its
own (query, b, partition): those landed in an earlier attempt of the same task (a task retry,
or a replay of the micro-batch after the query restarted) and are not written again.

Why the scan can stop early: Spark runs the micro-batches of one query one after another, so
everything an attempt of (query, b, partition) appended lies after every batch the query wrote
in micro-batches before ``b``. The scan walks back from the tail in doubling windows and stops
at the first window holding a batch of this query with a lower micro-batch id, at the start of
the stream, or after ``lookback_records`` records (then it logs that the check was bounded).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyarrow as pa

from sbp_spark.protocol.errors import BatchFormatError

log = logging.getLogger(__name__)

TAG_QUERY = b"sbp.write.query"
TAG_BATCH = b"sbp.write.batch"
TAG_PARTITION = b"sbp.write.partition"
TAG_SEQ = b"sbp.write.seq"
_TAG_KEYS = (TAG_QUERY, TAG_BATCH, TAG_PARTITION, TAG_SEQ)

# How far back a retry looks for its own earlier batches when it does not meet a batch of an
# earlier micro-batch of its query first. Records written to the stream (by anyone) since the
# failed attempt began must fit in it; 4M records of 100 bytes is a 400 MB read, paid only by
# the first micro-batch a query writes to a stream (later ones stop at the previous batch).
DEFAULT_LOOKBACK_RECORDS = 4_000_000
# The first window the backward scan reads; each further one doubles.
FIRST_WINDOW_RECORDS = 4096


@dataclass(frozen=True)
class WriteTag:
    """Who wrote one record batch: (query, micro-batch, partition) and its sequence number."""

    query_id: str
    batch_id: int
    partition_id: int
    seq: int

    def metadata(self) -> dict[bytes, bytes]:
        return {TAG_QUERY: self.query_id.encode(), TAG_BATCH: str(self.batch_id).encode(),
                TAG_PARTITION: str(self.partition_id).encode(), TAG_SEQ: str(self.seq).encode()}

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes] | None) -> WriteTag | None:
        """The tag in a body's schema metadata, or None when it has none (or a broken one)."""
        if not metadata or TAG_QUERY not in metadata:
            return None
        try:
            return cls(metadata[TAG_QUERY].decode(), int(metadata[TAG_BATCH]),
                       int(metadata[TAG_PARTITION]), int(metadata[TAG_SEQ]))
        except (KeyError, ValueError, UnicodeDecodeError):
            return None


def tag_batch(batch: pa.RecordBatch, tag: WriteTag) -> pa.RecordBatch:
    """``batch`` with ``tag`` added to its schema metadata (no data copied)."""
    metadata = dict(batch.schema.metadata or {})
    metadata.update(tag.metadata())
    return batch.replace_schema_metadata(metadata)


def tag_of_body(body: bytes | memoryview | pa.Buffer) -> WriteTag | None:
    """The tag of an Arrow IPC body (reads only its schema message), None if untagged."""
    try:
        schema = pa.ipc.open_stream(pa.py_buffer(body)).schema
    except (pa.ArrowInvalid, OSError) as exc:
        raise BatchFormatError(f"record batch body is not an Arrow IPC stream: {exc}") from exc
    return WriteTag.from_metadata(schema.metadata)


@dataclass
class Landed:
    """What an earlier attempt of one (query, micro-batch, partition) left in one stream."""

    seqs: set[int] = field(default_factory=set)
    # Where the scan began; everything of earlier attempts at or after it was seen.
    scanned_from: int = 0
    # False when the lookback bound ended the scan before a safe stopping point.
    complete: bool = True


# (offset of the batch, its tag or None) for the batches overlapping [low, high), in order.
WindowReader = Callable[[int, int], Iterable[tuple[int, WriteTag | None]]]


def find_landed(
    read_window: WindowReader,
    stream_start: int,
    stream_end: int,
    query_id: str,
    batch_id: int,
    partition_id: int,
    lookback_records: int = DEFAULT_LOOKBACK_RECORDS,
    first_window: int = FIRST_WINDOW_RECORDS,
) -> Landed:
    """Scan a stream's tail backwards for batches of (query_id, batch_id, partition_id).

    ``[stream_start, stream_end)`` are the records there now. Returns the sequence numbers
    found; see the module docstring for where the scan stops.
    """
    if lookback_records < 1 or first_window < 1:
        raise ValueError("lookback_records and first_window must be >= 1")
    landed = Landed(scanned_from=stream_end)
    high, window = stream_end, first_window
    lowest = max(stream_start, stream_end - lookback_records)
    while high > stream_start:
        low = max(lowest, high - window)
        earlier_batch_seen = False
        for _offset, tag in read_window(low, high):
            if tag is None or tag.query_id != query_id:
                continue
            if tag.batch_id < batch_id:
                earlier_batch_seen = True
            elif tag.batch_id == batch_id and tag.partition_id == partition_id:
                landed.seqs.add(tag.seq)
        landed.scanned_from = low
        if earlier_batch_seen or low <= stream_start:
            return landed
        if low <= lowest:
            landed.complete = False
            log.warning(
                "idempotent write of query %s micro-batch %d partition %d: looked back %d "
                "records (offsets [%d, %d)) without reaching an earlier micro-batch of the "
                "query or the stream start; batches an earlier attempt wrote before offset %d "
                "would not be recognised", query_id, batch_id, partition_id,
                stream_end - low, low, stream_end, low)
            return landed
        high, window = low, window * 2
    return landed
