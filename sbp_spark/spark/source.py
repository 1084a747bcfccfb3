"""The ``sbp`` data source: what Spark calls for ``format("sbp")``.

Two classes share one implementation. ``SbpDataSource`` (registered by
``sbp_spark.register(spark)``, which also turns on Python filter pushdown) pushes filters on the
metadata columns down to planning. ``SbpDataSourceNoPushdown`` (what ``pyspark_sbp`` offers for
automatic discovery) reads the same data with Spark evaluating every filter itself: pyspark
fails every read of a reader that implements ``pushFilters`` while pushdown is disabled, and a
data source cannot see that setting.

Streaming lives in ``sbp_spark.spark.streaming``; ``streamReader``/``streamWriter`` below only
delegate to it; the batch parts here are what it builds on (options, schema,
planning via ``cluster.stream_layouts``, ``reader.read_partition``).
"""

from __future__ import annotations

import logging

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    PAYLOAD_ARROW,
    BodyFormat,
    body_to_arrow,
    payload_kind,
)

from . import cluster, tables
from .encode import RowEncoder
from .options import ReadOptions, check_option_names, parse_read_options, parse_write_options
from .reader import SbpBatchReader, SbpPushdownBatchReader
from .schemas import (
    METADATA_TYPES,
    arrow_payload_schema,
    check_records_read_schema,
    records_schema,
)
from .writer import SbpBatchWriter

log = logging.getLogger(__name__)


class SbpDataSource(DataSource):
    """``spark.read.format("sbp")`` and ``df.write.format("sbp")`` with filter pushdown."""

    pushdown = True

    def __init__(self, options: dict[str, str]) -> None:
        given, self.creating_table = tables.source_options(options)
        super().__init__(given)
        check_option_names(self.options)
        # payload=arrow: the names of the data columns, known once schema() inferred them; they
        # tell metadata columns from data columns of the same name.
        self.arrow_data_columns: tuple[str, ...] | None = None

    @classmethod
    def name(cls) -> str:
        return "sbp"

    def schema(self) -> StructType:
        options = parse_read_options(self.options)
        if options.payload == "records":
            schema = records_schema(options.include_headers)
        else:
            data = self._infer_arrow_schema(options)
            self.arrow_data_columns = tuple(data.names)
            schema = arrow_payload_schema(data)
        if self.creating_table:
            schema = tables.with_definition(schema, tables.TableDefinition(
                dict(self.options), self.arrow_data_columns))
        return schema

    def _infer_arrow_schema(self, options: ReadOptions):
        client = cluster.get_client(options.client)
        layouts = cluster.stream_layouts(client, options.streams, options.client.pd)
        for layout in layouts:
            fetched = cluster.first_batch(client, layout)
            if fetched is None:
                continue
            body = fetched.data[ENVELOPE_SIZE:ENVELOPE_SIZE + fetched.header.body_length]
            if fetched.header.body_format != BodyFormat.ARROW:
                raise ValueError(
                    f"stream {layout.stream_id} offset {fetched.header.base_offset} holds an "
                    "opaque record, not Arrow data written with payload=arrow; read it with "
                    "payload=records")
            data = body_to_arrow(body)
            kind = payload_kind(data.schema)
            if kind is not None and kind != PAYLOAD_ARROW:
                raise ValueError(
                    f"stream {layout.stream_id} offset {fetched.header.base_offset} holds "
                    f"payload={kind.decode()} data; read it with payload={kind.decode()}")
            return data.schema.remove_metadata()
        raise ValueError(
            f"cannot infer the payload=arrow schema: streams {','.join(map(str, options.streams))}"
            " hold no records yet; give the schema with .schema(...)")

    def reader(self, schema: StructType) -> DataSourceReader:
        table = tables.definition_of(schema)
        options = parse_read_options(tables.read_options(self.options, table))
        data_columns = self.arrow_data_columns or (table and table.data_columns)
        if options.payload == "records":
            check_records_read_schema(schema)
            metadata = frozenset(METADATA_TYPES)
        elif data_columns is not None:
            metadata = frozenset(n for n in schema.fieldNames() if n not in data_columns)
        else:
            # A schema given by the user: a column named like a metadata column may be data in
            # some batches, so no filter on it is pushed.
            metadata = frozenset()
        cls = SbpPushdownBatchReader if self.pushdown else SbpBatchReader
        return cls(options, schema, metadata)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise ValueError(
                "format sbp cannot overwrite: SBP streams are append-only, so mode('overwrite') "
                "cannot replace their records; use mode('append')")
        options = parse_write_options(
            tables.write_options(self.options, tables.definition_of(schema)))
        client = cluster.get_client(options.client)
        stream = options.stream
        created = False
        if stream is not None:
            cluster.check_streams_exist(client, [stream], options.client.pd)
        elif options.create_if_missing and "stream_id" not in schema.names:
            stream = client.create_streams(count=1, replicas=options.replicas,
                                           retention_ms=options.retention_ms)[0].stream_id
            created = True
            log.warning("sbp write: created stream %d (replicas=%d, retentionMs=%d)",
                        stream, options.replicas, options.retention_ms)
        encoder = RowEncoder.for_schema(schema, options.payload, stream)
        return SbpBatchWriter(options, encoder, stream, created)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from .streaming.reader import stream_reader

        return stream_reader(
            tables.read_options(self.options, tables.definition_of(schema)), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from .streaming.writer import stream_writer

        return stream_writer(
            tables.write_options(self.options, tables.definition_of(schema)), schema, overwrite)


class SbpDataSourceNoPushdown(SbpDataSource):
    """The same source without filter pushdown: works whatever the session's settings."""

    pushdown = False


__all__ = ["SbpDataSource", "SbpDataSourceNoPushdown"]
