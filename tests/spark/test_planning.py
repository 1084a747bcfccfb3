"""Planning and filter pushdown as pure functions: layouts + options + filters -> partitions."""

from __future__ import annotations

import datetime as dt
import pickle

import pytest

from sbp_spark.spark.filters import (
    Predicate,
    PushedFilters,
    intersect_intervals,
    merge_intervals,
    split_filters,
)
from sbp_spark.spark.options import OptionError, parse_read_options
from sbp_spark.spark.planning import (
    MAX_PIECES_PER_RANGE,
    RangeLayout,
    ReplicaLocation,
    StreamLayout,
    plan_partitions,
    split_evenly,
)
from sbp_spark.spark.pyspark_api import found

from .pyspark_features import requires

if found().filter_pushdown:  # Spark's filter classes came with pushdown (pyspark 4.1)
    from pyspark.sql.datasource import (
        EqualNullSafe,
        EqualTo,
        GreaterThan,
        GreaterThanOrEqual,
        In,
        IsNotNull,
        LessThan,
        LessThanOrEqual,
        Not,
        StringStartsWith,
    )

A = (ReplicaLocation(1, "127.0.0.1:1001", True),
     ReplicaLocation(2, "127.0.0.1:1002", False))
B = (ReplicaLocation(2, "127.0.0.1:1002", True),)


def layout(stream_id=7, start=0):
    """Stream 7: range 0 [0, 1000) sealed on server 1, range 1 [1000, 2500) open on server 2."""
    return StreamLayout(stream_id, start, (
        RangeLayout(0, start, 1000, A),
        RangeLayout(1, 1000, 2500, B, is_open=True),
    ))


def read(**options):
    return parse_read_options({"pd": "h:1", "streams": "7", **options})


def spans(parts):
    return [(p.stream_id, p.range_index, p.start_offset, p.end_offset) for p in parts]


def test_one_partition_per_range_with_replicas():
    parts = plan_partitions([layout()], read())
    assert spans(parts) == [(7, 0, 0, 1000), (7, 1, 1000, 2500)]
    assert parts[0].replicas == A and parts[1].range_is_open
    clone = pickle.loads(pickle.dumps(parts[0]))
    assert clone == parts[0] and len(pickle.dumps(parts[0])) < 600


def test_starting_and_ending_offsets():
    parts = plan_partitions([layout()], read(startingOffsets='{"7": 900}',
                                             endingOffsets='{"7": 1200}'))
    assert spans(parts) == [(7, 0, 900, 1000), (7, 1, 1000, 1200)]
    assert plan_partitions([layout()], read(startingOffsets='{"7": 2500}')) == []
    assert spans(plan_partitions([layout()], read(startingOffsets='{"7": 1000}'))) == [
        (7, 1, 1000, 2500)]


def test_bad_offsets_fail_with_the_stream_bounds():
    with pytest.raises(OptionError, match="from offset 2600, but the stream ends at offset 2500"):
        plan_partitions([layout()], read(startingOffsets='{"7": 2600}'))
    with pytest.raises(OptionError, match="up to offset 3000, but the stream ends at offset 2500"):
        plan_partitions([layout()], read(endingOffsets='{"7": 3000}'))
    with pytest.raises(OptionError, match=r"endingOffsets \(10\) is before startingOffsets"):
        plan_partitions([layout()], read(startingOffsets='{"7": 20}', endingOffsets='{"7": 10}'))


def test_trimmed_start_and_fail_on_data_loss():
    trimmed = layout(start=300)
    with pytest.raises(OptionError, match="offsets below 300 were trimmed.*failOnDataLoss"):
        plan_partitions([trimmed], read(startingOffsets='{"7": 100}'))
    parts = plan_partitions([trimmed], read(startingOffsets='{"7": 100}', failOnDataLoss="false"))
    assert spans(parts)[0] == (7, 0, 300, 1000)
    # an end among the trimmed offsets: data loss too, not a start after the end
    with pytest.raises(OptionError, match="endingOffsets asks for stream 7 up to offset 200, "
                                          "but offsets below 300 were trimmed.*failOnDataLoss"):
        plan_partitions([trimmed], read(endingOffsets='{"7": 200}'))
    assert plan_partitions([trimmed], read(endingOffsets='{"7": 200}',
                                           failOnDataLoss="false")) == []
    assert plan_partitions([trimmed], read(startingOffsets='{"7": 100}',
                                           endingOffsets='{"7": 200}',
                                           failOnDataLoss="false")) == []


def test_split_by_max_records_and_min_partitions():
    parts = plan_partitions([layout()], read(maxRecordsPerPartition="400"))
    assert spans(parts) == [
        (7, 0, 0, 334), (7, 0, 334, 667), (7, 0, 667, 1000),
        (7, 1, 1000, 1375), (7, 1, 1375, 1750), (7, 1, 1750, 2125), (7, 1, 2125, 2500)]
    parts = plan_partitions([layout()], read(minPartitions="5"))
    assert [p.record_count for p in parts] == [500, 500, 500, 500, 500]
    assert split_evenly(0, 3, 5) == [(0, 1), (1, 2), (2, 3)]


@requires("filter_pushdown")
def test_filter_split_and_intervals():
    filters = [EqualTo(("stream_id",), 7), GreaterThanOrEqual(("offset",), 950),
               LessThan(("offset",), 1100), GreaterThan(("timestamp",), dt.datetime(2024, 1, 1)),
               In(("range_index",), [1, None]), EqualTo(("value",), b"x"),
               Not(EqualTo(("offset",), 3)), StringStartsWith(("key",), "a"),
               IsNotNull(("offset",)), EqualTo(("offset",), "3")]
    columns = ["stream_id", "range_index", "offset", "timestamp", "key", "value"]
    handled, unhandled = split_filters(filters, columns)
    assert unhandled == filters[5:]
    assert handled[3] == Predicate("timestamp", ">", 1_704_067_200_000_000)
    pushed = PushedFilters.from_predicates(handled)
    assert pushed.intervals["offset"] == ((950, 1100),)
    assert pushed.intervals["range_index"] == ((1, 2),)
    assert pushed.row_predicates == (handled[3],)
    parts = plan_partitions([layout()], read(), pushed)
    assert spans(parts) == [(7, 1, 1000, 1100)]
    assert parts[0].row_predicates == (handled[3],)
    # predicates on columns the schema does not have are left to Spark
    assert split_filters([EqualTo(("offset",), 1)], ["value"]) == ([], [EqualTo(("offset",), 1)])


@requires("filter_pushdown")
def test_a_predicate_holds_a_tuple_for_in_alone():
    with pytest.raises(ValueError, match="IN takes a tuple"):
        Predicate("offset", "in", 3)
    with pytest.raises(ValueError, match="IN takes a tuple"):
        Predicate("offset", "<", (3,))
    with pytest.raises(ValueError, match="operator '!=' is not one of"):
        Predicate("offset", "!=", 3)
    assert Predicate("offset", "in", (1, 3)).describe() == "offset IN (1, 3)"


@requires("filter_pushdown")
def test_stream_and_offset_filters_choose_streams_and_pieces():
    other = StreamLayout(8, 0, (RangeLayout(0, 0, 50, B, is_open=True),))
    options = parse_read_options({"pd": "h:1", "streams": "7,8"})
    handled, _ = split_filters([In(("stream_id",), [8, 9])], ["stream_id"])
    assert spans(plan_partitions([layout(), other], options,
                                 PushedFilters.from_predicates(handled))) == [(8, 0, 0, 50)]
    handled, _ = split_filters([In(("offset",), [5, 6, 7, 999, 1000, 2400]),
                                LessThanOrEqual(("offset",), 1000),
                                EqualNullSafe(("stream_id",), 7)], ["stream_id", "offset"])
    parts = plan_partitions([layout(), other], options, PushedFilters.from_predicates(handled))
    assert spans(parts) == [(7, 0, 5, 8), (7, 0, 999, 1000), (7, 1, 1000, 1001)]
    assert all(p.row_predicates == () for p in parts)


@requires("filter_pushdown")
def test_many_in_values_become_one_partition_with_a_row_filter():
    values = list(range(0, 2 * (MAX_PIECES_PER_RANGE + 1), 2))
    handled, _ = split_filters([In(("offset",), values)], ["offset"])
    parts = plan_partitions([layout()], read(), PushedFilters.from_predicates(handled))
    assert spans(parts) == [(7, 0, 0, values[-1] + 1)]
    assert parts[0].row_predicates == (Predicate("offset", "in", tuple(values)),)


def test_interval_helpers():
    assert merge_intervals([(5, 6), (1, 3), (3, 4), (10, 10)]) == [(1, 4), (5, 6)]
    assert intersect_intervals([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
