"""payload=arrow schemas as streams evolve: what a read infers, and what a guarded write checks.

Both look at a few stored batches only, each fetched with one small FETCH
(``cluster_access.batch_at``):

- inference takes the schema of the newest batch (the last one of the last range holding
  records; across several streams, the one with the latest envelope timestamp), or with
  ``mergeSchema`` the union of the first and last batch of every range, widened by the rules
  of ``resolve``. Columns and nested fields are made nullable, so batches that lack a column
  (or struct field) read it as nulls, as Spark's file sources do;
- ``schemaCompatibility=backward`` resolves the stream's newest batch against the schema a
  write is about to store, and refuses the write when a reader of that schema could not read
  the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from sbp_spark.client import FetchedBatch, SbpClient
from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    PAYLOAD_ARROW,
    BodyFormat,
    body_to_arrow,
    payload_kind,
)

from . import cluster_access
from .planning import StreamLayout
from .resolve import case_duplicates, merge_fields, plan_schema
from .schemas import METADATA_TYPES


class NothingToInferError(ValueError):
    """The streams of a payload=arrow read hold no batch to infer its schema from."""


def stored_schema(fetched: FetchedBatch) -> pa.Schema:
    """The Arrow schema (without metadata) of a stored payload=arrow batch; ``ValueError`` when
    the batch holds other data."""
    header = fetched.header
    where = f"stream {fetched.stream_id} offset {header.base_offset}"
    if header.body_format != BodyFormat.ARROW:
        raise ValueError(f"{where} holds an opaque record, not Arrow data written with "
                         "payload=arrow; read it with payload=records")
    body = fetched.data[ENVELOPE_SIZE:ENVELOPE_SIZE + header.body_length]
    schema = body_to_arrow(body).schema
    kind = payload_kind(schema)
    if kind is not None and kind != PAYLOAD_ARROW:
        raise ValueError(f"{where} holds payload={kind.decode()} data; read it with "
                         f"payload={kind.decode()}")
    return schema.remove_metadata()


def _nullable(fields: Sequence[pa.Field]) -> pa.Schema:
    return pa.schema([_nullable_field(f) for f in fields])


def _nullable_field(field: pa.Field) -> pa.Field:
    """``field`` nullable at every level, as Spark's file sources make their schemas: Spark
    marks struct fields, array elements and map values of non-null expressions NOT NULL, and
    a read schema keeping that would refuse older batches where they are missing or null."""
    dtype = field.type
    if pa.types.is_struct(dtype):
        dtype = pa.struct([_nullable_field(f) for f in dtype])
    elif pa.types.is_large_list(dtype):
        dtype = pa.large_list(_nullable_field(dtype.value_field))
    elif pa.types.is_list(dtype):
        dtype = pa.list_(_nullable_field(dtype.value_field))
    elif pa.types.is_map(dtype):  # Arrow map keys are never null
        dtype = pa.map_(dtype.key_field, _nullable_field(dtype.item_field), dtype.keys_sorted)
    return field.with_type(dtype).with_nullable(True)


def infer_arrow_schema(client: SbpClient, layouts: Sequence[StreamLayout],
                       merge: bool = False, folded: list[str] | None = None) -> pa.Schema:
    """The data schema of a payload=arrow read of ``layouts`` (see the module docstring).

    ``mergeSchema`` unions names that differ only by case into one column (or struct field),
    as Spark's file sources do while ``spark.sql.caseSensitive`` is false (its default: the
    setting is not visible here); ``folded`` gets a description of each such pair."""
    if merge:
        fields: list[pa.Field] | None = None
        for layout in layouts:
            for fetched in _range_samples(client, layout):
                schema = stored_schema(fetched)
                try:
                    fields = list(schema) if fields is None else merge_fields(
                        fields, list(schema), folded=folded)
                except ValueError as exc:
                    raise ValueError(
                        f"mergeSchema cannot union the schema of stream {fetched.stream_id} "
                        f"offset {fetched.header.base_offset} with the batches before it: {exc}"
                        "; give the schema with .schema(...)") from None
        if fields is not None:
            return _nullable(fields)
    else:
        newest: FetchedBatch | None = None
        for layout in layouts:
            last = cluster_access.last_batch(client, layout)
            if last is not None and (newest is None or last.header.base_timestamp_ms
                                     > newest.header.base_timestamp_ms):
                newest = last
        if newest is not None:
            return _nullable(stored_schema(newest))
    raise NothingToInferError(
        "cannot infer the payload=arrow schema: streams "
        f"{','.join(str(lay.stream_id) for lay in layouts)} hold no records yet; give the "
        "schema with .schema(...)")


def _range_samples(client: SbpClient, layout: StreamLayout) -> list[FetchedBatch]:
    """The first and last stored batch of every range of ``layout`` that holds records (one
    when a single batch covers the range)."""
    out = []
    for first, end in cluster_access.filled_ranges(layout):
        head = cluster_access.batch_at(client, layout, first)
        if head is not None:
            out.append(head)
            if head.header.base_offset + head.header.record_count >= end:
                continue
        tail = cluster_access.batch_at(client, layout, end - 1)
        if tail is not None:
            out.append(tail)
    return out


def check_backward(client: SbpClient, stream_id: int, pd: Sequence[str],
                   schema: pa.Schema) -> None:
    """Refuse (``ValueError`` naming the columns) a payload=arrow write of ``schema`` to
    ``stream_id`` when a reader of ``schema`` could not read the stream's newest stored batch.

    Columns and nested fields are judged nullable, as every inferred read schema has them.
    """
    (layout,) = cluster_access.stream_layouts(client, [stream_id], pd)
    fetched = cluster_access.last_batch(client, layout)
    if fetched is None:
        return
    where = f"stream {stream_id} offset {fetched.header.base_offset}"
    try:
        stored = stored_schema(fetched)
    except ValueError as exc:
        raise ValueError(f"schemaCompatibility=backward refuses this write: the newest batch "
                         f"of stream {stream_id} is not payload=arrow data: {exc}") from None
    read = _nullable([f for f in schema if f.name != "stream_id"])
    # Readers match names ignoring case unless their session says otherwise (the default); a
    # batch with names that differ only by case is read by case-sensitive readers only.
    exact = bool(case_duplicates(stored.names))
    problems = plan_schema(stored, read, METADATA_TYPES, case_sensitive=exact).problems
    if problems:
        raise ValueError(
            f"schemaCompatibility=backward refuses this write: readers using its schema could "
            f"not read the newest stored batch ({where}): " + "; ".join(problems))


__all__ = ["NothingToInferError", "check_backward", "infer_arrow_schema", "stored_schema"]
