"""A read that was told a range holds records up to an offset, and then finds the range sealed
below it, says so (``HistoryRewrittenError``) instead of ending short (issue 22)."""

from __future__ import annotations

import pickle

import pytest

from sbp_spark.protocol.errors import HistoryRewrittenError
from sbp_spark.protocol.records import batch_bytes
from tests.rewrite import rewrite_history


def test_a_read_planned_past_a_later_seal_fails_naming_both_offsets(cluster, client):
    [stream] = client.create_streams(1)
    sid = stream.stream_id
    client.open_stream(sid).append([batch_bytes(b"%d" % i) for i in range(10)])
    [open_range] = client.list_ranges(sid)
    end = client.open_range_end(open_range)
    assert end == 10
    rewrite_history(cluster, sid, 6)
    with pytest.raises(HistoryRewrittenError) as info:
        list(client.fetch(open_range, 0, end))
    err = info.value
    assert (err.stream_id, err.range_index, err.end_offset, err.expected) == (sid, 0, 6, 10)
    assert f"stream {sid}: range 0 was sealed at offset 6, below offset 10" in str(err)
    again = pickle.loads(pickle.dumps(err))  # Spark pickles errors raised on executors
    assert str(again) == str(err) and again.expected == 10
    # Reading the stream as it is now gives the six records the range kept.
    assert [b.header.base_offset for b in client.read(sid)] == list(range(6))
