"""Record-batch envelope vectors, and the Arrow body helpers."""

from __future__ import annotations

import pyarrow as pa
import pytest

from sbp_spark.protocol.errors import BatchFormatError
from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    BodyFormat,
    batch_body,
    batch_bytes,
    body_to_arrow,
    encode_arrow_batch,
    iter_batches,
    make_records_batch,
    parse_header,
    payload_kind,
    set_base_offset,
)
from tests.conftest import load_vectors

BATCHES = load_vectors("record_batches.json")
VALID = [v for v in BATCHES if v["valid"]]
INVALID = [v for v in BATCHES if not v["valid"]]


@pytest.mark.parametrize("vector", VALID, ids=[v["name"] for v in VALID])
def test_valid_batch_vector_round_trips(vector):
    data = bytes.fromhex(vector["hex"])
    header = parse_header(data)
    assert header.body_format == vector["body_format"]
    assert header.base_offset == vector["base_offset"]
    assert header.record_count == vector["record_count"]
    assert header.base_timestamp_ms == vector["base_timestamp_ms"]
    ((h, view),) = list(iter_batches(data))
    assert bytes(batch_body(view)).hex() == vector["body_hex"]
    again = batch_bytes(bytes.fromhex(vector["body_hex"]), header.record_count,
                        header.base_timestamp_ms, header.body_format, header.base_offset)
    assert again.hex() == vector["hex"]


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_invalid_batch_vector_is_rejected(vector):
    with pytest.raises(BatchFormatError) as info:
        list(iter_batches(bytes.fromhex(vector["hex"])))
    assert "record batch at byte 0" in str(info.value)


def test_range_server_patches_base_offset_like_the_vector():
    writer_form = bytearray(bytes.fromhex(VALID[0]["hex"]))
    set_base_offset(writer_form, 0, 41)
    assert writer_form.hex() == VALID[1]["hex"]


def test_batches_laid_end_to_end_split_without_copies():
    payload = bytearray(batch_bytes(b"a") + batch_bytes(b"bcd") + batch_bytes(b""))
    parts = list(iter_batches(memoryview(payload)))
    assert [bytes(batch_body(v)) for _, v in parts] == [b"a", b"bcd", b""]
    assert all(v.obj is payload for _, v in parts)
    assert sum(h.batch_length for h, _ in parts) == len(payload)


def test_truncated_envelope_is_rejected():
    with pytest.raises(BatchFormatError, match="envelope"):
        parse_header(b"\x42" * (ENVELOPE_SIZE - 1))


def test_arrow_body_round_trip_with_each_compression():
    rb = pa.record_batch({"a": pa.array(range(1000)), "s": pa.array(["x"] * 1000)})
    for compression in (None, "lz4", "zstd"):
        data = b"".join(bytes(p) for p in encode_arrow_batch(rb, 5, compression))
        ((header, view),) = list(iter_batches(data))
        assert header.body_format == BodyFormat.ARROW and header.record_count == 1000
        assert body_to_arrow(batch_body(view)).equals(rb)


def test_records_batch_casts_strings_and_marks_its_kind():
    rb = make_records_batch(pa.array(["v1", "v2"]), key=pa.array([b"k", None]))
    assert rb.schema.field("value").type == pa.binary()
    assert payload_kind(rb.schema) == b"records"
    with pytest.raises(ValueError, match="column 'value'"):
        make_records_batch(pa.array([[1], [2]]))


def test_garbage_arrow_body_is_a_batch_format_error():
    with pytest.raises(BatchFormatError):
        body_to_arrow(b"not arrow at all")
