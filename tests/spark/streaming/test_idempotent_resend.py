"""The idempotent sink's resend check: batches of this attempt found in the stream by their write
tag are reported as stored, so an APPEND whose answer was lost is not written twice (the client
side of the resend is tested in tests/client/test_append_resend_check.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.spark.options import parse_write_options
from sbp_spark.spark.streaming.writer import _IdempotentBatchWriter, _IdempotentSink
from sbp_spark.spark.writer import _TaskAppends


@pytest.fixture
def cluster(tmp_path):
    with EmbeddedCluster(str(tmp_path / "cluster")) as running:
        yield running


def _rows(start: int, n: int) -> pa.RecordBatch:
    return pa.record_batch({"value": pa.array([b"v%d" % i for i in range(start, start + n)])})


def test_resend_check_finds_exactly_the_batches_this_attempt_stored(cluster):
    with ConnectionPool() as pool:
        client = SbpClient(cluster.pd_address, pool=pool)
        (stream,) = client.create_streams()
        sid = stream.stream_id
        options = parse_write_options({"pd": cluster.pd_address, "stream": str(sid)})
        owner = _IdempotentBatchWriter(options, None, sid, "query-1", 3, 1)
        other = _IdempotentBatchWriter(options, None, sid, "query-1", 3, 0)
        appends = _TaskAppends()
        try:
            sink = _IdempotentSink(client, sid, options, appends, owner)
            sink._encode([_rows(0, 10), _rows(10, 10), _rows(20, 10)])
            batches = list(sink.pending)
            assert len(batches) == 3
            check = sink._resend_check(batches)
            assert check([0, 1, 2]) == {}  # nothing stored yet: everything is sent again
            # Another partition's batch with the same sequence number is not ours.
            rival = _IdempotentSink(client, sid, options, appends, other)
            rival._encode([_rows(100, 5)])
            writer = client.open_stream(sid)
            writer.append([b.buffers for b in rival.pending])
            # The first two of ours landed before the answer was lost.
            landed = writer.append([b.buffers for b in batches[:2]])
            found = check([0, 1, 2])
            assert sorted(found) == [0, 1]
            assert [(a.base_offset, a.record_count) for a in found.values()] == [
                (landed[0].base_offset, 10), (landed[1].base_offset, 10)]
        finally:
            appends.close()
