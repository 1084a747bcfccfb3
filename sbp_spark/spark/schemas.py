"""The DataFrame schemas of the source, and how they map to Arrow.

payload=records rows look like Kafka's: metadata columns plus ``key``/``value`` (and
``headers``). payload=arrow rows are the DataFrame that was written, plus the metadata columns
whose names the data does not already use.

Schemas here are built as ``StructType`` objects, never parsed from DDL: parsing DDL needs a JVM,
and these functions also run in Spark's Python workers. Spark's own mapping to Arrow is reached
through ``to_arrow_type`` and ``to_arrow_schema`` here, which take what each pyspark 4.x
accepts, and a StructField's metadata through ``spark_metadata_of``/``with_spark_metadata``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from pyspark.sql.pandas import types as spark_arrow
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from . import pyspark_api

# Columns the source fills from where a record is stored, not from the record's body.
METADATA_TYPES: dict[str, DataType] = {
    "stream_id": LongType(),
    "range_index": IntegerType(),
    "offset": LongType(),
    "timestamp": TimestampType(),
}
# The metadata columns an inferred payload=arrow schema gets (range_index only on request).
ARROW_PAYLOAD_METADATA = ("stream_id", "offset", "timestamp")

HEADERS_TYPE = ArrayType(StructType([
    StructField("key", StringType()),
    StructField("value", BinaryType()),
]))

RECORDS_TYPES: dict[str, DataType] = {
    **METADATA_TYPES,
    "key": BinaryType(),
    "value": BinaryType(),
    "headers": HEADERS_TYPE,
}

# The Arrow type Spark expects for its TimestampType in a Python data source's batches.
ARROW_TIMESTAMP = pa.timestamp("us", tz="UTC")

# Where pyspark (4.2 and later) keeps a StructField's metadata in the metadata of the Arrow
# field it hands a data source: this key, with the metadata as JSON.
SPARK_METADATA_KEY = b"SPARK::metadata::json"


def _in_utc() -> dict[str, Any]:
    """The keyword that makes pyspark's Arrow mapping give timestamps in UTC: ``timezone``
    since pyspark 4.2, ``timestamp_utc`` before."""
    if pyspark_api.found().arrow_timezone_keyword:
        return {"timezone": "UTC"}
    return {"timestamp_utc": True}


def to_arrow_type(dtype: DataType) -> pa.DataType:
    """The Arrow type Spark uses for ``dtype`` in a data source's batches (timestamps in
    UTC); raises as pyspark does for types Arrow cannot hold."""
    return spark_arrow.to_arrow_type(dtype, **_in_utc())


def spark_metadata_of(arrow_metadata: Mapping[bytes, bytes] | None) -> dict[str, Any] | None:
    """The StructField metadata an Arrow field's metadata carries (None: none)."""
    if not arrow_metadata or SPARK_METADATA_KEY not in arrow_metadata:
        return None
    return json.loads(arrow_metadata[SPARK_METADATA_KEY].decode("utf-8"))


def with_spark_metadata(arrow_metadata: Mapping[bytes, bytes] | None,
                        spark_metadata: Mapping[str, Any] | None) -> dict[bytes, bytes]:
    """``arrow_metadata`` with its StructField metadata replaced by ``spark_metadata`` (left
    out when that is empty); other keys are kept."""
    out = {k: v for k, v in (arrow_metadata or {}).items() if k != SPARK_METADATA_KEY}
    if spark_metadata:
        out[SPARK_METADATA_KEY] = json.dumps(dict(spark_metadata)).encode("utf-8")
    return out


def records_schema(include_headers: bool = False) -> StructType:
    """The payload=records schema (``headers`` last, when asked for)."""
    names = ["stream_id", "range_index", "offset", "timestamp", "key", "value"]
    if include_headers:
        names.append("headers")
    return StructType([StructField(name, RECORDS_TYPES[name]) for name in names])


def arrow_payload_schema(data: pa.Schema) -> StructType:
    """The schema of a payload=arrow read of data written with Arrow schema ``data``.

    The data's own columns come first; metadata columns follow unless the data has a column
    of that name, ignoring case (the data's column wins: Spark's default
    ``spark.sql.caseSensitive=false`` would take the two for one column).
    """
    try:
        # A timestamp without a zone is TIMESTAMP_NTZ (pyspark 4.2+ by default, 4.0 and 4.1
        # only when asked).
        data_struct = spark_arrow.from_arrow_schema(data, prefer_timestamp_ntz=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the stream holds Arrow data Spark cannot represent: {exc}") from exc
    fields = list(data_struct.fields)
    for field in fields:
        try:
            to_arrow_type(field.dataType)
        except (TypeError, ValueError) as exc:  # void elements that are never null
            raise ValueError(
                f"the stream holds Arrow data Spark cannot read: column '{field.name}' is "
                f"{field.dataType.simpleString()} ({exc}); read it with a schema that leaves "
                "the column out") from exc
    names = {f.name.lower() for f in fields}
    fields += [StructField(name, METADATA_TYPES[name])
               for name in ARROW_PAYLOAD_METADATA if name not in names]
    return StructType(fields)


def to_arrow(schema: StructType) -> pa.Schema:
    """The exact Arrow schema Spark requires of batches read with ``schema``."""
    return spark_arrow.to_arrow_schema(schema, **_in_utc())


def check_records_read_schema(schema: StructType) -> None:
    """A payload=records read may select and order the records columns, not change them."""
    for field in schema.fields:
        expected = RECORDS_TYPES.get(field.name)
        if expected is None:
            raise ValueError(
                f"column '{field.name}' of the given schema is not a payload=records column; "
                f"allowed: {', '.join(RECORDS_TYPES)} (use payload=arrow to read your own "
                "columns)")
        if field.dataType != expected:
            raise ValueError(
                f"column '{field.name}' of the given schema is {field.dataType.simpleString()}, "
                f"but payload=records reads it as {expected.simpleString()}")
