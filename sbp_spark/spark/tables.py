"""Catalog tables: ``CREATE TABLE t USING sbp OPTIONS (...)``, then ``SELECT``, ``INSERT INTO``.

What pyspark (4.2, 4.3) hands a Python data source for a table in a catalog: at ``CREATE TABLE``,
``schema()`` gets the OPTIONS twice (as written and with an ``option.`` prefix) plus
``provider`` and ``owner``; at ``SELECT``, ``INSERT INTO`` and ``readStream.table``, the reader
and writer get no options at all (only those of a ``WITH (...)`` clause), but they do get the
table's schema with the column metadata ``schema()`` returned. So the schema of a table carries
its definition in the metadata of its first column: the OPTIONS it was created with (addresses,
stream ids, read and write settings, paths of TLS files: the connector has no option that holds
a secret, keys stay in the files named) and, for payload=arrow, which columns are data.

A table created with a column list, or by ``CREATE TABLE ... AS SELECT`` (also in the form of
``df.write.saveAsTable`` or ``df.writeTo(...).create()``), never had its schema asked for, so it
has no definition; using it fails with a message saying how to create it.
``writeStream.toTable`` hands the sink the DataFrame's schema instead of the table's, so it
cannot write to an sbp table; it fails with a message naming what does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.types import StructField, StructType

from .options import (
    INCLUDE_HEADERS,
    MERGE_SCHEMA,
    OPTIONS,
    PAYLOAD,
    OptionError,
    OptionSpec,
    parse_stream_refs,
)
from .schemas import spark_metadata_of, with_spark_metadata

DEFINITION_KEY = "sbp.table"
_PREFIX = "option."

NO_DEFINITION = (
    "format sbp got no options: Spark hands a Python data source the OPTIONS of a catalog table "
    "only through the schema it returned at CREATE TABLE, and neither a table created with a "
    "column list nor CREATE TABLE ... AS SELECT (nor df.write.saveAsTable or "
    "df.writeTo(...).create(), which are the same) asks for it. Create the table as "
    "CREATE TABLE t USING sbp OPTIONS (pd 'host:port', streams '7') (no column list, no AS "
    "SELECT; DROP TABLE one made otherwise first: its records stay in the streams), then fill "
    "it with INSERT INTO t SELECT ...")

NO_STREAMING_TABLE = (
    "format sbp got no option 'pd' for a streaming write. writeStream.toTable() cannot write "
    "to an sbp table: Spark hands the streaming sink of a Python data source neither the "
    "table's OPTIONS nor its schema, only the DataFrame's, so the sink cannot know the table's "
    "pd and streams. Name them on the write: writeStream.format('sbp').option('pd', "
    "'host:port').option('stream', '7').start(), or append each micro-batch to the table "
    "with foreachBatch(lambda df, _: df.writeTo('t').append())")


def empty_arrow_table_error(streams: tuple[int, ...]) -> OptionError:
    """What CREATE TABLE says when its payload=arrow streams hold nothing to infer columns
    from: SQL has no ``.schema(...)``, and a table given a column list cannot keep its OPTIONS,
    but a temporary view may have a column list and gets its OPTIONS on every use."""
    which = (f"stream {streams[0]}: it holds" if len(streams) == 1 else
             f"streams {','.join(map(str, streams))}: they hold")
    return OptionError(
        f"CREATE TABLE over payload=arrow {which} no records, so there are no columns to "
        "infer the table's schema from (and a table created with a column list cannot keep "
        "its OPTIONS). Write the first rows through a temporary view, which may have a column "
        "list: CREATE TEMPORARY VIEW v (id BIGINT, name STRING) USING sbp OPTIONS (the same "
        "OPTIONS); INSERT INTO v VALUES (...); then create the table")


@dataclass(frozen=True)
class TableDefinition:
    """What a table keeps: its OPTIONS (lower-case names), its payload=arrow data columns, and
    the pairs of column names that differ only by case which ``mergeSchema`` took for one
    column when the table was created (a case-sensitive read refuses them, as it refuses them
    in ``spark.read``; without them it read one of each pair as nulls)."""

    options: dict[str, str]
    data_columns: tuple[str, ...] | None = None
    case_folded: tuple[str, ...] = ()


def source_options(options: Mapping[str, Any]) -> tuple[dict[str, str], bool]:
    """(the connector's options, whether they come from CREATE TABLE). At CREATE TABLE the
    OPTIONS are the ``option.`` copies; the keys without the prefix are those OPTIONS again
    plus the table's properties (Spark's ``provider`` and ``owner``, ``comment``,
    ``TBLPROPERTIES``), which are no options of the connector; a ``location`` among them (the
    LOCATION clause) is refused: an sbp table has no files."""
    keys = {str(k).lower() for k in options}
    creating = any(k.startswith(_PREFIX) for k in keys)
    out: dict[str, str] = {}
    if creating and "location" in keys:
        raise OptionError(
            "CREATE TABLE ... USING sbp takes no LOCATION: the table's records live in its SBP "
            "streams (name them in OPTIONS with 'streams' or 'stream')")
    for key, value in options.items():
        name = str(key).lower()
        if creating:
            if not name.startswith(_PREFIX):
                continue
            name = name.removeprefix(_PREFIX)
        out[name] = value
    if creating and "streams" not in out and "stream" in out:
        out["streams"] = out["stream"]  # a table on one stream reads what it writes
    return out, creating


def with_definition(schema: StructType, definition: TableDefinition) -> StructType:
    """``schema`` carrying ``definition`` in its first column's metadata."""
    text = json.dumps({"options": dict(sorted(definition.options.items())),
                       "dataColumns": definition.data_columns,
                       "caseFolded": list(definition.case_folded)})
    first, *rest = schema.fields
    tagged = StructField(first.name, first.dataType, first.nullable,
                         {**(first.metadata or {}), DEFINITION_KEY: text})
    return StructType([tagged, *rest])


def definition_of(schema: StructType) -> TableDefinition | None:
    """The table definition ``schema`` carries, if any."""
    for field in schema.fields:
        text = (field.metadata or {}).get(DEFINITION_KEY)
        if text is not None:
            parsed = json.loads(text)
            columns = parsed.get("dataColumns")
            return TableDefinition(dict(parsed["options"]),
                                   None if columns is None else tuple(columns),
                                   tuple(parsed.get("caseFolded") or ()))
    return None


def without_definition(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` (a table's rows as Spark hands them to a writer) without the definition that
    Spark copies from the schema's column metadata into the Arrow field metadata: records
    stored in a stream never carry a table's options. Other metadata is kept."""
    fields = []
    for field in batch.schema:
        spark_metadata = spark_metadata_of(field.metadata)
        if spark_metadata is not None and DEFINITION_KEY in spark_metadata:
            rest = {k: v for k, v in spark_metadata.items() if k != DEFINITION_KEY}
            metadata = with_spark_metadata(field.metadata, rest)
            field = field.with_metadata(metadata) if metadata else field.remove_metadata()
        fields.append(field)
    schema = pa.schema(fields, metadata=batch.schema.metadata)
    if schema.equals(batch.schema, check_metadata=True):
        return batch
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema)


# Options that position one end of a read, each excluding the others: a query that positions
# an end overrides the table's position of that end, whichever way either gives it.
_POSITIONS = (
    ("startingoffsets", "startingtimestamp", "startingoffsetsbytimestamp"),
    ("endingoffsets", "endingtimestamp", "endingoffsetsbytimestamp"),
)
# Only for a start positioned by time.
_TIME_STRATEGY = "startingoffsetsbytimestampstrategy"
# The positions given per stream, as a JSON object {"<stream_id>": ...}.
_PER_STREAM_POSITIONS = ("startingoffsets", "endingoffsets", "startingoffsetsbytimestamp",
                         "endingoffsetsbytimestamp")


# Options that decide a table's columns: CREATE TABLE fixed them, so a query may not change
# them (its rows would silently keep the table's columns, or a write would store batches of
# another payload that the table's reads cannot take).
_READ_SCHEMA_OPTIONS = (PAYLOAD, INCLUDE_HEADERS, MERGE_SCHEMA)
_WRITE_SCHEMA_OPTIONS = (PAYLOAD,)


def _check_fixed(given: Mapping[str, str], table: TableDefinition,
                 specs: tuple[OptionSpec, ...]) -> None:
    for spec in specs:
        key = spec.name.lower()
        if key not in given:
            continue
        fixed = table.options.get(key, spec.default)
        if spec.check(spec.name, given[key]) != spec.check(spec.name, fixed):
            raise OptionError(
                f"option '{spec.name}' = '{given[key]}' cannot be given per query on an sbp "
                f"table: CREATE TABLE fixed its columns with {spec.name} '{fixed}'; create "
                f"another table with OPTIONS ({spec.name} '{given[key]}'), or use "
                f"spark.read/df.write with format('sbp') and option pd")


def _query_options(options: Mapping[str, str], table: TableDefinition | None
                   ) -> tuple[dict[str, str], bool]:
    """A query's own options (names in lower case), and whether they stand alone: a query
    naming its own ``pd`` is no table query, and without a table there is nothing else."""
    given = {str(k).lower(): v for k, v in options.items()}
    alone = "pd" in given or table is None
    if alone and not given:
        raise OptionError(NO_DEFINITION)
    return given, alone


def read_options(options: Mapping[str, str], table: TableDefinition | None,
                 streaming: bool = False) -> dict[str, str]:
    """The options of a read: a table's, overridden by the query's (``WITH (...)``); a read
    naming its own ``pd`` is not a table read and uses only its own. A streaming read of a
    table whose OPTIONS end its reads fails saying so (the query never named that option)."""
    given, alone = _query_options(options, table)
    if alone or table is None:
        return given
    _check_fixed(given, table, _READ_SCHEMA_OPTIONS)
    inherited = dict(table.options)
    ends = [name for name in _POSITIONS[1] if name in inherited]
    if streaming and ends:
        spec = next(spec for spec in OPTIONS if spec.name.lower() == ends[0])
        raise OptionError(
            f"this sbp table was created with OPTIONS ({spec.name} '{inherited[ends[0]]}'), "
            "which end its batch reads; a streaming read has no end, so the table cannot be "
            "read with readStream. Stream from another table on the same streams (its records "
            "stay where they are), created without that option, or use "
            "spark.readStream.format('sbp') with option pd and streams")
    for group in _POSITIONS:
        if any(name in given for name in group):
            for name in group:
                inherited.pop(name, None)
    if "startingoffsets" in given:
        inherited.pop(_TIME_STRATEGY, None)
    if "streams" in given:
        _keep_positions_of(inherited, given["streams"])
        if not any(name in inherited or name in given for name in _POSITIONS[0][1:]):
            inherited.pop(_TIME_STRATEGY, None)  # nothing is positioned by time any more
    return {**inherited, **given}


def _keep_positions_of(inherited: dict[str, str], streams_text: str) -> None:
    """Drop from the table's per-stream positions (``inherited``) the streams a query's own
    ``streams`` does not read: a query narrowing a table to some of its streams reads those
    from the table's positions, and the positions of the others are not used (they failed the
    read with "names stream N, which is not in option 'streams'", an option the query never
    gave). A position the query gives itself is checked as in ``spark.read``."""
    try:
        read = set(parse_stream_refs("streams", streams_text))
    except OptionError:
        return  # the read's own parsing reports it, naming the option
    if any(not isinstance(ref, int) for ref in read):
        return  # names or '*': which ids they are is known once they are looked up
    for name in _PER_STREAM_POSITIONS:
        text = inherited.get(name)
        if text is None:
            continue
        try:
            positions = json.loads(text)
        except json.JSONDecodeError:
            continue  # earliest / latest: every stream alike
        if not isinstance(positions, dict):
            continue
        kept = {key: value for key, value in positions.items()
                if str(key).strip().isdigit() and int(key) in read}
        if len(kept) == len(positions):
            continue
        if kept:
            inherited[name] = json.dumps(kept)
        else:
            del inherited[name]


def write_options(options: Mapping[str, str], table: TableDefinition | None) -> dict[str, str]:
    """The options of a batch write: a table's (``INSERT INTO``, ``df.writeTo``), overridden
    by the write's own (``WITH (...)``, ``.option(...)``); a write naming its own ``pd``
    (``df.write`` with options, a temporary view) is not a table write and uses only its own.
    Either way, without ``stream`` the write goes to the one stream of ``streams``, or routes
    rows by their ``stream_id`` column to one of several (``parse_write_options``)."""
    given, alone = _query_options(options, table)
    if alone or table is None:
        return dict(options)
    _check_fixed(given, table, _WRITE_SCHEMA_OPTIONS)
    return {**table.options, **given}


def stream_write_options(options: Mapping[str, str]) -> dict[str, str]:
    """The options of a streaming write: its own, always naming ``pd``. Spark gives the sink
    of ``writeStream.toTable`` the DataFrame's schema, never the table's, so a definition in
    that schema is the one of a table the stream was read from (``readStream.table``):
    taking its options would write the rows back into the table they came from."""
    if not any(str(k).lower() == "pd" for k in options):
        raise OptionError(NO_STREAMING_TABLE)
    return dict(options)


__all__ = ["NO_DEFINITION", "NO_STREAMING_TABLE", "TableDefinition", "definition_of",
           "empty_arrow_table_error",
           "read_options", "source_options", "stream_write_options", "with_definition",
           "without_definition", "write_options"]
