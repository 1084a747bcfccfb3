"""Where an appended batch landed: a client's plain APPEND names no range, and a range server
stores it in the open range of the stream it holds, which is the next range once someone else
sealed the one the writer knew (and the PD opened the next on the same server). An idempotent
APPEND names its range (each batch's sequence belongs to one), so it lands there or nowhere."""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from sbp_spark.protocol.records import encode_arrow_batch, make_records_batch

from .conftest import TEST_CONFIG
from .private_cluster import client_of, private_cluster


def one_record(value: bytes):
    return encode_arrow_batch(make_records_batch(pa.array([value], pa.binary())))


def test_locate_names_the_range_that_holds_a_batch_sent_to_a_range_sealed_meanwhile(tmp_path):
    plain = dataclasses.replace(TEST_CONFIG, idempotent=False)
    with private_cluster(tmp_path, range_servers=1) as cluster, \
            client_of(cluster, plain) as client, client_of(cluster, TEST_CONFIG) as other:
        sid = client.create_streams(1)[0].stream_id
        writer = client.open_stream(sid)
        first = writer.append([one_record(b"a"), one_record(b"b")])
        assert [(a.range_index, a.base_offset) for a in first] == [(0, 0), (0, 1)]
        other.seal_range(sid)  # an operator's `sbp ranges seal`, or another writer's seal
        (late,) = writer.append([one_record(b"c")])
        ranges = client.list_ranges(sid)
        assert [(r.range_index, r.start_offset) for r in ranges] == [(0, 0), (1, 2)]
        # The writer still knew range 0, and the server stored the batch in range 1.
        assert (late.range_index, late.base_offset) == (0, 2)
        located = client.locate([*first, late])
        assert [(a.range_index, a.base_offset) for a in located] == [(0, 0), (0, 1), (1, 2)]
        assert located[:2] == first  # nothing else changes
        assert client.locate([]) == []


def test_an_idempotent_batch_sent_to_a_range_sealed_meanwhile_lands_in_the_next_one_named(
        tmp_path):
    with private_cluster(tmp_path, range_servers=1) as cluster, \
            client_of(cluster, TEST_CONFIG) as client, client_of(cluster, TEST_CONFIG) as other:
        sid = client.create_streams(1)[0].stream_id
        writer = client.open_stream(sid)
        writer.append([one_record(b"a"), one_record(b"b")])
        other.seal_range(sid)
        (late,) = writer.append([one_record(b"c")])
        # Refused by range 0's server as sealed (its sequence was range 0's), sent to range 1.
        assert (late.range_index, late.base_offset) == (1, 2)
        assert client.locate([late]) == [late]
