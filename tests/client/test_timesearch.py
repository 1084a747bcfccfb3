"""Offsets by time against a real embedded cluster, with handcrafted timestamps: base timestamps,
per-record timestamps that differ from them (in any order inside a batch, some null), opaque
batches, several ranges, and what a search over n batches costs."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pyarrow as pa
import pytest

from sbp_spark.client.timesearch import TimeSearch, record_timestamps_ms
from sbp_spark.protocol.records import (
    PAYLOAD_RECORDS,
    encode_arrow_batch,
    encode_batch,
    make_records_batch,
    with_payload_kind,
)


def records(base_ms: int, stamps: list[int | None] | None, count: int | None = None):
    """A payload=records batch; ``stamps`` are its per-record timestamps (None: no column)."""
    n = len(stamps) if stamps is not None else count
    values = pa.array([b"v"] * n, pa.binary())
    column = None if stamps is None else pa.array(stamps, pa.timestamp("ms"))
    return encode_arrow_batch(make_records_batch(values, timestamp=column), base_ms)


def expected_stamps(base_ms: int, stamps: list[int | None] | None, count: int | None = None):
    if stamps is None:
        return [base_ms] * count
    return [base_ms if s is None else s for s in stamps]


def write(client, batches_per_range: list[list[tuple]]) -> tuple[int, list[int]]:
    """A new stream with one range per list (all but the last sealed); returns its id and every
    record's timestamp in offset order."""
    sid = client.create_streams(1)[0].stream_id
    stamps: list[int] = []
    for i, batches in enumerate(batches_per_range):
        encoded = []
        for spec in batches:
            if spec[0] == "opaque":
                encoded.append(encode_batch(b"body", base_timestamp_ms=spec[1]))
                stamps.append(spec[1])
            else:
                encoded.append(records(*spec[1:]))
                stamps.extend(expected_stamps(*spec[1:]))
        client.append(sid, encoded)
        if i < len(batches_per_range) - 1:
            client.seal_range(sid)
    return sid, stamps


def search_of(client, sid: int) -> TimeSearch:
    ranges = [replace(r, next_offset=client.open_range_end(r)) if r.is_open else r
              for r in client.list_ranges(sid)]
    return TimeSearch(client, ranges)


def kafka_answer(stamps: list[int], time_ms: int, start: int = 0, end: int | None = None):
    """Where the running maximum of the timestamps (from ``start``) first reaches the time."""
    running = None
    for offset in range(start, len(stamps) if end is None else end):
        running = stamps[offset] if running is None else max(running, stamps[offset])
        if running >= time_ms:
            return offset
    return None


def test_exact_per_record_across_ranges_batches_and_record_timestamps(client):
    # Each batch's latest timestamp is no earlier than the ones before it; inside batches the
    # records run back and forth, sit before and after their base timestamp, or are null.
    sid, stamps = write(client, [
        [("records", 1_000, [1_500, 900, 2_000, None]),      # base 1000: 1500 900 2000 1000
         ("opaque", 2_100),
         ("records", 9_999, [2_050, 2_300, 2_200])],         # base far after its records
        [("records", 2_400, None, 5),                        # no column: all at the base
         ("records", 100, [3_000, 2_500, 3_000, 3_100])],    # base far before its records
        [("opaque", 3_200), ("opaque", 3_200),
         ("records", 3_300, [None, 3_900, 3_400, 4_000])],
    ])
    search = search_of(client, sid)
    times = sorted({t + d for t in stamps for d in (-1, 0, 1)} | {0, 10_000})
    for time_ms in times:
        for start, end in ((0, len(stamps)), (3, len(stamps)), (0, 9), (6, 14)):
            got = search.first_at_or_after(time_ms, start, end).offset
            assert got == kafka_answer(stamps, time_ms, start, end), (time_ms, start, end)


def test_batch_timestamps_are_what_readers_show(client):
    sid, stamps = write(client, [[("records", 7, [5, None, 9]), ("opaque", 11),
                                  ("records", 13, None, 2)]])
    seen = []
    for batch in client.read(sid):
        seen += record_timestamps_ms(batch.header, batch.data).to_pylist()
    assert seen == stamps == [5, 7, 9, 11, 13, 13]


def test_a_search_reads_log_n_batches(client):
    batches = 512
    sid, stamps = write(client, [
        [("records", 10 * (r * 128 + b), None, 4) for b in range(128)] for r in range(4)])
    search = search_of(client, sid)
    rng = random.Random(7)
    bound = math.ceil(math.log2(batches)) + 2
    for time_ms in [0, 5, 10_000, stamps[-1], stamps[-1] + 1] + rng.sample(range(6_000), 20):
        result = search.first_at_or_after(time_ms, 0, len(stamps))
        assert result.offset == kafka_answer(stamps, time_ms)
        assert 1 <= result.fetches <= bound, (time_ms, result.fetches)


def test_nothing_at_or_after_the_time(client):
    sid, stamps = write(client, [[("records", 50, [10, 20, 30])]])
    search = search_of(client, sid)
    assert search.first_at_or_after(31, 0, 3).offset is None
    assert search.first_at_or_after(25, 0, 2).offset is None  # 30 is past the searched end
    assert search.first_at_or_after(0, 3, 3).fetches == 0  # an empty span costs nothing


def test_batches_running_back_in_time_give_a_crossing(client):
    # One record per batch, timestamps going back and forth across 250: Kafka would answer 1
    # (300), which only reading every batch could find; the search lands on a record at or
    # after the time whose preceding record is before it.
    sid, stamps = write(client, [[("opaque", t) for t in (100, 300, 200, 240, 400, 260)]])
    got = search_of(client, sid).first_at_or_after(250, 0, len(stamps)).offset
    assert got is not None and stamps[got] >= 250 and stamps[got - 1] < 250


def test_client_offset_for_time_reads_the_open_range_and_skips_trimmed(client):
    sid, stamps = write(client, [[("records", 0, [100, 200, 300])],
                                 [("records", 0, [400, 500])]])
    assert client.offset_for_time(sid, 250) == 2
    client.append(sid, [records(0, [600])])  # into the open range after the search above
    assert client.offset_for_time(sid, 550) == 5
    client.trim_stream(sid, 4)
    assert client.offset_for_time(sid, 0) == 4
    assert client.offset_for_time(sid, 601) is None


@pytest.mark.parametrize("unit", ["s", "us", "ns"])
def test_other_timestamp_units_compare_exactly_in_ms(client, unit):
    # Another writer's records body with a finer or coarser timestamp column than ms.
    stamps = pa.array([1_000_999_999, 1_001_000_000], pa.timestamp("ns")).cast(
        pa.timestamp(unit), safe=False)
    body = with_payload_kind(pa.record_batch({"value": pa.array([b"a", b"b"]),
                                              "timestamp": stamps}), PAYLOAD_RECORDS)
    sid = client.create_streams(1)[0].stream_id
    client.append(sid, [encode_arrow_batch(body, 0)])
    # 1000.999999 ms is before 1001 ms; in whole seconds both records are at 1000 ms.
    assert client.offset_for_time(sid, 1_001) == {"s": None, "us": 1, "ns": 1}[unit]


def test_finer_units_before_1970_compare_exactly_in_ms(client):
    # -0.5 ms and -1.5 ms are before 0 ms and -1 ms: cutting them toward zero (to 0 and -1)
    # would put them at those times.
    body = with_payload_kind(pa.record_batch({
        "value": pa.array([b"a", b"b"]),
        "timestamp": pa.array([-1_500, -500], pa.timestamp("us"))}), PAYLOAD_RECORDS)
    sid = client.create_streams(1)[0].stream_id
    client.append(sid, [encode_arrow_batch(body, 0)])
    assert client.offset_for_time(sid, 0) is None
    search = search_of(client, sid)
    assert search.first_at_or_after(-1, 0, 2).offset == 1
    assert search.first_at_or_after(-2, 0, 2).offset == 0


def _expire_on_range_servers(cluster, sid: int, offset: int) -> None:
    """What retention does on a range server before the PD hears of it (its report is sent
    from the server's PD link a moment later): records below ``offset`` are gone, while the
    PD still lists the stream's old start."""
    trimmed = 0
    for server in cluster.range_servers:
        for rlog in server.storage.ranges() if server is not None else ():
            if rlog.stream_id == sid and rlog.start_offset < offset:
                rlog.trim(offset)
                trimmed += 1
    assert trimmed, f"stream {sid} has no range below offset {offset} on any range server"


def test_records_expired_before_the_pd_knows_are_not_there(client, cluster):
    # A time before every retained record, or one a probe lands below the retained start for:
    # the search failed with OFFSET_OUT_OF_RANGE ("offset 25 of stream 1 is below the start
    # 35"), so a read by time (startingTimestamp, a filter on timestamp) failed to plan while
    # retention was expiring the stream's oldest batches. Expired records are simply not there.
    sid, stamps = write(client, [[("records", 0, [10 * i + j for j in range(10)])
                                  for i in range(10)]])
    search = search_of(client, sid)  # planned while the PD still says the stream starts at 0
    _expire_on_range_servers(cluster, sid, 35)
    assert client.describe_stream(sid).start_offset == 0
    for time_ms, expected in ((0, 35), (36, 36), (50, 50), (99, 99), (100, None)):
        assert search.first_at_or_after(time_ms, 0, len(stamps)).offset == expected, time_ms
        # the anchor probe (timestamp filters) starts at the span's first offset
        result = search.first_at_or_after(time_ms, 0, len(stamps), anchor=True)
        assert result.offset == expected and result.disorder_ms == 0, time_ms
