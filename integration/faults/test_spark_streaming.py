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

import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    body_to_arrow,
    encode_arrow_batch,
    make_records_batch,
)
from sbp_spark.server.cluster import ProcessCluster

from .helpers import RIDE_OUT, StreamCheck, Writer, check_stream, wait_until
from .relay import CONNECTOR_RETRIES, PY_ERROR, Relay, check_output, stream_led_by

BODY = 1024
# How long the only range server stays down in the R=1 case (the fault itself, not a wait).
OUTAGE_S = 3.0
# Batches the writer gets acknowledged before the query starts, and after the kill.
BACKLOG, AFTER_KILL = 200, 400
# The writer's pace (8 batches, then this pause: about 150 batches/s) and the relay's
# micro-batch size limit keep the query busy with many small micro-batches, so the kill hits
# one while it runs.
WRITER_PAUSE_S = 0.05


def _primary_index(cluster: ProcessCluster, client: SbpClient, stream_id: int) -> int:
    """Index in the cluster of the primary of the stream's open range."""
    rng = client.list_ranges(stream_id)[-1]
    address = next(r.server.advertise_addr for r in rng.servers if r.is_primary)
    return next(i for i, p in enumerate(cluster.range_servers)
                if p is not None and p.info["range_server"] == address)


def _input(client: SbpClient, stream_id: int, writer: Writer) -> tuple[StreamCheck, dict]:
    """The input stream checked against the writer's acknowledgements, and its bodies."""
    check = check_stream(client, stream_id, writer.acked)
    bodies = {b.header.base_offset: bytes(b.data[ENVELOPE_SIZE:]) for b in client.read(stream_id)}
    return check, bodies


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
            assert PY_ERROR.match(message) and any(
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
