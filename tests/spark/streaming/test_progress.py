"""The lag report of a streaming read, without Spark or a cluster."""

from __future__ import annotations

from sbp_spark.spark.decode import SkipTally
from sbp_spark.spark.streaming.progress import (
    MAX_STAMPS,
    StampCache,
    StreamLag,
    lag_report,
    ms_between,
    skip_warning,
)


def test_the_report_per_stream_in_stream_order():
    lags = [StreamLag(10, end=5, latest=9, ms_behind=1200), StreamLag(2, end=7, latest=7)]
    assert lag_report(lags, {}) == {
        "2": {"latestOffset": 7, "recordsBehind": 0, "msBehindLatest": 0},
        "10": {"latestOffset": 9, "recordsBehind": 4, "msBehindLatest": 1200},
    }
    assert list(lag_report(lags, {}) or {}) == ["2", "10"]
    assert lag_report([], {}) is None


def test_the_report_names_a_rewritten_history_and_skipped_batches():
    tally = SkipTally()
    tally.add(30, "column 'x' is a string")
    report = lag_report([StreamLag(1, 10, 12), StreamLag(2, 4, 4)],
                        {1: {"range": 0, "sealedAt": 6, "hadReadTo": 10}}, {1: tally})
    assert report == {
        "1": {"latestOffset": 12, "recordsBehind": 2, "msBehindLatest": 0,
              "historyRewritten": {"range": 0, "sealedAt": 6, "hadReadTo": 10},
              "incompatibleBatchesSkipped": 1, "incompatibleRecordsSkipped": 30},
        "2": {"latestOffset": 4, "recordsBehind": 0, "msBehindLatest": 0,
              "incompatibleBatchesSkipped": 0, "incompatibleRecordsSkipped": 0},
    }


def test_lag_is_never_negative():
    # A micro-batch that went on from a rewritten history may end past the stream's end.
    lag = StreamLag(3, end=12, latest=10)
    assert lag.records_behind == 0
    assert ms_between(1_000, 5_000) == 0
    assert ms_between(5_000, 1_000) == 4_000
    assert lag.describe() == ("sbp stream 3: micro-batch ends at offset 12; latest 10; 0 "
                              "records and 0 ms behind the newest record")


def test_skip_warning_names_the_span_and_the_first_problem():
    tally = SkipTally()
    tally.add(5, "no column 'id'")
    tally.add(7, "another problem")
    assert skip_warning(4, '{"4": 0} -> {"4": 12}', tally) == (
        'sbp stream 4: micro-batch {"4": 0} -> {"4": 12} skips 2 stored batches (12 records) '
        "that do not fit the read schema (skipIncompatibleBatches=true); the first: no column "
        "'id'")


def test_the_stamp_cache_forgets_everything_when_full():
    cache = StampCache()
    for offset in range(MAX_STAMPS + 1):
        cache.put(1, offset, offset * 10)
    assert cache.get(1, 0) == 0 and cache.get(1, MAX_STAMPS) == MAX_STAMPS * 10
    assert cache.get(2, 0) is None
    cache.put(1, MAX_STAMPS + 1, 7)
    assert cache.get(1, 0) is None and cache.get(1, MAX_STAMPS + 1) == 7
