"""Option parsing: names checked case-insensitively, every bad value named with what is allowed."""

from __future__ import annotations

import pytest

from sbp_spark.client.config import DEFAULT_MAX_INFLIGHT_FRAMES
from sbp_spark.spark.options import (
    EARLIEST,
    LATEST,
    OPTIONS,
    OffsetSpec,
    OptionError,
    TimeSpec,
    check_option_names,
    options_table_markdown,
    parse_read_options,
    parse_stream_read_options,
    parse_stream_write_options,
    parse_write_options,
)

PD = {"pd": "127.0.0.1:2378"}


def test_read_defaults_and_case_insensitive_names():
    opts = parse_read_options({"PD": "h:1,h2:2", "STREAMS": "3, 1,3", "payload": "Records"})
    assert opts.client.pd == ("h:1", "h2:2")
    assert opts.streams == (3, 1)
    assert opts.starting == OffsetSpec(EARLIEST)
    assert opts.ending == OffsetSpec(LATEST)
    assert opts.fail_on_data_loss is True
    assert opts.include_headers is False
    assert opts.payload == "records"
    assert opts.max_records_per_partition is None and opts.min_partitions is None
    config = opts.client.client_config()
    assert config.retries is None and config.max_inflight_frames == DEFAULT_MAX_INFLIGHT_FRAMES
    assert config.request_timeout_s == 30.0


def test_read_all_values():
    opts = parse_read_options({
        **PD, "streams": "1,2", "startingOffsets": '{"1": 5, "2": -2}',
        "endingOffsets": '{"2": 40}', "failOnDataLoss": "FALSE", "includeHeaders": "true",
        "fetchMaxBytes": "8m", "fetchMaxWaitMs": "20", "maxRecordsPerPartition": "1000",
        "minPartitions": "4", "requestTimeoutMs": "1500", "retries": "0",
    })
    assert opts.starting.for_stream(1) == 5 and opts.starting.for_stream(2) == EARLIEST
    assert opts.ending.for_stream(2) == 40 and opts.ending.for_stream(1) == LATEST
    assert opts.fail_on_data_loss is False and opts.include_headers is True
    assert opts.fetch_max_bytes == 8 << 20 and opts.fetch_max_wait_ms == 20
    assert opts.max_records_per_partition == 1000 and opts.min_partitions == 4
    assert opts.client.client_config().request_timeout_s == 1.5


@pytest.mark.parametrize(("options", "message"), [
    ({"streams": "1"}, "option 'pd' is required"),
    ({**PD}, "option 'streams' is required"),
    ({**PD, "stream": "1"}, "option 'stream' is for writing"),
    ({**PD, "pd": "localhost"}, "option 'pd' = 'localhost'.*host:port"),
    ({**PD, "pd": "h:99999"}, "ports 1-65535"),
    ({**PD, "streams": "1,x y"}, "option 'streams' = '1,x y'.*neither a stream id"),
    ({**PD, "streams": "1,,2"}, "option 'streams'"),
    ({**PD, "streams": "-1"}, "option 'streams'"),
    ({**PD, "streams": "1,9223372036854775808"},
     "option 'streams' = '1,9223372036854775808'.*0 to 9223372036854775807"),
    ({**PD, "streams": "1", "startingOffsets": "latest"}, "option 'startingOffsets'.*earliest"),
    ({**PD, "streams": "1", "startingOffsets": "{bad"}, "option 'startingOffsets'"),
    ({**PD, "streams": "1", "startingOffsets": '{"1": -7}'}, "offsets >= 0"),
    ({**PD, "streams": "1", "startingOffsets": '{"1": 1.5}'}, "offsets >= 0"),
    ({**PD, "streams": "1", "startingOffsets": '{"x": 1}'}, "keys are stream ids"),
    ({**PD, "streams": "1", "startingOffsets": '{"2": 1}'}, "names stream 2, which is not in"),
    # One stream named twice ("1" and "01"): one of its two offsets was dropped without a word.
    ({**PD, "streams": "1", "startingOffsets": '{"1": 5, "01": 9}'},
     r"names stream 1 twice \('1' and '01'\)"),
    ({**PD, "streams": "1", "endingOffsetsByTimestamp": '{"01": 5, "1": 9}'},
     r"option 'endingOffsetsByTimestamp'.*names stream 1 twice \('01' and '1'\)"),
    ({**PD, "streams": "1", "endingOffsets": "earliest"}, "option 'endingOffsets'.*latest"),
    ({**PD, "streams": "1", "endingOffsets": '{"1": -2}'}, "option 'endingOffsets'"),
    ({**PD, "streams": "1", "failOnDataLoss": "yes"}, "'failOnDataLoss' = 'yes'.*true or false"),
    ({**PD, "streams": "1", "includeHeaders": "1"}, "option 'includeHeaders'"),
    ({**PD, "streams": "1", "payload": "json"}, "'payload' = 'json'.*records, arrow"),
    ({**PD, "streams": "1", "payload": "arrow", "includeHeaders": "true"}, "needs payload=records"),
    ({**PD, "streams": "1", "fetchMaxBytes": "0"}, "'fetchMaxBytes' = '0'.*byte count"),
    ({**PD, "streams": "1", "fetchMaxBytes": "3x"}, "option 'fetchMaxBytes'"),
    ({**PD, "streams": "1", "fetchMaxBytes": "4g"}, "option 'fetchMaxBytes'"),
    ({**PD, "streams": "1", "fetchMaxWaitMs": "-1"}, "option 'fetchMaxWaitMs'"),
    ({**PD, "streams": "1", "maxRecordsPerPartition": "0"}, "'maxRecordsPerPartition'.*>= 1"),
    ({**PD, "streams": "1", "minPartitions": "two"}, "option 'minPartitions'"),
    ({**PD, "streams": "1", "requestTimeoutMs": "0"}, "option 'requestTimeoutMs'"),
    ({**PD, "streams": "1", "retries": "-1"}, "option 'retries'"),
    ({**PD, "streams": "1", "maxInflightFrames": "0"}, "option 'maxInflightFrames'"),
    # values of options meant for writing are still checked
    ({**PD, "streams": "1", "compression": "gzip"}, "'compression' = 'gzip'.*none, lz4, zstd"),
])
def test_bad_read_options(options, message):
    with pytest.raises(ValueError, match=message):
        parse_read_options(options)


def test_unknown_names_get_a_did_you_mean():
    with pytest.raises(OptionError, match="unknown option 'fetchmaxbyte'.*did you mean "
                                          "'fetchMaxBytes'"):
        parse_read_options({**PD, "streams": "1", "fetchmaxbyte": "1"})
    with pytest.raises(OptionError, match="unknown option 'zzz' for format sbp Known options"):
        check_option_names({"zzz": "1"})
    with pytest.raises(OptionError, match="takes no path"):
        check_option_names({"path": "/tmp/x"})
    check_option_names({"checkpointLocation": "/tmp/cp", "STARTINGOFFSETS": "earliest"})


def test_write_defaults_and_values():
    opts = parse_write_options({**PD})
    assert opts.stream is None and opts.payload == "records"
    assert (opts.batch_max_records, opts.batch_max_bytes) == (65_536, 4 << 20)
    assert (opts.create_if_missing, opts.replicas, opts.retention_ms) == (False, 1, -1)
    assert opts.compression == "none"
    opts = parse_write_options({
        **PD, "stream": "9", "payload": "arrow", "batchMaxRecords": "10", "batchMaxBytes": "64k",
        "maxInflightFrames": "8", "createIfMissing": "true", "replicas": "3",
        "retentionMs": "60000", "compression": "ZSTD"})
    assert (opts.stream, opts.payload, opts.batch_max_records) == (9, "arrow", 10)
    assert opts.batch_max_bytes == 65536 and opts.client.max_inflight_frames == 8
    assert (opts.create_if_missing, opts.replicas, opts.retention_ms) == (True, 3, 60000)
    assert opts.compression == "zstd"


def test_a_write_given_streams_goes_to_the_one_or_routes_among_several():
    # A temporary view hands its write the OPTIONS it was created with, 'streams' included.
    one = parse_write_options({**PD, "streams": "7"})
    assert (one.stream, one.routes) == (7, None)
    several = parse_write_options({**PD, "streams": "7,8"})
    assert (several.stream, several.routes) == (None, (7, 8))
    named = parse_write_options({**PD, "streams": "7,8", "stream": "3"})
    assert (named.stream, named.routes) == (3, None)


@pytest.mark.parametrize(("options", "message"), [
    ({**PD, "streams": "1,2", "createIfMissing": "true"},
     "option 'createIfMissing' cannot go with option 'streams'"),
    ({**PD, "stream": "a b"}, "option 'stream' = 'a b'.*neither a stream id"),
    ({**PD, "stream": "9223372036854775808"},
     "option 'stream' = '9223372036854775808'.*0 to 9223372036854775807"),
    ({**PD, "batchMaxRecords": "0"}, "option 'batchMaxRecords'"),
    ({**PD, "batchMaxBytes": "16m"}, "option 'batchMaxBytes' = '16m'.*between 1024 and"),
    ({**PD, "batchMaxBytes": "12"}, "option 'batchMaxBytes'"),
    ({**PD, "replicas": "0"}, "option 'replicas'"),
    ({**PD, "replicas": "200"}, "option 'replicas'"),
    ({**PD, "retentionMs": "0"}, "option 'retentionMs' = '0'.*-1"),
    ({**PD, "retentionMs": "-5"}, "option 'retentionMs'"),
    ({**PD, "createIfMissing": "maybe"}, "option 'createIfMissing'"),
    ({**PD, "compression": "snappy"}, "option 'compression'"),
    ({**PD, "startingOffsets": "whenever"}, "option 'startingOffsets'"),
    ({**PD, "maxTriggerDelay": "soon"}, "option 'maxTriggerDelay'"),
])
def test_bad_write_options(options, message):
    with pytest.raises(ValueError, match=message):
        parse_write_options(options)


def test_streaming_options():
    opts = parse_stream_read_options({
        **PD, "streams": "4", "maxRecordsPerTrigger": "100", "maxBytesPerTrigger": "1m",
        "minRecordsPerTrigger": "10", "maxTriggerDelay": "30s"})
    assert opts.read.starting == OffsetSpec(LATEST)
    assert (opts.max_records_per_trigger, opts.max_bytes_per_trigger) == (100, 1 << 20)
    assert (opts.min_records_per_trigger, opts.max_trigger_delay_ms) == (10, 30_000)
    assert parse_stream_read_options({**PD, "streams": "4"}).max_trigger_delay_ms == 900_000
    assert parse_stream_read_options(
        {**PD, "streams": "4", "startingOffsets": "latest"}).read.starting == OffsetSpec(LATEST)
    with pytest.raises(OptionError, match="'endingOffsets' is for batch reads"):
        parse_stream_read_options({**PD, "streams": "4", "endingOffsets": "latest"})
    with pytest.raises(OptionError, match="'maxRecordsPerTrigger'"):
        parse_stream_read_options({**PD, "streams": "4", "maxRecordsPerTrigger": "0"})
    write = parse_stream_write_options({**PD, "stream": "1", "idempotent": "true"})
    assert write.idempotent is True and write.write.stream == 1


def test_every_option_is_documented_and_parsed():
    table = options_table_markdown()
    names = {spec.name for spec in OPTIONS}
    assert {"pd", "streams", "stream", "startingOffsets", "endingOffsets", "failOnDataLoss",
            "includeHeaders", "payload", "fetchMaxBytes", "fetchMaxWaitMs", "batchMaxRecords",
            "batchMaxBytes", "maxInflightFrames", "idempotentAppends", "requestTimeoutMs",
            "retries",
            "createIfMissing", "replicas", "retentionMs", "compression",
            "maxRecordsPerPartition", "minPartitions", "maxRecordsPerTrigger",
            "maxBytesPerTrigger", "minRecordsPerTrigger", "maxTriggerDelay",
            "idempotent", "tls.enabled", "tls.caFile", "tls.certFile", "tls.keyFile",
            "startingTimestamp", "endingTimestamp", "startingOffsetsByTimestamp",
            "endingOffsetsByTimestamp", "startingOffsetsByTimestampStrategy",
            "maxOutOfOrderness", "mergeSchema", "schemaCompatibility",
            "skipIncompatibleBatches", "timeZone", "streamPattern",
            "discoveryIntervalMs", "consumer", "committedFallback", "token",
            "tokenFile"} == names
    for name in names:
        assert f"| {name} |" in table


def test_consumer_and_starting_from_its_record():
    from sbp_spark.spark.options import COMMITTED, EARLIEST, LATEST

    read = parse_stream_read_options({**PD, "streams": "1", "consumer": "etl-1",
                                      "startingOffsets": "Committed",
                                      "committedFallback": "latest"}).read
    assert (read.consumer, read.starting.default, read.committed_fallback) == (
        "etl-1", COMMITTED, LATEST)
    batch = parse_read_options({**PD, "streams": "1", "consumer": "etl-1",
                                "startingOffsets": "committed"})
    assert batch.committed_fallback == EARLIEST
    for options, message in (
            ({"startingOffsets": "committed"}, "needs option 'consumer'"),
            ({"consumer": "a b"}, "not valid: expected a consumer name"),
            ({"consumer": "x", "committedFallback": "earliest"}, "only with startingOffsets"),
            ({"consumer": "x", "startingOffsets": "committed", "committedFallback": "nope"},
             "one of earliest, latest")):
        with pytest.raises(OptionError, match=message):
            parse_stream_read_options({**PD, "streams": "1", **options})
    with pytest.raises(OptionError, match="not valid"):
        parse_read_options({**PD, "streams": "1", "endingOffsets": "committed"})
    # A batch read records nothing: a consumer there only says where committed starts.
    with pytest.raises(OptionError, match="records no positions"):
        parse_read_options({**PD, "streams": "1", "consumer": "x"})
    with pytest.raises(OptionError, match="for streaming reads"):
        parse_read_options({**PD, "streams": "1", "consumer": "x",
                            "startingOffsets": "committed", "committedFallback": "latest"})


def test_idempotent_appends_is_on_unless_turned_off():
    assert parse_write_options({**PD, "stream": "1"}).client.client_config().idempotent
    off = parse_write_options({**PD, "stream": "1", "idempotentAppends": "false"})
    assert off.client.client_config().idempotent is False
    with pytest.raises(ValueError, match="idempotentAppends"):
        parse_write_options({**PD, "stream": "1", "idempotentAppends": "maybe"})


def test_time_positions():
    opts = parse_read_options({**PD, "streams": "1,2", "startingTimestamp": "1700000000000",
                               "endingOffsetsByTimestamp": '{"2": 1700000001000}',
                               "startingOffsetsByTimestampStrategy": "LATEST",
                               "maxOutOfOrderness": "5s"})
    assert opts.starting_time == TimeSpec(1_700_000_000_000)
    assert opts.ending_time == TimeSpec(None, ((2, 1_700_000_001_000),))
    assert opts.ending_time.for_stream(2) == 1_700_000_001_000
    assert opts.ending_time.for_stream(1) is None
    assert (opts.time_strategy, opts.max_out_of_orderness_ms) == ("latest", 5_000)
    defaults = parse_read_options({**PD, "streams": "1"})
    assert defaults.starting_time is None and defaults.ending_time is None
    assert (defaults.time_strategy, defaults.max_out_of_orderness_ms) == ("error", 60_000)
    assert parse_read_options({**PD, "streams": "1", "maxOutOfOrderness": "Unbounded"}
                              ).max_out_of_orderness_ms is None
    streaming = parse_stream_read_options({**PD, "streams": "1,2",
                                           "startingOffsetsByTimestamp": '{"1": 5}'})
    assert streaming.read.starting_time == TimeSpec(None, ((1, 5),))


@pytest.mark.parametrize(("options", "message"), [
    ({"startingTimestamp": "yesterday"},
     "option 'startingTimestamp' = 'yesterday' is not valid: expected a time in ms"),
    ({"endingTimestamp": "-5"}, "option 'endingTimestamp'"),
    ({"startingOffsetsByTimestamp": '{"1": "noon"}'},
     "option 'startingOffsetsByTimestamp'.*JSON object"),
    ({"startingOffsetsByTimestamp": "[1]"}, "option 'startingOffsetsByTimestamp'"),
    ({"endingOffsetsByTimestamp": '{"9": 5}'},
     "names stream 9, which is not in option 'streams'"),
    ({"startingTimestamp": "5", "startingOffsets": "earliest"},
     "options 'startingTimestamp' and 'startingOffsets' exclude each other"),
    ({"startingTimestamp": "5", "startingOffsetsByTimestamp": '{"1": 5}'},
     "options 'startingTimestamp' and 'startingOffsetsByTimestamp' exclude each other"),
    ({"endingOffsetsByTimestamp": '{"1": 5}', "endingOffsets": "latest"},
     "options 'endingOffsetsByTimestamp' and 'endingOffsets' exclude each other"),
    ({"startingTimestamp": "10", "endingTimestamp": "9"},
     r"'endingTimestamp' \(9\) is before 'startingTimestamp' \(10\)"),
    ({"startingOffsetsByTimestampStrategy": "latest"},
     "'startingOffsetsByTimestampStrategy' needs 'startingTimestamp'"),
    ({"startingTimestamp": "1", "startingOffsetsByTimestampStrategy": "skip"},
     "option 'startingOffsetsByTimestampStrategy' = 'skip'.*one of error, latest"),
    ({"maxOutOfOrderness": "a while"}, "option 'maxOutOfOrderness'"),
    # Past what a Spark timestamp holds: refused here, not an overflow deep in the planning.
    ({"startingTimestamp": str(2**63)},
     r"expected a time in ms since the epoch \(0 to 9223372036854775\)"),
    ({"endingOffsetsByTimestamp": f'{{"1": {2**63}}}'}, r"\(times 0 to 9223372036854775\)"),
    ({"maxOutOfOrderness": "100000000000000d"},
     "expected a duration of at most 9223372036854775 ms"),
])
def test_bad_time_options(options, message):
    with pytest.raises(OptionError, match=message):
        parse_read_options({**PD, "streams": "1,2", **options})


def test_streaming_reads_have_no_end_time():
    for name, value in (("endingTimestamp", "5"), ("endingOffsetsByTimestamp", '{"1": 5}')):
        with pytest.raises(OptionError, match=f"'{name}' is for batch reads"):
            parse_stream_read_options({**PD, "streams": "1", name: value})


def test_schema_evolution_options_need_payload_arrow():
    arrow = {**PD, "streams": "4", "payload": "arrow"}
    assert parse_read_options(arrow).merge_schema is False
    assert parse_read_options({**arrow, "MERGESCHEMA": "true"}).merge_schema is True
    stream = parse_stream_read_options({**arrow, "skipIncompatibleBatches": "true"})
    assert stream.skip_incompatible_batches is True and stream.read.merge_schema is False
    write = parse_write_options({**PD, "stream": "1", "payload": "arrow",
                                 "schemaCompatibility": "Backward"})
    assert write.schema_compatibility == "backward"
    assert parse_write_options({**PD, "stream": "1"}).schema_compatibility == "none"
    with pytest.raises(OptionError, match="'mergeSchema' = 'true' needs payload=arrow"):
        parse_read_options({**PD, "streams": "4", "mergeSchema": "true"})
    with pytest.raises(OptionError, match="'skipIncompatibleBatches' = 'true' needs "
                                          "payload=arrow"):
        parse_stream_read_options({**PD, "streams": "4", "skipIncompatibleBatches": "true"})
    with pytest.raises(OptionError, match="'schemaCompatibility' = 'backward' needs "
                                          "payload=arrow"):
        parse_write_options({**PD, "stream": "1", "schemaCompatibility": "backward"})
    with pytest.raises(OptionError, match="'schemaCompatibility' = 'forward' is not valid: "
                                          "expected one of none, backward"):
        parse_write_options({**PD, "stream": "1", "schemaCompatibility": "forward"})
    with pytest.raises(OptionError, match="'mergeSchema' = 'yes' is not valid"):
        parse_write_options({**PD, "stream": "1", "mergeSchema": "yes"})


def test_streams_by_name_pattern_or_every_stream():
    by_id = parse_read_options({**PD, "streams": "7,3"})
    assert by_id.streams == (7, 3) and by_id.selection is None
    mixed = parse_read_options({**PD, "streams": "orders, 7,orders,clicks"})
    assert mixed.streams == () and not mixed.selection.dynamic
    assert mixed.selection.refs == ("orders", 7, "clicks")
    every = parse_read_options({**PD, "streams": "*"})
    assert every.selection.every and every.selection.matches("")
    pattern = parse_stream_read_options({**PD, "streamPattern": "orders-.*",
                                         "discoveryIntervalMs": "250"})
    selection = pattern.read.selection
    assert selection.pattern == "orders-.*" and pattern.discovery_interval_ms == 250
    assert selection.matches("orders-eu") and not selection.matches("my-orders-eu")
    assert not selection.matches("") and not selection.matches("orders")
    assert parse_stream_read_options({**PD, "streams": "1"}).discovery_interval_ms == 10_000
    # Positions per stream are checked once names are known (stream_names.resolve_read).
    later = parse_read_options({**PD, "streams": "orders", "startingOffsets": '{"9": 3}'})
    assert later.starting.per_stream == ((9, 3),)
    assert parse_write_options({**PD, "stream": "orders"}).stream == "orders"
    assert parse_write_options({**PD, "streams": "orders,7"}).routes == ("orders", 7)


@pytest.mark.parametrize("options, message", [
    ({**PD, "streams": "1", "streamPattern": "a.*"}, "exclude each other"),
    ({**PD, "streamPattern": "("}, "'streamPattern' = '\\(' is not a regular expression"),
    ({**PD, "streams": "*,1"}, "'\\*' \\(every stream\\) stands alone"),
    ({**PD, "streams": "123abc,9x/"}, "neither a stream id"),
    ({**PD, "streams": "1", "discoveryIntervalMs": "-5"}, "option 'discoveryIntervalMs'"),
])
def test_bad_stream_selections(options, message):
    with pytest.raises(ValueError, match=message):
        parse_stream_read_options(options)


def test_a_write_cannot_go_to_every_stream():
    with pytest.raises(ValueError, match="'\\*' is for reading"):
        parse_write_options({**PD, "streams": "*"})
