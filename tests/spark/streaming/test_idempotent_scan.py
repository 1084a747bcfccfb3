"""The idempotent writer's tags and its backward scan, without Spark or a cluster."""

from __future__ import annotations

import pyarrow as pa

from sbp_spark.protocol.records import arrow_to_body, make_records_batch
from sbp_spark.spark.streaming.idempotent import WriteTag, find_landed, tag_batch, tag_of_body


def test_tag_travels_in_the_body_schema_metadata():
    batch = make_records_batch(pa.array([b"a", b"b"]))
    tag = WriteTag("q-1", 7, 3, 12)
    body = arrow_to_body(tag_batch(batch, tag))
    assert tag_of_body(body) == tag
    assert tag_of_body(arrow_to_body(batch)) is None
    # the payload kind the reader relies on survives tagging
    assert pa.ipc.open_stream(body).schema.metadata[b"sbp.payload"] == b"records"


class FakeStream:
    """A stream of batches of ``size`` records each, with tags; counts what is read."""

    def __init__(self, tags, size=10, start=0):
        self.size, self.start = size, start
        self.batches = [(start + i * size, t) for i, t in enumerate(tags)]
        self.read = 0

    @property
    def end(self):
        return self.start + len(self.batches) * self.size

    def window(self, low, high):
        out = [(o, t) for o, t in self.batches if o < high and o + self.size > low]
        self.read += len(out)
        return out


def test_scan_finds_own_batches_and_stops_at_the_previous_micro_batch():
    other = WriteTag("other", 5, 0, 0)
    tags = ([None] * 1000 + [WriteTag("q", 4, 0, 0), WriteTag("q", 4, 1, 0)]
            + [other, WriteTag("q", 5, 1, 0), WriteTag("q", 5, 0, 0), None,
               WriteTag("q", 5, 0, 2), WriteTag("q", 5, 1, 1)])
    stream = FakeStream(tags)
    landed = find_landed(stream.window, 0, stream.end, "q", 5, 0, first_window=16)
    assert landed.seqs == {0, 2}
    assert landed.complete
    assert stream.read < 40     # it stopped at batch 4's tags, not at the stream start


def test_scan_reaches_the_stream_start():
    stream = FakeStream([WriteTag("q", 0, 0, 1), None, WriteTag("q", 0, 0, 0)], start=50)
    landed = find_landed(stream.window, 50, stream.end, "q", 0, 0, first_window=4)
    assert landed.seqs == {0, 1}
    assert landed.complete and landed.scanned_from == 50


def test_scan_is_bounded_by_the_lookback():
    stream = FakeStream([WriteTag("q", 3, 0, 0)] + [None] * 100)
    landed = find_landed(stream.window, 0, stream.end, "q", 3, 0, lookback_records=200,
                         first_window=16)
    assert landed.seqs == set()
    assert not landed.complete
    assert landed.scanned_from == stream.end - 200


def test_empty_stream():
    landed = find_landed(lambda lo, hi: [], 0, 0, "q", 0, 0)
    assert landed.seqs == set() and landed.complete
