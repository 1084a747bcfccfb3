"""The idempotent sink when Spark retries a failed task within one run of the query.

test_stream_write.py covers a micro-batch replayed after the query failed and was restarted.
Here the query never fails: a writing task fails after part of its output landed and Spark
runs it again in the same micro-batch (``local[2,3]``: three attempts per task), so the retry
must find and skip what the first attempt stored. The job runs in a Spark of its own
(``task_retry_job.py``), against this session's embedded cluster; slow for that reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    body_to_arrow,
    encode_arrow_batch,
    make_records_batch,
)
from sbp_spark.spark.streaming.idempotent import tag_of_body

from .helpers import new_stream

JOB = Path(__file__).with_name("task_retry_job.py")
REPO = Path(__file__).resolve().parents[3]
# Two partitions of 3,000 records of 8 KiB: 24 MiB each, more than one sink APPEND call
# (16 MiB), so the failing attempt lands its first call before it fails.
PER_PARTITION = 3_000
VALUE_BYTES = 8192


def _value(i: int) -> bytes:
    head = f"r{i:08d}:".encode()
    return head + bytes([97 + i % 26]) * (VALUE_BYTES - len(head))


@pytest.mark.slow  # a Spark of its own: 10-15 s to start, 20-30 s in all on two cores
@pytest.mark.spark
@pytest.mark.timeout(300)
def test_task_retried_within_the_run_writes_each_record_once(sbp_client, pd, tmp_path):
    source, target = new_stream(sbp_client), new_stream(sbp_client)
    writer = sbp_client.open_stream(source)
    total = 2 * PER_PARTITION
    for start in range(0, total, 500):
        values = pa.array([_value(i) for i in range(start, start + 500)], pa.binary())
        writer.append([encode_arrow_batch(make_records_batch(values))])
    marker = tmp_path / "failed-once.json"

    run = subprocess.run(
        [sys.executable, str(JOB), pd, str(source), str(target), str(tmp_path / "checkpoint"),
         str(marker), str(PER_PARTITION)],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the job printed no result (exit {run.returncode}):\n{run.stderr[-3000:]}"
    result = json.loads(lines[-1])
    # the query itself never failed: Spark retried the task inside the micro-batch
    assert result["error"] is None and run.returncode == 0, result["error"]
    assert result["micro_batches"] == 1

    failed = json.loads(marker.read_text())  # written by the failed attempt before it raised
    assert failed["attempt"] == 0 and failed["partition"] == 1
    # part of the attempt's output had landed when it failed (the sink's first APPEND call)
    assert 0 < failed["records"] < PER_PARTITION, failed

    values: list[bytes] = []
    tags = []
    for fetched in sbp_client.read(target):
        body = fetched.data[ENVELOPE_SIZE:ENVELOPE_SIZE + fetched.header.body_length]
        values += body_to_arrow(body).column("value").to_pylist()
        tags.append(tag_of_body(body))
    repeated = [v[:9] for v, n in Counter(values).items() if n > 1]
    assert not repeated, f"{len(repeated)} records stored twice, e.g. {repeated[:3]}"
    assert sorted(values) == [_value(i) for i in range(total)]
    # every stored batch is one (partition, seq) of this query's only micro-batch
    assert {(t.query_id, t.batch_id) for t in tags} == {(result["query_id"], 0)}
    keys = [(t.partition_id, t.seq) for t in tags]
    assert len(keys) == len(set(keys))
    assert {p for p, _ in keys} == {0, 1}
