"""``sbp_spark.register(spark)`` as users call it: no filter pushdown, and so no plan of one
query reused for another.

pyspark (4.3.0) keeps what a Python source planned with pushed filters on the source's relation
and hands it to later scans of that relation: a DataFrame counted with a filter and then
without counted the filtered rows twice over, and a union of two filtered scans of one
DataFrame returned the second scan's rows twice. The default registration pushes nothing, so
every scan reads what it asks for; pushdown is ``register(spark, filter_pushdown=True)``.
"""

from __future__ import annotations

import contextlib
import io

import pytest

import sbp_spark

from .test_batch import append_values, new_stream, read


@pytest.fixture(scope="module")
def default_session(spark):
    """A session of the test SparkContext set up as the README says: ``register(spark)``."""
    session = spark.newSession()
    sbp_spark.register(session)
    yield session
    spark.sql("SELECT 1").collect()  # leave the fixture's own session the active one


@pytest.fixture(scope="module")
def stream_200(sbp_client):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, [f"v{i}".encode() for i in range(200)])
    return sid


def test_a_dataframe_queried_with_and_without_a_filter_reads_each_time_what_it_asks(
        default_session, pd, stream_200):
    df = read(default_session, pd, stream_200)
    assert df.where("offset < 3").count() == 3
    assert df.count() == 200
    both = df.where("offset < 3").union(df.where("offset >= 190"))
    assert sorted(r.offset for r in both.collect()) == [0, 1, 2, *range(190, 200)]


def test_a_view_scanned_with_different_filters_reads_each_time_what_it_asks(
        default_session, pd, stream_200):
    read(default_session, pd, stream_200).createOrReplaceTempView("default_pushdown_view")
    sql = default_session.sql
    assert sql("SELECT count(*) FROM default_pushdown_view WHERE offset < 3").first()[0] == 3
    assert sql("SELECT count(*) FROM default_pushdown_view").first()[0] == 200
    rows = sql("SELECT offset FROM default_pushdown_view WHERE offset < 3 UNION ALL "
               "SELECT offset FROM default_pushdown_view WHERE offset >= 195").collect()
    assert sorted(r.offset for r in rows) == [0, 1, 2, 195, 196, 197, 198, 199]


def test_the_default_registration_pushes_no_filter(default_session, pd, stream_200):
    assert default_session.conf.get("spark.sql.python.filterPushdown.enabled", "false") != "true"
    plan = io.StringIO()
    with contextlib.redirect_stdout(plan):
        read(default_session, pd, stream_200).where("offset >= 120").explain("formatted")
    assert "PushedFilters" not in plan.getvalue()
