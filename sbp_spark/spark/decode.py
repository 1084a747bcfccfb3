"""Fetched SBP record batches -> Arrow batches of the read schema, without per-row Python.

Reading one partition yields a stream of record batches in offset order. ``PartitionDecoder``
cuts them to the partition's offsets, turns each into columns (Arrow bodies are sliced, opaque
bodies become a binary column built from their lengths), adds the metadata columns
(stream_id, range_index, offset, timestamp) with vectorised Arrow kernels, applies the row
predicates, and yields batches of tens of thousands of rows with exactly the Arrow schema Spark
expects.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import StructType

from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    PAYLOAD_ARROW,
    PAYLOAD_RECORDS,
    BatchHeader,
    BodyFormat,
    body_to_arrow,
    floor_timestamps,
    payload_kind,
)

from .filters import Predicate, row_mask
from .resolve import (
    ColumnPlan,
    Conversion,
    SchemaMismatchError,
    case_duplicates,
    duplicates_problem,
    plan_schema,
    schema_text,
)
from .schemas import ARROW_TIMESTAMP, METADATA_TYPES, to_arrow
from .settings import case_sensitive as session_case_sensitive

# Batches handed to Spark: a stored batch with at least SOLO_ROWS rows or SOLO_BYTES bytes
# (within the partition) is handed on by itself, its columns zero-copy views of the fetched
# body. Runs of smaller ones (opaque records, tiny Arrow batches) are combined up to
# TARGET_ROWS (Spark's Arrow path is clearly slower below ~10k rows) or TARGET_BYTES. A batch
# larger than MAX_ROWS is cut into equal slices (no copy).
TARGET_ROWS = 65_536
MAX_ROWS = 100_000
TARGET_BYTES = 32 * 1024 * 1024
SOLO_ROWS = 10_000
SOLO_BYTES = 1024 * 1024

_RECORDS_BODY_COLUMNS = ("key", "value", "headers")
# Distinct stored schemas a decoder keeps plans for; a partition rarely sees more than a few.
MAX_PLANS = 64


class CorruptBatchError(ValueError):
    """A stored batch whose Arrow body disagrees with its envelope."""


@dataclass
class SkipTally:
    """Stored batches a read skipped because they do not fit the read schema
    (``skipIncompatibleBatches``)."""

    batches: int = 0
    records: int = 0
    first_problem: str | None = None  # why the first one was skipped

    def add(self, records: int, problem: str) -> None:
        self.batches += 1
        self.records += records
        if self.first_problem is None:
            self.first_problem = problem


@dataclass
class _Piece:
    """Rows decoded from stored batches, waiting to be combined into one output batch."""

    columns: dict[str, pa.Array]  # body columns (by output name)
    offsets: pa.Array  # int64
    timestamps: pa.Array  # timestamp[us, UTC]
    nbytes: int

    @property
    def num_rows(self) -> int:
        return len(self.offsets)


@dataclass
class _OpaqueRun:
    """Consecutive opaque records (one per stored batch) gathered before building columns."""

    bodies: list[memoryview] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    timestamps_ms: list[int] = field(default_factory=list)
    nbytes: int = 0


_ARANGE_CACHE: list[pa.Array] = []


def _arange(start: int, count: int) -> pa.Array:
    """int64 values start, start+1, ..., start+count-1 (vectorised, from a cached ramp)."""
    if not _ARANGE_CACHE or len(_ARANGE_CACHE[0]) < count:
        size = max(count, MAX_ROWS * 2)
        _ARANGE_CACHE[:] = [pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), size),
                                              start=-1)]
    return pc.add(_ARANGE_CACHE[0].slice(0, count), pa.scalar(start, pa.int64()))


def _binary_column(bodies: Sequence[memoryview]) -> pa.Array:
    """A binary array of ``bodies``: one values buffer and offsets from the body lengths."""
    lengths = [b.nbytes for b in bodies]
    offsets = pa.array(list(itertools.accumulate(lengths, initial=0)), pa.int32())
    values = pa.py_buffer(b"".join(bodies))
    return pa.Array.from_buffers(pa.binary(), len(bodies), [None, offsets.buffers()[1], values])


class PartitionDecoder:
    """Turns the stored batches of one partition into Arrow batches of ``schema``.

    ``payload`` is ``records`` or ``arrow``. For payload=arrow, columns of ``schema`` named
    like metadata columns come from the data when a batch has such a column, and every stored
    batch is resolved to ``schema`` by the rules of ``resolve`` (planned once per distinct
    stored schema; a batch that already has the read types passes untouched). A batch that
    cannot be resolved raises ``SchemaMismatchError``, or, when ``skipped`` is given, is
    left out and counted there. Names in ``metadata_columns`` are metadata in every batch (a
    stored column of that name is dropped): the read knows them to be (see
    ``SbpBatchReader.metadata_columns``) and may have pushed filters on them; every other
    column is then data, read as nulls from batches that lack it. Without ``metadata_columns``
    (a schema the user gave), a column named and typed like a metadata column is data in the
    batches that store it and metadata in the others; any other column is data.

    payload=arrow columns and struct fields match the stored ones ignoring case unless
    ``case_sensitive`` (default: the task's session setting ``spark.sql.caseSensitive``).
    """

    def __init__(self, schema: StructType, payload: str, stream_id: int, range_index: int,
                 start_offset: int, end_offset: int,
                 row_predicates: Sequence[Predicate] = (),
                 target_rows: int = TARGET_ROWS, target_bytes: int = TARGET_BYTES,
                 skipped: SkipTally | None = None,
                 metadata_columns: frozenset[str] | None = None,
                 case_sensitive: bool | None = None) -> None:
        self.schema = schema
        self.case_sensitive = (session_case_sensitive() if case_sensitive is None
                               else case_sensitive)
        if payload == "arrow" and not self.case_sensitive:
            groups = case_duplicates(schema.fieldNames())
            if groups:
                raise SchemaMismatchError(duplicates_problem(groups))
        self.arrow_schema = to_arrow(schema)
        self.payload = payload
        self.stream_id = stream_id
        self.range_index = range_index
        self.start_offset = start_offset
        self.end_offset = end_offset
        self.row_predicates = tuple(row_predicates)
        self.target_rows = target_rows
        self.target_bytes = target_bytes
        self.solo_rows = min(SOLO_ROWS, target_rows)
        self.solo_bytes = min(SOLO_BYTES, target_bytes)
        self.next_offset = start_offset  # first offset not yet seen
        self._pieces: list[_Piece] = []
        self._rows = 0
        self._bytes = 0
        self._opaque = _OpaqueRun()
        self.skipped = skipped
        self.metadata_columns = metadata_columns or frozenset()
        # What a batch lacking the column fills it from: where its records are stored. Never a
        # column of another type (that would cast the time or offset into the data's type).
        self.fillable = frozenset() if metadata_columns is not None else frozenset(
            f.name for f in schema.fields if METADATA_TYPES.get(f.name) == f.dataType)
        self._conformers: dict[pa.Schema, _Conformer] = {}
        self._names = [f.name for f in schema.fields]
        self._types = {f.name: f.type for f in self.arrow_schema}
        self._constants: dict[str, pa.Array] = {}  # stream_id / range_index columns to slice

    # -- input ---------------------------------------------------------------------------------

    def add(self, header: BatchHeader, batch: memoryview) -> list[pa.RecordBatch]:
        """Take one stored batch (``batch`` = envelope + body); return the output batches that
        are ready (usually none)."""
        base = header.base_offset
        end = base + header.record_count
        if end > self.next_offset:
            self.next_offset = end if end < self.end_offset else self.end_offset
        if end <= self.start_offset or base >= self.end_offset:
            return []
        body = batch[ENVELOPE_SIZE:ENVELOPE_SIZE + header.body_length]
        if header.body_format == BodyFormat.OPAQUE:
            if self.payload != "records":
                return self._misfit(header, SchemaMismatchError(
                    f"stream {self.stream_id} offset {base} holds an opaque record, not Arrow "
                    "data written with payload=arrow; read it with payload=records"))
            # one record per batch: the hot path of opaque streams, kept to list appends
            run = self._opaque
            run.bodies.append(body)
            run.offsets.append(base)
            run.timestamps_ms.append(header.base_timestamp_ms)
            run.nbytes += header.body_length
            self._rows += 1
            self._bytes += header.body_length
        else:
            self._flush_opaque()
            try:
                whole = self._arrow_piece(header, body, max(base, self.start_offset),
                                          min(end, self.end_offset))
            except SchemaMismatchError as exc:
                return self._misfit(header, exc)
            piece = self._filtered(whole)
            if piece is None:
                return []
            if piece.num_rows >= self.solo_rows or piece.nbytes >= self.solo_bytes:
                # big enough for Spark on its own: never copied into a combined batch
                return self._drain() + self._output([piece])
            self._pieces.append(piece)
            self._rows += piece.num_rows
            self._bytes += piece.nbytes
        if self._rows < self.target_rows and self._bytes < self.target_bytes:
            return []
        return self._drain()

    def finish(self) -> list[pa.RecordBatch]:
        """What is left."""
        return self._drain()

    def _misfit(self, header: BatchHeader, exc: SchemaMismatchError) -> list[pa.RecordBatch]:
        """A stored batch that does not fit the read schema: fail, or skip and count it."""
        if self.skipped is None:
            raise exc
        records = (min(header.base_offset + header.record_count, self.end_offset)
                   - max(header.base_offset, self.start_offset))
        self.skipped.add(records, str(exc))
        return []

    # -- arrow bodies --------------------------------------------------------------------------

    def _arrow_piece(self, header: BatchHeader, body: memoryview, first: int, last: int
                     ) -> _Piece:
        data = body_to_arrow(body)
        if data.num_rows != header.record_count:
            raise CorruptBatchError(
                f"stream {self.stream_id} offset {header.base_offset}: the Arrow body holds "
                f"{data.num_rows} rows but the envelope says {header.record_count}")
        kind = payload_kind(data.schema)
        wanted = PAYLOAD_RECORDS if self.payload == "records" else PAYLOAD_ARROW
        if kind != wanted and (self.payload == "records" or kind == PAYLOAD_RECORDS):
            stored = f"payload={kind.decode()}" if kind else "Arrow data of another writer"
            raise SchemaMismatchError(
                f"stream {self.stream_id} offset {header.base_offset} holds {stored}, which a "
                f"payload={self.payload} read cannot decode; read it with "
                f"payload={'arrow' if self.payload == 'records' else 'records'}")
        skip, take = first - header.base_offset, last - first
        if skip or take != data.num_rows:
            data = data.slice(skip, take)
        # Keyed without metadata: batches of one writer differ in their tags (idempotent
        # writes) but share one plan.
        key = data.schema.remove_metadata()
        conformer = self._conformers.get(key)
        if conformer is None:
            if len(self._conformers) >= MAX_PLANS:
                self._conformers.clear()
            conformer = _Conformer(self, key, header.base_offset)
            self._conformers[key] = conformer
        columns, row_ts = conformer.columns(data, header.base_offset)
        base_ts = pa.scalar(header.base_timestamp_ms * 1000, ARROW_TIMESTAMP)
        if row_ts is None:
            timestamps = pa.repeat(base_ts, take)
        else:
            # A finer unit (another writer's ns) is floored to Spark's microseconds, as the
            # time search floors it to ms: a safe cast would fail on every value not whole in
            # us, and an unsafe one would move times before 1970 forward.
            timestamps = floor_timestamps(row_ts, "us").cast(ARROW_TIMESTAMP).fill_null(base_ts)
        return _Piece(columns, _arange(first, take), timestamps, data.nbytes)

    def _flush_opaque(self) -> None:
        run = self._opaque
        if not run.bodies:
            return
        count = len(run.bodies)
        columns: dict[str, pa.Array] = {}
        if "value" in self._types:
            columns["value"] = _binary_column(run.bodies)
        for name in ("key", "headers"):
            if name in self._types:
                columns[name] = pa.nulls(count, self._types[name])
        offsets = pa.array(run.offsets, pa.int64())
        timestamps = pa.array([ms * 1000 for ms in run.timestamps_ms], ARROW_TIMESTAMP)
        self._opaque = _OpaqueRun()
        piece = self._filtered(_Piece(columns, offsets, timestamps, run.nbytes))
        if piece is not None:
            self._pieces.append(piece)

    def _filtered(self, piece: _Piece) -> _Piece | None:
        """``piece`` with only the rows every row predicate keeps (None: no row is left).

        Filtering each piece before combining keeps the output batches full when a
        predicate drops most rows."""
        mask = row_mask(self.row_predicates,
                        {"offset": piece.offsets, "timestamp": piece.timestamps})
        if mask is None:  # no row predicates
            return piece
        kept = pc.sum(mask).as_py() or 0
        if kept == piece.num_rows and mask.null_count == 0:
            return piece
        if kept == 0:
            return None
        return _Piece({name: array.filter(mask) for name, array in piece.columns.items()},
                      piece.offsets.filter(mask), piece.timestamps.filter(mask),
                      piece.nbytes * kept // piece.num_rows)

    # -- output --------------------------------------------------------------------------------

    def _drain(self) -> list[pa.RecordBatch]:
        self._flush_opaque()
        pieces, self._pieces = self._pieces, []
        self._rows = self._bytes = 0
        if not pieces:
            return []
        return self._output(pieces)

    def _output(self, pieces: list[_Piece]) -> list[pa.RecordBatch]:
        batch = self._build(pieces)
        if batch.num_rows <= MAX_ROWS:
            return [batch]
        size = -(-batch.num_rows // -(-batch.num_rows // MAX_ROWS))  # equal slices <= MAX_ROWS
        return [batch.slice(start, size) for start in range(0, batch.num_rows, size)]

    def _build(self, pieces: list[_Piece]) -> pa.RecordBatch:
        arrays = []
        for name in self._names:
            from_data = sum(name in p.columns for p in pieces)
            if from_data == len(pieces):
                array = _concat([p.columns[name] for p in pieces])
            elif from_data:
                # A column named and typed like a metadata column that some of the combined
                # batches store: each batch's rows keep what that batch gives them, as when
                # the batch is output alone (its data where it stores the column, else the
                # metadata).
                array = _concat([p.columns[name] if name in p.columns
                                 else self._metadata(name, [p]) for p in pieces])
            else:
                array = self._metadata(name, pieces)
            arrays.append(array)
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)

    def _metadata(self, name: str, pieces: list[_Piece]) -> pa.Array:
        """The metadata column ``name`` of the rows of ``pieces``."""
        if name == "offset":
            return _concat([p.offsets for p in pieces])
        if name == "timestamp":
            return _concat([p.timestamps for p in pieces])
        count = sum(p.num_rows for p in pieces)
        if name == "stream_id":
            return self._constant(name, pa.scalar(self.stream_id, pa.int64()), count)
        if name == "range_index":
            return self._constant(name, pa.scalar(self.range_index, pa.int32()), count)
        raise SchemaMismatchError(
            f"stream {self.stream_id}: column '{name}' of the read schema is neither "
            f"stored in these batches nor metadata")

    def _constant(self, name: str, value: pa.Scalar, count: int) -> pa.Array:
        """``count`` copies of ``value``: a slice of one array kept for the partition."""
        array = self._constants.get(name)
        if array is None or len(array) < count:
            array = pa.repeat(value, max(count, MAX_ROWS))
            self._constants[name] = array
        return array.slice(0, count)


def _concat(arrays: list[pa.Array]) -> pa.Array:
    if len(arrays) == 1:
        return arrays[0]
    return pa.concat_arrays(arrays)


class _Conformer:
    """Maps one stored body schema to the output columns (planned once per schema)."""

    def __init__(self, decoder: PartitionDecoder, schema: pa.Schema, offset: int) -> None:
        self.stream_id = decoder.stream_id
        self.casts: list[ColumnPlan] = []
        self.null_columns: list[tuple[str, pa.DataType]] = []
        self.timestamp_index: int | None = None
        self.problem: str | None = None  # why batches of this schema cannot be read
        names = schema.names
        if decoder.payload == "records":
            where = f"stream {decoder.stream_id} offset {offset}"
            if "value" not in names:
                raise SchemaMismatchError(
                    f"{where}: the payload=records batch has no 'value' column (columns: "
                    f"{', '.join(names)})")
            wanted = [n for n in _RECORDS_BODY_COLUMNS if n in decoder._types]
            if "timestamp" in names:
                stamp_type = schema.field("timestamp").type
                if not pa.types.is_timestamp(stamp_type):
                    # Casting it would guess a unit (an int64 read as us), and positions by
                    # time would not agree: they take the batch's time for such a column.
                    raise SchemaMismatchError(
                        f"{where}: the payload=records batch's 'timestamp' column is "
                        f"{stamp_type}, not an Arrow timestamp")
                self.timestamp_index = names.index("timestamp")
            for name in wanted:
                if name in names:
                    self._add_records_column(where, schema, name, decoder._types[name])
            # key/headers absent from this batch: filled with nulls
            self.null_columns = [(n, decoder._types[n]) for n in wanted if n not in names]
            return
        read = [f for f in decoder.arrow_schema if f.name not in decoder.metadata_columns]
        plan = plan_schema(schema, read, decoder.fillable, decoder.case_sensitive)
        self.casts = plan.columns
        self.null_columns = plan.null_columns
        if plan.problems:
            self.problem = ("the stored batch does not fit the read schema: "
                            + "; ".join(plan.problems)
                            + f" (stored schema: {schema_text(schema)})")

    def _add_records_column(self, where: str, schema: pa.Schema, name: str,
                            target: pa.DataType) -> None:
        index = schema.get_field_index(name)
        source = schema.field(index).type
        if source.equals(target):
            self.casts.append(ColumnPlan(name, index, Conversion.NONE, target, False))
            return
        try:
            pc.cast(pa.nulls(0, source), target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            raise SchemaMismatchError(
                f"{where}: column '{name}' is {source} in the data but {target} in the read "
                "schema") from None
        self.casts.append(ColumnPlan(name, index, Conversion.CAST, target, False))

    def columns(self, data: pa.RecordBatch, offset: int
                ) -> tuple[dict[str, pa.Array], pa.Array | None]:
        """The read columns of ``data`` (stored at ``offset``), and its row timestamps."""
        if self.problem is not None:
            raise SchemaMismatchError(f"stream {self.stream_id} offset {offset}: {self.problem}")
        out: dict[str, pa.Array] = {}
        for column in self.casts:
            array = data.column(column.index)
            if column.refuse_nulls and array.null_count:
                raise SchemaMismatchError(
                    f"stream {self.stream_id} offset {offset}: column '{column.name}' holds "
                    f"{array.null_count} nulls but the read schema says it cannot be null")
            if column.conversion is Conversion.RELABEL:
                array = array.view(column.type)
            elif column.conversion is Conversion.CAST:
                if column.view_as is not None:
                    array = array.view(column.view_as)
                try:
                    array = array.cast(column.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise SchemaMismatchError(
                        f"stream {self.stream_id} offset {offset}: column '{column.name}' "
                        f"({array.type}) cannot be read as {column.type}: {exc}") from exc
            out[column.name] = array
        for name, dtype in self.null_columns:
            out[name] = pa.nulls(data.num_rows, dtype)
        row_ts = None if self.timestamp_index is None else data.column(self.timestamp_index)
        return out, row_ts
