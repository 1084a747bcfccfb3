"""The stream reader's driver-side calls against the embedded cluster, without a Spark query:
the cases a query rarely reaches (streams joining on restart, spans trimmed away entirely,
availableNow targets, long polls)."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from sbp_spark.spark.pyspark_api import found
from sbp_spark.spark.reader import ReadFailedError
from sbp_spark.spark.schemas import records_schema
from sbp_spark.spark.streaming.offsets import from_spark
from sbp_spark.spark.streaming.reader import DataLossError, stream_reader
from tests.rewrite import rewrite_history

from ..pyspark_features import requires
from .helpers import append_values, new_stream


def make_reader(pd, streams, **options):
    opts = {"pd": pd, "streams": ",".join(str(s) for s in streams)}
    opts.update({k: str(v) for k, v in options.items()})
    return stream_reader(opts, records_schema())


def latest(reader, start):
    """The end of the micro-batch after ``start``, asked as Spark asks this pyspark: with the
    start and "all available" where it has admission control; else right after planning the
    micro-batch that ends at ``start``, as Spark does (also on a restart)."""
    if found().admission_control:
        from pyspark.sql.streaming.datasource import ReadAllAvailable

        return reader.latestOffset(start, ReadAllAvailable())
    reader.partitions(start, start)
    return reader.latestOffset()


def report(reader):
    """The lag report: in the query progress where pyspark carries it (4.2+), else logged."""
    if found().progress_lag:
        return reader.reportLatestOffset()
    return reader.state.report


def test_a_stream_added_on_restart_joins_at_its_first_offset(pd, sbp_client):
    old, added = new_stream(sbp_client), new_stream(sbp_client)
    append_values(sbp_client, old, ["a"] * 5)
    append_values(sbp_client, added, ["b"] * 7)
    sbp_client.trim_stream(added, 2)
    reader = make_reader(pd, [old, added])
    checkpointed = {str(old): 3}  # offsets of a query that only read 'old'
    end = latest(reader, checkpointed)
    assert from_spark(end) == {old: 5, added: 2}
    assert [(p.stream_id, p.start_offset, p.end_offset)
            for p in reader.partitions(checkpointed, end)] == [(old, 3, 5)]
    following = latest(reader, end)
    assert from_spark(following) == {old: 5, added: 7}
    assert [(p.stream_id, p.start_offset, p.end_offset)
            for p in reader.partitions(end, following)] == [(added, 2, 7)]
    # a stream no longer named in 'streams' leaves the offsets
    assert from_spark(latest(make_reader(pd, [added]), following)) == {
        added: 7}


def test_a_planned_span_trimmed_away(pd, sbp_client):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 30)
    sbp_client.trim_stream(sid, 20)
    start, end = {str(sid): 0}, {str(sid): 10}
    with pytest.raises(DataLossError, match=rf"stream {sid}: offsets \[0, 20\).*offset 20"):
        make_reader(pd, [sid]).partitions(start, end)
    tolerant = make_reader(pd, [sid], failOnDataLoss="false")
    assert tolerant.partitions(start, end) == []
    assert [(p.start_offset, p.end_offset)
            for p in tolerant.partitions(start, {str(sid): 25})] == [(20, 25)]


@requires("admission_control")
def test_available_now_stops_at_its_target(pd, sbp_client):
    from pyspark.sql.streaming.datasource import ReadMaxRows

    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 10)
    reader = make_reader(pd, [sid], startingOffsets="earliest", maxRecordsPerTrigger=4,
                         minRecordsPerTrigger=1000)
    reader.prepareForTriggerAvailableNow()
    append_values(sbp_client, sid, ["late"] * 5)
    limit = reader.getDefaultReadLimit()
    assert limit == ReadMaxRows(4)
    offsets = [reader.initialOffset()]
    while True:
        end = reader.latestOffset(offsets[-1], limit)
        if end == offsets[-1]:
            break
        offsets.append(end)
    assert [o[str(sid)] for o in offsets] == [0, 4, 8, 10]
    assert reader.reportLatestOffset()[str(sid)]["latestOffset"] == 15


def test_an_idle_reader_wakes_when_a_record_arrives(pd, sbp_client):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"])
    reader = make_reader(pd, [sid], fetchMaxWaitMs=30_000)
    start = reader.initialOffset()
    assert from_spark(start) == {sid: 1}
    timer = threading.Timer(0.2, lambda: append_values(sbp_client, sid, ["y"]))
    began = time.monotonic()
    timer.start()
    try:
        end = latest(reader, start)
    finally:
        timer.join()
    assert from_spark(end) == {sid: 2}
    assert time.monotonic() - began < 30  # the poll ended with the record, not at its limit


def test_the_reader_spark_pickles_carries_no_driver_state(pd, sbp_client):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 3)
    reader = make_reader(pd, [sid], startingOffsets="earliest")
    latest(reader, reader.initialOffset())
    assert report(reader) is not None
    copy = pickle.loads(pickle.dumps(reader))
    assert copy._state is None and copy.options == reader.options
    (partition,) = reader.partitions({str(sid): 0}, {str(sid): 3})
    assert sum(b.num_rows for b in copy.read(pickle.loads(pickle.dumps(partition)))) == 3


def test_a_range_sealed_after_planning_is_still_read(pd, sbp_client):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, [f"v{i}" for i in range(6)])
    reader = make_reader(pd, [sid], startingOffsets="earliest")
    start = reader.initialOffset()
    end = latest(reader, start)
    (partition,) = reader.partitions(start, end)
    assert partition.range_is_open
    sbp_client.seal_range(sid)  # during the micro-batch: tasks have not read yet
    append_values(sbp_client, sid, ["after-seal"])
    (batch,) = list(reader.read(partition))
    assert [v.decode() for v in batch.column("value").to_pylist()] == [
        f"v{i}" for i in range(6)]
    following = latest(reader, end)
    assert [(p.range_index, p.start_offset, p.end_offset)
            for p in reader.partitions(end, following)] == [(1, 6, 7)]


def test_a_checkpoint_past_a_later_seal_is_noticed(pd, sbp_cluster, sbp_client):
    # Issue 22: the query read range 0 up to offset 10, then that range was sealed at 6 and
    # the stream went on with other records from 6. The next micro-batch must notice.
    sid = new_stream(sbp_client)
    for i in range(10):  # a range ends between batches
        append_values(sbp_client, sid, [f"old-{i}"])
    reader = make_reader(pd, [sid], startingOffsets="earliest")
    read_to = latest(reader, reader.initialOffset())
    assert read_to == {str(sid): 10, "ranges": {str(sid): 0}}
    rewrite_history(sbp_cluster, sid, 6)
    append_values(sbp_client, sid, [f"new-{i}" for i in range(6, 12)])
    message = (rf"stream {sid}: range 0 was sealed at offset 6, but this query had already "
               rf"read it up to offset 10; the records \[6, 10\)")
    with pytest.raises(DataLossError, match=message):
        latest(reader, read_to)
    with pytest.raises(DataLossError, match=message):
        reader.partitions(read_to, {str(sid): 12})
    # failOnDataLoss=false: go on from the seal, reading what stands there now, and say so.
    tolerant = make_reader(pd, [sid], failOnDataLoss="false")
    following = latest(tolerant, read_to)
    assert following == {str(sid): 12, "ranges": {str(sid): 1}}
    assert [(p.range_index, p.start_offset, p.end_offset)
            for p in tolerant.partitions(read_to, following)] == [(1, 6, 12)]
    assert report(tolerant)[str(sid)]["historyRewritten"] == {
        "range": 0, "sealedAt": 6, "hadReadTo": 10}
    # Offsets checkpointed before they named ranges still load (without this check).
    assert from_spark(latest(tolerant, {str(sid): 12})) == {sid: 12}


def test_a_rewritten_history_refilled_to_the_same_offset_is_read(pd, sbp_cluster, sbp_client):
    # failOnDataLoss=false goes on from the seal "reading the records that stand there now",
    # also when the stream now ends exactly where the query had read to: the micro-batch's
    # end offset equals its start offset, but the records [6, 10) are new ones.
    sid = new_stream(sbp_client)
    for i in range(10):
        append_values(sbp_client, sid, [f"old-{i}"])
    reader = make_reader(pd, [sid], startingOffsets="earliest", failOnDataLoss="false")
    read_to = latest(reader, reader.initialOffset())
    assert read_to == {str(sid): 10, "ranges": {str(sid): 0}}
    rewrite_history(sbp_cluster, sid, 6)
    append_values(sbp_client, sid, [f"new-{i}" for i in range(6, 10)])
    following = latest(reader, read_to)
    assert following == {str(sid): 10, "ranges": {str(sid): 1}}
    assert [(p.range_index, p.start_offset, p.end_offset)
            for p in reader.partitions(read_to, following)] == [(1, 6, 10)]


def planned_past_a_later_seal(pd, sbp_cluster, sbp_client):
    """A stream, the reader that planned a micro-batch over its range 0 up to offset 12, and
    that micro-batch's start and end; range 0 was sealed at 10 since (a rewritten history)."""
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, [f"a{i}" for i in range(5)])
    reader = make_reader(pd, [sid])
    start = reader.initialOffset()
    for i in range(7):
        append_values(sbp_client, sid, [f"b{i}"])
    end = latest(reader, start)
    assert end == {str(sid): 12, "ranges": {str(sid): 0}}
    rewrite_history(sbp_cluster, sid, 10)
    return sid, reader, start, end


def test_a_planned_end_above_a_later_seal_is_data_loss(pd, sbp_cluster, sbp_client):
    # The micro-batch was planned to read range 0 up to offset 12; before it is planned into
    # partitions (or when it is replayed after a restart) range 0 was sealed at 10 and the
    # stream went on with other records. This is a rewritten history, not a bad option.
    sid, reader, start, end = planned_past_a_later_seal(pd, sbp_cluster, sbp_client)
    append_values(sbp_client, sid, [f"new-{i}" for i in range(10, 14)])
    message = (rf"stream {sid}: this micro-batch was planned to read up to offset 12, but the "
               r"range that held its last record now ends at offset 10; the records \[10, 12\)")
    with pytest.raises(DataLossError, match=message):
        reader.partitions(start, end)
    # failOnDataLoss=false: read what range 0 holds, then go on from its seal, reading the
    # records that stand there now, each once.
    tolerant = make_reader(pd, [sid], failOnDataLoss="false")
    assert [(p.range_index, p.start_offset, p.end_offset)
            for p in tolerant.partitions(start, end)] == [(0, 5, 10)]
    following = latest(tolerant, end)
    assert following == {str(sid): 14, "ranges": {str(sid): 1}}
    assert [(p.range_index, p.start_offset, p.end_offset)
            for p in tolerant.partitions(end, following)] == [(1, 10, 14)]


def test_a_planned_end_past_the_stream_after_a_seal_is_data_loss(pd, sbp_cluster, sbp_client):
    # As above with nothing appended after the seal: the stream now ends below the planned
    # end. This failed with "endingOffsets asks for stream ..." (an option a streaming read
    # does not have), whatever failOnDataLoss said.
    sid, reader, start, end = planned_past_a_later_seal(pd, sbp_cluster, sbp_client)
    with pytest.raises(DataLossError, match=rf"history rewritten in stream {sid}: .*\[10, 12\)"):
        reader.partitions(start, end)
    tolerant = make_reader(pd, [sid], failOnDataLoss="false")
    assert [(p.range_index, p.start_offset, p.end_offset)
            for p in tolerant.partitions(start, end)] == [(0, 5, 10)]


def test_a_stream_deleted_after_planning(pd, sbp_client):
    # A micro-batch was planned, then its stream deleted before the tasks read it. The
    # failure named no data loss ("no replica could serve it"), and failOnDataLoss=false,
    # which drops a deleted stream from the query, failed the micro-batch all the same.
    def planned(fail_on_data_loss):
        sid = new_stream(sbp_client)
        append_values(sbp_client, sid, ["x"] * 5)
        reader = make_reader(pd, [sid], startingOffsets="earliest",
                             failOnDataLoss=fail_on_data_loss)
        start = reader.initialOffset()
        (partition,) = reader.partitions(start, latest(reader, start))
        sbp_client.delete_streams([sid])
        return sid, reader, partition

    sid, reader, partition = planned("true")
    with pytest.raises(ReadFailedError, match=rf"data loss: .*stream {sid} was deleted after "
                       r"the read was planned; its records \[0, 5\) are gone.*failOnDataLoss"):
        list(reader.read(partition))
    _, tolerant, partition = planned("false")
    assert list(tolerant.read(partition)) == []


def read_ten_then_end_layouts_at(pd, sbp_client, monkeypatch, end: int):
    """A reader that read a new stream's 10 records, after which the stream's layouts show
    its open range ending at ``end`` (what a secondary, or a restarted primary, may say):
    (stream id, the reader, the offsets it read to)."""
    from dataclasses import replace

    from sbp_spark.spark import cluster_access

    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 10)
    reader = make_reader(pd, [sid], startingOffsets="earliest")
    read_to = latest(reader, reader.initialOffset())
    assert from_spark(read_to) == {sid: 10}
    real = cluster_access.stream_layouts

    def lowered(*args):
        return [replace(lay, ranges=lay.ranges[:-1] + (replace(lay.ranges[-1], end_offset=end),))
                for lay in real(*args)]

    monkeypatch.setattr(cluster_access, "stream_layouts", lowered)
    return sid, reader, read_to


def test_a_lagging_secondary_end_is_not_data_loss(pd, sbp_client, monkeypatch):
    # When the primary does not answer, a stream's layout gives the open range's end that a
    # secondary vouches for, which may lag what the query already read. Only the primary's
    # word may make that data loss; here it still holds every record.
    sid, reader, read_to = read_ten_then_end_layouts_at(pd, sbp_client, monkeypatch, 6)
    assert from_spark(latest(reader, read_to)) == {sid: 10}


def test_a_restarted_primary_still_capped_is_not_data_loss(pd, sbp_client, monkeypatch):
    # A primary that restarted shows its open replicated range only up to the range's start
    # until every secondary said it holds the records too. Taken for the stream's end, that
    # failed a relay in the nemesis with "history rewritten" while no record was lost: the
    # primary still takes a FETCH at the offset the query read to, so the end is not known
    # yet, and the query waits. (The stream here has one replica; the primary's answer is
    # made to look like a restarted one's.)
    from dataclasses import replace

    from sbp_spark.client.range_server import RangeServerClient

    sid, reader, read_to = read_ten_then_end_layouts_at(pd, sbp_client, monkeypatch, 0)
    real_describe = RangeServerClient.describe_ranges

    def capped_describe(self, ranges):
        return [replace(item, value=replace(item.value, next_offset=item.value.start_offset))
                for item in real_describe(self, ranges)]

    monkeypatch.setattr(RangeServerClient, "describe_ranges", capped_describe)
    assert from_spark(latest(reader, read_to)) == {sid: 10}
    # Past what the primary stores, it is data loss as before.
    ahead = {str(sid): 12, "ranges": {str(sid): 0}}
    with pytest.raises(DataLossError, match=rf"history rewritten in stream {sid}: it now ends "
                       r"at offset 0, but this query had already read it up to offset 12"):
        latest(make_reader(pd, [sid]), ahead)


def test_a_planned_end_past_the_end_of_an_open_stream_is_data_loss(pd, sbp_client):
    # A micro-batch planned up to offset 10 (then the query stopped before it ran) is replayed
    # against a stream that now ends at 3 in an open range: a rebuilt cluster, say. This failed
    # with "endingOffsets asks for stream ...", an option a streaming read does not have,
    # also with failOnDataLoss=false.
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 3)
    start, end = {str(sid): 0}, {str(sid): 10, "ranges": {str(sid): 0}}
    with pytest.raises(DataLossError, match=rf"history rewritten in stream {sid}: this "
                       r"micro-batch was planned to read up to offset 10, but the stream now "
                       r"ends at offset 3; the records \[3, 10\)"):
        make_reader(pd, [sid]).partitions(start, end)
    tolerant = make_reader(pd, [sid], failOnDataLoss="false")
    assert [(p.start_offset, p.end_offset) for p in tolerant.partitions(start, end)] == [(0, 3)]
