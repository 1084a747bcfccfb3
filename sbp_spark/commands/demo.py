"""``sbp demo``: the connector end to end on one machine, in about half a minute.

Starts an embedded SBP cluster (a PD and range servers) in a temporary directory, writes a
generated DataFrame into a few streams with ``df.write.format("sbp")``, reads it back in batch
and checks every stream's rows and offsets, runs a streaming query (``trigger(availableNow)``)
into parquet, appends more rows and runs it again from its checkpoint, then prints what it did.
Everything it started is stopped and its temporary files removed, also when a step fails.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .common import cli_errors

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

DEFAULT_ROWS = 200_000
DEFAULT_STREAMS = 3
DEFAULT_RANGE_SERVERS = 3
# Rows appended before the second streaming run, to show it resumes from its checkpoint.
APPEND_ROWS = 1_000
# Rows written and read before the timed steps, in a stream deleted afterwards.
WARM_UP_ROWS = 1_000
# The streaming query reads the backlog in about this many micro-batches.
STREAM_BATCHES = 4

# Spark's driver logs at INFO by default: the demo keeps only warnings and errors, and drops
# two warnings every run would show (no native Hadoop library; adaptive execution is off in
# streaming queries).
LOG4J2_PROPERTIES = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
logger.nativecode.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativecode.level = error
logger.streamplan.name = org.apache.spark.sql.execution.streaming.runtime.ResolveWriteToStream
logger.streamplan.level = error
# sbp_spark.register() replacing the automatically discovered source is what it is meant to do.
logger.sources.name = org.apache.spark.sql.execution.datasources.DataSourceManager
logger.sources.level = error
"""

# Every generated value is this exact width (JSON padded with spaces), so the bytes written
# are known without a pass over the data, and the batch read can check them.
VALUE_FORMAT = '{"event": %10d, "user": "u%04d", "amount": %9.2f, "note": "%s"}'
NOTE = "sbp-demo-" + "x" * 31
VALUE_BYTES = len(VALUE_FORMAT % (0, 0, 0.0, NOTE))
KEY_FORMAT = "u%04d"
KEY_BYTES = len(KEY_FORMAT % 0)


class DemoError(RuntimeError):
    """A demo step found something wrong (the message says what)."""


@dataclass
class Timed:
    """Rows and payload bytes (key + value) moved by one step, and how long it took."""

    rows: int
    seconds: float
    payload_bytes: int

    @property
    def mb_per_s(self) -> float:
        return self.payload_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass
class StreamSummary:
    """One stream after the demo: rows read back and its ranges."""

    stream_id: int
    rows: int
    ranges: list[str] = field(default_factory=list)
    next_offset: int = 0


@dataclass
class DemoReport:
    """What ``run_demo`` did, for printing and for tests."""

    pd_address: str
    data_dir: str
    stream_ids: list[int]
    data_kept: bool = False
    write: Timed | None = None
    read: Timed | None = None
    streaming_rows: int = 0
    streaming_batches: int = 0
    resumed_rows: int = 0
    streams: list[StreamSummary] = field(default_factory=list)


def expected_rows(rows: int, streams: int, start: int = 0) -> list[int]:
    """Rows per stream of generated rows ``start .. start+rows-1`` (row ``i`` goes to stream
    number ``i % streams``)."""
    def below(n: int, i: int) -> int:  # how many of 0 .. n-1 are i modulo streams
        return (n - i + streams - 1) // streams
    return [below(start + rows, i) - below(start, i) for i in range(streams)]


def generate(spark: SparkSession, stream_ids: list[int], start: int, rows: int) -> DataFrame:
    """Rows ``start .. start+rows-1`` as (stream_id, key, value), spread over ``stream_ids``."""
    from pyspark.sql import functions as F

    ids = F.array(*[F.lit(s) for s in stream_ids])
    n = len(stream_ids)
    event = F.col("id")
    partitions = max(1, min(4, rows // 10_000))
    return spark.range(start, start + rows, numPartitions=partitions).select(
        F.element_at(ids, (event % n + 1).cast("int")).alias("stream_id"),
        F.format_string(KEY_FORMAT, event % 1000).cast("binary").alias("key"),
        F.format_string(VALUE_FORMAT, event, event % 1000, (event * 7919 % 100_000) / 100.0,
                        F.lit(NOTE)).cast("binary").alias("value"),
    )


class _Printer:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def __call__(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)


def _timed_step(say: Callable[[str], None], label: str, step: Callable[[], object]) -> float:
    say(label)
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def _quiet_spark(workdir: Path) -> SparkSession:
    from sbp_spark.environment import local_spark_session

    log_config = workdir / "log4j2-demo.properties"
    log_config.write_text(LOG4J2_PROPERTIES)
    spark = local_spark_session(
        "sbp-demo",
        **{
            "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={log_config.as_uri()}",
            "spark.ui.showConsoleProgress": "false",
        },
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark


def _warm_up(spark: SparkSession, client, pd: str) -> None:
    """Write and read a few rows through the connector in a stream of their own (deleted
    after), so the timed steps do not include Spark's first-query costs: Python workers
    starting, code generation. Measured here, those make a first write of 200k rows take
    several times longer than the second."""
    (stream,) = client.create_streams(count=1)
    try:
        generate(spark, [stream.stream_id], 0, WARM_UP_ROWS).write.format("sbp").option(
            "pd", pd).mode("append").save()
        (spark.read.format("sbp").option("pd", pd).option("streams", str(stream.stream_id))
         .load().groupBy("stream_id").count().collect())
    finally:
        client.delete_streams([stream.stream_id])


def _verify_batch_read(spark: SparkSession, pd: str, stream_ids: list[int],
                       rows: int) -> tuple[Timed, dict[int, int]]:
    from pyspark.sql import functions as F

    df = (spark.read.format("sbp").option("pd", pd)
          .option("streams", ",".join(map(str, stream_ids))).load())
    event = F.get_json_object(F.col("value").cast("string"), "$.event").cast("long")
    started = time.perf_counter()
    got = {
        row["stream_id"]: row
        for row in df.groupBy("stream_id").agg(
            F.count("*").alias("rows"),
            F.countDistinct("offset").alias("offsets"),
            F.min("offset").alias("first"),
            F.max("offset").alias("last"),
            F.sum(F.length("key") + F.length("value")).alias("bytes"),
            F.sum(event).alias("events"),
        ).collect()
    }
    seconds = time.perf_counter() - started
    problems = []
    n = len(stream_ids)
    for i, (stream_id, want) in enumerate(zip(stream_ids, expected_rows(rows, n), strict=True)):
        row = got.get(stream_id)
        if row is None:
            problems.append(f"stream {stream_id}: no rows read back, {want:,} written")
            continue
        want_events = want * i + n * want * (want - 1) // 2
        checks = {"rows": want, "offsets": want, "first": 0, "last": want - 1,
                  "bytes": want * (KEY_BYTES + VALUE_BYTES), "events": want_events}
        for name, value in checks.items():
            if row[name] != value:
                problems.append(f"stream {stream_id}: {name} = {row[name]}, expected {value}")
    if problems:
        raise DemoError("the batch read does not match what was written: " + "; ".join(problems))
    total = sum(r["rows"] for r in got.values())
    return (Timed(total, seconds, total * (KEY_BYTES + VALUE_BYTES)),
            {sid: got[sid]["rows"] for sid in stream_ids})


def _run_stream(spark: SparkSession, pd: str, stream_ids: list[int], output: Path,
                checkpoint: Path, max_records: int) -> int:
    """availableNow up to what the streams hold; the number of micro-batches that read rows.
    One run where pyspark has admission control (4.2+); before, each run is one micro-batch
    within maxRecordsPerTrigger (docs/streaming.md), so it runs until one finds nothing."""
    from sbp_spark.spark.pyspark_api import found

    batches = _run_stream_once(spark, pd, stream_ids, output, checkpoint, max_records)
    if not found().admission_control:
        while ran := _run_stream_once(spark, pd, stream_ids, output, checkpoint, max_records):
            batches += ran
    return batches


def _run_stream_once(spark: SparkSession, pd: str, stream_ids: list[int], output: Path,
                     checkpoint: Path, max_records: int) -> int:
    """One availableNow run; the number of micro-batches that read rows."""
    query = (
        spark.readStream.format("sbp").option("pd", pd)
        .option("streams", ",".join(map(str, stream_ids)))
        .option("startingOffsets", "earliest")
        .option("maxRecordsPerTrigger", str(max_records))
        .load()
        .writeStream.format("parquet")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start(str(output))
    )
    try:
        query.awaitTermination()
    finally:
        if query.isActive:
            query.stop()
    if query.exception() is not None:
        raise DemoError(f"the streaming query failed: {query.exception()}")
    return sum(1 for p in query.recentProgress if p.get("numInputRows", 0) > 0)


def _range_text(rng, next_offset: int) -> str:
    servers = ", ".join(
        f"{r.server.server_id}{'*' if r.is_primary else ''}" for r in rng.servers)
    end = f"{rng.end_offset:,}" if not rng.is_open else f"{next_offset:,} (open)"
    return f"range {rng.range_index}: offsets {rng.start_offset:,} .. {end} on servers {servers}"


def run_demo(rows: int = DEFAULT_ROWS, streams: int = DEFAULT_STREAMS,
             range_servers: int = DEFAULT_RANGE_SERVERS, data_dir: str | None = None,
             out: TextIO | None = None) -> DemoReport:
    """Run the demo, printing its progress to ``out``; raise ``DemoError`` on a mismatch.

    ``data_dir`` keeps the cluster's data and the parquet output there instead of in a
    temporary directory that is removed at the end.
    """
    if rows < streams:
        raise ValueError(f"--rows {rows}: need at least one row per stream ({streams} streams)")
    say = _Printer(out or sys.stdout)
    from sbp_spark.client import SbpClient
    from sbp_spark.environment import check_java, check_pyspark
    from sbp_spark.server.cluster import EmbeddedCluster

    check_pyspark("sbp demo")
    check_java()
    with ExitStack() as stack:
        if data_dir is None:
            workdir = Path(tempfile.mkdtemp(prefix="sbp-demo-"))
            stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        else:
            workdir = Path(data_dir)
            workdir.mkdir(parents=True, exist_ok=True)
        say(f"Starting an embedded SBP cluster (1 PD, {range_servers} range servers) "
            f"in {workdir} ...")
        cluster = stack.enter_context(
            EmbeddedCluster(str(workdir / "cluster"), range_servers=range_servers))
        pd = cluster.pd_address
        client = stack.enter_context(SbpClient(pd))
        stream_ids = [s.stream_id for s in client.create_streams(count=streams)]
        report = DemoReport(pd, str(workdir), stream_ids, data_kept=data_dir is not None)
        say(f"  PD at {pd}; created streams {', '.join(map(str, stream_ids))}")

        say("Starting Spark (local[2]) ...")
        spark = _quiet_spark(workdir)
        stack.callback(spark.stop)
        say("Warming Spark up (its first queries start Python workers and generate code) ...")
        _warm_up(spark, client, pd)

        df = generate(spark, stream_ids, 0, rows)
        seconds = _timed_step(
            say, f"Writing {rows:,} rows with df.write.format(\"sbp\") ...",
            lambda: df.write.format("sbp").option("pd", pd).mode("append").save())
        report.write = Timed(rows, seconds, rows * (KEY_BYTES + VALUE_BYTES))

        say("Reading them back with spark.read.format(\"sbp\") and checking every stream ...")
        report.read, per_stream = _verify_batch_read(spark, pd, stream_ids, rows)

        output, checkpoint = workdir / "stream-output", workdir / "stream-checkpoint"
        max_records = max(1, rows // STREAM_BATCHES)
        say(f"Streaming query, trigger(availableNow=True), maxRecordsPerTrigger={max_records:,}"
            " -> parquet ...")
        report.streaming_batches = _run_stream(spark, pd, stream_ids, output, checkpoint,
                                               max_records)
        report.streaming_rows = spark.read.parquet(str(output)).count()
        if report.streaming_rows != rows:
            raise DemoError(f"the streaming query wrote {report.streaming_rows:,} rows to "
                            f"parquet, expected {rows:,}")

        say(f"Appending {APPEND_ROWS:,} more rows and restarting the query from its "
            "checkpoint ...")
        generate(spark, stream_ids, rows, APPEND_ROWS).write.format("sbp").option(
            "pd", pd).mode("append").save()
        _run_stream(spark, pd, stream_ids, output, checkpoint, max_records)
        total = spark.read.parquet(str(output)).count()
        report.resumed_rows = total - report.streaming_rows
        if report.resumed_rows != APPEND_ROWS:
            raise DemoError(f"the restarted query added {report.resumed_rows:,} rows, expected "
                            f"exactly the {APPEND_ROWS:,} new ones")

        appended = dict(zip(stream_ids, expected_rows(APPEND_ROWS, streams, start=rows),
                            strict=True))
        for stream_id in stream_ids:
            ranges = client.list_ranges(stream_id)
            summary = StreamSummary(stream_id, per_stream[stream_id] + appended[stream_id])
            for rng in ranges:
                next_offset = client.open_range_end(rng) if rng.is_open else rng.end_offset
                summary.next_offset = max(summary.next_offset, next_offset)
                summary.ranges.append(_range_text(rng, next_offset))
            report.streams.append(summary)
        _print_summary(say, report)
    return report


def _print_summary(say: Callable[[str], None], report: DemoReport) -> None:
    say("")
    say("What happened")
    for label, timed in (("write", report.write), ("read ", report.read)):
        if timed is not None:
            say(f"  {label}  {timed.rows:>11,} rows  {timed.payload_bytes / 1e6:8.1f} MB  "
                f"{timed.seconds:6.2f} s  {timed.mb_per_s:7.1f} MB/s  "
                f"{timed.rows_per_s:>10,.0f} rows/s")
    say("  (MB = key + value bytes; each figure includes Spark's fixed cost per query, and the")
    say("   read a Spark aggregation with the checks; `sbp bench` measures sustained throughput)")
    say(f"  streaming: {report.streaming_rows:,} rows in {report.streaming_batches} "
        "micro-batches to parquet;")
    say(f"             restarted from its checkpoint, it read exactly the {report.resumed_rows:,} "
        "new rows")
    say("  streams (* = primary replica):")
    for s in report.streams:
        say(f"    stream {s.stream_id}: {s.rows:,} rows, next offset {s.next_offset:,}")
        for text in s.ranges:
            say(f"      {text}")
    where = (f"kept in {report.data_dir}" if report.data_kept
             else "in a temporary directory, removed now")
    say(f"  PD was at {report.pd_address}; data {where}")
    say("OK: every count and offset matched.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp demo`` to the ``sbp`` command's subparsers."""
    parser = subparsers.add_parser(
        "demo",
        help="run the connector end to end on an embedded cluster",
        description=(
            "Start an embedded SBP cluster, write a generated DataFrame into SBP streams with "
            "Spark, read it back in batch and with a streaming query, print what happened, "
            "and clean up. Needs pyspark and Java 17+; works offline."),
    )
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, metavar="N",
                        help=f"rows to write (default {DEFAULT_ROWS:,})")
    parser.add_argument("--streams", type=int, default=DEFAULT_STREAMS, metavar="N",
                        help=f"streams to spread them over (default {DEFAULT_STREAMS})")
    parser.add_argument("--range-servers", type=int, default=DEFAULT_RANGE_SERVERS, metavar="N",
                        help=f"range servers of the cluster (default {DEFAULT_RANGE_SERVERS})")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="keep the cluster's data and the output here (default: a "
                             "temporary directory, removed at the end)")
    parser.set_defaults(handler=demo_command, command="sbp demo")


@cli_errors
def demo_command(args: argparse.Namespace) -> int:
    """The ``sbp demo`` handler: 0 when everything matched."""
    for name in ("rows", "streams", "range_servers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    # The embedded cluster's start-up and connection notes are not what the demo is about.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("sbp_spark.server").setLevel(logging.WARNING)
    run_demo(rows=args.rows, streams=args.streams, range_servers=args.range_servers,
             data_dir=args.data_dir)
    return 0
