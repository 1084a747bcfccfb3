"""The stream reader of a pyspark without admission control (4.0, 4.1), driven as Spark drives
it there (calls measured on pyspark 4.0.5 and 4.1.4; docs/streaming.md), against the embedded
cluster: Spark passes latestOffset() neither the start nor a limit, asks for the first end
before it asks initialOffset, and plans the empty micro-batch at the checkpoint on a restart.
The reader works the same on every pyspark, so these run on all of them."""

from __future__ import annotations

import logging

import pytest

from sbp_spark.spark.options import parse_stream_read_options
from sbp_spark.spark.pyspark_api import PysparkUnsupportedError
from sbp_spark.spark.schemas import records_schema
from sbp_spark.spark.streaming.offsets import from_spark
from sbp_spark.spark.streaming.reader import SbpSelfLimitingStreamReader

from .helpers import append_values, new_stream

READER_LOG = "sbp_spark.spark.streaming.reader"


def make_reader(pd, sid, **options) -> SbpSelfLimitingStreamReader:
    opts = {"pd": pd, "streams": str(sid), "fetchMaxWaitMs": "50"}
    opts.update({k: str(v) for k, v in options.items()})
    return SbpSelfLimitingStreamReader(parse_stream_read_options(opts), records_schema())


def spans(parts) -> list[tuple[int, int]]:
    return [(p.start_offset, p.end_offset) for p in parts]


def test_a_new_query_keeps_max_records_per_trigger(pd, sbp_client):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 10)
    reader = make_reader(pd, sid, startingOffsets="earliest", maxRecordsPerTrigger=4)
    first_end = reader.latestOffset()   # Spark asks before it asks where the query starts
    start = reader.initialOffset()
    assert from_spark(start) == {sid: 0} and from_spark(first_end) == {sid: 4}
    ends = [first_end]
    assert spans(reader.partitions(start, first_end)) == [(0, 4)]
    while (end := reader.latestOffset()) != ends[-1]:
        assert spans(reader.partitions(ends[-1], end)) == [
            (from_spark(ends[-1])[sid], from_spark(end)[sid])]
        ends.append(end)
    assert [from_spark(e)[sid] for e in ends] == [4, 8, 10]


def test_a_new_query_on_an_empty_backlog_plans_its_empty_first_micro_batch(pd, sbp_client):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 3)
    reader = make_reader(pd, sid, maxRecordsPerTrigger=4)   # startingOffsets latest
    end = reader.latestOffset()
    start = reader.initialOffset()
    assert start == end and reader.partitions(start, end) == []
    append_values(sbp_client, sid, ["y"] * 6)
    assert from_spark(reader.latestOffset()) == {sid: 7}


def test_initial_offsets_are_fixed_at_the_first_ask(pd, sbp_client):
    # startingOffsets=latest moves with every append; Spark asks more than once.
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 3)
    reader = make_reader(pd, sid)
    end = reader.latestOffset()
    append_values(sbp_client, sid, ["y"] * 2)
    assert reader.initialOffset() == reader.initialOffset()
    assert from_spark(reader.initialOffset()) == from_spark(end) == {sid: 3}


def test_a_restart_goes_on_from_the_checkpoint(pd, sbp_client):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 10)
    reader = make_reader(pd, sid, startingOffsets="earliest", maxBytesPerTrigger=1)
    checkpointed = {str(sid): 7, "ranges": {str(sid): 0}}
    assert reader.partitions(checkpointed, checkpointed) == []   # setLatestSeenOffset
    end = reader.latestOffset()
    assert from_spark(end) == {sid: 8}   # one record: the byte limit admits at least one
    assert spans(reader.partitions(checkpointed, end)) == [(7, 8)]


def test_min_records_per_trigger_waits_after_the_first_micro_batch(pd, sbp_client, caplog):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 2)
    reader = make_reader(pd, sid, startingOffsets="earliest", minRecordsPerTrigger=5,
                         maxTriggerDelay="1h", maxRecordsPerTrigger=100)
    end = reader.latestOffset()   # the first trigger runs with what is there
    reader.partitions(reader.initialOffset(), end)
    assert from_spark(end) == {sid: 2}
    append_values(sbp_client, sid, ["y"] * 3)
    with caplog.at_level(logging.WARNING, logger=READER_LOG):
        assert reader.latestOffset() == end   # 3 wait, fewer than 5: held back
    assert not caplog.records   # held back is no micro-batch cut short by a limit
    append_values(sbp_client, sid, ["z"] * 2)
    assert from_spark(reader.latestOffset()) == {sid: 7}


def test_a_micro_batch_cut_short_says_how_many_records_wait(pd, sbp_client, caplog):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 25)
    reader = make_reader(pd, sid, startingOffsets="earliest", maxRecordsPerTrigger=10)
    with caplog.at_level(logging.INFO, logger=READER_LOG):
        end = reader.latestOffset()
        reader.partitions(reader.initialOffset(), end)
        reader.latestOffset()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1   # once per query run
    assert "this micro-batch reads up to {'" + str(sid) + "': 10" in warnings[0]
    assert "leaves 15 records waiting" in warnings[0]
    assert "Trigger.Once or availableNow" in warnings[0] and "pyspark 4.2" in warnings[0]
    # The lag of every micro-batch is logged (the progress carries it only on pyspark 4.2+).
    assert (f"sbp stream {sid}: micro-batch ends at offset 20; latest 25; 5 records and "
            in caplog.text)


def test_no_warning_without_limits(pd, sbp_client, caplog):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 5)
    reader = make_reader(pd, sid, startingOffsets="earliest")
    with caplog.at_level(logging.WARNING, logger=READER_LOG):
        assert from_spark(reader.latestOffset()) == {sid: 5}
    assert not caplog.records


def test_a_wrapped_available_now_restart_is_refused_where_its_end_is_wrong(pd, sbp_client):
    # With spark.sql.streaming.triggerAvailableNowWrapper.enabled=true, a restarted query's
    # availableNow run fixes its end by asking before Spark says where the query stands: the
    # source can only answer from its starting options. Spark says it right after, before the
    # run reads: partitions(o, o).
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["x"] * 10)
    checkpointed = {str(sid): 7, "ranges": {str(sid): 0}}
    for at in (7, 2):   # the answer (4) lies before the checkpoint, or is just not the next
        reader = make_reader(pd, sid, startingOffsets="earliest", maxRecordsPerTrigger=4)
        assert from_spark(reader.latestOffset()) == {sid: 4}   # the wrapper fixes its end
        standing = {str(sid): at, "ranges": {str(sid): 0}}
        with pytest.raises(PysparkUnsupportedError, match=(
                r"restarted availableNow query on pyspark .* with spark\.sql\.streaming\."
                r"triggerAvailableNowWrapper\.enabled=true: .*maxRecordsPerTrigger/"
                r"maxBytesPerTrigger.*Leave the wrapper off")) as refused:
            reader.partitions(standing, standing)
        assert ("behind them: " in str(refused.value)) == (at == 7)
    # Without those limits the end is where the stream ends: one micro-batch up to it.
    reader = make_reader(pd, sid, startingOffsets="earliest")
    end = reader.latestOffset()
    assert reader.partitions(checkpointed, checkpointed) == []
    assert spans(reader.partitions(checkpointed, end)) == [(7, 10)]
