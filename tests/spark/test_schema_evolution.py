"""payload=arrow streams whose schema evolves: resolution, inference and the writer guard, with
a real local[2] Spark against the embedded cluster."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pyarrow as pa
import pytest
from pyspark.sql import types as spark_types

from sbp_spark.spark.streaming.sink import stream_writer

from .streaming.helpers import append_arrow, arrow_read

UTC = dt.timezone.utc
MIDNIGHT_2024_02_29_US = int(dt.datetime(2024, 2, 29, tzinfo=UTC).timestamp()) * 1_000_000


def new_stream(client) -> int:
    return client.create_streams(1)[0].stream_id


def write_arrow(df, pd, sid, **options):
    writer = (df.coalesce(1).write.format("sbp").option("pd", pd).option("stream", str(sid))
              .option("payload", "arrow"))
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.mode("append").save()


def data_fields(df):
    return [(f.name, f.dataType.simpleString(), f.nullable) for f in df.schema.fields
            if f.name not in ("stream_id", "offset", "timestamp")]


def rows(df, *columns):
    return [tuple(r) for r in df.orderBy("offset").select(*columns).collect()]


def test_a_stream_outlives_its_first_schema(spark, pd, sbp_client):
    """The issue's case: written as (id int, name), then with score, then with long ids."""
    sid = new_stream(sbp_client)
    write_arrow(spark.createDataFrame([(1, "a"), (2, "b")], "id int, name string"), pd, sid)
    sbp_client.seal_range(sid)  # later schemas live in a second range
    write_arrow(spark.createDataFrame([(3, "c", 0.5)], "id int, name string, score double"),
                pd, sid)
    write_arrow(spark.createDataFrame([(2**40, "d", 1.5)],
                                      "id long, name string, score double"), pd, sid)

    # inferred from the newest batch (nullable), and every older batch resolves to it
    df = arrow_read(spark, pd, sid)
    assert data_fields(df) == [("id", "bigint", True), ("name", "string", True),
                               ("score", "double", True)]
    assert rows(df, "id", "name", "score") == [(1, "a", None), (2, "b", None), (3, "c", 0.5),
                                               (2**40, "d", 1.5)]
    # the wider schema given by the user reads the oldest batches too
    given = arrow_read(spark, pd, sid, "id BIGINT, score DOUBLE, offset BIGINT")
    assert rows(given, "id", "score") == [(1, None), (2, None), (3, 0.5), (2**40, 1.5)]

    # a newest batch without score: the default inference no longer sees it, mergeSchema does
    write_arrow(spark.createDataFrame([(5, "e")], "id long, name string"), pd, sid)
    assert data_fields(arrow_read(spark, pd, sid)) == [("id", "bigint", True),
                                                       ("name", "string", True)]
    merged = arrow_read(spark, pd, sid, mergeSchema="true")
    assert data_fields(merged) == [("id", "bigint", True), ("name", "string", True),
                                   ("score", "double", True)]
    assert rows(merged, "id", "score") == [(1, None), (2, None), (3, 0.5), (2**40, 1.5),
                                           (5, None)]

    # the old schema given explicitly: the long ids do not fit an int, and nothing is truncated
    with pytest.raises(Exception, match=rf"stream {sid} offset 3: the stored batch does not "
                                        r"fit the read schema: column 'id' is int64 in the "
                                        r"stored batch but int32 in the read schema: a "
                                        r"narrowing"):
        arrow_read(spark, pd, sid, "id INT, name STRING").collect()


def test_nested_fields_that_spark_wrote_as_not_null_evolve_like_top_level_columns(
        spark, pd, sbp_client):
    """Spark marks struct fields, array elements and map values built from non-null
    expressions NOT NULL. A struct that gains such a field, or whose field stops being null,
    must still read its older batches with the inferred schema, and pass the writer guard."""
    sid = new_stream(sbp_client)
    write_arrow(spark.sql("SELECT 1 AS id, named_struct('a', CAST(NULL AS INT)) AS st, "
                          "array(CAST(NULL AS INT)) AS l"), pd, sid)
    write_arrow(spark.sql("SELECT 2 AS id, named_struct('a', 2) AS st, array(2) AS l"), pd, sid)
    write_arrow(spark.sql("SELECT 3 AS id, named_struct('a', 3, 'b', 'x') AS st, array(3) AS l, "
                          "map('k', 3) AS m"), pd, sid, schemaCompatibility="backward")

    df = arrow_read(spark, pd, sid)
    assert df.schema["st"].dataType.simpleString() == "struct<a:int,b:string>"
    assert [f.nullable for f in df.schema["st"].dataType.fields] == [True, True]
    assert df.schema["l"].dataType.containsNull and df.schema["m"].dataType.valueContainsNull
    got = [row.asDict(recursive=True) for row in df.orderBy("offset").select(
        "id", "st", "l", "m").collect()]
    assert got == [
        {"id": 1, "st": {"a": None, "b": None}, "l": [None], "m": None},
        {"id": 2, "st": {"a": 2, "b": None}, "l": [2], "m": None},
        {"id": 3, "st": {"a": 3, "b": "x"}, "l": [3], "m": {"k": 3}}]


def test_data_columns_named_like_metadata_are_null_where_older_batches_lack_them(
        spark, pd, sbp_client):
    """A stream gains columns that happen to be called 'timestamp' (epoch ms, a bigint) and
    'offset' (a string). They are data: the batches written before them read them as nulls,
    never as the record's time or offset cast to the data's type."""
    sid = new_stream(sbp_client)
    write_arrow(spark.sql("SELECT 1 AS a"), pd, sid)
    write_arrow(spark.sql("SELECT 2 AS a, 1700000000000L AS timestamp, 'UTC+2' AS offset"),
                pd, sid)
    expected = [(1, None, None), (2, 1_700_000_000_000, "UTC+2")]
    inferred = arrow_read(spark, pd, sid)
    assert inferred.columns == ["a", "timestamp", "offset", "stream_id"]
    assert sorted(tuple(r) for r in inferred.select("a", "timestamp", "offset").collect()
                  ) == expected
    given = arrow_read(spark, pd, sid, "a INT, timestamp BIGINT, offset STRING")
    assert sorted(tuple(r) for r in given.collect()) == expected
    # a given type that is not the metadata column's: data too, never the time cast to it
    day = arrow_read(spark, pd, sid, "a INT, timestamp DATE", endingOffsets=f'{{"{sid}": 1}}')
    assert [tuple(r) for r in day.collect()] == [(1, None)]


def test_a_given_schema_pushes_no_filter_on_columns_that_may_be_data(spark, pd, sbp_client):
    """With .schema(...), 'offset' is data in the batches that store such a column and the
    record's offset in the others, and which batches store one is not known when the read is
    planned, so a filter on it cannot choose the offsets fetched: the source leaves it to
    Spark, which keeps the rows whose column passes (pushed, it would return (1, 5))."""
    sid = new_stream(sbp_client)
    write_arrow(spark.sql("SELECT 1 AS a, 5L AS offset"), pd, sid)  # record offset 0
    write_arrow(spark.sql("SELECT 2 AS a, 0L AS offset"), pd, sid)  # record offset 1
    df = arrow_read(spark, pd, sid, "a INT, offset BIGINT").where("offset < 1")
    plan = df._jdf.queryExecution().explainString(
        spark._jvm.org.apache.spark.sql.execution.ExplainMode.fromString("formatted"))
    assert "LessThan(offset" not in plan
    assert [tuple(r) for r in df.collect()] == [(2, 0)]
    # the inferred schema knows 'offset' is data: nothing of it is pushed either
    assert [r.a for r in arrow_read(spark, pd, sid).where("offset < 1").collect()] == [2]


def test_a_given_schema_reads_offset_as_data_or_metadata_per_batch(spark, pd, sbp_client):
    """A batch without an 'offset' column gives the record's offset, one with it its data,
    however small the batches (small ones are combined into one output batch: that read
    failed, 'is data in some batches and metadata in others', while large ones passed)."""
    sid = new_stream(sbp_client)
    write_arrow(spark.sql("SELECT 1 AS a"), pd, sid)  # record offset 0
    write_arrow(spark.sql("SELECT 2 AS a, 42L AS offset"), pd, sid)  # record offset 1
    got = arrow_read(spark, pd, sid, "a INT, offset BIGINT").orderBy("a").collect()
    assert [tuple(r) for r in got] == [(1, 0), (2, 42)]


def test_merge_schema_fails_clearly_on_unrelated_types(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([1], pa.int32())}))
    sbp_client.seal_range(sid)
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array(["x"])}))
    with pytest.raises(Exception, match=rf"mergeSchema cannot union the schema of stream {sid} "
                                        r"offset 1 with the batches before it: column 'id' is "
                                        r"int32 in one batch and string in another"):
        arrow_read(spark, pd, sid, mergeSchema="true")  # inference fails at load()
    # the newest batch alone infers fine; reading the older batch then names the problem
    with pytest.raises(Exception, match=rf"stream {sid} offset 0: .*column 'id' is int32 in the "
                                        r"stored batch but string in the read schema: "
                                        r"unrelated types"):
        arrow_read(spark, pd, sid).collect()


OLD = pa.record_batch({
    "i8": pa.array([-128], pa.int8()),
    "i16": pa.array([-32768], pa.int16()),
    "i32": pa.array([-2**31], pa.int32()),
    "f": pa.array([1.5], pa.float32()),
    "dec": pa.array([Decimal("-999.99")], pa.decimal128(5, 2)),
    "day": pa.array([dt.date(2024, 2, 29)], pa.date32()),
    "s": pa.array(["é"], pa.large_string()),
    "b": pa.array([b"\x00\xff"], pa.large_binary()),
    "ts": pa.array([1_700_000_000_123], pa.timestamp("ms", tz="UTC")),
    "tokyo": pa.array([1_700_000_000_000_000], pa.timestamp("us", tz="Asia/Tokyo")),
    "nothing": pa.nulls(1),
    "st": pa.array([{"x": 7, "gone": "g"}], pa.struct([("x", pa.int32()),
                                                       ("gone", pa.string())])),
    "l": pa.array([[{"a": 1}, {"a": -2}]], pa.list_(pa.struct([("a", pa.int16())]))),
    "m": pa.array([[("k", 2**31 - 1)]], pa.map_(pa.string(), pa.int32())),
    "gone": pa.array(["dropped"]),
})
NEW = pa.record_batch({
    "i8": pa.array([1], pa.int16()),
    "i16": pa.array([2], pa.int32()),
    "i32": pa.array([2**40], pa.int64()),
    "f": pa.array([0.1], pa.float64()),
    "dec": pa.array([Decimal("12345.678")], pa.decimal128(8, 3)),
    "day": pa.array([0], pa.timestamp("us", tz="UTC")),
    "s": pa.array(["t"]),
    "b": pa.array([b"u"]),
    "ts": pa.array([5], pa.timestamp("us", tz="UTC")),
    "tokyo": pa.array([6], pa.timestamp("us", tz="UTC")),
    "nothing": pa.array(["something"]),
    "st": pa.array([{"x": 2**40, "y": "new"}], pa.struct([("x", pa.int64()),
                                                         ("y", pa.string())])),
    "l": pa.array([[{"a": 3, "c": 0.5}]], pa.list_(pa.struct([("a", pa.int32()),
                                                              ("c", pa.float64())]))),
    "m": pa.array([[("k", 2**40)]], pa.map_(pa.string(), pa.int64())),
    "added": pa.array(["new"]),
})


def test_every_widening_rule_inside_and_outside_nested_types(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, OLD)
    append_arrow(sbp_client, sid, NEW)
    df = arrow_read(spark, pd, sid)
    assert [f[:2] for f in data_fields(df)] == [
        ("i8", "smallint"), ("i16", "int"), ("i32", "bigint"), ("f", "double"),
        ("dec", "decimal(8,3)"), ("day", "timestamp"), ("s", "string"), ("b", "binary"),
        ("ts", "timestamp"), ("tokyo", "timestamp"), ("nothing", "string"),
        ("st", "struct<x:bigint,y:string>"),
        ("l", "array<struct<a:int,c:double>>"), ("m", "map<string,bigint>"),
        ("added", "string")]
    got = df.orderBy("offset").selectExpr(
        "i8", "i16", "i32", "f", "dec", "unix_micros(day) AS day", "s", "b",
        "unix_micros(ts) AS ts", "unix_micros(tokyo) AS tokyo", "nothing", "st", "l", "m",
        "added").collect()
    old, new = (row.asDict(recursive=True) for row in got)
    assert old == {
        "i8": -128, "i16": -32768, "i32": -2**31, "f": 1.5, "dec": Decimal("-999.990"),
        "day": MIDNIGHT_2024_02_29_US, "s": "é", "b": bytearray(b"\x00\xff"),
        "ts": 1_700_000_000_123_000, "tokyo": 1_700_000_000_000_000, "nothing": None,
        "st": {"x": 7, "y": None},
        "l": [{"a": 1, "c": None}, {"a": -2, "c": None}], "m": {"k": 2**31 - 1},
        "added": None}
    assert new["i32"] == 2**40 and new["st"] == {"x": 2**40, "y": "new"}
    assert new["dec"] == Decimal("12345.678") and new["added"] == "new"


NARROWINGS = [
    ("big INT", "column 'big' is int64 in the stored batch but int32 in the read schema: "
                "a narrowing"),
    ("dbl FLOAT", "column 'dbl' is double in the stored batch but float in the read schema: "
                  "a narrowing"),
    ("dec DECIMAL(10,3)", r"column 'dec' is decimal128\(10, 2\) in the stored batch but "
                          r"decimal128\(10, 3\) in the read schema"),
    ("dec DECIMAL(9,2)", r"column 'dec' is decimal128\(10, 2\) in the stored batch but "
                         r"decimal128\(9, 2\) in the read schema: a narrowing"),
    ("txt BIGINT", "column 'txt' is string in the stored batch but int64 in the read schema: "
                   "unrelated types"),
    ("big STRING", "column 'big' is int64 in the stored batch but string in the read schema: "
                   "unrelated types"),
    ("big DOUBLE", "column 'big' is int64 in the stored batch but double in the read schema: "
                   "unrelated types"),
    ("ns TIMESTAMP", r"column 'ns' is timestamp\[ns, tz=UTC\] in the stored batch but "
                     r"timestamp\[us, tz=UTC\] in the read schema: a narrowing"),
    ("ts DATE", r"column 'ts' is timestamp\[us, tz=UTC\] in the stored batch but date32\[day\] "
                "in the read schema: a narrowing"),
    ("st STRUCT<a: INT>", "column 'st.a' is int64 in the stored batch but int32 in the read "
                          "schema: a narrowing"),
    ("l ARRAY<INT>", r"column 'l\[\]' is int64 in the stored batch but int32"),
    ("m MAP<STRING, INT>", r"column 'm\[value\]' is int64 in the stored batch but int32"),
    ("nul BIGINT NOT NULL", "column 'nul' holds 1 nulls but the read schema says it cannot be "
                            "null"),
    ("absent INT NOT NULL", "column 'absent' is missing from the stored batch and the read "
                            "schema says it cannot be null"),
]


@pytest.fixture(scope="module")
def narrow_stream(sbp_client):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({
        "big": pa.array([2**40, 1]), "dbl": pa.array([1e300, 1.0]),
        "dec": pa.array([Decimal("12345678.91"), None], pa.decimal128(10, 2)),
        "txt": pa.array(["12", "x"]),
        "ts": pa.array([1, 2], pa.timestamp("us", tz="UTC")),
        "ns": pa.array([1, 2], pa.timestamp("ns", tz="UTC")),
        "st": pa.array([{"a": 2**40}, None], pa.struct([("a", pa.int64())])),
        "l": pa.array([[2**40], []], pa.list_(pa.int64())),
        "m": pa.array([[("k", 2**40)], None], pa.map_(pa.string(), pa.int64())),
        "nul": pa.array([1, None], pa.int64()),
    }))
    return sid


@pytest.mark.parametrize(("read_schema", "message"), NARROWINGS)
def test_each_narrowing_is_refused_naming_stream_offset_column_and_types(
        spark, pd, narrow_stream, read_schema, message):
    with pytest.raises(Exception, match=rf"stream {narrow_stream} offset 0: .*{message}"):
        arrow_read(spark, pd, narrow_stream, read_schema).collect()


def test_writer_guard_refuses_what_readers_of_the_new_schema_cannot_read(
        spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    write_arrow(spark.createDataFrame([(1, "a")], "id long, name string"), pd, sid)

    def guarded(df):
        write_arrow(df, pd, sid, schemaCompatibility="backward")

    # compatible: a new column (read as nulls in the old batch), a dropped one, the same types
    guarded(spark.createDataFrame([(2, "b", 0.5)], "id long, name string, score double"))
    guarded(spark.sql("SELECT 3L AS id, 'c' AS name, 1.5D AS score"))  # non-null columns too
    guarded(spark.createDataFrame([("d",)], "name string"))
    # refused: id narrowed (the newest batch is the previous write: name only, so give it ids)
    write_arrow(spark.createDataFrame([(4, "e")], "id long, name string"), pd, sid)

    def count():
        return arrow_read(spark, pd, sid, "name STRING").count()

    before = count()
    with pytest.raises(Exception, match=rf"schemaCompatibility=backward refuses this write: "
                                        rf".*stream {sid} offset 4\): column 'id' is int64 in "
                                        r"the stored batch but int32 in the read schema"):
        guarded(spark.createDataFrame([(5, "f")], "id int, name string"))
    with pytest.raises(Exception, match=r"column 'name' is string in the stored batch but "
                                        r"int64 in the read schema: unrelated types"):
        guarded(spark.createDataFrame([(5, 6)], "id long, name long"))
    assert count() == before  # nothing was written

    # rows routed by their stream_id column: checked by the task before it appends
    routed = spark.createDataFrame([(sid, 7, "g")], "stream_id long, id int, name string")
    with pytest.raises(Exception, match=rf"stream {sid} offset 4\): column 'id' is int64"):
        (routed.coalesce(1).write.format("sbp").option("pd", pd).option("payload", "arrow")
         .option("schemaCompatibility", "backward").mode("append").save())
    assert count() == before
    # without the guard the narrowing write is stored, and readers of its schema (inferred
    # from it, the newest batch) cannot read the older batches
    write_arrow(spark.createDataFrame([(5, "f")], "id int, name string"), pd, sid)
    assert count() == before + 1
    with pytest.raises(Exception, match=rf"stream {sid} offset 0: .*column 'id' is int64"):
        arrow_read(spark, pd, sid).collect()

    # the streaming sink runs the same check when each micro-batch's writer is made
    narrowed = spark.createDataFrame([(1,)], "name int").schema
    options = {"pd": pd, "stream": str(sid), "payload": "arrow",
               "schemaCompatibility": "backward"}
    with pytest.raises(ValueError, match=r"column 'name' is string in the stored batch but "
                                         r"int32 in the read schema"):
        stream_writer(options, narrowed, False)
    assert stream_writer(options, spark.createDataFrame([(1,)], "id long").schema, False)


def test_another_writers_encodings_read_with_the_schema_inferred_from_them(spark, pd,
                                                                          sbp_client):
    """Arrow writers other than Spark store dictionary-encoded strings, fixed-size binaries and
    lists, and times of day in microseconds. Before, inference offered Spark's types for them
    (string, binary, array, time) and then refused the very batch it inferred them from as
    'unrelated types'; each holds the same values as the inferred type, so it is read."""
    sid = new_stream(sbp_client)
    columns = {
        "label": pa.array(["a", None, "a"]).dictionary_encode(),
        "digest": pa.array([b"ab", None, b"cd"], pa.binary(2)),
        "pair": pa.array([[1, 2], None, [3, None]], pa.list_(pa.int32(), 2)),
        "at": pa.array([1, None, 86_399_999_999], pa.time64("us")),
    }
    fields = [("label", "string", True), ("digest", "binary", True),
              ("pair", "array<int>", True), ("at", "time(6)", True)]
    expected = [("a", bytearray(b"ab"), [1, 2], dt.time(0, 0, 0, 1)),
                (None, None, None, None),
                ("a", bytearray(b"cd"), [3, None], dt.time(23, 59, 59, 999_999))]
    if not hasattr(spark_types, "TimeType"):  # Spark's TIME type came with pyspark 4.1
        del columns["at"]
        fields, expected = fields[:3], [row[:3] for row in expected]
    append_arrow(sbp_client, sid, pa.record_batch(columns))
    df = arrow_read(spark, pd, sid)
    assert data_fields(df) == fields
    assert rows(df, *columns) == expected
    # mergeSchema unions the encoded column with a plain one
    append_arrow(sbp_client, sid, pa.record_batch({"label": pa.array(["b"], pa.large_string())}))
    merged = arrow_read(spark, pd, sid, mergeSchema="true")
    assert [r.label for r in merged.orderBy("offset").collect()] == ["a", None, "a", "b"]
