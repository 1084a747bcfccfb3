"""SQL: sbp tables in the session catalog (CREATE TABLE, SELECT, INSERT INTO, DESCRIBE, DROP,
readStream.table) and temporary views, through a real local Spark session and cluster."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pyarrow as pa
import pytest

from sbp_spark.protocol.records import PAYLOAD_ARROW, encode_arrow_batch, with_payload_kind
from sbp_spark.spark.tables import DEFINITION_KEY

from .streaming.helpers import (
    append_arrow,
    append_values,
    drain_to_memory,
    stored_schemas,
    stored_values,
)
from .test_batch import new_stream, read


@pytest.fixture(scope="module")
def column_lists(spark, pd, sbp_client) -> None:
    """Skip where Spark refuses an INSERT whose column list leaves columns of the table out.
    Spark 4.1+ fills them with nulls; pyspark 4.0's analysis fails such an INSERT into a
    Python source's table with INCOMPATIBLE_DATA_FOR_TABLE.CANNOT_FIND_DATA (the README's
    SQL section says to name every column there). Found out by planning one (EXPLAIN, which
    writes nothing; pyspark 4.0 answers "Error occurred during query planning")."""
    sid = new_stream(sbp_client)
    with table(spark, f"probe_{sid}", f"USING sbp OPTIONS (pd '{pd}', stream '{sid}')"):
        try:
            plan = spark.sql(f"EXPLAIN INSERT INTO probe_{sid} (value) VALUES (X'00')"
                             ).first()[0]
        except Exception as exc:  # how an analysis error may come out
            plan = str(exc)
    if "CANNOT_FIND_DATA" in plan or "Error occurred during query planning" in plan:
        pytest.skip("this Spark refuses an INSERT that leaves a Python source table's "
                    "columns out (pyspark 4.0)")


@contextmanager
def table(spark, name: str, definition: str):
    """``CREATE TABLE name <definition>``, dropped afterwards (the session outlives the test)."""
    spark.sql(f"CREATE TABLE {name} {definition}")
    try:
        yield name
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {name}")


@pytest.mark.usefixtures("column_lists")
def test_table_select_insert_describe_stream_and_drop(spark, pd, sbp_client, tmp_path):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["a", "b", "c"])
    name = f"events_{sid}"
    with table(spark, name, f"USING sbp OPTIONS (pd '{pd}', streams '{sid}', stream '{sid}')"):
        assert [(r.col_name, r.data_type) for r in spark.sql(f"DESCRIBE TABLE {name}").collect()
                ] == [("stream_id", "bigint"), ("range_index", "int"), ("offset", "bigint"),
                      ("timestamp", "timestamp"), ("key", "binary"), ("value", "binary")]
        spark.sql(f"INSERT INTO {name} (key, value) "
                  "SELECT CAST(CAST(id AS STRING) AS BINARY), CAST(CONCAT('v', id) AS BINARY) "
                  "FROM range(4)")
        spark.sql(f"INSERT INTO {name} SELECT NULL, NULL, NULL, NULL, NULL, BINARY('last')")
        rows = spark.sql(f"SELECT offset, CAST(value AS STRING) AS v FROM {name} "
                         "WHERE offset >= 2 ORDER BY offset").collect()
        # The first INSERT's two tasks append in either order; the second comes after both.
        assert [r.offset for r in rows] == [2, 3, 4, 5, 6, 7]
        assert rows[0].v == "c" and rows[-1].v == "last"
        assert sorted(r.v for r in rows[1:5]) == ["v0", "v1", "v2", "v3"]
        # Per-query options override the table's.
        ending = json.dumps({str(sid): 2}).replace("'", "")
        assert spark.sql(f"SELECT count(*) FROM {name} WITH ('endingOffsets' = '{ending}')"
                         ).first()[0] == 2
        with pytest.raises(Exception, match="option 'fetchMaxBytes' = '0' is not valid"):
            spark.sql(f"SELECT * FROM {name} WITH ('fetchMaxBytes' = '0')").collect()
        with pytest.raises(Exception, match="cannot overwrite.*append-only, so INSERT "
                                            "OVERWRITE.*use INSERT INTO or mode\\('append'\\)"):
            spark.sql(f"INSERT OVERWRITE {name} SELECT NULL, NULL, NULL, NULL, NULL, X'00'")

        drain_to_memory(spark.readStream.table(name), f"table_stream_{sid}", tmp_path / "chk")
        # A streaming read starts at latest unless told otherwise; the table says nothing.
        assert spark.table(f"table_stream_{sid}").count() == 0
    # Dropping the table drops its definition, never the stream's records.
    assert not spark.catalog.tableExists(name)
    stored = stored_values(sbp_client, sid)
    assert stored[:3] == ["a", "b", "c"] and stored[-1] == "last"
    assert sorted(stored[3:7]) == ["v0", "v1", "v2", "v3"]


def test_an_insert_naming_every_column_works_on_every_pyspark(spark, pd, sbp_client):
    # The form the README gives for pyspark 4.0, whose SQL fills no column an INSERT leaves
    # out: the metadata columns as NULL (a records table), or left to the stream (arrow).
    sid, arrow_sid = new_stream(sbp_client), new_stream(sbp_client)
    append_arrow(sbp_client, arrow_sid, pa.record_batch({"id": pa.array([1], pa.int64())}))
    with table(spark, f"full_{sid}", f"USING sbp OPTIONS (pd '{pd}', stream '{sid}')") as name, \
            table(spark, f"full_{arrow_sid}", f"USING sbp OPTIONS (pd '{pd}', "
                  f"stream '{arrow_sid}', payload 'arrow')") as arrow:
        spark.sql(f"INSERT INTO {name} SELECT NULL, NULL, NULL, NULL, BINARY('k'), "
                  "BINARY(CONCAT('v', id)) FROM range(3)")
        spark.sql(f"INSERT INTO {arrow} SELECT 2, NULL, NULL, NULL")
        assert sorted(r.v for r in spark.sql(
            f"SELECT CAST(value AS STRING) AS v FROM {name}").collect()) == ["v0", "v1", "v2"]
        assert [(r.id, r.offset) for r in spark.sql(
            f"SELECT id, offset FROM {arrow} ORDER BY offset").collect()] == [(1, 0), (2, 1)]


@pytest.mark.usefixtures("column_lists")
def test_table_over_several_streams_routes_inserts_by_stream_id(spark, pd, sbp_client):
    s1, s2 = new_stream(sbp_client), new_stream(sbp_client)
    name = f"pair_{s1}_{s2}"
    options = (f"pd '{pd}', streams '{s1},{s2}', startingOffsets "
               f"'{json.dumps({str(s2): 1})}', includeHeaders 'true'")
    with table(spark, name, f"USING sbp OPTIONS ({options})"):
        spark.sql(f"INSERT INTO {name} (stream_id, value) "
                  f"VALUES ({s1}, BINARY('one')), ({s2}, BINARY('two')), ({s2}, BINARY('three'))")
        rows = spark.sql(f"SELECT stream_id, CAST(value AS STRING) AS v, headers FROM {name}"
                         ).collect()
        # The table's startingOffsets skips the first record of s2.
        assert sorted((r.stream_id, r.v) for r in rows) == [(s1, "one"), (s2, "three")]
        with pytest.raises(Exception, match="null stream_id"):
            spark.sql(f"INSERT INTO {name} (value) VALUES (BINARY('lost'))")


@pytest.mark.usefixtures("column_lists")
def test_arrow_table_stores_only_its_data_columns(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    first = pa.record_batch({"id": pa.array([1], pa.int64()), "name": pa.array(["x"])})
    sbp_client.append(sid, [encode_arrow_batch(with_payload_kind(first, PAYLOAD_ARROW))])
    name = f"typed_{sid}"
    with table(spark, name, f"USING sbp OPTIONS (pd '{pd}', stream '{sid}', payload 'arrow')"):
        assert spark.table(name).columns == ["id", "name", "stream_id", "offset", "timestamp"]
        spark.sql(f"INSERT INTO {name} (id, name) VALUES (2, 'y'), (3, 'z')")
        rows = spark.sql(f"SELECT id, name, offset FROM {name} WHERE offset >= 1").collect()
        assert sorted((r.id, r.name) for r in rows) == [(2, "y"), (3, "z")]
        assert sorted(r.offset for r in rows) == [1, 2]
    # The metadata columns INSERT INTO filled with nulls are not stored as data.
    assert {tuple(s.names) for s in stored_schemas(sbp_client, sid)} == {("id", "name")}


@pytest.mark.usefixtures("column_lists")
def test_a_tables_definition_is_not_stored_in_the_records_it_writes(spark, pd, sbp_client):
    """The table keeps its OPTIONS in its schema's column metadata; the rows INSERT INTO
    stores must not carry them (every stored batch would repeat the table's settings, and a
    plain read of the stream would look like a read of that table)."""
    sid = new_stream(sbp_client)
    first = pa.record_batch({"id": pa.array([1], pa.int64())})
    sbp_client.append(sid, [encode_arrow_batch(with_payload_kind(first, PAYLOAD_ARROW))])
    name = f"untagged_{sid}"
    with table(spark, name, f"USING sbp OPTIONS (pd '{pd}', stream '{sid}', payload 'arrow')"):
        spark.sql(f"INSERT INTO {name} (id) VALUES (2)")
        # a write of the table's own rows, which keep its first column (ids 1 and 2)
        spark.table(name).select("id").write.format("sbp").mode("append").save()
    stored = stored_schemas(sbp_client, sid)
    assert len(stored) == 3
    assert all(DEFINITION_KEY not in json.dumps(
        {k.decode(): v.decode() for k, v in (f.metadata or {}).items()})
        for schema in stored for f in schema)
    plain = read(spark, pd, sid, payload="arrow")
    assert DEFINITION_KEY not in plain.schema["id"].metadata
    assert sorted(r.id for r in plain.collect()) == [1, 1, 2, 2]


def test_tables_that_cannot_carry_their_options_say_what_to_do(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    advice = r"CREATE TABLE t USING sbp OPTIONS \(pd 'host:port', streams '7'\)"
    with pytest.raises(Exception, match=advice):
        spark.sql(f"CREATE TABLE ctas_{sid} USING sbp OPTIONS (pd '{pd}', stream '{sid}') "
                  "AS SELECT CAST('v' AS BINARY) AS value")
    spark.sql(f"DROP TABLE IF EXISTS ctas_{sid}")
    with table(spark, f"listed_{sid}", f"(key BINARY, value BINARY) USING sbp OPTIONS "
                                       f"(pd '{pd}', streams '{sid}')") as name:
        with pytest.raises(Exception, match=advice):
            spark.sql(f"SELECT * FROM {name}").collect()
    with pytest.raises(Exception, match="unknown option 'fetchmaxbytez' for format sbp; did "
                                        "you mean 'fetchMaxBytes'"):
        spark.sql(f"CREATE TABLE typo_{sid} USING sbp OPTIONS (pd '{pd}', streams '{sid}', "
                  "fetchMaxBytez '1k')")
    assert not spark.catalog.tableExists(f"typo_{sid}")


def test_an_arrow_table_on_an_empty_stream_says_what_sql_can_do(spark, pd, sbp_client):
    """Nothing to infer the columns from, and SQL has no .schema(...): the message names
    what works in SQL, and following it works."""
    sid = new_stream(sbp_client)
    options = f"pd '{pd}', stream '{sid}', payload 'arrow'"
    with pytest.raises(Exception, match=(
            rf"CREATE TABLE over payload=arrow stream {sid}: it holds no records.*"
            r"CREATE TEMPORARY VIEW v \(id BIGINT, name STRING\) USING sbp")):
        spark.sql(f"CREATE TABLE empty_{sid} USING sbp OPTIONS ({options})")
    assert not spark.catalog.tableExists(f"empty_{sid}")
    spark.sql(f"CREATE TEMPORARY VIEW first_{sid} (id BIGINT, name STRING) USING sbp "
              f"OPTIONS ({options})")
    spark.sql(f"INSERT INTO first_{sid} VALUES (1, 'a')")
    with table(spark, f"empty_{sid}", f"USING sbp OPTIONS ({options})") as name:
        assert [(r.id, r.name) for r in spark.table(name).collect()] == [(1, "a")]


@pytest.mark.usefixtures("column_lists")
def test_temporary_view_select_and_insert(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    view = f"view_{sid}"
    spark.sql(f"CREATE TEMPORARY VIEW {view} USING sbp OPTIONS "
              f"(pd '{pd}', streams '{sid}', stream '{sid}')")
    try:
        spark.sql(f"INSERT INTO {view} (value) VALUES (BINARY('p')), (BINARY('q'))")
        assert sorted(r.v for r in spark.sql(
            f"SELECT CAST(value AS STRING) AS v FROM {view}").collect()) == ["p", "q"]
    finally:
        spark.catalog.dropTempView(view)
    assert read(spark, pd, sid).count() == 2


@pytest.mark.usefixtures("column_lists")
def test_insert_with_per_query_options_keeps_the_tables(spark, pd, sbp_client):
    # Like SELECT ... WITH (...), an INSERT's own options override the table's; they must not
    # replace them (the write then had no 'pd' and failed with "option 'pd' is required").
    sid = new_stream(sbp_client)
    with table(spark, f"ins_with_{sid}", f"USING sbp OPTIONS (pd '{pd}', streams '{sid}')") as name:
        spark.sql(f"INSERT INTO {name} WITH ('batchMaxRecords' = '1') (key, value) "
                  "SELECT /*+ REPARTITION(1) */ NULL, CAST(CONCAT('v', id) AS BINARY) "
                  "FROM range(3)")
        assert stored_values(sbp_client, sid) == ["v0", "v1", "v2"]
        # batchMaxRecords=1 from the WITH clause: one stored batch per record.
        assert len(stored_schemas(sbp_client, sid)) == 3


def test_a_querys_position_overrides_the_tables_position_of_another_kind():
    # Per-query options override the table's, also when the table positions an end by time
    # and the query by offsets (or the reverse): the query's position replaces the table's,
    # where merging them failed with "options ... exclude each other".
    from sbp_spark.spark.options import parse_read_options, parse_stream_read_options
    from sbp_spark.spark.tables import TableDefinition, read_options

    table_def = TableDefinition({"pd": "127.0.0.1:1", "streams": "7",
                                 "startingtimestamp": "1000", "endingoffsets": '{"7": 50}'})
    read = parse_read_options(read_options(
        {"startingOffsets": '{"7": 3}', "endingTimestamp": "5000"}, table_def))
    assert read.starting.for_stream(7) == 3 and read.starting_time is None
    assert read.ending_time is not None and read.ending_time.for_stream(7) == 5000
    by_time = TableDefinition({"pd": "127.0.0.1:1", "streams": "7",
                               "startingoffsetsbytimestamp": '{"7": 1000}',
                               "startingoffsetsbytimestampstrategy": "latest"})
    stream = parse_stream_read_options(read_options({"startingOffsets": "earliest"}, by_time))
    assert stream.read.starting_time is None


def test_create_table_with_a_comment_and_table_properties(spark, pd, sbp_client):
    # COMMENT and TBLPROPERTIES describe the catalog table; Spark hands them to schema() next
    # to the OPTIONS, and they are no options of the connector (this failed with "unknown
    # option 'comment' for format sbp").
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["a", "b"])
    with table(spark, f"described_{sid}",
               f"USING sbp OPTIONS (pd '{pd}', streams '{sid}') COMMENT 'my events' "
               "TBLPROPERTIES ('team' = 'ingest')") as name:
        assert spark.sql(f"SELECT count(*) FROM {name}").first()[0] == 2


def test_create_table_with_a_location_is_refused(spark, pd, sbp_client):
    # LOCATION arrives among the table's properties, which are otherwise left out: it must not
    # be dropped silently, since an sbp table keeps nothing at that place.
    sid = new_stream(sbp_client)
    with pytest.raises(Exception, match="CREATE TABLE ... USING sbp takes no LOCATION"):
        spark.sql(f"CREATE TABLE located_{sid} USING sbp OPTIONS (pd '{pd}', streams '{sid}') "
                  "LOCATION '/tmp/sbp-table-location'")
    assert not spark.catalog.tableExists(f"located_{sid}")


def test_write_stream_to_table_is_refused_and_never_writes_the_source(spark, pd, sbp_client,
                                                                       tmp_path):
    # Spark hands the sink of writeStream.toTable the DataFrame's schema, not the table's: the
    # sink failed with "option 'pd' is required", and a stream read from another sbp table
    # carried that table's definition, so its rows were appended back into the source stream.
    source, target = new_stream(sbp_client), new_stream(sbp_client)
    append_values(sbp_client, source, ["a", "b"])
    refusal = r"writeStream.toTable\(\) cannot write to an sbp table.*writeStream.format\('sbp'\)"
    with table(spark, f"src_{source}", f"USING sbp OPTIONS (pd '{pd}', stream '{source}', "
                                       "startingOffsets 'earliest')") as src, \
            table(spark, f"dst_{target}", f"USING sbp OPTIONS (pd '{pd}', stream '{target}')"
                  ) as dst:
        plain = (spark.readStream.format("sbp").option("pd", pd).option("streams", str(source))
                 .option("startingOffsets", "earliest").load().select("key", "value"))
        for n, frame in enumerate([plain, spark.readStream.table(src)]):
            query = (frame.writeStream.option("checkpointLocation", str(tmp_path / f"chk{n}"))
                     .trigger(availableNow=True).toTable(dst))
            try:
                with pytest.raises(Exception, match=refusal):
                    query.awaitTermination(120)
            finally:
                query.stop()
    assert stored_values(sbp_client, source) == ["a", "b"]
    assert stored_values(sbp_client, target) == []


@pytest.mark.usefixtures("column_lists")
def test_temporary_view_on_streams_only_writes_like_a_table(spark, pd, sbp_client):
    # A view hands the write its OPTIONS as they are, so a view given only 'streams' refused
    # every INSERT ("option 'streams' is for reading"). Like a table, a view on one stream
    # writes to it, and a view on several routes each row by stream_id to one of them.
    s1, s2, outside = (new_stream(sbp_client) for _ in range(3))
    one, pair = f"one_{s1}", f"pair_view_{s1}_{s2}"
    spark.sql(f"CREATE TEMPORARY VIEW {one} USING sbp OPTIONS (pd '{pd}', streams '{s1}')")
    spark.sql(f"CREATE TEMPORARY VIEW {pair} USING sbp OPTIONS (pd '{pd}', streams '{s1},{s2}')")
    try:
        spark.sql(f"INSERT INTO {one} (value) VALUES (BINARY('p'))")
        spark.sql(f"INSERT INTO {pair} (stream_id, value) "
                  f"VALUES ({s1}, BINARY('q')), ({s2}, BINARY('r'))")
        with pytest.raises(Exception, match=f"stream_id {outside}, which is not one of the "
                                            f"streams {s1},{s2} of option 'streams'"):
            spark.sql(f"INSERT INTO {pair} (stream_id, value) VALUES ({outside}, BINARY('x'))")
        with pytest.raises(Exception, match="null stream_id"):
            spark.sql(f"INSERT INTO {pair} (value) VALUES (BINARY('which'))")
    finally:
        spark.catalog.dropTempView(one)
        spark.catalog.dropTempView(pair)
    assert stored_values(sbp_client, s1) == ["p", "q"]
    assert stored_values(sbp_client, s2) == ["r"]
    assert stored_values(sbp_client, outside) == []


def test_a_batch_write_of_table_rows_without_pd_writes_as_an_insert_would(spark, pd,
                                                                          sbp_client):
    # The README's rule: Spark hands df.write the same options and schema as INSERT INTO, so a
    # write naming no pd, of rows straight from an sbp table, takes that table's options (here
    # its pd, with the write's own stream); a write naming its own pd takes only its own.
    source, target, other = (new_stream(sbp_client) for _ in range(3))
    append_values(sbp_client, source, ["a", "b"])
    with table(spark, f"rows_{source}", f"USING sbp OPTIONS (pd '{pd}', stream '{source}')"
               ) as src:
        rows = spark.table(src)  # its first column carries the table's definition
        rows.write.format("sbp").option("stream", str(target)).mode("append").save()
        (rows.write.format("sbp").option("pd", pd).option("stream", str(other))
         .mode("append").save())
    assert stored_values(sbp_client, source) == ["a", "b"]
    assert stored_values(sbp_client, target) == ["a", "b"]
    assert stored_values(sbp_client, other) == ["a", "b"]


@pytest.mark.usefixtures("column_lists")
def test_a_query_may_not_change_the_options_that_fixed_a_tables_columns(spark, pd, sbp_client):
    # The columns come from CREATE TABLE: includeHeaders, payload or mergeSchema given per
    # query used to change nothing (SELECT) or store batches of another payload (INSERT).
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["a"])
    name = f"fixed_{sid}"
    with table(spark, name, f"USING sbp OPTIONS (pd '{pd}', streams '{sid}', stream '{sid}')"):
        with pytest.raises(Exception, match="option 'includeHeaders' = 'true' cannot be given "
                                            "per query on an sbp table.*includeHeaders 'false'"):
            spark.sql(f"SELECT * FROM {name} WITH ('includeHeaders' = 'true')").collect()
        with pytest.raises(Exception, match="option 'payload' = 'arrow' cannot be given"):
            spark.sql(f"INSERT INTO {name} WITH ('payload' = 'arrow') (value) "
                      "SELECT BINARY('x')")
        # Restating the table's own value is no change.
        assert spark.sql(f"SELECT count(*) FROM {name} WITH ('includeHeaders' = 'FALSE', "
                         "'payload' = 'records')").first()[0] == 1
    assert stored_values(sbp_client, sid) == ["a"]


def test_a_table_made_by_save_as_table_says_what_it_is_and_what_to_do(spark, pd, sbp_client):
    # saveAsTable with the connector's own options writes the rows and leaves a catalog table
    # that never had its schema asked for; using it failed with advice about column lists and
    # CREATE TABLE ... AS SELECT, neither of which the user wrote, and creating the table as
    # advised then failed, as the name was taken.
    sid = new_stream(sbp_client)
    name = f"saved_{sid}"
    try:
        (spark.createDataFrame([(b"a",)], "value binary").write.format("sbp")
         .option("pd", pd).option("stream", str(sid)).saveAsTable(name))
        assert stored_values(sbp_client, sid) == ["a"]
        with pytest.raises(Exception, match=r"df.write.saveAsTable.*DROP TABLE one made "
                                            r"otherwise first: its records stay"):
            spark.table(name).collect()
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {name}")
    assert stored_values(sbp_client, sid) == ["a"]


@pytest.mark.usefixtures("column_lists")
def test_alter_table_adds_a_column_a_writer_added_but_changes_no_option(spark, pd, sbp_client):
    # What the README says about ALTER TABLE: the columns of a payload=arrow table are fixed at
    # CREATE TABLE until ADD COLUMNS names one a writer added; TBLPROPERTIES are no options.
    sid, other = new_stream(sbp_client), new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([1], pa.int64())}))
    append_arrow(sbp_client, other, pa.record_batch({"id": pa.array([9], pa.int64())}))
    with table(spark, f"grown_{sid}", f"USING sbp OPTIONS (pd '{pd}', stream '{sid}', "
                                      "payload 'arrow')") as name:
        append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([2], pa.int64()),
                                                       "name": pa.array(["b"])}))
        assert "name" not in spark.table(name).columns
        spark.sql(f"ALTER TABLE {name} ADD COLUMNS (name STRING)")
        spark.sql(f"INSERT INTO {name} (id, name) VALUES (3, 'c')")
        assert sorted((r.id, r.name) for r in spark.sql(f"SELECT id, name FROM {name}").collect()
                      ) == [(1, None), (2, "b"), (3, "c")]
        spark.sql(f"ALTER TABLE {name} SET TBLPROPERTIES ('streams' = '{other}')")
        assert sorted(r.id for r in spark.table(name).collect()) == [1, 2, 3]
    assert [s.names for s in stored_schemas(sbp_client, sid)] == [["id"], ["id", "name"],
                                                                   ["id", "name"]]


def test_streaming_a_table_whose_options_end_its_reads_says_why_it_cannot(spark, pd,
                                                                         sbp_client, tmp_path):
    # The query never named endingTimestamp: it failed with "option 'endingTimestamp' is for
    # batch reads", which sent the user looking for it in their readStream.
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["a"])
    with table(spark, f"ended_{sid}", f"USING sbp OPTIONS (pd '{pd}', streams '{sid}', "
                                      "endingTimestamp '99999999999999')") as name:
        assert spark.table(name).count() == 1  # batch reads take the end
        query = (spark.readStream.table(name).writeStream.format("memory")
                 .queryName(f"ended_{sid}").option("checkpointLocation", str(tmp_path / "chk"))
                 .trigger(availableNow=True).start())
        try:
            with pytest.raises(Exception, match=(
                    r"this sbp table was created with OPTIONS "
                    r"\(endingTimestamp '99999999999999'\), which end its batch reads; a "
                    r"streaming read has no end")):
                query.awaitTermination(120)
        finally:
            query.stop()


def test_a_query_narrowing_a_table_to_some_streams_uses_their_positions_only(spark, pd,
                                                                            sbp_client):
    # The table positions stream `second`; a query reading only `first` failed with "option
    # 'startingOffsets' = ... names stream <second>, which is not in option 'streams'", two
    # options of which the query gave one. Positions of streams not read are not used.
    first, second = new_stream(sbp_client), new_stream(sbp_client)
    append_values(sbp_client, first, ["a", "b", "c"])
    append_values(sbp_client, second, ["x", "y", "z"])
    starts = json.dumps({str(second): 1})
    ends = json.dumps({str(first): 2, str(second): 3})
    by_time = json.dumps({str(second): 0})
    with table(spark, f"narrowed_{first}", f"USING sbp OPTIONS (pd '{pd}', "
                                           f"streams '{first},{second}', startingOffsets "
                                           f"'{starts}', endingOffsets '{ends}')") as name:
        assert spark.table(name).count() == 2 + 2
        only_first = spark.sql(f"SELECT stream_id, offset FROM {name} "
                               f"WITH ('streams' = '{first}') ORDER BY offset").collect()
        assert [(r.stream_id, r.offset) for r in only_first] == [(first, 0), (first, 1)]
        only_second = spark.sql(f"SELECT offset FROM {name} WITH ('streams' = '{second}') "
                                "ORDER BY offset").collect()
        assert [r.offset for r in only_second] == [1, 2]
        # A position the query gives itself for a stream it does not read is refused, as
        # spark.read refuses it.
        with pytest.raises(Exception, match=f"names stream {second}, which is not in option "
                                            f"'streams' \\({first}\\)"):
            spark.sql(f"SELECT * FROM {name} WITH ('streams' = '{first}', "
                      f"'startingOffsets' = '{starts}')").collect()
        with pytest.raises(Exception, match=f"names stream {second}, which is not in option "
                                            f"'streams' \\({first}\\)"):
            read(spark, pd, first, startingOffsets=starts).collect()
    with table(spark, f"narrowed_t_{first}", f"USING sbp OPTIONS (pd '{pd}', streams "
                                             f"'{first},{second}', startingOffsetsByTimestamp "
                                             f"'{by_time}', startingOffsetsByTimestampStrategy "
                                             "'latest')") as name:
        # The start of `first` was positioned by no time: the strategy goes with the times.
        assert spark.sql(f"SELECT count(*) FROM {name} WITH ('streams' = '{first}')"
                         ).first()[0] == 3


def test_a_table_keeps_the_case_merge_of_merge_schema(spark, pd, sbp_client, tmp_path):
    # CREATE TABLE with mergeSchema took `id` and `ID` for one column (Spark's default,
    # spark.sql.caseSensitive=false), but the table did not record that merge: a session with
    # caseSensitive=true then read the `ID` batch's values as nulls without a word, where the
    # same read through spark.read fails naming the pair.
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([1], pa.int64())}))
    append_arrow(sbp_client, sid, pa.record_batch({"ID": pa.array([2], pa.int64()),
                                                   "v": pa.array(["x"])}))
    with table(spark, f"folded_{sid}", f"USING sbp OPTIONS (pd '{pd}', stream '{sid}', "
                                       "payload 'arrow', mergeSchema 'true')") as name:
        assert [r.col_name for r in spark.sql(f"DESCRIBE TABLE {name}").collect()] == [
            "id", "v", "stream_id", "offset", "timestamp"]
        rows = spark.sql(f"SELECT id, v FROM {name} ORDER BY offset").collect()
        assert [(r.id, r.v) for r in rows] == [(1, None), (2, "x")]
        spark.conf.set("spark.sql.caseSensitive", "true")
        try:
            with pytest.raises(Exception, match=r"'id' and 'ID'.*spark.sql.caseSensitive=true.*"
                                                r"CREATE TEMPORARY VIEW v"):
                spark.table(name).collect()
            query = (spark.readStream.option("startingOffsets", "earliest").table(name)
                     .writeStream.format("memory").queryName(f"folded_{sid}")
                     .option("checkpointLocation", str(tmp_path / "chk"))
                     .trigger(availableNow=True).start())
            try:
                with pytest.raises(Exception, match=r"'id' and 'ID'"):
                    query.awaitTermination(120)
            finally:
                query.stop()
        finally:
            spark.conf.unset("spark.sql.caseSensitive")
