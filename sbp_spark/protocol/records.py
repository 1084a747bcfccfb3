"""Record batches: the fixed envelope every APPEND/FETCH batch starts with (docs/wire.md, Record
batches), and the Arrow bodies this project writes inside it.

Envelope, big-endian, 28 bytes::

    magic u8 (0x42) | body_format u8 | flags u16 | base_offset i64 | record_count i32 |
    base_timestamp_ms i64 | body_length i32 | body

Body formats: OPAQUE holds one record whose value is the body; ARROW holds an Arrow IPC stream
(schema and exactly one record batch of ``record_count`` rows).

Arrow bodies written by this project say what they carry in the schema metadata key
``sbp.payload``: ``records`` (Kafka-like records: ``key``, ``value``, optional ``headers`` and
``timestamp`` columns) or ``arrow`` (a DataFrame's own columns).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from enum import IntEnum
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from .errors import BatchFormatError

Buffer = bytes | bytearray | memoryview

BATCH_MAGIC = 0x42
ENVELOPE_SIZE = 28
_ENVELOPE = struct.Struct(">BBHqiqi")
_BASE_OFFSET = struct.Struct(">q")
_BASE_OFFSET_POS = 4
_I32_MAX = (1 << 31) - 1


class BodyFormat(IntEnum):
    OPAQUE = 0
    ARROW = 1


class BatchHeader(NamedTuple):
    """The decoded envelope of one record batch."""

    body_format: int
    flags: int
    base_offset: int
    record_count: int
    base_timestamp_ms: int
    body_length: int

    @property
    def batch_length(self) -> int:
        """Bytes of the whole batch, envelope included."""
        return ENVELOPE_SIZE + self.body_length

    @property
    def end_offset(self) -> int:
        """The offset after this batch's last record."""
        return self.base_offset + self.record_count


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def encode_envelope(
    body_length: int,
    record_count: int = 1,
    base_timestamp_ms: int | None = None,
    body_format: int = BodyFormat.OPAQUE,
    base_offset: int = -1,
) -> bytes:
    """The 28-byte envelope for a body of ``body_length`` bytes, after checking the fields."""
    if body_format not in (BodyFormat.OPAQUE, BodyFormat.ARROW):
        raise ValueError(f"body_format {body_format} is not 0 (opaque) or 1 (Arrow IPC)")
    if not 1 <= record_count <= _I32_MAX:
        raise ValueError(f"record_count {record_count} must be between 1 and {_I32_MAX}")
    if body_format == BodyFormat.OPAQUE and record_count != 1:
        raise ValueError(f"an opaque batch holds exactly one record, not {record_count}")
    if not 0 <= body_length <= _I32_MAX - ENVELOPE_SIZE:
        raise ValueError(f"body of {body_length} bytes does not fit a record batch")
    ts = now_ms() if base_timestamp_ms is None else base_timestamp_ms
    return _ENVELOPE.pack(BATCH_MAGIC, body_format, 0, base_offset, record_count, ts, body_length)


def encode_batch(
    body: Buffer,
    record_count: int = 1,
    base_timestamp_ms: int | None = None,
    body_format: int = BodyFormat.OPAQUE,
    base_offset: int = -1,
) -> list[Buffer]:
    """A record batch as [envelope, body]; the body is not copied."""
    envelope = encode_envelope(
        _nbytes(body), record_count, base_timestamp_ms, body_format, base_offset)
    return [envelope, body] if _nbytes(body) else [envelope]


def batch_bytes(*args, **kwargs) -> bytes:
    """``encode_batch`` joined into one bytes object."""
    return b"".join(encode_batch(*args, **kwargs))


def parse_header(buf: Buffer, pos: int = 0) -> BatchHeader:
    """Decode and validate the envelope at ``pos``; the whole body must be inside ``buf``."""
    size = _nbytes(buf)
    if pos < 0 or size - pos < ENVELOPE_SIZE:
        raise BatchFormatError(
            f"record batch at byte {pos}: {max(size - pos, 0)} bytes cannot hold the "
            f"{ENVELOPE_SIZE}-byte envelope")
    header = BatchHeader(*_ENVELOPE.unpack_from(buf, pos)[1:])
    magic = buf[pos]
    if magic != BATCH_MAGIC:
        raise BatchFormatError(f"record batch at byte {pos}: magic {magic:#04x} is not 0x42")
    if header.body_format not in (BodyFormat.OPAQUE, BodyFormat.ARROW):
        raise BatchFormatError(
            f"record batch at byte {pos}: body_format {header.body_format} is not 0 or 1")
    if header.record_count < 1:
        raise BatchFormatError(
            f"record batch at byte {pos}: record_count {header.record_count} is below 1")
    if header.body_format == BodyFormat.OPAQUE and header.record_count != 1:
        raise BatchFormatError(
            f"record batch at byte {pos}: an opaque batch holds one record, "
            f"not {header.record_count}")
    if header.body_length < 0 or header.body_length > size - pos - ENVELOPE_SIZE:
        raise BatchFormatError(
            f"record batch at byte {pos}: body_length {header.body_length} runs past the "
            f"{size - pos - ENVELOPE_SIZE} bytes that follow the envelope (truncated body)")
    return header


def iter_batches(payload: Buffer) -> Iterator[tuple[BatchHeader, memoryview]]:
    """Split a payload of batches laid end to end; yields (header, view of the whole batch)."""
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    pos, size = 0, view.nbytes
    while pos < size:
        header = parse_header(view, pos)
        end = pos + ENVELOPE_SIZE + header.body_length
        yield header, view[pos:end]
        pos = end


def batch_body(batch: memoryview) -> memoryview:
    """The body of one whole batch (as yielded by ``iter_batches``)."""
    return batch[ENVELOPE_SIZE:]


def set_base_offset(buf: bytearray | memoryview, pos: int, base_offset: int) -> None:
    """Write the offset a range server assigned into the envelope at ``pos``."""
    _BASE_OFFSET.pack_into(buf, pos + _BASE_OFFSET_POS, base_offset)


# -- Arrow bodies --------------------------------------------------------------------------

PAYLOAD_METADATA_KEY = b"sbp.payload"
PAYLOAD_RECORDS = b"records"
PAYLOAD_ARROW = b"arrow"

HEADERS_TYPE = pa.list_(pa.struct([
    pa.field("key", pa.string(), nullable=False),
    pa.field("value", pa.binary()),
]))
RECORDS_FIELDS = {
    "key": pa.field("key", pa.binary()),
    "value": pa.field("value", pa.binary()),
    "headers": pa.field("headers", HEADERS_TYPE),
    "timestamp": pa.field("timestamp", pa.timestamp("ms")),
}

_COMPRESSIONS = (None, "lz4", "zstd")


def arrow_to_body(batch: pa.RecordBatch, compression: str | None = None) -> pa.Buffer:
    """An Arrow IPC stream (schema + this one batch), optionally with compressed buffers."""
    if compression == "none":
        compression = None
    if compression not in _COMPRESSIONS:
        raise ValueError(f"compression {compression!r} is not one of none, lz4, zstd")
    options = pa.ipc.IpcWriteOptions(compression=compression)
    if compression is not None:
        # compressed sizes are only known by compressing; the output is small anyway
        sink = pa.BufferOutputStream()
        _write_ipc_stream(sink, batch, options)
        return sink.getvalue()
    # Uncompressed: measure the stream first (no data is copied to count it), then write it
    # into one buffer of exactly that size, so every value byte is copied once.
    counter = pa.MockOutputStream()
    _write_ipc_stream(counter, batch, options)
    body = pa.allocate_buffer(counter.size())
    writer = pa.FixedSizeBufferWriter(body)
    _write_ipc_stream(writer, batch, options)
    if writer.tell() != body.size:
        raise RuntimeError(f"Arrow IPC body wrote {writer.tell()} bytes, measured {body.size}")
    return body


def _write_ipc_stream(sink: pa.NativeFile, batch: pa.RecordBatch,
                      options: pa.ipc.IpcWriteOptions) -> None:
    with pa.ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch)


def body_to_arrow(body: Buffer) -> pa.RecordBatch:
    """The one record batch of an Arrow IPC body, without copying its buffers."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(body))
        batch = reader.read_next_batch()
    except (pa.ArrowInvalid, StopIteration, OSError) as exc:
        raise BatchFormatError(f"Arrow IPC body does not hold a record batch: {exc}") from exc
    return batch


def encode_arrow_batch(
    batch: pa.RecordBatch,
    base_timestamp_ms: int | None = None,
    compression: str | None = None,
) -> list[Buffer]:
    """An ARROW record batch (envelope + IPC body) for ``batch``, which must have rows."""
    if batch.num_rows < 1:
        raise ValueError("an Arrow record batch needs at least one row")
    body = arrow_to_body(batch, compression)
    return encode_batch(memoryview(body), batch.num_rows, base_timestamp_ms, BodyFormat.ARROW)


def payload_kind(schema: pa.Schema) -> bytes | None:
    """``records``, ``arrow`` or None (not written by this project) for a body's schema."""
    meta = schema.metadata or {}
    return meta.get(PAYLOAD_METADATA_KEY)


_TIME_UNITS = ("s", "ms", "us", "ns")  # coarsest first
_TEMPORAL_UNITS = {"s": "second", "ms": "millisecond", "us": "microsecond"}


def floor_timestamps(values: pa.Array, unit: str) -> pa.Array:
    """Arrow timestamps ``values`` in ``unit``, keeping their zone. Finer digits are dropped by
    flooring, toward the past, as Spark does (Java's ``floorDiv``): a cast cuts toward zero,
    which moves a time before 1970 forward (-0.5 ms would become 0 ms, the next day)."""
    target = pa.timestamp(unit, tz=values.type.tz)
    source = values.type.unit
    if _TIME_UNITS.index(unit) >= _TIME_UNITS.index(source):  # the same or finer: exact
        return values.cast(target)
    naive = values.cast(pa.timestamp(source))  # the same numbers, no zone to floor in
    return pc.floor_temporal(naive, unit=_TEMPORAL_UNITS[unit]).cast(target)


def make_records_batch(
    value: pa.Array,
    key: pa.Array | None = None,
    headers: pa.Array | None = None,
    timestamp: pa.Array | None = None,
) -> pa.RecordBatch:
    """A payload=records Arrow batch from columns; strings are stored as binary."""
    columns = {"key": key if key is not None else pa.nulls(len(value), pa.binary()),
               "value": value}
    if headers is not None:
        columns["headers"] = headers
    if timestamp is not None:
        columns["timestamp"] = timestamp
    arrays, fields = [], []
    for name, array in columns.items():
        field = RECORDS_FIELDS[name]
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        if not array.type.equals(field.type):
            try:
                array = array.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ValueError(
                    f"column {name!r} of type {array.type} cannot be stored as {field.type}"
                ) from exc
        arrays.append(array)
        fields.append(field)
    schema = pa.schema(fields, metadata={PAYLOAD_METADATA_KEY: PAYLOAD_RECORDS})
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def with_payload_kind(batch: pa.RecordBatch, kind: bytes) -> pa.RecordBatch:
    """``batch`` with the ``sbp.payload`` metadata set (schema change only, no data copy)."""
    meta = dict(batch.schema.metadata or {})
    meta[PAYLOAD_METADATA_KEY] = kind
    return batch.replace_schema_metadata(meta)
