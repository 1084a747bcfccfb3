"""The objects Spark pickles and calls, checked without Spark or a cluster."""

from __future__ import annotations

import logging
import pickle

import pytest
from pyspark.sql.datasource import DataSourceReader
from pyspark.sql.types import BinaryType, StructField, StructType

from sbp_spark.client import Appended
from sbp_spark.spark.options import parse_read_options, parse_write_options
from sbp_spark.spark.pyspark_api import found
from sbp_spark.spark.reader import SbpBatchReader, SbpPushdownBatchReader
from sbp_spark.spark.schemas import records_schema
from sbp_spark.spark.source import SbpDataSource, SbpDataSourceNoPushdown
from sbp_spark.spark.writer import (
    SbpBatchWriter,
    SbpCommitMessage,
    _TaskAppends,
    summarize,
)

from .pyspark_features import requires

if found().filter_pushdown:  # Spark's filter classes came with pushdown (pyspark 4.1)
    from pyspark.sql.datasource import EqualTo, GreaterThan

OPTIONS = {"pd": "127.0.0.1:1", "streams": "3"}


def test_data_source_names_and_option_checks():
    assert SbpDataSource.name() == SbpDataSourceNoPushdown.name() == "sbp"
    source = SbpDataSource(dict(OPTIONS))
    assert source.schema() == records_schema()
    assert SbpDataSource({**OPTIONS, "includeHeaders": "true"}).schema().fieldNames()[-1] == \
        "headers"
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        SbpDataSource({**OPTIONS, "bogus": "1"})
    with pytest.raises(ValueError, match="cannot overwrite"):
        source.writer(StructType([StructField("value", BinaryType())]), overwrite=True)
    with pytest.raises(ValueError, match="'other' of the given schema is not a payload=records"):
        source.reader(StructType([StructField("other", BinaryType())]))


@requires("filter_pushdown")
def test_only_the_pushdown_reader_overrides_push_filters():
    # pyspark fails every read of a reader overriding pushFilters while pushdown is off
    plain = SbpDataSourceNoPushdown(dict(OPTIONS)).reader(records_schema())
    assert type(plain) is SbpBatchReader
    assert plain.pushFilters.__func__ is DataSourceReader.pushFilters
    reader = SbpDataSource(dict(OPTIONS)).reader(records_schema())
    assert type(reader) is SbpPushdownBatchReader
    left = list(reader.pushFilters([EqualTo(("offset",), 5), GreaterThan(("value",), b"a")]))
    assert left == [GreaterThan(("value",), b"a")]
    assert reader.pushed.intervals["offset"] == ((5, 6),)
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.pushed == reader.pushed and clone.options == reader.options


def test_commit_messages_and_summary(caplog):
    appends = _TaskAppends()
    appends.record([Appended(7, 0, 0, 100, 5000), Appended(7, 0, 100, 50, 2600),
                    Appended(7, 1, 150, 10, 600), Appended(9, 0, 40, 5, 300)])
    message = appends.message()
    assert [(s.stream_id, s.range_index, s.first_offset, s.last_offset, s.records, s.bytes,
             s.batches) for s in message.spans] == [
        (7, 0, 0, 149, 150, 7600, 2), (7, 1, 150, 159, 10, 600, 1), (9, 0, 40, 44, 5, 300, 1)]
    other = SbpCommitMessage(pickle.loads(pickle.dumps(message)).spans[:1])
    lines = summarize([message, None, other])
    assert lines == [
        "stream 7: 310 records, 15800 bytes in 5 batches, offsets 0-159 in ranges 0,1, "
        "from 2 tasks",
        "stream 9: 5 records, 300 bytes in 1 batches, offsets 40-44 in range 0, from 1 tasks",
    ]
    writer = SbpBatchWriter(parse_write_options({"pd": "h:1", "stream": "7"}), None, 7)
    with caplog.at_level(logging.INFO, logger="sbp_spark.spark.writer"):
        writer.commit([message])
        writer.abort([message, None])
    assert "sbp write committed: stream 7: 160 records" in caplog.text
    assert "1 of 2 tasks failed" in caplog.text


def test_read_options_are_picklable_and_hashable():
    options = parse_read_options({**OPTIONS, "startingOffsets": '{"3": 4}'})
    assert pickle.loads(pickle.dumps(options)) == options
    assert hash(options.client) == hash(parse_read_options(OPTIONS).client)


def test_one_client_per_process_and_options():
    from sbp_spark.spark import cluster_access

    first = parse_read_options(OPTIONS).client
    again = parse_read_options({**OPTIONS, "startingOffsets": '{"3": 4}'}).client
    other = parse_read_options({**OPTIONS, "retries": "2"}).client
    try:
        assert cluster_access.get_client(first) is cluster_access.get_client(again)
        assert cluster_access.get_client(other) is not cluster_access.get_client(first)
        assert cluster_access.get_client(other).config.retries == 2
    finally:
        cluster_access.close_clients()
