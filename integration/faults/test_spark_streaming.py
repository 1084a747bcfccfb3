"""Spark Structured Streaming (``readStream.format("sbp")`` into ``writeStream.format("sbp")``
with ``idempotent=true``) while a range server is killed with SIGKILL.

A client-level writer appends numbered, self-checking batches to an input stream; a streaming
query relays every input record into an output stream, keyed by its input offset. A range
server holding both streams is killed during the query. When the writer has stopped and the
query has processed through the input's end, the output must hold every input record exactly
once, byte for byte: that is the end-to-end exactly-once claim of an sbp source with an
idempotent sbp sink. A query that fails must say why; it is then restarted from its checkpoint,
as a user would, and must finish the job.

Slow: they start Spark (the ``spark`` fixture of this suite's conftest). Run with
``pytest integration/faults -m slow -k streaming``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.errors import BatchFormatError
from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    BodyFormat,
    body_to_arrow,
    encode_arrow_batch,
    make_records_batch,
)
from sbp_spark.server.cluster import ProcessCluster
from sbp_spark.spark.streaming.idempotent import WriteTag, tag_of_body

from .helpers import RIDE_OUT, StreamCheck, Writer, check_body, check_stream, wait_until

BODY = 1024
# How long the only range server stays down in the R=1 case (the fault itself, not a wait).
OUTAGE_S = 3.0
# Restarts from the checkpoint a case allows before it gives up on the query.
MAX_RESTARTS = 3
# Batches the writer gets acknowledged before the query starts, and after the kill.
BACKLOG, AFTER_KILL = 200, 400
# The writer's pace (8 batches, then this pause: about 150 batches/s) and the micro-batch size
# limit keep the query busy with many small micro-batches, so the kill hits one while it runs.
WRITER_PAUSE_S = 0.05
MAX_RECORDS_PER_TRIGGER = 300
# Connector options that ride out a server restart or a failover (as RIDE_OUT does for clients).
CONNECTOR_RETRIES = {"retries": "60", "requestTimeoutMs": "10000"}


def _primary_index(cluster: ProcessCluster, client: SbpClient, stream_id: int) -> int:
    """Index in the cluster of the primary of the stream's open range."""
    rng = client.list_ranges(stream_id)[-1]
    address = next(r.server.advertise_addr for r in rng.servers if r.is_primary)
    return next(i for i, p in enumerate(cluster.range_servers)
                if p is not None and p.info["range_server"] == address)


_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


def _cause(message: str) -> str:
    """The line of a query failure that names the error: a Python data source error comes as
    a Spark error class, a traceback, then the exception (often with a JVM stack after it)."""
    lines = [line.strip() for line in message.strip().splitlines()]
    found = [line for line in lines if _PY_ERROR.match(line)]
    return (found[-1] if found else lines[0] if lines else "(no message)")[:300]


class Relay:
    """The streaming query under test: input stream -> idempotent sbp sink -> output stream.
    Restarts from its checkpoint when it fails, and keeps every failure's message."""

    def __init__(self, spark, pd: str, source: int, target: int, checkpoint: str,
                 options: dict[str, str] | None = None) -> None:
        self.spark = spark
        # Connector options of both ends (retries, timeouts).
        self.options = CONNECTOR_RETRIES if options is None else options
        self.pd = pd
        self.source = source
        self.target = target
        self.checkpoint = checkpoint
        self.failures: list[str] = []  # the line of each failure that says what went wrong
        self.full_failures: list[str] = []
        self.query = None
        self.last_batch_id = -1  # the newest micro-batch reported, over every run of the query

    def start(self) -> None:
        reader = (self.spark.readStream.format("sbp").option("pd", self.pd)
                  .option("streams", str(self.source)).option("startingOffsets", "earliest")
                  .option("minPartitions", "2")
                  .option("maxRecordsPerTrigger", str(MAX_RECORDS_PER_TRIGGER)))
        for key, value in self.options.items():
            reader = reader.option(key, value)
        writer = (reader.load().selectExpr("CAST(offset AS STRING) AS key", "value")
                  .writeStream.format("sbp").option("pd", self.pd)
                  .option("stream", str(self.target)).option("idempotent", "true")
                  .option("checkpointLocation", self.checkpoint)
                  .trigger(processingTime="0 seconds"))
        for key, value in self.options.items():
            writer = writer.option(key, value)
        self.query = writer.start()

    def processed_to(self) -> int:
        """The input offset the query has committed through (restarting it if it died)."""
        if not self.query.isActive:
            error = self.query.exception()
            message = str(error) if error is not None else "stopped without an error"
            self.full_failures.append(message)
            self.failures.append(_cause(message))
            assert len(self.failures) <= MAX_RESTARTS, (
                f"the query failed {len(self.failures)} times: {self.failures}")
            self.start()
            return 0
        progress = self.query.lastProgress
        if progress is None or not progress.sources:
            return 0
        self.last_batch_id = max(self.last_batch_id, progress.batchId)
        end = json.loads(progress.sources[0].endOffset or "{}")
        return int(end.get(str(self.source), 0))

    def start_and_wait_busy(self) -> int:
        """Start the query and return once it is up to speed (three micro-batches through)
        and running one: that micro-batch's number, the one a fault injected now hits."""
        self.start()
        wait_until(lambda: self.processed_to() > 0 and self.last_batch_id >= 2, 180,
                   "three micro-batches")
        wait_until(self.trigger_active, 60, "a micro-batch to run")
        return self.last_batch_id + 1

    def trigger_active(self) -> bool:
        """Whether a micro-batch is running now."""
        return bool(self.query.isActive and self.query.status["isTriggerActive"])

    def wait_processed(self, end: int, timeout_s: float) -> None:
        wait_until(lambda: self.processed_to() >= end, timeout_s,
                   f"the query to process input offsets up to {end} (failures: "
                   f"{self.failures})")

    def stop(self) -> None:
        if self.query is not None:
            if self.query.isActive:
                self.query.stop()


@dataclass
class OutputCheck:
    """What the output stream holds, measured against the input stream."""

    batches: int = 0
    records: int = 0
    holes: list[int] = field(default_factory=list)  # output offsets where a gap begins
    bad: list[str] = field(default_factory=list)  # undecodable batches or damaged values
    duplicated: list[int] = field(default_factory=list)  # input offsets stored more than once
    # input offsets stored twice under the same write tag (query, micro-batch, partition, seq):
    # an APPEND the client sent again after losing its answer, or a task retry that did not see
    # its earlier attempt's batch
    resent: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # input offsets not in the output
    changed: list[int] = field(default_factory=list)  # stored, but not the input's bytes
    tags: int = 0  # distinct write tags (query, micro-batch, partition, seq)

    @property
    def exactly_once(self) -> bool:
        return not (self.holes or self.bad or self.duplicated or self.missing or self.changed)

    def summary(self) -> str:
        return (f"{self.records} records in {self.batches} batches ({self.tags} write tags); "
                f"{len(self.holes)} holes, "
                f"{len(self.bad)} damaged, {len(self.missing)} input records missing, "
                f"{len(self.changed)} changed, {len(self.duplicated)} duplicated "
                f"({len(self.resent)} of them twice under the same write tag)"
                + (f"; first problems: {(self.bad + self.missing + self.duplicated)[:5]}"
                   if not self.exactly_once else ""))


def _input(client: SbpClient, stream_id: int, writer: Writer) -> tuple[StreamCheck, dict]:
    """The input stream checked against the writer's acknowledgements, and its bodies."""
    check = check_stream(client, stream_id, writer.acked)
    bodies = {b.header.base_offset: bytes(b.data[ENVELOPE_SIZE:]) for b in client.read(stream_id)}
    return check, bodies


def check_output(client: SbpClient, stream_id: int, inputs: dict[int, bytes],
                 source: int) -> OutputCheck:
    """Read the output stream and compare it, record by record, with the input bodies."""
    out = OutputCheck()
    found: dict[int, bytes] = {}
    tags_of: dict[int, list[WriteTag | None]] = {}
    expected = 0
    for fetched in client.read(stream_id):
        header = fetched.header
        if header.base_offset != expected:
            out.holes.append(expected)
        expected = header.end_offset
        out.batches += 1
        out.records += header.record_count
        body = fetched.data[ENVELOPE_SIZE:ENVELOPE_SIZE + header.body_length]
        try:
            if header.body_format != BodyFormat.ARROW:
                raise BatchFormatError(f"body format {header.body_format} is not ARROW")
            batch, tag = body_to_arrow(body), tag_of_body(body)
        except BatchFormatError as exc:
            out.bad.append(f"output offset {header.base_offset}: {exc}")
            continue
        keys = batch.column("key").to_pylist()
        for key, value in zip(keys, batch.column("value").to_pylist(), strict=True):
            offset = int(key)
            try:
                sid, _seq = check_body(value)
                if sid != source:
                    raise ValueError(f"names stream {sid}, not {source}")
            except ValueError as exc:
                out.bad.append(f"input offset {offset}: {exc}")
                continue
            if offset in found:
                out.duplicated.append(offset)
                if tag is not None and tag in tags_of[offset]:
                    out.resent.append(offset)
            found[offset] = value
            tags_of.setdefault(offset, []).append(tag)
            if inputs.get(offset) != value:
                out.changed.append(offset)
    out.tags = len({t for ts in tags_of.values() for t in ts if t is not None})
    out.missing = sorted(set(inputs) - set(found))
    return out


def stream_led_by(client: SbpClient, replicas: int, victim, leader_of) -> tuple[int, bool]:
    """A new stream whose open range's primary is ``victim`` (as ``leader_of(stream_id)``
    names primaries), if one of a few new streams lands there: (its id, whether it does).
    An output stream led by the server a fault hits, so the fault hits the sink's appends
    too."""
    target = client.create_streams(1, replicas=replicas)[0].stream_id
    for _ in range(8):
        if leader_of(target) == victim:
            break
        target = client.create_streams(1, replicas=replicas)[0].stream_id
    return target, leader_of(target) == victim


def relay_under_fault(tmp_path, spark, figures, replicas: int, servers: int,
                      fault: Callable[[ProcessCluster], None] | None = None,
                      **cluster_options: Any) -> None:
    """Run the relay and inject ``fault`` (default: kill -9 the primary of the input's open
    range, restarted after ``OUTAGE_S`` when it is the only replica) during a micro-batch, on
    a ``ProcessCluster`` made with ``cluster_options``; then check the output."""
    with ProcessCluster(tmp_path, range_servers=servers, **cluster_options) as cluster, \
            ConnectionPool(RIDE_OUT) as pool:
        client = SbpClient(cluster.pd_address, RIDE_OUT, pool)
        [source] = [s.stream_id for s in client.create_streams(1, replicas=replicas)]
        victim = _primary_index(cluster, client, source)
        target, shared = stream_led_by(client, replicas, victim,
                                       lambda sid: _primary_index(cluster, client, sid))

        writer = Writer(client, source, batches_per_append=8, body_size=BODY,
                        pause_s=WRITER_PAUSE_S)
        writer.start()
        relay = Relay(spark, cluster.pd_address, source, target, str(tmp_path / "checkpoint"))
        try:
            writer.wait_for_more(BACKLOG)
            figures["killed during"] = f"micro-batch {relay.start_and_wait_busy()}"
            killed_at = time.monotonic()
            if fault is not None:
                fault(cluster)
            else:
                cluster.kill_range_server(victim)
                if replicas == 1:
                    time.sleep(OUTAGE_S)  # the outage is the injected fault
                    cluster.start_range_server(victim)
            writer.wait_for_more(AFTER_KILL, timeout=120)
            writer.finish()
            inputs_check, inputs = _input(client, source, writer)
            relay.wait_processed(inputs_check.end, 240)
            caught_up_s = time.monotonic() - killed_at
        finally:
            writer.stop.set()
            relay.stop()
        output = check_output(client, target, inputs, source)
        if relay.full_failures:  # kept for a look after the run (pytest keeps its tmp dirs)
            (tmp_path / "query-failures.txt").write_text("\n\n".join(relay.full_failures))

        figures["acknowledged input batches"] = len(writer.acked)
        figures["input"] = (f"offsets [0, {inputs_check.end}), {len(inputs_check.duplicates)} "
                            "stored twice by the writer's retries")
        figures["output"] = output.summary()
        figures["micro-batches"] = relay.last_batch_id + 1
        figures["query failures (restarted from the checkpoint)"] = len(relay.failures)
        if relay.failures:
            figures["first failure"] = relay.failures[0]
        if fault is None:
            figures["killed server also led the output stream"] = "yes" if shared else "no"
        figures["from the kill to the query through the end"] = f"{caught_up_s:.1f} s"
        figures["writer: longest wait for an ack"] = f"{writer.longest_stall_s:.1f} s"

        assert inputs_check.ok, inputs_check.summary()
        for message in relay.failures:  # a failure must say what went wrong, and where
            assert _PY_ERROR.match(message) and any(
                word in message for word in ("stream", "range", "127.0.0.1")), message
        assert not output.bad, output.bad[:5]
        assert not output.holes, f"output offsets have holes at {output.holes[:5]}"
        assert not output.missing, (
            f"{len(output.missing)} input records never reached the output, first "
            f"{output.missing[:5]}")
        assert not output.changed, f"output values differ from the input at {output.changed[:5]}"
        assert not output.duplicated, (
            f"idempotent sink stored {len(output.duplicated)} input records twice "
            f"({len(output.resent)} resent under the same write tag), first "
            f"{output.duplicated[:5]}")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "range server killed during a Spark streaming query (R=1)",
    f"a writer appends {BODY} B batches to an input stream while readStream.format('sbp') "
    "relays it (key = input offset) into an output stream with writeStream.format('sbp') "
    "idempotent=true, checkpointed, retries=60; kill -9 the only range server, restart it "
    f"{OUTAGE_S:g} s later",
    "after the writer stops, the query processes through the input's end (restarted from its "
    "checkpoint if it failed, with a clear message); the output holds every input record "
    "exactly once with its exact bytes, offsets without holes, nothing corrupt; every "
    "acknowledged input batch is stored")
def test_spark_streaming_relay_while_range_server_is_killed(tmp_path, spark, figures):
    relay_under_fault(tmp_path, spark, figures, replicas=1, servers=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "primary killed during a Spark streaming query (R=3)",
    "as the R=1 case, on 4 range servers with 3-replica streams; kill -9 the primary of the "
    "input's open range (chosen to lead the output's open range too), no restart",
    "as the R=1 case: the PD fails the ranges over and the query reads and writes through the "
    "survivors; the output holds every input record exactly once, byte for byte")
def test_spark_streaming_relay_while_primary_is_killed_with_three_replicas(
        tmp_path, spark, figures):
    relay_under_fault(tmp_path, spark, figures, replicas=3, servers=4)


# The backlog of the case below: enough that the sink has many APPEND frames in flight when
# the secondary dies (40,000-record input ranges, 300-record output batches).
BACKLOG_RECORDS, PARTITION_RECORDS = 160_000, 40_000


def _numbered(start: int, count: int) -> bytes:
    values = pa.array([b"%07d|" % i + b"x" * 120 for i in range(start, start + count)])
    return encode_arrow_batch(make_records_batch(values))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "output's secondary killed under an idempotent sink's backlog (R=2)",
    f"3 range servers; a {BACKLOG_RECORDS}-record input stream relayed by one availableNow "
    "query into a 2-replica output stream (idempotent=true, 300-record batches); kill -9 a "
    "secondary of the output's open range once the output holds 20,000 records",
    "the query finishes; the output holds every input record exactly once, each partition's in "
    "order")
def test_idempotent_sink_while_an_output_secondary_dies(tmp_path, spark, figures):
    # The sink's appends in flight fail their replication, yet the primary stored them, and
    # so does the range the PD then ends where the replicas that answered stopped. The sink
    # looked for them before the PD had ended the range, while the primary still hid that
    # tail, and sent them again (22,065 records stored twice in a run of 600,000 where the
    # secondary was restarted at once).
    with ProcessCluster(tmp_path, range_servers=3) as cluster, \
            ConnectionPool(RIDE_OUT) as pool:
        client = SbpClient(cluster.pd_address, RIDE_OUT, pool)
        source = client.create_streams(1)[0].stream_id
        target = client.create_streams(1, replicas=2)[0].stream_id
        writer = client.open_stream(source)
        for start in range(0, BACKLOG_RECORDS, 10_000):
            writer.append([_numbered(start, 10_000)])

        def stored() -> int:
            return sum(b.header.record_count for b in client.read(target))

        query = (spark.readStream.format("sbp").option("pd", cluster.pd_address)
                 .option("streams", str(source)).option("startingOffsets", "earliest")
                 .option("maxRecordsPerPartition", str(PARTITION_RECORDS)).load()
                 .selectExpr("key", "value").writeStream.format("sbp")
                 .option("pd", cluster.pd_address).option("stream", str(target))
                 .option("idempotent", "true").option("batchMaxRecords", "300")
                 .options(**CONNECTOR_RETRIES)
                 .option("checkpointLocation", str(tmp_path / "checkpoint"))
                 .trigger(availableNow=True).start())
        try:
            wait_until(lambda: stored() >= 20_000, 120, "the sink's first records")
            secondary = next(r.server for r in client.list_ranges(target)[-1].servers
                             if not r.is_primary)
            victim = cluster.range_server_addresses.index(secondary.advertise_addr)
            cluster.kill_range_server(victim)
            query.awaitTermination(300)
        finally:
            if query.isActive:
                query.stop()
        numbers = [int(v[:7]) for b in client.read(target)
                   for v in body_to_arrow(b.data[ENVELOPE_SIZE:ENVELOPE_SIZE
                                                 + b.header.body_length])
                   .column("value").to_pylist()]
        ranges = len(client.list_ranges(target))
    twice = len(numbers) - len(set(numbers))
    figures["output"] = f"{len(numbers)} records in {ranges} ranges, {twice} stored twice"
    assert ranges > 1, "the restart did not fail the output's range over"
    assert twice == 0, f"the idempotent sink stored {twice} records twice"
    assert sorted(numbers) == list(range(BACKLOG_RECORDS))
    for first in range(0, BACKLOG_RECORDS, PARTITION_RECORDS):
        part = [n for n in numbers if first <= n < first + PARTITION_RECORDS]
        assert part == sorted(part), f"partition from {first} out of order"
