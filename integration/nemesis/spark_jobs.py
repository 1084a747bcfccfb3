"""The nemesis's Spark jobs: a process of their own (on a network node of its own) with its own
local[2] SparkSession, running two things at once until told to stop:

- a batch loop: job ``j`` writes ``--rows`` rows with ``df.write.format("sbp")`` to the batch
  stream, then reads back with ``spark.read.format("sbp")`` everything after what it read
  before. A job that fails is run again (try ``a + 1``) until it succeeds, as an orchestrator
  would. Each row's key is ``<job>:<row>`` and its value names the job, the row, the try, and
  the attempt number and id of the Spark task that wrote it (``j7 r12 a0 t1 i345``; the id
  tells every run of a task apart, stage retries included), so a row stored twice says why:
  the client sent the same bytes twice within a task, Spark ran the task again, or the job
  ran again after failing. Each read's rows go to ``--reads`` as (offset, CRC-32 of the
  value), to be compared with the stream's final log; the read itself is checked at once
  (every offset of the read once, without holes).
- the relay (``integration/faults/relay.py``): ``readStream`` of the relay input into
  ``writeStream.format("sbp")`` with ``idempotent=true`` on the relay output, restarted from
  its checkpoint whenever it fails (between jobs: Spark finds the sbp source only in the
  thread that registered it, this process's main thread).

It reports on stdout, one JSON object per line (times are ``time.monotonic()``, which every
process on this machine shares)::

    {"e": "ready"}                                   the relay has processed a micro-batch
    {"e": "job", "job": 3, "try": 0, "ok": true, "rows": 2000, "t0": ..., "t1": ...}
    {"e": "job", "job": 4, "try": 0, "ok": false, "error": "...", "t0": ..., "t1": ...}
    {"e": "read", "job": 3, "start": 4000, "end": 6000, "rows": 2000, "problems": [], ...}
    {"e": "read", "job": 4, "ok": false, "error": "...", "t0": ..., "t1": ...}
    {"e": "relay", "processed": 1234, "batch": 17}    progress of the relay
    {"e": "relay_failed", "error": "...", "t": ...}   the query failed; restarted
    {"e": "drained", "processed": 5678, "ok": true}  the relay reached the end it was given
    {"e": "done"}

stdin ``stop <end>`` ends the batch loop after the job under way, waits (up to
``--drain-timeout-s``) until the relay has processed the relay input through ``<end>``, stops
the query and the session, and exits.

    python -m integration.nemesis.spark_jobs --pd H:P,... --batch-stream 5 --relay-in 3 \\
        --relay-out 4 --checkpoint DIR --reads FILE
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import threading
import time
import zlib
from pathlib import Path

from integration.faults.driver import Events
from integration.faults.relay import Relay, failure_cause

# One read's row as written to --reads: offset, CRC-32 of the value.
READ_ROW = struct.Struct(">qI")
# A failed job is run again this many times at most before the loop moves on to the next.
MAX_TRIES = 20
# Between jobs: the loop writes steadily without taking both cores from the servers.
JOB_PAUSE_S = 1.0


def row_value(job: int, row: int, attempt: int, task_attempt: int, task_id: int) -> bytes:
    """The value of row ``row`` of job ``job`` (see the module doc)."""
    return f"j{job} r{row} a{attempt} t{task_attempt} i{task_id}".encode()


def parse_value(value: bytes) -> tuple[int, int, int, int, int]:
    """(job, row, try, task attempt, task id) of a ``row_value``; ValueError if not."""
    words = value.decode(errors="replace").split()
    if len(words) != 5 or [w[:1] for w in words] != list("jrati"):
        raise ValueError(f"not a nemesis row: {value[:60]!r}")
    try:
        job, row, attempt, task, task_id = (int(w[1:]) for w in words)
    except ValueError:
        raise ValueError(f"not a nemesis row: {value[:60]!r}") from None
    return job, row, attempt, task, task_id


class SparkJobs:
    def __init__(self, args: argparse.Namespace, events: Events) -> None:
        from sbp_spark.environment import local_spark_session

        self.args = args
        self.events = events
        self.spark = local_spark_session("sbp-nemesis", master="local[2]", **{
            "spark.driver.memory": "1g", "spark.ui.showConsoleProgress": "false"})
        self.spark.sparkContext.setLogLevel("ERROR")
        self.read_from = 0
        self.reads = open(args.reads, "ab")  # noqa: SIM115 - closed in run()
        self.stop = threading.Event()
        self.drain_to: int | None = None
        self.reported = (0, -1)  # the relay's progress reported last
        self.relay = Relay(self.spark, args.pd, args.relay_in, args.relay_out,
                           args.checkpoint, options={}, max_restarts=None)
        self.processed = 0

    # -- the batch loop ---------------------------------------------------------------------

    def frame(self, job: int, attempt: int):
        """The rows of job ``job``, try ``attempt``, each tagged by the task writing it."""
        from pyspark import TaskContext

        def tag(batches):
            import pyarrow as pa

            ctx = TaskContext.get()
            task, task_id = ctx.attemptNumber(), ctx.taskAttemptId()
            for batch in batches:
                rows = batch.column(0).to_pylist()
                yield pa.RecordBatch.from_arrays([
                    pa.array([f"{job}:{r}".encode() for r in rows], pa.binary()),
                    pa.array([row_value(job, r, attempt, task, task_id) for r in rows],
                             pa.binary())], names=["key", "value"])

        return self.spark.range(self.args.rows, numPartitions=self.args.partitions) \
            .mapInArrow(tag, "key binary, value binary")

    def write(self, job: int, attempt: int) -> bool:
        began = time.monotonic()
        try:
            self.frame(job, attempt).write.format("sbp").option("pd", self.args.pd) \
                .option("stream", str(self.args.batch_stream)).mode("append").save()
        except Exception as exc:  # noqa: BLE001 - every failure of the job is reported
            self.events.emit({"e": "job", "job": job, "try": attempt, "ok": False,
                              "error": failure_cause(str(exc)), "t0": began,
                              "t1": time.monotonic()})
            return False
        self.events.emit({"e": "job", "job": job, "try": attempt, "ok": True,
                          "rows": self.args.rows, "t0": began, "t1": time.monotonic()})
        return True

    def read(self, job: int) -> None:
        """Read the batch stream from where the last read ended, check the read and keep its
        rows for the comparison with the final log."""
        began = time.monotonic()
        start = self.read_from
        try:
            rows = self.spark.read.format("sbp").option("pd", self.args.pd) \
                .option("streams", str(self.args.batch_stream)) \
                .option("startingOffsets", json.dumps({str(self.args.batch_stream): start})) \
                .load().select("offset", "value").collect()
        except Exception as exc:  # noqa: BLE001 - every failure of the read is reported
            self.events.emit({"e": "read", "job": job, "ok": False,
                              "error": failure_cause(str(exc)), "t0": began,
                              "t1": time.monotonic()})
            return
        offsets = sorted(r.offset for r in rows)
        problems = []
        if offsets and offsets[0] != start:
            problems.append(f"began at offset {offsets[0]}, not {start}")
        repeated = len(offsets) - len(set(offsets))
        if repeated:
            problems.append(f"{repeated} offsets read twice")
        end = offsets[-1] + 1 if offsets else start
        if len(set(offsets)) != end - start:
            problems.append(f"{end - start - len(set(offsets))} offsets of [{start}, {end}) "
                            "missing")
        self.reads.write(b"".join(READ_ROW.pack(r.offset, zlib.crc32(r.value)) for r in rows))
        self.reads.flush()
        self.read_from = end
        self.events.emit({"e": "read", "job": job, "ok": True, "start": start, "end": end,
                          "rows": len(rows), "problems": problems, "t0": began,
                          "t1": time.monotonic()})

    def batch_loop(self) -> None:
        """Jobs, each run again until it succeeds, and a read after each; the relay is looked
        after between them (this thread registered the sbp source: Spark finds it only here)."""
        job = 0
        while not self.stop.is_set():
            job += 1
            for attempt in range(MAX_TRIES):
                self.look_after_relay()
                if self.write(job, attempt) or self.stop.is_set():
                    break
            self.read(job)
            self.look_after_relay()
            self.stop.wait(JOB_PAUSE_S)

    # -- the relay --------------------------------------------------------------------------

    def look_after_relay(self) -> None:
        """Note the relay's progress and failures; restart it when it failed."""
        failures = len(self.relay.failures)
        try:
            processed = self.relay.processed_to()
        except Exception as exc:  # noqa: BLE001 - a restart that failed: tried again next time
            self.events.emit({"e": "relay_failed", "error": "restarting the query failed: "
                              + failure_cause(str(exc)), "t": time.monotonic()})
            processed = 0
        for error in self.relay.failures[failures:]:
            self.events.emit({"e": "relay_failed", "error": error, "t": time.monotonic()})
        self.processed = max(self.processed, processed)
        if (self.processed, self.relay.last_batch_id) != self.reported:
            self.reported = (self.processed, self.relay.last_batch_id)
            self.events.emit({"e": "relay", "processed": self.processed,
                              "batch": self.relay.last_batch_id})

    def wait_relay(self, until, timeout_s: float) -> bool:
        """Look after the relay until ``until()`` holds (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while not until():
            if time.monotonic() > deadline:
                return False
            self.look_after_relay()
            time.sleep(0.5)
        return True

    def run(self) -> None:
        threading.Thread(target=self.read_commands, daemon=True).start()
        try:
            self.relay.start()
            self.wait_relay(lambda: self.relay.last_batch_id >= 0, self.args.drain_timeout_s)
            self.events.emit({"e": "ready"})
            self.batch_loop()
            drained = self.wait_relay(lambda: self.processed >= (self.drain_to or 0),
                                      self.args.drain_timeout_s)
            self.events.emit({"e": "drained", "processed": self.processed, "ok": drained})
        finally:
            self.relay.stop()
            self.reads.close()
            self.spark.stop()

    def read_commands(self) -> None:
        for line in sys.stdin:
            words = line.split()
            if words[:1] == ["stop"]:
                self.drain_to = int(words[1]) if len(words) > 1 else 0
                break
        if self.drain_to is None:  # stdin closed: the nemesis is gone
            self.drain_to = 0
        self.stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pd", required=True)
    parser.add_argument("--batch-stream", type=int, required=True)
    parser.add_argument("--relay-in", type=int, required=True)
    parser.add_argument("--relay-out", type=int, required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--reads", required=True, type=Path)
    parser.add_argument("--rows", type=int, default=2000, help="rows per batch job")
    parser.add_argument("--partitions", type=int, default=4, help="tasks per batch job")
    parser.add_argument("--drain-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    events = Events()
    SparkJobs(args, events).run()
    events.emit({"e": "done"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
