"""Shared helpers of the streaming tests: appending through the client, reading a stream back,
and waiting for a condition with a deadline (never a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pyarrow as pa

from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    PAYLOAD_ARROW,
    body_to_arrow,
    encode_arrow_batch,
    make_records_batch,
    with_payload_kind,
)

T = TypeVar("T")


def new_stream(client) -> int:
    return client.create_streams(1)[0].stream_id


def append_values(client, stream_id: int, values: list[str], timestamp_ms: int | None = None):
    """Append ``values`` as one payload=records batch."""
    batch = make_records_batch(pa.array([v.encode() for v in values], pa.binary()))
    return client.open_stream(stream_id).append([encode_arrow_batch(batch, timestamp_ms)])


def append_arrow(client, stream_id: int, batch: pa.RecordBatch, timestamp_ms: int = 1_000):
    """Append ``batch`` as one payload=arrow record batch."""
    encoded = encode_arrow_batch(with_payload_kind(batch, PAYLOAD_ARROW), timestamp_ms)
    return client.open_stream(stream_id).append([encoded])


def arrow_read(spark, pd, sid, schema=None, **options):
    """A payload=arrow batch read of stream ``sid`` (with ``schema`` and ``options``)."""
    reader = (spark.read.format("sbp").option("pd", pd).option("streams", str(sid))
              .option("payload", "arrow"))
    for key, value in options.items():
        reader = reader.option(key, value)
    if schema is not None:
        reader = reader.schema(schema)
    return reader.load()


def stored_values(client, stream_id: int) -> list[str]:
    """Every value stored in a stream, in offset order."""
    out: list[str] = []
    for fetched in client.read(stream_id):
        body = fetched.data[ENVELOPE_SIZE:ENVELOPE_SIZE + fetched.header.body_length]
        out += [v.decode() for v in body_to_arrow(body).column("value").to_pylist()]
    return out


def stored_schemas(client, stream_id: int) -> list[pa.Schema]:
    """The Arrow schema (with metadata) of every batch of a stream."""
    out = []
    for fetched in client.read(stream_id):
        body = fetched.data[ENVELOPE_SIZE:ENVELOPE_SIZE + fetched.header.body_length]
        out.append(body_to_arrow(body).schema)
    return out


def wait_for(condition: Callable[[], T], timeout: float = 120.0, what: str = "condition") -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def drain_to_memory(df, name: str, checkpoint) -> None:
    """Run a streaming ``df`` once over what is there (``availableNow``) into the memory
    table ``name``, checkpointed in ``checkpoint``; the query is stopped afterwards."""
    query = (df.writeStream.format("memory").queryName(name)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    try:
        query.awaitTermination(120)
    finally:
        query.stop()


def memory_values(spark, name: str) -> list[str]:
    return [r.v for r in spark.sql(f"SELECT CAST(value AS STRING) AS v FROM {name}").collect()]
