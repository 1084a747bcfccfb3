"""The ``sbp`` data source: what Spark calls for ``format("sbp")``.

Two classes share one implementation. ``SbpDataSource`` (registered by
``sbp_spark.register(spark, filter_pushdown=True)``, which also turns on Python filter
pushdown) pushes filters on the metadata columns down to planning. ``SbpDataSourceNoPushdown``
(what ``sbp_spark.register(spark)`` registers and ``pyspark_sbp`` offers for automatic
discovery) reads the same data with Spark evaluating every filter itself: pyspark fails every
read of a reader that implements ``pushFilters`` while pushdown is disabled, and a data source
cannot see that setting. Pushdown is not the default because pyspark reuses one scan's pushed
plan for other scans of the same relation (``sbp_spark.register`` says more).

Streaming lives in ``sbp_spark.spark.streaming``; ``streamReader``/``streamWriter`` below only
delegate to it; the batch parts here are what it builds on (options, schema,
planning via ``cluster_access.stream_layouts``, ``reader.read_partition``).
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

from . import cluster_access, stream_names, tables
from .encode import ROUTE_COLUMNS, RowEncoder
from .evolution import NothingToInferError, check_backward, infer_arrow_schema
from .options import (
    check_option_names,
    parse_read_options,
    parse_schema_options,
    parse_write_options,
)
from .planning import named_ends
from .reader import SbpBatchReader, SbpPushdownBatchReader, metadata_columns_of
from .schemas import (
    arrow_payload_schema,
    check_records_read_schema,
    records_schema,
    to_arrow,
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
        # payload=arrow mergeSchema: the pairs of names it took for one column because they
        # differ only by case (see ``infer_arrow_schema``), which a case-sensitive read refuses.
        self.arrow_case_folded: tuple[str, ...] = ()

    @classmethod
    def name(cls) -> str:
        return "sbp"

    def schema(self) -> StructType:
        options = parse_schema_options(self.options)
        if options.payload == "records":
            schema = records_schema(options.include_headers)
        else:
            client = cluster_access.get_client(options.client)
            options = stream_names.resolve_read(client, options)
            layouts = cluster_access.stream_layouts(client, options.streams, options.client.pd,
                                                    named_ends(options))
            try:
                folded: list[str] = []
                data = infer_arrow_schema(client, layouts, options.merge_schema, folded)
                self.arrow_case_folded = tuple(folded)
            except NothingToInferError:
                if not self.creating_table:
                    raise
                raise tables.empty_arrow_table_error(options.streams) from None
            self.arrow_data_columns = tuple(data.names)
            schema = arrow_payload_schema(data)
        if self.creating_table:
            schema = tables.with_definition(schema, tables.TableDefinition(
                dict(self.options), self.arrow_data_columns, self.arrow_case_folded))
        return schema

    def reader(self, schema: StructType) -> DataSourceReader:
        table = tables.definition_of(schema)
        options = parse_read_options(tables.read_options(self.options, table))
        if options.payload == "records":
            check_records_read_schema(schema)
        metadata = metadata_columns_of(schema, options.payload, self._data_columns(table))
        cls = SbpPushdownBatchReader if self.pushdown else SbpBatchReader
        return cls(options, schema, metadata, self._case_folded(table))

    def _data_columns(self, table: tables.TableDefinition | None) -> tuple[str, ...] | None:
        """payload=arrow: the data columns schema() inferred or the table keeps (None: the
        user gave the schema)."""
        return self.arrow_data_columns or (table.data_columns if table is not None else None)

    def _case_folded(self, table: tables.TableDefinition | None) -> tuple[str, ...]:
        """The pairs of names mergeSchema took for one column: schema() found them now, or
        the table recorded them when it was created (a table's reads call no schema())."""
        return self.arrow_case_folded or (table.case_folded if table is not None else ())

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise ValueError(
                "format sbp cannot overwrite: SBP streams are append-only, so INSERT OVERWRITE "
                "and mode('overwrite') cannot replace their records; use INSERT INTO or "
                "mode('append')")
        options = parse_write_options(
            tables.write_options(self.options, tables.definition_of(schema)))
        client = cluster_access.get_client(options.client)
        create = (options.stream is None and options.create_if_missing
                  and not ROUTE_COLUMNS & set(schema.names))
        # The schema is checked before a stream is created for it: a write refused for its
        # columns must not leave an empty stream behind (one per attempt).
        encoder = RowEncoder.for_schema(schema, options.payload, options.stream, create=create,
                                        routes=stream_names.route_ids(client, options))
        stream: int | None = None
        if options.stream is not None:
            stream, create = stream_names.write_target(client, options)
        elif create:
            stream = client.create_streams(count=1, replicas=options.replicas,
                                           retention_ms=options.retention_ms)[0].stream_id
            log.warning("sbp write: created stream %d (replicas=%d, retentionMs=%d)",
                        stream, options.replicas, options.retention_ms)
        if options.schema_compatibility == "backward" and stream is not None and not create:
            check_backward(client, stream, options.client.pd, to_arrow(schema))
        return SbpBatchWriter(options, encoder, stream, create)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from .streaming.reader import refused_stream_reader, stream_reader

        try:
            table = tables.definition_of(schema)
            return stream_reader(tables.read_options(self.options, table, streaming=True), schema,
                                 self._data_columns(table), self._case_folded(table))
        except Exception as exc:  # raised at the query's first call (see RefusedStreamReader)
            return refused_stream_reader(exc)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from .streaming.sink import stream_writer

        return stream_writer(tables.stream_write_options(self.options), schema, overwrite)


class SbpDataSourceNoPushdown(SbpDataSource):
    """The same source without filter pushdown: works whatever the session's settings."""

    pushdown = False


__all__ = ["SbpDataSource", "SbpDataSourceNoPushdown"]
