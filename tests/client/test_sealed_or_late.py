"""A RANGE_SEALED from the primary of the range the PD lists open means one of two things: the
primary has not heard of that range yet (the PD records a range before it tells its servers,
so the refusal was about the range before), or the primary sealed the range itself (a replica
failed to store a batch) and the PD has not recorded it. The first must not end the range: a
writer that took it for a seal had the PD seal the new range empty and open yet another,
which in a partition could land on the very server the writer had just given up on (seen in
the fault case "writer cut off from the primary": an 11 s stall). The second must end it."""

from __future__ import annotations

from sbp_spark.client import RangeServerClient
from sbp_spark.protocol.messages import RangeId
from sbp_spark.protocol.records import batch_body, batch_bytes

from .conftest import TEST_CONFIG
from .private_cluster import client_of, private_cluster


def test_a_refusal_that_came_before_the_push_does_not_seal_the_new_range(tmp_path):
    with private_cluster(tmp_path, range_servers=2) as cluster, \
            client_of(cluster, TEST_CONFIG) as client:
        sid = client.create_streams(1)[0].stream_id
        writer = client.open_stream(sid)
        writer.append([batch_bytes(b"a")])
        client.seal_range(sid)  # range 1 opens, and its servers hold it by the time this returns
        (opened,) = [r for r in client.list_ranges(sid) if r.is_open]
        writer.refresh()
        # What a RANGE_SEALED answered by range 1's primary before the PD's push reached it
        # leaves behind: the writer takes range 1 for sealed by its primary.
        writer._sealed_index = opened.range_index
        (landed,) = writer.append([batch_bytes(b"b")])
        ranges = client.list_ranges(sid)
        got = [bytes(batch_body(b.data)) for b in client.read(sid)]
    assert (landed.range_index, landed.base_offset) == (opened.range_index, 1)
    assert [(r.range_index, r.is_open) for r in ranges] == [(0, False), (1, True)]
    assert got == [b"a", b"b"]


def test_a_range_its_primary_sealed_itself_is_sealed_and_writes_go_on(tmp_path):
    with private_cluster(tmp_path, range_servers=2) as cluster, \
            client_of(cluster, TEST_CONFIG) as client:
        sid = client.create_streams(1, replicas=2)[0].stream_id
        writer = client.open_stream(sid)
        writer.append([batch_bytes(b"a")])
        (first,) = client.list_ranges(sid)
        # The primary stops taking appends, as when a replica failed to store a batch: sealed
        # there, its end not recorded by the PD, so it shows the range open (its end is not
        # final: the PD may end a replicated range lower).
        primary = RangeServerClient(first.primary.advertise_addr, TEST_CONFIG, client.pool)
        (stopped,) = primary.seal([RangeId(sid, 0)])
        stopped.unwrap()
        (described,) = primary.describe_ranges([RangeId(sid, 0)])
        assert described.unwrap().is_open
        (landed,) = writer.append([batch_bytes(b"b")])
        ranges = client.list_ranges(sid)
        got = [bytes(batch_body(b.data)) for b in client.read(sid)]
    assert (landed.range_index, landed.base_offset) == (1, 1)
    assert [(r.range_index, r.end_offset) for r in ranges] == [(0, 1), (1, -1)]
    assert got == [b"a", b"b"]
