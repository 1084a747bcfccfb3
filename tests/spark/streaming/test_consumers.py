"""Streaming queries under option ``consumer``: the cluster's record follows the checkpoint,
the lag it shows grows and drops back to 0, a second query under the name fences the first,
and ``startingOffsets=committed`` starts where the record stands (streaming and batch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException

from sbp_spark.client.consumers import consumer_lag
from sbp_spark.spark.streaming.offsets import from_spark

from .helpers import append_values, memory_values, new_stream, wait_for


def _query(spark, pd, streams, name, checkpoint, consumer, sink="memory", **options):
    """A query of the streams' values under ``consumer`` (the memory sink cannot restart
    from its checkpoint: a query that does restarts on sink noop)."""
    reader = (spark.readStream.format("sbp").option("pd", pd)
              .option("streams", ",".join(map(str, streams))).option("consumer", consumer))
    for key, value in options.items():
        reader = reader.option(key, value)
    return (reader.load().writeStream.format(sink).queryName(name)
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime="100 milliseconds").start())


def checkpoint_committed(checkpoint: Path) -> dict[int, int]:
    """The end offsets of the last micro-batch the checkpoint holds as committed."""
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    lines = (checkpoint / "offsets" / str(last)).read_text().splitlines()
    return from_spark(json.loads(lines[2]))


def recorded(client, name: str) -> dict[int, int]:
    return {p.stream_id: p.committed_offset for p in client.consumers.get(name).positions}


def test_the_record_follows_the_checkpoint_and_the_lag_drops_to_zero(spark, pd, sbp_client,
                                                                     tmp_path):
    first, second = new_stream(sbp_client), new_stream(sbp_client)
    checkpoint = tmp_path / "ck"
    query = _query(spark, pd, [first, second], "followed", checkpoint, "follower",
                   sink="noop", startingOffsets="earliest")
    try:
        for round_ in range(3):
            append_values(sbp_client, first, [f"a{round_}-{i}" for i in range(5)])
            append_values(sbp_client, second, [f"b{round_}"])
            query.processAllAvailable()
            # After each micro-batch: the record is the checkpoint's committed offsets.
            expected = {first: 5 * (round_ + 1), second: round_ + 1}
            assert checkpoint_committed(checkpoint) == expected
            wait_for(lambda e=expected: recorded(sbp_client, "follower") == e,
                     what=f"the record to reach {expected}")
    finally:
        query.stop()
    # Appends while nobody reads: the lag grows, in records and in the records' time.
    append_values(sbp_client, first, ["late-1"], timestamp_ms=1_000_000)
    append_values(sbp_client, first, ["late-2"], timestamp_ms=1_004_000)
    lag = {s.stream_id: s for s in consumer_lag(sbp_client, sbp_client.consumers.get(
        "follower"))}
    assert (lag[first].records_behind, lag[first].time_behind_ms) == (2, 4000)
    assert lag[second].records_behind == 0 and lag[second].time_behind_ms == 0
    # The query comes back from its checkpoint and catches up: the lag drops to 0.
    query = _query(spark, pd, [first, second], "followed", checkpoint, "follower",
                   sink="noop")
    try:
        query.processAllAvailable()
        wait_for(lambda: all(s.records_behind == 0 for s in consumer_lag(
            sbp_client, sbp_client.consumers.get("follower"))), what="the lag to drop to 0")
        assert sbp_client.consumers.get("follower").generation == 2
    finally:
        query.stop()
    # A new query (no checkpoint) starting at the record reads only what came after it.
    append_values(sbp_client, first, ["after"])
    query = _query(spark, pd, [first, second], "resumed", tmp_path / "ck2", "follower",
                   startingOffsets="committed")
    try:
        query.processAllAvailable()
        assert memory_values(spark, "resumed") == ["after"]
    finally:
        query.stop()
    # A batch read from the record (which the query above moved past "after"), and
    # committedFallback (earliest) for a stream it has none of.
    append_values(sbp_client, first, ["later"])
    third = new_stream(sbp_client)
    append_values(sbp_client, third, ["t0", "t1"])
    rows = (spark.read.format("sbp").option("pd", pd)
            .option("streams", f"{first},{third}").option("consumer", "follower")
            .option("startingOffsets", "committed").load()
            .selectExpr("CAST(value AS STRING) AS v").collect())
    assert sorted(r.v for r in rows) == ["later", "t0", "t1"]


def test_a_second_query_under_the_name_fences_the_first(spark, pd, sbp_client, tmp_path):
    stream = new_stream(sbp_client)
    append_values(sbp_client, stream, ["one"])
    older = _query(spark, pd, [stream], "older", tmp_path / "a", "contested",
                   startingOffsets="earliest")
    newer = None
    try:
        older.processAllAvailable()
        newer = _query(spark, pd, [stream], "newer", tmp_path / "b", "contested",
                       startingOffsets="earliest")
        newer.processAllAvailable()
        assert sbp_client.consumers.get("contested").generation == 2
        append_values(sbp_client, stream, ["two"])
        # The older query's next record is refused: it stops, saying why.
        wait_for(lambda: not older.isActive, what="the fenced query to stop")
        with pytest.raises(StreamingQueryException, match="CONSUMER_FENCED|generation 2"):
            older.awaitTermination(30)
        newer.processAllAvailable()
        wait_for(lambda: recorded(sbp_client, "contested") == {stream: 2},
                 what="the newer query's record")
    finally:
        older.stop()
        if newer is not None:
            newer.stop()


def test_committed_needs_a_consumer(spark, pd, sbp_client):
    stream = new_stream(sbp_client)
    with pytest.raises(Exception, match="needs option 'consumer'"):
        (spark.read.format("sbp").option("pd", pd).option("streams", str(stream))
         .option("startingOffsets", "committed").load().collect())


class _Commits:
    """A PD's consumer calls, in memory: generations and forward-only positions, and a
    failure to inject."""

    def __init__(self):
        self.generation = 0
        self.positions: dict[int, int] = {}
        self.calls: list[str] = []
        self.fail: Exception | None = None

    def join(self, name):
        from sbp_spark.protocol.messages import Consumer, ConsumerPosition

        self.calls.append("join")
        self.generation += 1
        return Consumer(name, self.generation,
                        [ConsumerPosition(s, o) for s, o in self.positions.items()])

    def commit(self, name, generation, positions):
        from sbp_spark.protocol.errors import ConsumerFencedError
        from sbp_spark.protocol.messages import Consumer, ConsumerPosition

        self.calls.append(f"commit {dict(positions)}")
        if self.fail is not None:
            raise self.fail
        if generation != self.generation:
            raise ConsumerFencedError(f"consumer {name!r} is at generation {self.generation}")
        for sid, off in positions.items():
            self.positions[sid] = max(off, self.positions.get(sid, -1))
        return Consumer(name, generation,
                        [ConsumerPosition(s, o) for s, o in self.positions.items()])


def test_the_record_joins_once_sends_only_moves_and_survives_an_outage(caplog):
    from sbp_spark.protocol.errors import ConsumerFencedError, ReadTimeoutError
    from sbp_spark.spark.streaming.consumer_record import ConsumerRecord

    pd = _Commits()
    pd.positions = {1: 10}  # an earlier generation got here
    record = ConsumerRecord("q", pd)
    record.record({1: 5})  # behind the record: joins, then nothing to send
    assert pd.calls == ["join"] and record.generation == 1
    record.record({1: 12, 2: 0})
    record.record({1: 12, 2: 0})  # the same again (commit() after partitions()): not sent
    assert pd.calls == ["join", "commit {1: 12, 2: 0}"]
    pd.fail = ReadTimeoutError("the PD did not answer")
    record.record({1: 13, 2: 0})  # logged, the query goes on
    assert "could not record consumer 'q'" in caplog.text
    pd.fail = None
    record.record({1: 14, 2: 1})
    assert pd.positions == {1: 14, 2: 1}
    pd.join("q")  # another query takes the name over
    with pytest.raises(ConsumerFencedError, match="recording as consumer 'q'.*generation 2"):
        record.record({1: 15, 2: 1})
    assert pd.positions == {1: 14, 2: 1}
