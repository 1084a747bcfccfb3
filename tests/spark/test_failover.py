"""Reading while a range server is down: a replica serves the read, or the error says who failed.

Uses its own cluster, since it stops servers.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql import functions as F

from sbp_spark.client import SbpClient
from sbp_spark.protocol.records import encode_arrow_batch, make_records_batch


@pytest.fixture()
def cluster(tmp_path):
    from sbp_spark.server.cluster import EmbeddedCluster

    with EmbeddedCluster(str(tmp_path / "failover"), range_servers=3) as running:
        yield running


def fill(client: SbpClient, replicas: int, primary: str | None = None,
         rows: int = 5000) -> tuple[int, str]:
    """A new stream holding ``rows`` records (on ``primary`` when given); returns it and its
    primary's address."""
    for _ in range(20):
        sid = client.create_streams(1, replicas=replicas)[0].stream_id
        (rng,) = client.list_ranges(sid)
        if primary is None or rng.primary.advertise_addr == primary:
            break
    else:
        pytest.fail(f"the PD placed no new stream on {primary}")
    assert len(rng.servers) == replicas
    batch = make_records_batch(pa.array([f"v{i}".encode() for i in range(rows)]))
    client.open_stream(sid).append([encode_arrow_batch(batch, 1000)])
    return sid, rng.primary.advertise_addr


def test_read_falls_back_to_a_replica_or_names_the_dead_server(spark, cluster):
    client = SbpClient(cluster.pd_address)
    replicated, victim = fill(client, replicas=2)
    single, _ = fill(client, replicas=1, primary=victim)
    sealed, _ = fill(client, replicas=1, primary=victim)
    # range 0's end is now known to the PD, so planning needs no range server for it; the new
    # open range must live elsewhere (its end is asked of its primary)
    for _ in range(20):
        if client.seal_range(sealed).primary.advertise_addr != victim:
            break
    cluster.stop_range_server(cluster.range_server_addresses.index(victim))

    def read(stream_id):
        return (spark.read.format("sbp").option("pd", cluster.pd_address)
                .option("streams", str(stream_id)).option("retries", "1").load())

    # the primary is gone; its replica serves planning (the open range's end) and the read
    row = read(replicated).agg(F.count("*").alias("n"), F.max("offset").alias("hi")).collect()[0]
    assert (row.n, row.hi) == (5000, 4999)

    # no replica left: planning (open range) or the task (sealed range) fails, naming the
    # range, its servers and the cause
    with pytest.raises(Exception, match=rf"open range 0 of stream {single} ends: none of its "
                                        rf"range servers answered \({victim} \(primary"):
        read(single).collect()
    with pytest.raises(Exception, match=rf"reading stream {sealed} range 0 offsets \[0, 5000\) "
                                        rf"failed.*\({victim} \(primary\)\).*"
                                        "cannot connect"):
        read(sealed).collect()


def test_history_reads_while_the_open_range_is_down(spark, cluster):
    """A read that ends before the open range needs only the servers of the ranges it reads:
    while the open range's only server is down, it reads them (and infers a payload=arrow
    schema from them); a read that would need the open range still fails naming it."""
    client = SbpClient(cluster.pd_address)

    def take_down_open_range(stream_id: int) -> None:
        holder = client.list_ranges(stream_id)[0].primary.advertise_addr
        for _ in range(20):
            if client.seal_range(stream_id).primary.advertise_addr != holder:
                break
        else:
            pytest.fail(f"the PD kept opening stream {stream_id}'s ranges on {holder}")
        down = client.list_ranges(stream_id)[-1].primary.advertise_addr
        cluster.stop_range_server(cluster.range_server_addresses.index(down))

    def read(stream_id, end, payload="records"):
        return (spark.read.format("sbp").option("pd", cluster.pd_address)
                .option("streams", str(stream_id)).option("retries", "1")
                .option("payload", payload)
                .option("endingOffsets", f'{{"{stream_id}": {end}}}').load())

    sid, _ = fill(client, replicas=1)
    take_down_open_range(sid)
    row = read(sid, 5000).agg(F.count("*").alias("n"), F.countDistinct("offset").alias("d"),
                              F.max("offset").alias("hi")).collect()[0]
    assert (row.n, row.d, row.hi) == (5000, 5000, 4999)
    assert read(sid, 1200).where("offset >= 1000").count() == 200
    # past the open range's start the read needs it: planning says which range is down
    with pytest.raises(Exception, match=rf"open range 1 of stream {sid} ends: none of its "
                                        "range servers answered"):
        read(sid, 5001).collect()

    typed = client.create_streams(1)[0].stream_id
    table = pa.record_batch({"n": pa.array(range(100), pa.int64())})
    client.open_stream(typed).append([encode_arrow_batch(table, 1000)])
    take_down_open_range(typed)
    arrow = read(typed, 100, "arrow")
    assert arrow.columns[:1] == ["n"]
    assert arrow.agg(F.sum("n")).collect()[0][0] == sum(range(100))
