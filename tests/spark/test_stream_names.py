"""Streams by name in the connector: options 'stream' and 'streams' with names and ids mixed,
'streamPattern' and streams '*' planned at the read, the stream_name column of writes,
createIfMissing by name, and SQL tables naming their streams by name or pattern."""

from __future__ import annotations

import uuid

import pytest
from pyspark.sql import functions as F

from sbp_spark.client import SbpClient
from sbp_spark.protocol.errors import SbpTimeoutError
from sbp_spark.protocol.messages import Stream
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.spark.options import StreamSelection
from sbp_spark.spark.stream_names import Discovery

from .streaming.helpers import append_values, stored_values
from .test_tables import column_lists, table  # noqa: F401 (column_lists: a fixture)


@pytest.fixture
def prefix() -> str:
    """Names of this test's own (the cluster is shared by the whole session)."""
    return f"t{uuid.uuid4().hex[:8]}"


def values(df) -> list[str]:
    return sorted(r.v for r in df.selectExpr("CAST(value AS STRING) AS v").collect())


def test_streams_by_name_and_id_mixed(spark, pd, sbp_client, prefix):
    orders = sbp_client.create_stream(f"{prefix}-orders").stream_id
    plain = sbp_client.create_streams(1)[0].stream_id
    append_values(sbp_client, orders, ["o1", "o2"])
    append_values(sbp_client, plain, ["p1"])
    df = (spark.read.format("sbp").option("pd", pd)
          .option("streams", f"{prefix}-orders,{plain}").load())
    assert values(df) == ["o1", "o2", "p1"]
    assert {r.stream_id for r in df.select("stream_id").collect()} == {orders, plain}
    # Positions per stream name the streams by id.
    df = (spark.read.format("sbp").option("pd", pd).option("streams", f"{prefix}-orders")
          .option("startingOffsets", f'{{"{orders}": 1}}').load())
    assert values(df) == ["o2"]
    with pytest.raises(Exception, match=f"names stream {plain}, which is not one of the "
                                        f"streams read"):
        (spark.read.format("sbp").option("pd", pd).option("streams", f"{prefix}-orders")
         .option("startingOffsets", f'{{"{plain}": 0}}').load().collect())
    with pytest.raises(Exception, match=f"'{prefix}-nothing'.*does not exist"):
        (spark.read.format("sbp").option("pd", pd)
         .option("streams", f"{prefix}-orders,{prefix}-nothing").load().collect())


def test_a_pattern_read_plans_the_streams_matching_at_planning(spark, pd, sbp_client,
                                                              prefix):
    eu = sbp_client.create_stream(f"{prefix}-orders-eu").stream_id
    us = sbp_client.create_stream(f"{prefix}-orders-us").stream_id
    other = sbp_client.create_stream(f"{prefix}-clicks").stream_id
    for sid, value in ((eu, "eu"), (us, "us"), (other, "click")):
        append_values(sbp_client, sid, [value])
    def load():
        return (spark.read.format("sbp").option("pd", pd)
                .option("streamPattern", f"{prefix}-orders-.*").load())

    assert values(load()) == ["eu", "us"]
    # Matched when the read is planned: a stream created since is in the next read.
    late = sbp_client.create_stream(f"{prefix}-orders-jp").stream_id
    append_values(sbp_client, late, ["jp"])
    assert values(load()) == ["eu", "jp", "us"]
    nothing = (spark.read.format("sbp").option("pd", pd)
               .option("streamPattern", f"{prefix}-none-.*").load())
    assert nothing.count() == 0


def test_every_stream(spark, tmp_path):
    with EmbeddedCluster(str(tmp_path / "c"), range_servers=1) as cluster:
        client = SbpClient(cluster.pd_address)
        named = client.create_stream("a-name").stream_id
        (plain,) = (s.stream_id for s in client.create_streams(1))
        append_values(client, named, ["n"])
        append_values(client, plain, ["p"])
        df = (spark.read.format("sbp").option("pd", cluster.pd_address)
              .option("streams", "*").load())
        assert values(df) == ["n", "p"]


def test_writes_by_name_stream_name_column_and_create_by_name(spark, pd, sbp_client, prefix):
    def write(df, **options):
        writer = df.coalesce(1).write.format("sbp").option("pd", pd).mode("append")
        for key, value in options.items():
            writer = writer.option(key, value)
        writer.save()

    target = sbp_client.create_stream(f"{prefix}-target").stream_id
    rows = spark.createDataFrame([("a",), ("b",)], "value string")
    write(rows, stream=f"{prefix}-target")
    assert stored_values(sbp_client, target) == ["a", "b"]

    with pytest.raises(Exception, match=f"'{prefix}-new'.*does not exist"):
        write(rows, stream=f"{prefix}-new")
    write(rows, stream=f"{prefix}-new", createIfMissing="true")
    created = sbp_client.describe_stream(f"{prefix}-new").stream_id
    assert stored_values(sbp_client, created) == ["a", "b"]
    # createIfMissing finds the stream it made before instead of making another.
    write(rows, stream=f"{prefix}-new", createIfMissing="true")
    assert stored_values(sbp_client, created) == ["a", "b", "a", "b"]

    routed = spark.createDataFrame(
        [(f"{prefix}-target", "t1"), (f"{prefix}-new", "n1"), (f"{prefix}-target", "t2")],
        "stream_name string, value string")
    write(routed)
    assert stored_values(sbp_client, target) == ["a", "b", "t1", "t2"]
    assert stored_values(sbp_client, created)[-1] == "n1"
    # A name no stream has fails the write, unless createIfMissing makes it.
    missing = spark.createDataFrame([(f"{prefix}-made", "m1")], "stream_name string, value string")
    with pytest.raises(Exception, match=f"stream_name '{prefix}-made', which no stream has"):
        write(missing)
    write(missing, createIfMissing="true")
    assert stored_values(sbp_client, sbp_client.stream_id(f"{prefix}-made")) == ["m1"]
    # Rows route only to the streams of option 'streams', named or by id.
    with pytest.raises(Exception, match="not one of the streams"):
        write(routed, streams=f"{prefix}-target,{sbp_client.create_streams(1)[0].stream_id}")
    with pytest.raises(Exception, match="both a stream_id and a stream_name"):
        write(routed.withColumn("stream_id", F.lit(target)))


@pytest.mark.usefixtures("column_lists")
def test_sql_tables_by_name_and_pattern(spark, pd, sbp_client, prefix):
    orders = sbp_client.create_stream(f"{prefix}-orders").stream_id
    append_values(sbp_client, orders, ["o1"])
    name = f"orders_{prefix}"
    with table(spark, name, f"USING sbp OPTIONS (pd '{pd}', streams '{prefix}-orders')"):
        spark.sql(f"INSERT INTO {name} (value) VALUES (CAST('o2' AS BINARY))")
        assert [r.v for r in spark.sql(f"SELECT CAST(value AS STRING) v FROM {name} "
                                       "ORDER BY offset").collect()] == ["o1", "o2"]
    assert stored_values(sbp_client, orders) == ["o1", "o2"]
    all_orders = f"all_{prefix}"
    other = sbp_client.create_stream(f"{prefix}-orders-2").stream_id
    append_values(sbp_client, other, ["x1"])
    with table(spark, all_orders,
               f"USING sbp OPTIONS (pd '{pd}', streamPattern '{prefix}-orders.*')"):
        assert [r.v for r in spark.sql(f"SELECT CAST(value AS STRING) v FROM {all_orders} "
                                       "ORDER BY v").collect()] == ["o1", "o2", "x1"]


class _Directory:
    """Live streams as the PD would list them; ``down`` makes the listing fail."""

    def __init__(self, streams: dict[int, str]) -> None:
        self.streams = streams
        self.listings = 0
        self.down = False

    def list_streams(self):
        self.listings += 1
        if self.down:
            raise SbpTimeoutError("the PD did not answer")
        return [Stream(stream_id=sid, name=name) for sid, name in sorted(self.streams.items())]

    def describe_streams(self, ids):
        raise AssertionError("a pattern lists the streams, it looks none up")


def test_discovery_lists_at_most_every_interval_and_rides_out_a_failed_listing():
    now = [0.0]
    directory = _Directory({1: "orders-eu", 2: "clicks", 3: ""})
    discovery = Discovery(StreamSelection(pattern="orders-.*"), 1_000, clock=lambda: now[0])
    assert discovery.streams(directory, ["pd"]) == [1]
    directory.streams[4] = "orders-us"
    now[0] = 0.5
    assert discovery.streams(directory, ["pd"]) == [1] and directory.listings == 1
    now[0] = 1.0
    assert discovery.streams(directory, ["pd"]) == [1, 4] and directory.listings == 2
    directory.down, now[0] = True, 2.5
    assert discovery.streams(directory, ["pd"]) == [1, 4]  # the last answer, with a warning
    directory.down, now[0] = False, 3.5
    del directory.streams[1]
    assert discovery.streams(directory, ["pd"]) == [4]
    every = Discovery(StreamSelection(every=True), 0)
    assert every.streams(directory, ["pd"]) == [2, 3, 4]
    with pytest.raises(SbpTimeoutError):  # no answer yet to fall back on
        directory.down = True
        Discovery(StreamSelection(every=True), 0).streams(directory, ["pd"])


def test_a_streaming_write_creates_its_named_stream_once(spark, pd, sbp_client, prefix,
                                                         tmp_path):
    source = sbp_client.create_stream(f"{prefix}-in").stream_id
    append_values(sbp_client, source, ["s1", "s2"])

    def relay(checkpoint):
        query = (spark.readStream.format("sbp").option("pd", pd)
                 .option("streams", f"{prefix}-in").option("startingOffsets", "earliest").load()
                 .selectExpr("value").writeStream.format("sbp").option("pd", pd)
                 .option("stream", f"{prefix}-out").option("createIfMissing", "true")
                 .option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        query.awaitTermination(120)
        assert query.exception() is None

    relay(tmp_path / "ck")
    out = sbp_client.describe_stream(f"{prefix}-out").stream_id
    assert sorted(stored_values(sbp_client, out)) == ["s1", "s2"]
    append_values(sbp_client, source, ["s3"])
    relay(tmp_path / "ck")  # the stream exists now: found by its name, not made again
    assert sorted(stored_values(sbp_client, out)) == ["s1", "s2", "s3"]
    assert [s.stream_id for s in sbp_client.list_streams() if s.name == f"{prefix}-out"] == [out]
