"""Arrow conversion both ways, no cluster: Spark batches -> record batches -> read batches."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    NullType,
    StringType,
    StructField,
    StructType,
    TimestampType,
    YearMonthIntervalType,
)

from sbp_spark.protocol.records import (
    BodyFormat,
    iter_batches,
    make_records_batch,
    set_base_offset,
)
from sbp_spark.spark.decode import PartitionDecoder, SchemaMismatchError
from sbp_spark.spark.encode import MAX_ENCODED_BATCH, Batcher, RowEncoder, encode_batches
from sbp_spark.spark.filters import Predicate
from sbp_spark.spark.schemas import (
    arrow_payload_schema,
    check_records_read_schema,
    records_schema,
    to_arrow,
)

UTC = dt.timezone.utc


def stored(encoded_batches, first_offset=0):
    """What a range server would store and a fetch return: batches with offsets assigned."""
    out, offset = [], first_offset
    for parts in encoded_batches:
        buf = bytearray(b"".join(bytes(p) for p in parts))
        set_base_offset(buf, 0, offset)
        for header, view in iter_batches(memoryview(buf)):
            out.append((header, view))
            offset += header.record_count
    return out


def decode_all(decoder, batches):
    result = []
    for header, view in batches:
        result.extend(decoder.add(header, view))
    result.extend(decoder.finish())
    return result


def spark_batch(n, start=0):
    """An Arrow batch shaped like what Spark hands a writer for a records DataFrame."""
    return pa.record_batch({
        "key": pa.array([f"k{i}".encode() if i % 3 else None for i in range(start, start + n)]),
        "value": pa.array([f"value-{i}" for i in range(start, start + n)]),
        "timestamp": pa.array([1_700_000_000_123_456 + i for i in range(start, start + n)],
                              pa.timestamp("us", tz="UTC")),
    })


def records_encoder(schema_fields, payload="records", stream=5):
    return RowEncoder.for_schema(StructType(schema_fields), payload, stream)


REC_FIELDS = [StructField("key", BinaryType()), StructField("value", StringType()),
              StructField("timestamp", TimestampType())]


def test_records_round_trip_with_cuts_and_combining():
    encoder = records_encoder(REC_FIELDS)
    batcher = Batcher(max_records=700, max_bytes=1 << 20)
    bodies = []
    start = 0
    for size in (1000, 1000, 100, 100, 100, 1000, 1700):  # sums to 5000
        for sid, body in encoder.bodies(spark_batch(size, start), 5):
            assert sid == 5
            bodies.extend(batcher.add(body))
        start += size
    bodies.extend(batcher.flush())
    # big batches are cut into equal slices, the run of small ones is combined, order is kept
    assert [b.num_rows for b in bodies] == [500] * 4 + [300] + [500] * 2 + [567, 567, 566]
    encoded = [e.buffers for b in bodies for e in encode_batches(b, "none", 1_000)]
    batches = stored(encoded, first_offset=100)
    schema = records_schema(include_headers=True)
    decoder = PartitionDecoder(schema, "records", stream_id=5, range_index=2,
                               start_offset=150, end_offset=4_990, target_rows=2_000)
    out = decode_all(decoder, batches)
    assert all(b.schema.equals(to_arrow(schema)) for b in out)
    assert all(b.num_rows >= 2000 for b in out[:-1])
    table = pa.Table.from_batches(out)
    assert table.num_rows == 4_840
    assert table.column("offset").to_pylist() == list(range(150, 4_990))
    assert set(table.column("stream_id").to_pylist()) == {5}
    assert set(table.column("range_index").to_pylist()) == {2}
    values = table.column("value").to_pylist()
    assert values[0] == b"value-50" and values[-1] == b"value-4889"
    keys = table.column("key").to_pylist()
    assert keys[0] == b"k50" and keys[1] is None
    # per-row timestamps were stored in ms
    assert table.column("timestamp")[0].as_py() == dt.datetime(
        2023, 11, 14, 22, 13, 20, 123_000, tzinfo=UTC)
    assert table.column("headers").null_count == table.num_rows
    assert decoder.next_offset == 4_990


def test_requested_subset_and_order_of_records_columns():
    schema = StructType([StructField("value", BinaryType()), StructField("offset", LongType())])
    check_records_read_schema(schema)
    batch = make_records_batch(pa.array([b"a", b"b", b"c"]))
    encoded = [e.buffers for e in encode_batches(batch, "lz4", 9)]
    out = decode_all(PartitionDecoder(schema, "records", 1, 0, 0, 3), stored(encoded))
    assert out[0].schema.equals(to_arrow(schema))
    assert out[0].to_pydict() == {"value": [b"a", b"b", b"c"], "offset": [0, 1, 2]}
    with pytest.raises(ValueError, match="column 'value' of the given schema is string"):
        check_records_read_schema(StructType([StructField("value", StringType())]))
    with pytest.raises(ValueError, match="'other' of the given schema is not a payload=records"):
        check_records_read_schema(StructType([StructField("other", StringType())]))


def test_opaque_records_become_a_binary_column():
    from sbp_spark.protocol.records import encode_batch
    encoded = [encode_batch(f"line {i}".encode() * (i % 4), 1, 5_000 + i, BodyFormat.OPAQUE)
               for i in range(10)]
    # an Arrow batch in the middle: the opaque run before it and after it are both kept
    encoded.insert(5, encode_batches(make_records_batch(pa.array([b"x", b"y"])), "none",
                                     7_000)[0].buffers)
    schema = records_schema()
    out = decode_all(PartitionDecoder(schema, "records", 3, 0, 1, 12), stored(encoded))
    table = pa.Table.from_batches(out)
    assert table.column("offset").to_pylist() == list(range(1, 12))
    values = table.column("value").to_pylist()
    assert values[:4] == [b"line 1", b"line 2line 2", b"line 3line 3line 3", b""]
    assert values[4:6] == [b"x", b"y"]
    assert values[6:] == [b"line 5", b"line 6" * 2, b"line 7" * 3, b"", b"line 9"]
    ts = table.column("timestamp").to_pylist()
    assert ts[0] == dt.datetime.fromtimestamp(5.001, UTC)
    assert ts[4] == dt.datetime.fromtimestamp(7.0, UTC)
    assert table.column("key").null_count == 11


def test_typed_arrow_payload_round_trip():
    data = pa.record_batch({
        "id": pa.array(range(6), pa.int64()),
        "price": pa.array([Decimal("1.25"), None, Decimal("-3.5"), None, None, Decimal("0")],
                          pa.decimal128(12, 2)),
        "tags": pa.array([["a"], None, [], ["b", None], None, ["c"]], pa.list_(pa.string())),
        "attrs": pa.array([[("x", 1)], None, [], None, None, [("y", 2)]],
                          pa.map_(pa.string(), pa.int32())),
        "when": pa.array([1, None, 3, None, None, 6], pa.timestamp("us", tz="UTC")),
        "nested": pa.array([{"a": 1, "b": "z"}, None, {"a": None, "b": None}, None, None,
                            {"a": 2, "b": "q"}],
                           pa.struct([("a", pa.int32()), ("b", pa.string())])),
        "stream_id": pa.array([8] * 6, pa.int64()),
    })
    struct = StructType([
        StructField("id", LongType()), StructField("price", DecimalType(12, 2)),
        StructField("tags", ArrayType(StringType())),
        StructField("attrs", MapType(StringType(), IntegerType())),
        StructField("when", TimestampType()),
        StructField("nested", StructType([StructField("a", IntegerType()),
                                          StructField("b", StringType())])),
        StructField("stream_id", LongType()),
    ])
    encoder = RowEncoder.for_schema(struct, "arrow", None)
    [(sid, body)] = list(encoder.bodies(data, None))
    assert sid == 8 and "stream_id" not in body.schema.names
    read_schema = arrow_payload_schema(body.schema)
    assert read_schema.fieldNames() == ["id", "price", "tags", "attrs", "when", "nested",
                                        "stream_id", "offset", "timestamp"]
    encoded = [e.buffers for e in encode_batches(body, "zstd", 42)]
    out = decode_all(PartitionDecoder(read_schema, "arrow", 8, 0, 0, 6), stored(encoded))
    assert out[0].schema.equals(to_arrow(read_schema))
    got = out[0].to_pydict()
    for name in ("id", "price", "tags", "attrs", "when", "nested"):
        assert got[name] == data.column(name).to_pylist(), name
    assert got["stream_id"] == [8] * 6 and got["offset"] == list(range(6))
    assert got["timestamp"] == [dt.datetime.fromtimestamp(0.042, UTC)] * 6


def test_arrow_payload_mismatch_names_offset_and_difference():
    body = pa.record_batch({"a": pa.array([1, 2], pa.int64())})
    from sbp_spark.protocol.records import PAYLOAD_ARROW, with_payload_kind
    encoded = [encode_batches(with_payload_kind(body, PAYLOAD_ARROW), "none", 1)[0].buffers]
    # a column the batch lacks: nulls when nullable, an error naming it when not
    schema = StructType([StructField("a", LongType()), StructField("b", StringType())])
    [out] = decode_all(PartitionDecoder(schema, "arrow", 4, 0, 0, 2), stored(encoded))
    assert out.to_pydict() == {"a": [1, 2], "b": [None, None]}
    schema = StructType([StructField("a", LongType()),
                         StructField("b", StringType(), nullable=False)])
    with pytest.raises(SchemaMismatchError, match="stream 4 offset 0: .*column 'b' is missing "
                                                  "from the stored batch and the read schema "
                                                  "says it cannot be null"):
        decode_all(PartitionDecoder(schema, "arrow", 4, 0, 0, 2), stored(encoded))
    schema = StructType([StructField("a", MapType(StringType(), StringType()))])
    with pytest.raises(SchemaMismatchError, match="column 'a' is int64 in the stored batch but "
                                                  "map<string, string> in the read schema: "
                                                  "unrelated types"):
        decode_all(PartitionDecoder(schema, "arrow", 4, 0, 0, 2), stored(encoded))
    # records data read as arrow, and the other way round
    rec = [encode_batches(make_records_batch(pa.array([b"v"])), "none", 1)[0].buffers]
    with pytest.raises(SchemaMismatchError, match="payload=records.*read it with "
                                                  "payload=records"):
        decode_all(PartitionDecoder(schema, "arrow", 4, 0, 0, 1), stored(rec))
    with pytest.raises(SchemaMismatchError, match="payload=arrow.*read it with payload=arrow"):
        decode_all(PartitionDecoder(records_schema(), "records", 4, 0, 0, 2), stored(encoded))


def arrow_stored(*bodies):
    """payload=arrow record batches of ``bodies``, stored one after another from offset 0."""
    from sbp_spark.protocol.records import PAYLOAD_ARROW, with_payload_kind
    return stored([encode_batches(with_payload_kind(b, PAYLOAD_ARROW), "none", 1)[0].buffers
                   for b in bodies])


def test_evolved_batches_resolve_and_those_that_cannot_are_skipped_and_counted():
    from sbp_spark.spark.decode import SkipTally
    old = pa.record_batch({"id": pa.array([1, 2], pa.int32()), "gone": pa.array(["x", "y"])})
    new = pa.record_batch({"id": pa.array([3, None], pa.int64()),
                           "score": pa.array([0.5, 1.5], pa.float64())})
    bad = pa.record_batch({"id": pa.array(["4"])})
    schema = StructType([StructField("id", LongType()), StructField("score", DoubleType())])
    batches = arrow_stored(old, new, bad, old)
    with pytest.raises(SchemaMismatchError, match=r"stream 4 offset 4: the stored batch does "
                                                  r"not fit the read schema: column 'id' is "
                                                  r"string in the stored batch but int64"):
        decode_all(PartitionDecoder(schema, "arrow", 4, 0, 0, 7), batches)
    tally = SkipTally()
    out = decode_all(PartitionDecoder(schema, "arrow", 4, 0, 0, 7, skipped=tally), batches)
    rows = pa.Table.from_batches(out).to_pydict()
    assert rows == {"id": [1, 2, 3, None, 1, 2], "score": [None, None, 0.5, 1.5, None, None]}
    assert (tally.batches, tally.records) == (1, 1)
    assert tally.first_problem.startswith("stream 4 offset 4: ")
    # a read column that may not be null refuses a batch that holds nulls in it
    strict = StructType([StructField("id", LongType(), nullable=False)])
    with pytest.raises(SchemaMismatchError, match="stream 4 offset 2: column 'id' holds 1 "
                                                  "nulls but the read schema says it cannot"):
        decode_all(PartitionDecoder(strict, "arrow", 4, 0, 0, 4), batches[:2])


def test_a_metadata_named_column_that_is_data_in_some_combined_batches():
    # The read schema's 'timestamp' is data in the second stored batch only; both are small, so
    # they are combined into one output batch. Each row keeps what its own batch gives it, as
    # when the batches are output one by one: the second batch's data, the first batch's
    # metadata (before, the combined batch was refused, so whether a read failed depended on
    # how small its batches were).
    old = pa.record_batch({"id": pa.array([1, 2], pa.int64())})
    new = pa.record_batch({"id": pa.array([3], pa.int64()),
                           "timestamp": pa.array([5_000_000], pa.timestamp("us", tz="UTC"))})
    schema = StructType([StructField("id", LongType()), StructField("timestamp", TimestampType()),
                         StructField("offset", LongType()), StructField("stream_id", LongType())])
    stored = arrow_stored(old, new)
    [combined] = decode_all(PartitionDecoder(schema, "arrow", 4, 0, 0, 3), stored)
    alone = [b for part in ((0, 2), (2, 3))
             for b in decode_all(PartitionDecoder(schema, "arrow", 4, 0, *part), stored)]
    assert combined.to_pydict() == pa.Table.from_batches(alone).to_pydict()
    rows = combined.to_pydict()
    assert rows["id"] == [1, 2, 3] and rows["offset"] == [0, 1, 2]
    assert rows["stream_id"] == [4, 4, 4]
    assert rows["timestamp"][2] == dt.datetime.fromtimestamp(5, UTC)
    appended = dt.datetime.fromtimestamp(stored[0][0].base_timestamp_ms / 1000, UTC)
    assert rows["timestamp"][:2] == [appended] * 2


def test_records_of_another_writer_with_nanosecond_timestamps_are_read():
    # Offsets by time already accept such bodies (tests/client/test_timesearch.py); reading
    # them must too, cutting the nanoseconds Spark's microseconds cannot hold.
    from sbp_spark.protocol.records import PAYLOAD_RECORDS, with_payload_kind
    stamps = pa.array([1_000_999_999, None], pa.timestamp("ns"))
    body = with_payload_kind(pa.record_batch({"value": pa.array([b"a", b"b"]),
                                              "timestamp": stamps}), PAYLOAD_RECORDS)
    encoded = [encode_batches(body, "none", 7)[0].buffers]
    out = decode_all(PartitionDecoder(records_schema(), "records", 1, 0, 0, 2), stored(encoded))
    assert pa.Table.from_batches(out).column("timestamp").to_pylist() == [
        dt.datetime.fromtimestamp(1, UTC) + dt.timedelta(microseconds=999),
        dt.datetime.fromtimestamp(0.007, UTC)]


def test_records_of_another_writer_whose_timestamp_is_no_timestamp_are_refused():
    # An int64 'timestamp' has no unit: reading it as microseconds would be a guess, and the
    # positions by time of the same batch use its stored time instead.
    from sbp_spark.protocol.records import PAYLOAD_RECORDS, with_payload_kind
    body = with_payload_kind(pa.record_batch({"value": pa.array([b"a"]),
                                              "timestamp": pa.array([1_000], pa.int64())}),
                             PAYLOAD_RECORDS)
    encoded = [encode_batches(body, "none", 7)[0].buffers]
    with pytest.raises(SchemaMismatchError, match="stream 1 offset 0: the payload=records "
                                                  "batch's 'timestamp' column is int64, not an "
                                                  "Arrow timestamp"):
        decode_all(PartitionDecoder(records_schema(), "records", 1, 0, 0, 1), stored(encoded))


def test_row_predicates_on_timestamp_and_offset():
    batches = [encode_batches(make_records_batch(pa.array([b"v"] * 10)), "none", ts)[0].buffers
               for ts in (1_000, 2_000, 3_000)]
    cut = dt.datetime.fromtimestamp(2, UTC)
    micros = int(cut.timestamp() * 1_000_000)
    preds = [Predicate("timestamp", ">=", micros), Predicate("offset", "in", (3, 12, 15, 29))]
    schema = StructType([StructField("offset", LongType())])
    out = decode_all(PartitionDecoder(schema, "records", 1, 0, 0, 30, preds), stored(batches))
    assert pa.Table.from_batches(out).column("offset").to_pylist() == [12, 15, 29]


def test_writer_routing_by_stream_id_and_schema_checks():
    batch = pa.record_batch({"stream_id": pa.array([2, 1, 2, 1, 2], pa.int64()),
                             "value": pa.array([b"a", b"b", b"c", b"d", b"e"])})
    fields = [StructField("stream_id", LongType()), StructField("value", BinaryType())]
    encoder = RowEncoder.for_schema(StructType(fields), "records", None)
    routed = {sid: body.column("value").to_pylist() for sid, body in encoder.bodies(batch, None)}
    assert routed == {1: [b"b", b"d"], 2: [b"a", b"c", b"e"]}
    with pytest.raises(ValueError, match="null stream_id"):
        list(encoder.bodies(pa.record_batch({"stream_id": pa.array([1, None], pa.int64()),
                                             "value": pa.array([b"a", b"b"])}), None))
    # a negative stream id names no stream: refused before anything is sent, naming the value
    with pytest.raises(ValueError, match=r"stream_id -1, which is not a stream id"):
        list(encoder.bodies(pa.record_batch({"stream_id": pa.array([1, -1], pa.int64()),
                                             "value": pa.array([b"a", b"b"])}), None))
    with pytest.raises(ValueError, match="needs a target stream"):
        RowEncoder.for_schema(StructType(fields[1:]), "records", None)
    # an encoder made for one stream, asked for bodies without it
    fixed = RowEncoder.for_schema(StructType(fields[1:]), "records", 5)
    with pytest.raises(ValueError, match="needs a target stream"):
        list(fixed.bodies(batch.drop_columns(["stream_id"]), None))
    with pytest.raises(ValueError, match="a 'value' column .* is required"):
        RowEncoder.for_schema(StructType(fields[:1]), "records", None)
    with pytest.raises(ValueError, match="column 'key' is int"):
        RowEncoder.for_schema(StructType([*fields, StructField("key", IntegerType())]),
                              "records", None)
    with pytest.raises(ValueError, match="column 'stream_id' is string"):
        RowEncoder.for_schema(StructType([StructField("stream_id", StringType()), fields[1]]),
                              "records", None)


def test_arrow_payload_refuses_types_spark_cannot_hand_over_as_arrow():
    # Spark fails such a write in every task with a bare KeyError from pyarrow
    struct = StructType([StructField("id", LongType()),
                         StructField("span", YearMonthIntervalType())])
    with pytest.raises(ValueError, match=r"column 'span' is interval year to month.*Arrow"):
        RowEncoder.for_schema(struct, "arrow", 5)
    # Spark's empty array() and map() (void elements, never null): written, they could never
    # be read back, since pyarrow cannot build the type
    for dtype in (ArrayType(NullType(), containsNull=False),
                  MapType(NullType(), NullType(), valueContainsNull=False)):
        with pytest.raises(ValueError, match=r"column 'none' is .*void.* no read could give it"):
            RowEncoder.for_schema(StructType([StructField("none", dtype)]), "arrow", 5)
    nulls = StructType([StructField("none", ArrayType(NullType(), containsNull=True))])
    assert RowEncoder.for_schema(nulls, "arrow", 5).names == ("none",)


def test_headers_are_stored_and_read_back():
    headers_type = ArrayType(StructType([StructField("key", StringType()),
                                         StructField("value", StringType())]))
    struct = StructType([StructField("value", BinaryType()), StructField("headers", headers_type)])
    encoder = RowEncoder.for_schema(struct, "records", 1)
    spark_type = pa.list_(pa.field("element", pa.struct([("key", pa.string()),
                                                         ("value", pa.string())])))
    batch = pa.record_batch({"value": pa.array([b"a", b"b"]),
                             "headers": pa.array([[{"key": "h", "value": "1"}], None],
                                                 spark_type)})
    [(_, body)] = list(encoder.bodies(batch, 1))
    encoded = [encode_batches(body, "none", 1)[0].buffers]
    schema = records_schema(include_headers=True)
    out = decode_all(PartitionDecoder(schema, "records", 1, 0, 0, 2), stored(encoded))
    assert out[0].column("headers").to_pylist() == [[{"key": "h", "value": b"1"}], None]
    bad = pa.record_batch({"value": pa.array([b"a"]),
                           "headers": pa.array([[{"key": None, "value": "1"}]], spark_type)})
    with pytest.raises(ValueError, match="needs a non-null key"):
        list(encoder.bodies(bad, 1))


def test_batcher_passes_spark_sized_batches_on_without_copying():
    batcher = Batcher(max_records=65_536, max_bytes=4 << 20)
    spark_sized = pa.record_batch({"value": pa.array([b"v" * 100] * 10_000)})
    assert batcher.add(spark_sized)[0] is spark_sized
    # small batches are combined up to the limits, flushed before the next big one
    small = pa.record_batch({"value": pa.array([b"s" * 100] * 10)})
    assert batcher.add(small) == [] and batcher.add(small) == []
    combined, passed = batcher.add(spark_sized)
    assert combined.num_rows == 20 and passed is spark_sized
    assert batcher.flush() == []
    tiny = Batcher(max_records=25, max_bytes=4 << 20)
    out = [b for _ in range(6) for b in tiny.add(small)] + tiny.flush()
    assert [b.num_rows for b in out] == [20, 20, 20]
    with pytest.raises(ValueError, match="batch limits must be positive"):
        Batcher(max_records=0, max_bytes=1)


def test_batches_respect_byte_limit_and_frame_size():
    big = pa.record_batch({"value": pa.array([b"x" * 1000] * 100)})
    batcher = Batcher(max_records=1_000_000, max_bytes=20_000)
    out = batcher.add(big) + batcher.flush()
    assert sum(b.num_rows for b in out) == 100
    assert all(b.nbytes <= 20_000 + 1100 for b in out)
    huge = make_records_batch(pa.array([b"y" * (4 << 20)] * 6))
    parts = encode_batches(huge, "none", 1)
    assert len(parts) > 1 and all(p.nbytes <= MAX_ENCODED_BATCH for p in parts)
    assert sum(p.record_count for p in parts) == 6
    with pytest.raises(ValueError, match="one record needs"):
        encode_batches(make_records_batch(pa.array([b"z" * (17 << 20)])), "none", 1)


def test_large_stored_batch_is_cut_into_equal_slices():
    encoded = [encode_batches(make_records_batch(pa.array([b"x"] * 250_001)), "none", 1)[0]
               .buffers]
    out = decode_all(PartitionDecoder(records_schema(), "records", 1, 0, 0, 250_001),
                     stored(encoded))
    assert [b.num_rows for b in out] == [83_334, 83_334, 83_333]
    assert pa.Table.from_batches(out).column("offset").to_pylist() == list(range(250_001))


def test_big_stored_batches_are_handed_on_alone_without_copying():
    sizes = (12_000, 300, 400, 12_000, 15_000)
    encoded = [encode_batches(make_records_batch(pa.array([b"v%d" % n] * n)), "none", 1)[0]
               .buffers for n in sizes]
    batches = stored(encoded)
    out = decode_all(PartitionDecoder(records_schema(), "records", 1, 0, 100, 39_600), batches)
    # the partition cuts the first and last stored batch; the two small ones are combined
    assert [b.num_rows for b in out] == [11_900, 700, 12_000, 14_900]
    table = pa.Table.from_batches(out)
    assert table.column("offset").to_pylist() == list(range(100, 39_600))
    assert set(table.column("stream_id").to_pylist()) == {1}
    # a batch handed on alone keeps its values in the fetched body's memory
    for batch, view in ((out[0], batches[0][1]), (out[2], batches[3][1])):
        start = pa.py_buffer(view).address
        values = batch.column(batch.schema.get_field_index("value")).buffers()[2]
        assert start <= values.address < start + view.nbytes


def test_selective_predicates_on_big_stored_batches_give_full_batches():
    encoded = [encode_batches(make_records_batch(pa.array([b"v"] * 12_000)), "none", ts)[0]
               .buffers for ts in (1_000, 2_000, 3_000, 4_000, 5_000)]
    wanted = (5, 11_999, 12_000, 30_001, 59_999)
    preds = [Predicate("timestamp", "<", 5_000_000), Predicate("offset", "in", wanted)]
    schema = StructType([StructField("offset", LongType()), StructField("value", BinaryType())])
    out = decode_all(PartitionDecoder(schema, "records", 1, 0, 0, 60_000, preds),
                     stored(encoded))
    # the few rows left of every stored batch are combined into one batch, not one per batch
    assert len(out) == 1
    assert out[0].to_pydict() == {"offset": [5, 11_999, 12_000, 30_001],
                                  "value": [b"v"] * 4}
