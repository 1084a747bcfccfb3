"""Spark's Arrow batches -> SBP record batches, without per-row Python.

``RowEncoder`` checks a DataFrame's schema against the payload when the write is planned, then
turns each Arrow batch Spark hands a task into body batches (the records convention, or the
DataFrame's own columns for payload=arrow), split by target stream when rows carry a
``stream_id`` (or its twin ``stream_name``, a name the writing task looks up). ``Batcher``
cuts and combines them into record batches of bounded rows and bytes, and ``encode_batches``
turns those into envelope + Arrow IPC body, each small enough for one APPEND frame.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    DataType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from sbp_spark.protocol.constants import MAX_FRAME_LENGTH
from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    HEADERS_TYPE,
    PAYLOAD_ARROW,
    encode_arrow_batch,
    floor_timestamps,
    make_records_batch,
    with_payload_kind,
)

from .schemas import METADATA_TYPES, to_arrow_type
from .tables import definition_of, without_definition
from .zones import arrow_zone, wall_clock_to_instants

# An encoded batch must leave room in its APPEND frame for the frame and FlatBuffers headers.
MAX_ENCODED_BATCH = MAX_FRAME_LENGTH - 64 * 1024

_STREAM_ID_TYPES = (LongType, IntegerType, ShortType, ByteType)
# The columns a row may name its stream in: by id, or by name (one of them per DataFrame).
ROUTE_COLUMNS = frozenset({"stream_id", "stream_name"})


def _is_text(dtype: DataType) -> bool:
    return isinstance(dtype, (StringType, BinaryType))


def _headers_ok(dtype: DataType) -> bool:
    if not isinstance(dtype, ArrayType) or not isinstance(dtype.elementType, StructType):
        return False
    fields = {f.name: f.dataType for f in dtype.elementType.fields}
    return (set(fields) == {"key", "value"} and isinstance(fields["key"], StringType)
            and _is_text(fields["value"]))


def _check_arrow_types(types: dict[str, DataType]) -> None:
    """Refuse columns Spark cannot hand a data source as Arrow data (it would fail every task
    with a bare pyarrow KeyError), and those no read could give back: Spark's empty
    ``array()`` and ``map()`` have void elements that are never null, a type Spark writes but
    pyarrow cannot build, so every read of the stream would fail."""
    for name, dtype in types.items():
        try:
            to_arrow_type(dtype)
        except ValueError:
            raise ValueError(
                f"payload=arrow cannot write this DataFrame: column '{name}' is "
                f"{dtype.simpleString()}, whose void elements are never null: Spark could "
                "write it, but no read could give it back; cast it to a typed one first "
                "(CAST(array() AS ARRAY<STRING>), say)") from None
        except TypeError:
            raise ValueError(
                f"payload=arrow cannot write this DataFrame: column '{name}' is "
                f"{dtype.simpleString()}, which Spark cannot hand a data source as Arrow "
                "data; cast it (to a string or a number, say) first") from None


def _route_column(types: dict[str, DataType]) -> str:
    """The column rows name their stream in: stream_id (an integer) or stream_name (a
    string), exactly one of them."""
    given = sorted(ROUTE_COLUMNS & set(types))
    if not given:
        raise ValueError(
            "writing to sbp needs a target stream: set option 'stream', give the rows a "
            "stream_id (or stream_name) column, or set createIfMissing=true to create a new "
            "stream")
    if len(given) > 1:
        raise ValueError("the rows have both a stream_id and a stream_name column: route them "
                         "by one (drop the other), or set option 'stream'")
    column = given[0]
    if column == "stream_name" and not isinstance(types[column], StringType):
        raise ValueError(f"column 'stream_name' is {types[column].simpleString()}; it must be "
                         "a string (the stream's name)")
    if column == "stream_id" and not isinstance(types[column], _STREAM_ID_TYPES):
        raise ValueError(f"column 'stream_id' is {types[column].simpleString()}; it must be an "
                         "integer type (bigint)")
    return column


@dataclass(frozen=True)
class RowEncoder:
    """How one DataFrame schema becomes record-batch bodies (built on the driver, pickled)."""

    payload: str
    route_by_column: bool  # rows name their stream in a stream_id or stream_name column
    names: tuple[str, ...]
    # payload=arrow: metadata columns of an sbp table's schema that are not data (INSERT INTO
    # fills them with nulls); never stored.
    dropped: tuple[str, ...] = ()
    # Routing by column: the streams a row may name (option 'streams'; None: any).
    routes: tuple[int, ...] | None = None
    # payload=records with a TIMESTAMP_NTZ 'timestamp' column: its wall-clock values become
    # record times in ``time_zone`` (known only in the task: ``with_time_zone``).
    wall_clock_timestamp: bool = False
    time_zone: str | None = None
    # payload=arrow rows of an sbp table: their Arrow fields carry the table's definition.
    tagged: bool = False
    # The column rows route by: stream_id, or stream_name (its values are stream names).
    route_column: str = "stream_id"

    @classmethod
    def for_schema(cls, schema: StructType, payload: str, stream: int | str | None,
                   create: bool = False, routes: tuple[int, ...] | None = None) -> RowEncoder:
        """Check ``schema`` for a write; ``stream`` is the stream option (None: per row, to
        one of ``routes`` when given)."""
        types = {f.name: f.dataType for f in schema.fields}
        route = stream is None and not create
        route_column = _route_column(types) if route else "stream_id"
        if payload == "records":
            problems = []
            if "value" not in types:
                problems.append("a 'value' column (binary or string) is required")
            elif not _is_text(types["value"]):
                problems.append(f"column 'value' is {types['value'].simpleString()}, "
                                "not binary or string")
            if "key" in types and not _is_text(types["key"]):
                problems.append(f"column 'key' is {types['key'].simpleString()}, "
                                "not binary or string")
            if "headers" in types and not _headers_ok(types["headers"]):
                problems.append(f"column 'headers' is {types['headers'].simpleString()}, not "
                                "array<struct<key:string,value:binary>>")
            if "timestamp" in types and not isinstance(
                    types["timestamp"], (TimestampType, TimestampNTZType)):
                problems.append(f"column 'timestamp' is {types['timestamp'].simpleString()}, "
                                "not timestamp")
            if problems:
                raise ValueError("payload=records cannot write this DataFrame: "
                                 + "; ".join(problems) + " (use payload=arrow to store any "
                                 "columns)")
        elif not [n for n in types if n != "stream_id" and not (route and n == route_column)]:
            raise ValueError(f"payload=arrow needs at least one column besides "
                             f"{route_column if route else 'stream_id'}")
        else:
            _check_arrow_types(types)
        table = definition_of(schema)
        dropped: tuple[str, ...] = ()
        if payload == "arrow" and table is not None and table.data_columns is not None:
            dropped = tuple(n for n in types
                            if n in METADATA_TYPES and n not in table.data_columns)
        wall_clock = payload == "records" and isinstance(types.get("timestamp"),
                                                         TimestampNTZType)
        return cls(payload, route, tuple(schema.fieldNames()), dropped,
                   routes if route else None, wall_clock_timestamp=wall_clock,
                   tagged=payload == "arrow" and table is not None,
                   route_column=route_column)

    def with_time_zone(self, zone: str) -> RowEncoder:
        """This encoder, taking wall-clock ``timestamp`` values in ``zone`` (a Spark time zone
        name)."""
        return replace(self, time_zone=arrow_zone(zone))

    def bodies(self, batch: pa.RecordBatch, stream: int | None
               ) -> Iterator[tuple[int | str, pa.RecordBatch]]:
        """(stream, body batch) pairs for one of Spark's batches; the stream is ``stream``
        unless rows route themselves: their stream_id, or the name in their stream_name (for
        the task to look up, then ``check_route``)."""
        if batch.num_rows == 0:
            return
        if not self.route_by_column:
            if stream is None:  # for_schema routes by column whenever no stream is given
                raise ValueError("writing to sbp needs a target stream: set option 'stream' "
                                 "or give the rows a stream_id column")
            yield stream, self._body(batch)
            return
        if self.route_column == "stream_name":
            yield from self._bodies_by_name(batch)
            return
        column = batch.column(batch.schema.get_field_index("stream_id"))
        if column.null_count:
            raise ValueError(f"{column.null_count} rows have a null stream_id; every row needs "
                             "a target stream (or set option 'stream')")
        unique = pc.unique(column)
        stream_ids = unique.to_pylist()
        negative = sorted(sid for sid in stream_ids if sid < 0)
        if negative:
            raise ValueError(f"rows have stream_id {','.join(map(str, negative))}, which is not "
                             "a stream id (stream ids are >= 0)")
        self._check_routes(stream_ids)
        if len(unique) == 1:
            yield unique[0].as_py(), self._body(batch)
            return
        for sid in sorted(stream_ids):
            yield sid, self._body(batch.filter(pc.equal(column, sid)))

    def _bodies_by_name(self, batch: pa.RecordBatch) -> Iterator[tuple[str, pa.RecordBatch]]:
        column = batch.column(batch.schema.get_field_index("stream_name"))
        if column.null_count:
            raise ValueError(f"{column.null_count} rows have a null stream_name; every row "
                             "needs a target stream (or set option 'stream')")
        names = pc.unique(column).to_pylist()
        if len(names) == 1:
            yield names[0], self._body(batch)
            return
        for name in sorted(names):
            yield name, self._body(batch.filter(pc.equal(column, name)))

    def check_route(self, stream_id: int, name: str) -> None:
        """Refuse a row's stream named ``name`` (its id ``stream_id``) outside option
        'streams'."""
        if self.routes is not None and stream_id not in self.routes:
            raise ValueError(
                f"rows have stream_name {name!r} (stream {stream_id}), which is not one of the "
                f"streams {','.join(map(str, self.routes))} of option 'streams'; a write on "
                "several streams routes each row to one of them")

    def _check_routes(self, stream_ids: list[int]) -> None:
        """Refuse rows naming a stream outside option 'streams' before any row is written."""
        if self.routes is None:
            return
        outside = sorted(set(stream_ids) - set(self.routes))
        if outside:
            raise ValueError(
                f"rows have stream_id {','.join(map(str, outside))}, which is not one of the "
                f"streams {','.join(map(str, self.routes))} of option 'streams'; a write on "
                "several streams routes each row to one of them by its stream_id")

    def _body(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if self.payload == "arrow":
            routing = (self.route_column,) if self.route_by_column else ()
            unstored = [n for n in dict.fromkeys(("stream_id", *routing, *self.dropped))
                        if n in batch.schema.names]
            if unstored:
                batch = batch.drop_columns(unstored)
            if self.tagged:
                batch = without_definition(batch)
            return with_payload_kind(batch, PAYLOAD_ARROW)
        names = batch.schema.names
        get = {name: batch.column(i) for i, name in enumerate(names)}
        timestamp = get.get("timestamp")
        if timestamp is not None:
            if self.wall_clock_timestamp:
                if self.time_zone is None:
                    raise ValueError("a TIMESTAMP_NTZ 'timestamp' column needs the time zone "
                                     "its values are in (RowEncoder.with_time_zone)")
                # As Spark's CAST(ntz AS TIMESTAMP) does: the instant in the session's zone.
                timestamp = wall_clock_to_instants(timestamp, self.time_zone)
            # Spark's microseconds are stored as milliseconds (the records convention),
            # floored as Spark's own conversions to milliseconds do.
            timestamp = floor_timestamps(timestamp, "ms")
        headers = get.get("headers")
        if headers is not None:
            try:
                headers = headers.cast(HEADERS_TYPE)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ValueError(f"column 'headers' cannot be stored: {exc} (every header "
                                 "needs a non-null key)") from exc
        return make_records_batch(get["value"], key=get.get("key"), headers=headers,
                                  timestamp=timestamp)


# A body batch with at least this many rows or bytes is a good record batch on its own: it is
# encoded as it comes (cut by zero-copy slices only when over the limits), never concatenated.
# Spark hands writers ~10,000-row batches, so in practice only small ones are combined.
SOLO_ROWS = 4096
SOLO_BYTES = 512 * 1024


class Batcher:
    """Turns body batches of one stream into record batches of at most ``max_records`` rows and
    about ``max_bytes`` bytes, in order.

    A batch that is big enough on its own is passed on as it is, or cut into equal zero-copy
    slices when it is over a limit. Only runs of small batches are concatenated (one copy of
    small data), each run up to the limits.
    """

    def __init__(self, max_records: int, max_bytes: int) -> None:
        if max_records < 1 or max_bytes < 1:
            raise ValueError(f"batch limits must be positive (max_records={max_records}, "
                             f"max_bytes={max_bytes})")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.solo_rows = min(SOLO_ROWS, max_records)
        self.solo_bytes = min(SOLO_BYTES, max_bytes)
        self._pending: list[pa.RecordBatch] = []
        self._rows = 0
        self._bytes = 0

    def add(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        """Take ``batch``; return the batches that are ready."""
        rows = batch.num_rows
        if rows == 0:
            return []
        nbytes = batch.nbytes
        if rows >= self.solo_rows or nbytes >= self.solo_bytes:
            return self._take() + self._cut(batch, rows, nbytes)
        out = []
        if self._rows + rows > self.max_records or self._bytes + nbytes > self.max_bytes:
            out = self._take()
        self._pending.append(batch)
        self._rows += rows
        self._bytes += nbytes
        return out

    def flush(self) -> list[pa.RecordBatch]:
        """The rest (at most one batch)."""
        return self._take()

    def _take(self) -> list[pa.RecordBatch]:
        pending = self._pending
        if not pending:
            return []
        self._pending = []
        self._rows = self._bytes = 0
        return [pending[0] if len(pending) == 1 else pa.concat_batches(pending)]

    def _cut(self, batch: pa.RecordBatch, rows: int, nbytes: int) -> list[pa.RecordBatch]:
        """``batch`` as equal slices within the limits (itself when it fits)."""
        pieces = max(-(-rows // self.max_records), -(-nbytes // self.max_bytes))
        if pieces <= 1:
            return [batch]
        pieces = min(pieces, rows)
        size = -(-rows // pieces)
        return [batch.slice(start, size) for start in range(0, rows, size)]


@dataclass(frozen=True)
class EncodedBatch:
    """One record batch ready for APPEND: envelope + body buffers."""

    buffers: list
    record_count: int
    nbytes: int


def encode_batches(batch: pa.RecordBatch, compression: str,
                   base_timestamp_ms: int | None = None) -> list[EncodedBatch]:
    """``batch`` as record batches of one frame each (halved until each fits)."""
    parts = encode_arrow_batch(batch, base_timestamp_ms,
                               None if compression == "none" else compression)
    nbytes = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    if nbytes <= MAX_ENCODED_BATCH:
        return [EncodedBatch(parts, batch.num_rows, nbytes)]
    if batch.num_rows == 1:
        raise ValueError(
            f"one record needs {nbytes - ENVELOPE_SIZE} bytes, more than a record batch can "
            f"carry in one APPEND frame ({MAX_ENCODED_BATCH} bytes): split such values over "
            f"several rows, or store them elsewhere and write a reference (option "
            f"'compression' helps only values that compress)")
    half = batch.num_rows // 2
    return (encode_batches(batch.slice(0, half), compression, base_timestamp_ms)
            + encode_batches(batch.slice(half), compression, base_timestamp_ms))
