"""A streaming relay whose writing task fails once and is retried by Spark within the same run.

Run as a script by ``test_task_retry.py``, in a process of its own: Spark retries a failed task
only when the master allows several attempts ("local[2,3]"), and the test session's SparkContext
(local[2]: one attempt) cannot be replaced inside the pytest process.

    python task_retry_job.py PD SOURCE TARGET CHECKPOINT MARKER RECORDS_PER_PARTITION

The query reads SOURCE (``startingOffsets=earliest``, two partitions), passes every value
through a Python UDF and writes to TARGET with ``idempotent=true``, with
``trigger(availableNow=True)``. In partition 1's first attempt the UDF holds the partition's
last row until the sink's first APPEND of that partition has landed in TARGET (so the attempt
wrote part of its batches), records what landed in MARKER, and raises. Spark runs the task
again; the retry must skip what the failed attempt stored. Prints one JSON line: the query id,
the micro-batches run, and the query's error if it failed.
"""

from __future__ import annotations

import json
import os
import sys


def _udf(pd: str, target: int, marker: str, last_offset: int):
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType

    def fail_once(offset, value):
        # self-contained: runs in an executor's Python worker
        import time

        from pyspark import TaskContext

        from sbp_spark.client import SbpClient
        from sbp_spark.protocol.records import ENVELOPE_SIZE
        from sbp_spark.spark.streaming.idempotent import tag_of_body

        if offset != last_offset or os.path.exists(marker):
            return value
        context = TaskContext.get()
        client = SbpClient(pd)
        deadline = time.monotonic() + 60
        while True:
            landed = [b.header.record_count for b in client.read(target)
                      if (tag := tag_of_body(b.data[ENVELOPE_SIZE:ENVELOPE_SIZE
                                                    + b.header.body_length])) is not None
                      and tag.partition_id == context.partitionId()]
            if landed:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the sink's first APPEND of partition 1 never landed")
            time.sleep(0.05)
        with open(marker, "w") as out:
            json.dump({"attempt": context.attemptNumber(), "partition": context.partitionId(),
                       "batches": len(landed), "records": sum(landed)}, out)
        raise RuntimeError("injected failure after part of the task's output landed")

    return F.udf(fail_once, BinaryType(), useArrow=False)


def main(argv: list[str]) -> int:
    pd, source, target, checkpoint, marker, per_partition = argv
    source_id, target_id, per = int(source), int(target), int(per_partition)
    from sbp_spark.environment import local_spark_session

    spark = local_spark_session("sbp-task-retry", master="local[2,3]", **{
        "spark.driver.memory": "1g",
        "spark.ui.showConsoleProgress": "false",
        # Small Arrow batches between Spark and the sink, so the sink receives (and appends)
        # the first rows of a partition while the UDF still holds its last row.
        "spark.sql.execution.arrow.maxRecordsPerBatch": "500",
    })
    spark.sparkContext.setLogLevel("ERROR")
    relay = (spark.readStream.format("sbp").option("pd", pd).option("streams", source)
             .option("startingOffsets", "earliest")
             .option("maxRecordsPerPartition", str(per)).load())
    # partition 1 holds offsets [per, 2 * per): its last row is the stream's last record
    udf = _udf(pd, target_id, marker, 2 * per - 1)
    query = (relay.select("key", udf("offset", "value").alias("value"))
             .writeStream.format("sbp").option("pd", pd).option("stream", str(target_id))
             .option("idempotent", "true")
             .option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    error = None
    try:
        query.awaitTermination(240)
    except Exception as exc:  # the query failed: report it to the test
        error = str(exc).strip().splitlines()[0]
    if query.isActive:
        query.stop()
        error = error or "the query did not finish within 240 s"
    batches = (query.lastProgress.batchId + 1) if query.lastProgress else 0
    print(json.dumps({"query_id": query.id, "micro_batches": batches, "error": error,
                      "source": source_id}))
    spark.stop()
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
