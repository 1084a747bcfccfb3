"""What a batch write's task reports it appended (its commit message, the driver's log line
and a failed task's error) names the ranges that hold the records."""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.types import BinaryType, StructField, StructType

from sbp_spark.client import SbpClient
from sbp_spark.spark import writer as writer_module
from sbp_spark.spark.encode import RowEncoder
from sbp_spark.spark.options import parse_write_options
from sbp_spark.spark.writer import SbpBatchWriter, summarize

from .streaming.helpers import wait_for


def test_a_task_reports_the_range_its_records_landed_in_after_a_seal(tmp_path, monkeypatch):
    # Another client seals the stream's range while a task writes, and the PD opens the next
    # one on the same (only) server: the records after the seal are in range 1, but the task
    # reported every record in range 0 ("offsets 0-3 in range 0").
    from sbp_spark.server.cluster import EmbeddedCluster

    monkeypatch.setattr(writer_module, "APPEND_CALL_BYTES", 1)  # one append call per batch
    with EmbeddedCluster(str(tmp_path / "cluster"), range_servers=1) as cluster:
        pd = cluster.pd_address
        other = SbpClient(pd)
        sid = other.create_streams(1)[0].stream_id
        options = parse_write_options({"pd": pd, "stream": str(sid), "batchMaxRecords": "1"})
        schema = StructType([StructField("value", BinaryType())])
        task = SbpBatchWriter(options, RowEncoder.for_schema(schema, "records", sid), sid)

        def rows():
            for i in range(4):
                if i == 2:  # both records of range 0 are stored: seal it
                    wait_for(lambda: sum(1 for _ in other.read(sid)) == 2, 30,
                             "the first two records")
                    other.seal_range(sid)
                yield pa.record_batch({"value": pa.array([b"v%d" % i], pa.binary())})

        message = task.write(rows())
        assert [(s.range_index, s.first_offset, s.last_offset, s.records)
                for s in message.spans] == [(0, 0, 1, 2), (1, 2, 3, 2)]
        assert summarize([message]) == [
            f"stream {sid}: 4 records, {sum(s.bytes for s in message.spans)} bytes in 4 "
            "batches, offsets 0-3 in ranges 0,1, from 1 tasks"]
        other.close()
