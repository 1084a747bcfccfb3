"""payload=arrow column names match as Spark's parquet source matches them: ignoring case
unless the session sets spark.sql.caseSensitive=true, and an error when a name is ambiguous."""

from __future__ import annotations

from contextlib import contextmanager

import pyarrow as pa
import pytest
from chispa import assert_df_equality

from .streaming.helpers import append_arrow, arrow_read, new_stream


@contextmanager
def case_sensitive(spark):
    spark.conf.set("spark.sql.caseSensitive", "true")
    try:
        yield
    finally:
        spark.conf.unset("spark.sql.caseSensitive")


def test_a_read_schema_matches_stored_columns_ignoring_case(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({
        "Amount": pa.array([5, 6], pa.int32()),
        "Info": pa.array([{"Code": "x"}, {"Code": "y"}], pa.struct([("Code", pa.string())])),
    }))
    df = arrow_read(spark, pd, sid, "amount BIGINT, info STRUCT<code: STRING>")
    expected = spark.createDataFrame([(5, ("x",)), (6, ("y",))],
                                     "amount BIGINT, info STRUCT<code: STRING>")
    assert_df_equality(df, expected, ignore_row_order=True)
    with case_sensitive(spark):  # as parquet: exact names only
        assert [tuple(r) for r in arrow_read(spark, pd, sid, "amount BIGINT").collect()] == [
            (None,), (None,)]


def test_merge_schema_takes_names_differing_only_by_case_for_one_column(spark, pd,
                                                                         sbp_client):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"ID": pa.array([1], pa.int64())}))
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([2], pa.int64())}))
    df = arrow_read(spark, pd, sid, mergeSchema="true")
    assert [f.name for f in df.schema.fields] == ["ID", "stream_id", "offset", "timestamp"]
    assert [r.ID for r in df.orderBy("offset").collect()] == [1, 2]

    with case_sensitive(spark):  # the schema was inferred for case-insensitive reads
        with pytest.raises(Exception, match=r"'ID' and 'id'.*spark.sql.caseSensitive=true"):
            arrow_read(spark, pd, sid, mergeSchema="true").collect()


def test_an_ambiguous_match_fails_naming_the_columns(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"ID": pa.array([1], pa.int64()),
                                                   "id": pa.array([2], pa.int64())}))
    with pytest.raises(Exception, match=r"column 'id' of the read schema matches columns "
                                         r"'ID', 'id' of the stored batch"):
        arrow_read(spark, pd, sid, "id BIGINT").collect()
    with pytest.raises(Exception, match=r"columns 'ID' and 'id' of the read schema differ "
                                         r"only by case"):
        arrow_read(spark, pd, sid).collect()
    with case_sensitive(spark):
        assert [tuple(r) for r in arrow_read(spark, pd, sid).select("ID", "id").collect()] == [
            (1, 2)]
        assert [r.id for r in arrow_read(spark, pd, sid, "id BIGINT").collect()] == [2]


def test_a_data_column_spelled_like_a_metadata_column_replaces_it(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"Offset": pa.array([7], pa.int64())}))
    df = arrow_read(spark, pd, sid)
    assert df.columns == ["Offset", "stream_id", "timestamp"]
    assert [r.Offset for r in df.collect()] == [7]


def test_the_writer_guard_matches_names_as_default_readers_do(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"id": pa.array([1], pa.int64())}))

    def guarded(ddl, row):
        (spark.createDataFrame([row], ddl).coalesce(1).write.format("sbp").option("pd", pd)
         .option("stream", str(sid)).option("payload", "arrow")
         .option("schemaCompatibility", "backward").mode("append").save())

    # readers of 'ID int' read the stored 'id' as ID: a narrowing, refused
    with pytest.raises(Exception, match=r"column 'ID' is int64 in the stored batch but int32"):
        guarded("ID INT", (2,))
    guarded("ID BIGINT", (2,))
    # a newest batch with both spellings is read by case-sensitive readers only: the same
    # columns again pass (written where the setting allows such columns)
    append_arrow(sbp_client, sid, pa.record_batch({"ID": pa.array([3], pa.int64()),
                                                   "id": pa.array([4], pa.int64())}))
    with case_sensitive(spark):
        guarded("ID BIGINT, id BIGINT", (5, 6))


def test_a_streaming_read_matches_names_as_its_session_says(spark, pd, sbp_client, tmp_path):
    from .streaming.helpers import drain_to_memory
    from .streaming.test_stream_schema import arrow_stream

    sid = new_stream(sbp_client)
    append_arrow(sbp_client, sid, pa.record_batch({"Amount": pa.array([5], pa.int64())}))
    drain_to_memory(arrow_stream(spark, pd, sid, "amount BIGINT"), f"amounts_{sid}",
                    tmp_path / "ci")
    assert [r.amount for r in spark.table(f"amounts_{sid}").collect()] == [5]
    with case_sensitive(spark):  # the setting reaches the micro-batches' tasks
        drain_to_memory(arrow_stream(spark, pd, sid, "amount BIGINT"), f"exact_{sid}",
                        tmp_path / "cs")
        assert [r.amount for r in spark.table(f"exact_{sid}").collect()] == [None]


def test_a_write_of_columns_differing_only_by_case_is_refused_as_parquet_does(
        spark, pd, sbp_client):
    """Before, it was stored, and every read with Spark's default setting then failed on it."""
    sid = new_stream(sbp_client)
    df = spark.createDataFrame([(1, 2)], "ID INT, id INT")

    def write():
        (df.coalesce(1).write.format("sbp").option("pd", pd).option("stream", str(sid))
         .option("payload", "arrow").mode("append").save())

    with pytest.raises(Exception, match=r"columns 'ID' and 'id' differ only by case"):
        write()
    assert arrow_read(spark, pd, sid, "ID INT").count() == 0  # nothing was stored
    with case_sensitive(spark):
        write()
        assert [tuple(r) for r in arrow_read(spark, pd, sid).select("ID", "id").collect()] == [
            (1, 2)]
