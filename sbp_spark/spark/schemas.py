"""The DataFrame schemas of the source, and how they map to Arrow.

payload=records rows look like Kafka's: metadata columns plus ``key``/``value`` (and
``headers``). payload=arrow rows are the DataFrame that was written, plus the metadata columns
whose names the data does not already use.

Schemas here are built as ``StructType`` objects, never parsed from DDL: parsing DDL needs a JVM,
and these functions also run in Spark's Python workers.
"""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema, to_arrow_type
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
        data_struct = from_arrow_schema(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the stream holds Arrow data Spark cannot represent: {exc}") from exc
    fields = list(data_struct.fields)
    for field in fields:
        try:
            to_arrow_type(field.dataType, timezone="UTC")
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
    return to_arrow_schema(schema, timezone="UTC")


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
