"""The data-loss verdicts of a streaming read, without Spark or a cluster: what each loss says,
where the read goes on, and how failOnDataLoss decides between the two."""

from __future__ import annotations

import pytest

from sbp_spark.client import ReplicaLocation
from sbp_spark.spark.planning import RangeLayout, StreamLayout
from sbp_spark.spark.streaming import data_loss
from sbp_spark.spark.streaming.data_loss import DataLossError, judge

REPLICA = (ReplicaLocation(1, "127.0.0.1:1", True),)


def layout(*ranges: tuple[int, int, bool], start: int = 0) -> StreamLayout:
    """Stream 7 with ranges (start, end, is_open) numbered from 0."""
    return StreamLayout(7, start, tuple(RangeLayout(i, lo, hi, REPLICA, is_open)
                                        for i, (lo, hi, is_open) in enumerate(ranges)))


def test_a_trim_fails_the_query_or_goes_on_from_the_new_start():
    loss = data_loss.trimmed(7, 10, 40)
    with pytest.raises(DataLossError) as failed:
        judge(loss, fail_on_data_loss=True)
    assert str(failed.value) == (
        "data loss in stream 7: offsets [10, 40) were trimmed before the query read them; the "
        "stream now starts at offset 40. Set failOnDataLoss=false to skip the missing records "
        "and continue from offset 40.")
    assert judge(loss, fail_on_data_loss=False) is loss
    assert loss.resume_at == 40 and loss.rewritten is None
    assert loss.warning == (
        "sbp data loss (failOnDataLoss=false): stream 7: offsets [10, 40) were trimmed before "
        "the query read them; the stream now starts at offset 40; continuing from there")


def test_a_deleted_stream_is_dropped_when_data_loss_is_allowed():
    loss = data_loss.stream_lost(7, 12)
    with pytest.raises(DataLossError, match=r"^data loss: stream 7 was deleted \(or no longer "
                       r"exists\) while the query still had to read it from offset 12\. Set "
                       "failOnDataLoss=false to drop the stream"):
        judge(loss, True)
    assert loss.resume_at is None
    assert loss.warning.endswith("from offset 12; dropping it")


def test_a_range_sealed_below_what_the_query_read():
    sealed = layout((0, 6, False), (6, 12, True))
    loss = data_loss.range_sealed_below(7, 10, 0, sealed)
    assert loss is not None and loss.resume_at == 6
    assert loss.rewritten == {"range": 0, "sealedAt": 6, "hadReadTo": 10}
    with pytest.raises(DataLossError, match=r"^history rewritten in stream 7: range 0 was sealed "
                       r"at offset 6, but this query had already read it up to offset 10; the "
                       r"records \[6, 10\) it read .*Set failOnDataLoss=false to go on from "
                       r"offset 6, reading the records that stand there now\.$"):
        judge(loss, True)
    assert loss.warning.endswith("; going on from offset 6")


@pytest.mark.parametrize(("stream", "range_index", "position"), [
    (layout((0, 6, False), (6, 12, True)), 0, 6),     # sealed exactly where the query read
    (layout((0, 6, False), (6, 12, True)), 1, 10),    # the range is still open
    (layout((0, 6, False)), 3, 10),                   # a range the layout does not know
    (layout((0, 6, False)), None, 4),                 # offsets checkpointed without ranges
])
def test_no_rewritten_range(stream, range_index, position):
    assert data_loss.range_sealed_below(7, position, range_index, stream) is None


def test_a_stream_that_ends_below_what_the_query_read():
    assert data_loss.needs_stream_end(layout((0, 3, True)), 10)
    assert not data_loss.needs_stream_end(layout((0, 10, True)), 10)
    loss = data_loss.stream_ends_below_read(7, 10, 0, 3)
    assert loss is not None and loss.resume_at == 3
    assert loss.rewritten == {"endsAt": 3, "hadReadTo": 10}
    with pytest.raises(DataLossError, match=r"^history rewritten in stream 7: it now ends at "
                       r"offset 3, but this query had already read it up to offset 10"):
        judge(loss, True)
    # The end is not known (the primary did not answer), or does not lie below: no loss.
    assert data_loss.stream_ends_below_read(7, 10, 0, None) is None
    assert data_loss.stream_ends_below_read(7, 10, 0, 10) is None


def test_a_planned_end_above_what_the_stream_holds():
    loss = data_loss.planned_end_cut(7, 12, 10, "the range that held its last record")
    with pytest.raises(DataLossError, match=r"^history rewritten in stream 7: this micro-batch "
                       r"was planned to read up to offset 12, but the range that held its last "
                       r"record now ends at offset 10; the records \[10, 12\) .*Set "
                       r"failOnDataLoss=false to read only what the stream holds\.$"):
        judge(loss, True)
    assert loss.resume_at == 10
    assert loss.warning.endswith("; reading up to offset 10")


def test_each_distinct_loss_warns_once():
    keys = {data_loss.trimmed(7, 0, 5).key, data_loss.trimmed(7, 5, 9).key,
            data_loss.stream_lost(7, 0).key, data_loss.planned_end_cut(7, 9, 5, "x").key}
    assert len(keys) == 4
    assert data_loss.trimmed(7, 0, 5).key == data_loss.trimmed(7, 0, 5).key


def test_only_a_seal_says_where_a_range_ends():
    stream = layout((0, 6, False), (6, 9, True))
    assert data_loss.sealed_end(stream, 0) == 6
    assert data_loss.sealed_end(stream, 1) is None   # open: a snapshot, not authoritative
    assert data_loss.sealed_end(stream, 2) is None
    assert data_loss.sealed_end(stream, None) is None
