"""Offsets and admission control, without Spark or a cluster."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbp_spark.spark.options import EARLIEST, LATEST, OffsetSpec
from sbp_spark.spark.streaming.limits import TriggerDelay, TriggerLimits, admit, apportion
from sbp_spark.spark.streaming.offsets import (
    OffsetFormatError,
    from_spark,
    resolve_starting,
    to_spark,
)

# -- offsets ---------------------------------------------------------------------------------


def test_offsets_serialise_in_one_canonical_text():
    a = to_spark({10: 5, 2: 7, 1: 0})
    b = to_spark({1: 0, 10: 5, 2: 7})
    assert list(a) == ["1", "2", "10"]
    assert json.dumps(a) == json.dumps(b) == '{"1": 0, "2": 7, "10": 5}'
    assert from_spark(json.dumps(a)) == {1: 0, 2: 7, 10: 5}
    assert from_spark({"7": 3}) == {7: 3}


@pytest.mark.parametrize("bad", [
    '{"x": 1}', '{"1": -1}', '{"1": 1.5}', '{"1": true}', "[1]", "not json", '{"1": "3"}'])
def test_bad_offsets_are_refused_with_the_value(bad):
    with pytest.raises(OffsetFormatError, match="start offset"):
        from_spark(bad, "start offset")


def test_to_spark_refuses_negative_offsets():
    with pytest.raises(OffsetFormatError, match="stream 3"):
        to_spark({3: -1})


def test_resolve_starting_offsets():
    bounds = {1: (10, 50), 2: (0, 7)}
    assert resolve_starting(OffsetSpec(EARLIEST), (1, 2), bounds) == {1: 10, 2: 0}
    assert resolve_starting(OffsetSpec(LATEST), (1, 2), bounds) == {1: 50, 2: 7}
    spec = OffsetSpec(LATEST, ((1, 20), (2, EARLIEST)))
    assert resolve_starting(spec, (1, 2), bounds) == {1: 20, 2: 0}
    # below the start: kept (data loss is decided when the batch is planned)
    assert resolve_starting(OffsetSpec(LATEST, ((1, 3),)), (1,), bounds) == {1: 3}
    with pytest.raises(ValueError, match="stream 2.*ends at offset 7"):
        resolve_starting(OffsetSpec(LATEST, ((2, 8),)), (2,), bounds)


# -- apportion -------------------------------------------------------------------------------


def test_apportion_gives_everything_when_it_fits():
    assert apportion(100, {1: 30, 2: 70}) == {1: 30, 2: 70}
    assert apportion(100, {1: 0, 2: 5}) == {1: 0, 2: 5}


def test_apportion_is_proportional_to_backlog():
    assert apportion(100, {1: 900, 2: 100}) == {1: 90, 2: 10}
    assert apportion(10, {1: 1, 2: 1, 3: 1, 4: 1}) == {1: 1, 2: 1, 3: 1, 4: 1}
    assert apportion(3, {1: 10, 2: 10, 3: 10, 4: 10}) == {1: 1, 2: 1, 3: 1, 4: 0}


def test_apportion_does_not_starve_a_small_backlog():
    shares = apportion(10, {1: 1_000_000, 2: 1})
    assert shares == {1: 9, 2: 1}


@given(st.integers(0, 10_000),
       st.dictionaries(st.integers(0, 50), st.integers(0, 100_000), max_size=8))
def test_apportion_invariants(budget, weights):
    shares = apportion(budget, weights)
    assert set(shares) == set(weights)
    assert all(0 <= shares[s] <= weights[s] for s in weights)
    assert sum(shares.values()) == min(budget, sum(weights.values()))
    positive = [s for s in weights if weights[s] > 0]
    if budget >= len(positive):
        assert all(shares[s] >= 1 for s in positive)


# -- admit -----------------------------------------------------------------------------------


def test_admit_unbounded_reads_to_latest():
    assert admit({1: 0, 2: 5}, {1: 10, 2: 5}, TriggerLimits()) == {1: 10, 2: 5}


def test_admit_max_records_spreads_by_backlog():
    end = admit({1: 0, 2: 100}, {1: 300, 2: 200}, TriggerLimits(max_records=40))
    assert end == {1: 30, 2: 110}


def test_admit_max_bytes_uses_the_estimate():
    # stream 1: 100 bytes a record, stream 2: 10 bytes a record; equal record backlogs
    end = admit({1: 0, 2: 0}, {1: 1000, 2: 1000}, TriggerLimits(max_bytes=11_000),
                {1: 100.0, 2: 10.0})
    assert end == {1: 100, 2: 100}
    # a record bigger than the budget still passes alone
    assert admit({1: 0}, {1: 5}, TriggerLimits(max_bytes=10), {1: 1000.0}) == {1: 1}


def test_admit_applies_both_maximums():
    limits = TriggerLimits(max_records=50, max_bytes=1000)
    assert admit({1: 0}, {1: 500}, limits, {1: 100.0}) == {1: 10}
    assert admit({1: 0}, {1: 500}, limits, {1: 1.0}) == {1: 50}


def test_admit_ignores_streams_behind_their_start():
    assert admit({1: 10}, {1: 5}, TriggerLimits(max_records=3)) == {1: 10}


def test_trigger_delay_waits_for_min_records_or_the_delay():
    now = [0.0]
    delay = TriggerDelay(lambda: now[0])
    assert not delay.should_wait(1, 10, 1000)       # first trigger admits what is there
    now[0] = 100
    assert delay.should_wait(5, 10, 1000)           # too few, delay not over
    assert delay.remaining_ms(1000) == 900
    assert not delay.should_wait(10, 10, 1000)      # enough records
    now[0] = 500
    assert delay.should_wait(9, 10, 1000)
    now[0] = 1100
    assert not delay.should_wait(9, 10, 1000)       # the delay forces a batch
    assert not delay.should_wait(0, 10, 1000)       # nothing waits: nothing to hold back


def test_trigger_delay_of_a_query_started_on_an_idle_stream():
    # The first trigger after a start admits what is there: nothing. A record arriving later
    # is not what was there at the start; it waits for minRecordsPerTrigger or the delay
    # (as in Spark's Kafka source, whose clock starts at the first trigger).
    now = [0.0]
    delay = TriggerDelay(lambda: now[0])
    assert not delay.should_wait(0, 10, 1000)       # first trigger: nothing there
    now[0] = 100
    assert delay.should_wait(1, 10, 1000)           # too few, delay not over
    assert delay.remaining_ms(1000) == 900
    now[0] = 1000
    assert not delay.should_wait(1, 10, 1000)       # the delay forces a batch
