"""A batch read planned before its range was sealed below the plan (a rewritten history,
issue 22) fails naming both offsets, or with failOnDataLoss=false ends at the seal. The reader
runs here without a Spark session: planning and reading are the connector's own calls."""

from __future__ import annotations

import pytest

from sbp_spark.spark.options import parse_read_options
from sbp_spark.spark.reader import ReadFailedError, SbpBatchReader
from sbp_spark.spark.schemas import records_schema
from tests.rewrite import rewrite_history

from .test_batch import append_values, new_stream


def test_a_read_whose_range_was_sealed_below_its_plan_fails_or_ends_there(
        pd, sbp_cluster, sbp_client):
    # Issue 22: partitions were planned with the open range's end (10); before they were read,
    # the range was sealed at 6 and other records followed. The read must not pass that by.
    sid = new_stream(sbp_client)
    for i in range(10):  # a range ends between batches
        append_values(sbp_client, sid, [f"v{i}"])

    def reader(**options):
        return SbpBatchReader(parse_read_options({"pd": pd, "streams": str(sid), **options}),
                              records_schema())

    [part] = reader().partitions()
    assert (part.start_offset, part.end_offset) == (0, 10)
    rewrite_history(sbp_cluster, sid, 6)
    with pytest.raises(ReadFailedError, match=(
            rf"range 0 of stream {sid} was sealed at offset 6, below the end 10 planned.*"
            "failOnDataLoss=false")):
        list(reader().read(part))
    tolerant = reader(failOnDataLoss="false").read(part)
    assert sum(batch.num_rows for batch in tolerant) == 6
