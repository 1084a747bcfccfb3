"""A Spark job that writes rows into SBP streams through the connector and reads them back.

Submitted with spark-submit by the Spark standalone test (``test_standalone.py``) and by the
``job`` service of docker-compose.yml, so the connector's reads and writes run in executors
on a worker, not in a local-mode driver::

    spark-submit --master spark://HOST:7077 integration/standalone/job.py --pd HOST:2378

``--pd`` may come from ``$SBP_PD`` instead (docker-compose.yml sets it for every service).

It creates its own streams, writes ``--rows`` generated rows spread over them with
``df.write.format("sbp")``, reads them back with ``spark.read.format("sbp")`` and checks,
per stream, the row count, the offsets (0 .. count-1) and the sum of the numbers written in
the values. It prints one line ``SBP_JOB_RESULT {json}`` and exits 0 when everything matches,
1 when something does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

RESULT_PREFIX = "SBP_JOB_RESULT "
APP_NAME = "sbp-standalone-job"


def build_parser() -> argparse.ArgumentParser:
    """The job's command line (also used by tests/test_compose.py to check the compose file)."""
    parser = argparse.ArgumentParser(
        prog="job.py", description="Write rows into SBP streams through Spark and read them back.")
    env_pd = os.environ.get("SBP_PD") or None
    parser.add_argument("--pd", required=env_pd is None, default=env_pd, metavar="HOST:PORT",
                        help="address(es) of the SBP placement driver, as the executors reach "
                             "them (default: $SBP_PD, and one of the two is required)")
    parser.add_argument("--rows", type=int, default=100_000, help="rows to write (default 100000)")
    parser.add_argument("--streams", type=int, default=2,
                        help="streams to create and spread the rows over (default 2)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="replicas of each stream (default 1; at most the range servers)")
    parser.add_argument("--partitions", type=int, default=4,
                        help="Spark partitions of the written DataFrame (default 4)")
    parser.add_argument("--wait-s", type=float, default=120.0,
                        help="how long to wait for the PD and enough live range servers "
                             "(default 120)")
    return parser


def expected_counts(rows: int, streams: int) -> list[int]:
    """Rows that land in each stream when row i goes to stream number i % streams."""
    return [(rows - i + streams - 1) // streams for i in range(streams)]


def expected_sums(rows: int, streams: int) -> list[int]:
    """Sum of the row numbers that land in each stream."""
    sums = []
    for i in range(streams):
        count = (rows - i + streams - 1) // streams
        # i, i + s, i + 2s, ...: count terms
        sums.append(count * i + streams * count * (count - 1) // 2)
    return sums


def create_streams(pd: str, streams: int, replicas: int, wait_s: float) -> list[int]:
    """Create the streams, waiting while the PD is not up or has too few live range servers
    (in docker-compose every service starts at once)."""
    from sbp_spark.client import SbpClient
    from sbp_spark.protocol.errors import NotEnoughServersError, SbpTimeoutError, TransportError

    deadline = time.monotonic() + wait_s
    with SbpClient(pd) as client:
        while True:
            try:
                return [s.stream_id for s in client.create_streams(count=streams,
                                                                   replicas=replicas)]
            except (NotEnoughServersError, TransportError, SbpTimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no cluster ready at {pd} within {wait_s:.0f} s: "
                                       f"{exc}") from exc
                print(f"job.py: waiting for the SBP cluster: {exc}", file=sys.stderr)
                time.sleep(1.0)


def run(spark, pd: str, stream_ids: list[int], rows: int, partitions: int) -> dict:
    """Write, read back and verify; the result dict has ``ok`` and what was checked."""
    from pyspark.sql import functions as F

    streams = len(stream_ids)

    ids = F.array(*[F.lit(s) for s in stream_ids])
    df = spark.range(0, rows, numPartitions=partitions).select(
        F.element_at(ids, (F.col("id") % streams + 1).cast("int")).alias("stream_id"),
        F.format_string("%d", F.col("id") % 100).cast("binary").alias("key"),
        F.format_string("event-%012d", F.col("id")).cast("binary").alias("value"),
    )
    started = time.perf_counter()
    df.write.format("sbp").option("pd", pd).mode("append").save()
    write_s = time.perf_counter() - started

    started = time.perf_counter()
    read = (spark.read.format("sbp").option("pd", pd)
            .option("streams", ",".join(str(s) for s in stream_ids)).load())
    number = F.substring(F.col("value").cast("string"), 7, 12).cast("long")
    per_stream = {
        row["stream_id"]: row
        for row in read.groupBy("stream_id").agg(
            F.count("*").alias("rows"),
            F.countDistinct("offset").alias("distinct_offsets"),
            F.min("offset").alias("min_offset"),
            F.max("offset").alias("max_offset"),
            F.sum(number).alias("sum"),
        ).collect()
    }
    read_s = time.perf_counter() - started

    problems = []
    counts, sums = expected_counts(rows, streams), expected_sums(rows, streams)
    for stream_id, count, total in zip(stream_ids, counts, sums, strict=True):
        got = per_stream.get(stream_id)
        if got is None:
            problems.append(f"stream {stream_id}: nothing read back, expected {count} rows")
            continue
        want = {"rows": count, "distinct_offsets": count, "min_offset": 0,
                "max_offset": count - 1, "sum": total}
        for name, value in want.items():
            if got[name] != value:
                problems.append(f"stream {stream_id}: {name} = {got[name]}, expected {value}")
    extra = sorted(set(per_stream) - set(stream_ids))
    if extra:
        problems.append(f"rows read from streams never written: {extra}")

    return {
        "ok": not problems,
        "problems": problems,
        "master": spark.sparkContext.master,
        "app_id": spark.sparkContext.applicationId,
        "streams": stream_ids,
        "rows_written": rows,
        "rows_read": sum(r["rows"] for r in per_stream.values()),
        "write_s": round(write_s, 3),
        "read_s": round(read_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rows < 1 or args.streams < 1 or args.replicas < 1 or args.partitions < 1:
        print("job.py: --rows, --streams, --replicas and --partitions must be >= 1",
              file=sys.stderr)
        return 2
    from pyspark.sql import SparkSession

    import sbp_spark

    stream_ids = create_streams(args.pd, args.streams, args.replicas, args.wait_s)
    spark = SparkSession.builder.appName(APP_NAME).getOrCreate()
    try:
        spark.sparkContext.setLogLevel("WARN")
        sbp_spark.register(spark)
        result = run(spark, args.pd, stream_ids, args.rows, args.partitions)
    finally:
        spark.stop()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
