"""``DataSource.streamWriter`` for format sbp: checks a streaming write's options and picks
the writer class this pyspark can host (``writer`` says what the writers do).

Apart from ``writer`` because the Arrow stream writer (``arrow_writer``) builds on
``writer.MicroBatchWriter`` and exists only on pyspark 4.1 and later: this module imports it
only where ``pyspark_api.found().stream_arrow_writer`` says so, and neither writer module
imports the other's picker.
"""

from __future__ import annotations

from pyspark.sql.types import StructType

from .. import cluster_access, stream_names
from ..encode import RowEncoder
from ..evolution import check_backward
from ..options import OptionError, parse_stream_write_options
from ..pyspark_api import found
from ..schemas import to_arrow
from .writer import MicroBatchWriter, SbpStreamRowWriter


def stream_writer(options: dict[str, str], schema: StructType, overwrite: bool
                  ) -> MicroBatchWriter:
    """The writer of one micro-batch (``DataSource.streamWriter``): the Arrow stream writer
    where pyspark has one, else the row writer."""
    if overwrite:
        raise OptionError(
            "format sbp cannot truncate: SBP streams are append-only, so output mode "
            "'complete' cannot replace their records; use outputMode('append') (pyspark's "
            "Python sinks cannot take 'update'), or foreachBatch with df.write.format('sbp')")
    parsed = parse_stream_write_options(options)
    write = parsed.write
    if write.create_if_missing and not isinstance(write.stream, str):
        # By name it is safe: the first micro-batch creates the stream, the others find it.
        raise OptionError(
            "option 'createIfMissing' of a streaming write needs option 'stream' to name the "
            "stream: without a name a streaming query would create a new stream for every "
            "micro-batch; create the stream first (`sbp streams create --name ...`), or give "
            "option 'stream' its name")
    client = cluster_access.get_client(write.client)
    encoder = RowEncoder.for_schema(schema, write.payload, write.stream,
                                    routes=stream_names.route_ids(client, write))
    stream: int | None = None
    if write.stream is not None:
        stream, _ = stream_names.write_target(client, write)
        if write.schema_compatibility == "backward":
            check_backward(client, stream, write.client.pd, to_arrow(schema))
    if found().stream_arrow_writer:
        from .arrow_writer import SbpStreamWriter

        return SbpStreamWriter(parsed, encoder, stream, schema)
    return SbpStreamRowWriter(parsed, encoder, stream, schema)


__all__ = ["stream_writer"]
