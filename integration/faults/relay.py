"""The relay of the Spark streaming fault cases and its exactly-once check.

``Relay`` is the streaming query under test: ``readStream.format("sbp")`` of an input stream
into ``writeStream.format("sbp")`` with ``idempotent=true`` on an output stream, each record
keyed by its input offset; it restarts from its checkpoint when it fails, keeping each
failure's message. ``check_output`` compares the output, record by record, with the input:
every input record exactly once, byte for byte.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from sbp_spark.client import SbpClient
from sbp_spark.protocol.errors import BatchFormatError
from sbp_spark.protocol.records import ENVELOPE_SIZE, BodyFormat, body_to_arrow
from sbp_spark.spark.streaming.idempotent import WriteTag, tag_of_body

from .helpers import check_body, wait_until

# Restarts from the checkpoint a case allows before it gives up on the query (by default).
MAX_RESTARTS = 3
# The micro-batch size limit keeps the query busy with many small micro-batches, so a fault
# hits one while it runs.
MAX_RECORDS_PER_TRIGGER = 300
# Connector options that ride out a server restart or a failover (as RIDE_OUT does for clients).
CONNECTOR_RETRIES = {"retries": "60", "requestTimeoutMs": "10000"}


# A line of a failure that names a Python exception and its message.
PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


def failure_cause(message: str) -> str:
    """The line of a query failure that names the error: a Python data source error comes as
    a Spark error class, a traceback, then the exception (often with a JVM stack after it)."""
    lines = [line.strip() for line in message.strip().splitlines()]
    found = [line for line in lines if PY_ERROR.match(line)]
    return (found[-1] if found else lines[0] if lines else "(no message)")[:300]


class Relay:
    """The streaming query under test: input stream -> idempotent sbp sink -> output stream.
    Restarts from its checkpoint when it fails, and keeps every failure's message."""

    def __init__(self, spark, pd: str, source: int, target: int, checkpoint: str,
                 options: dict[str, str] | None = None,
                 max_restarts: int | None = MAX_RESTARTS) -> None:
        self.spark = spark
        self.max_restarts = max_restarts  # None: restart as often as it fails
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
        """The input offset the query has committed through (restarting it if it died; a
        restart that fails raises, and the next call tries again). Call it from the thread
        that registered the sbp source: Spark looks the source up in that thread."""
        if self.query is not None and not self.query.isActive:
            error = self.query.exception()
            message = str(error) if error is not None else "stopped without an error"
            self.full_failures.append(message)
            self.failures.append(failure_cause(message))
            self.query = None
            assert self.max_restarts is None or len(self.failures) <= self.max_restarts, (
                f"the query failed {len(self.failures)} times: {self.failures}")
        if self.query is None:
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
    # input offset -> the write tag of each copy, for the offsets stored more than once
    copies: dict[int, list[WriteTag | None]] = field(default_factory=dict)
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
    out.copies = {offset: tags_of[offset] for offset in out.duplicated}
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
