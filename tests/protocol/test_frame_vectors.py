"""Every frame vector from the shared set round-trips byte for byte or is rejected."""

from __future__ import annotations

import random

import pytest

from sbp_spark.protocol.errors import ChecksumError, FrameError, HeaderError, ProtocolError
from sbp_spark.protocol.frame import (
    Frame,
    FrameDecoder,
    InvalidFrame,
    decode_frame,
    encode_frame,
    frame_bytes,
)
from tests.conftest import load_vectors

FRAMES = load_vectors("frames.json")
VALID = [v for v in FRAMES if v["valid"]]
INVALID = [v for v in FRAMES if not v["valid"]]


def _ids(vectors):
    return [v["name"] for v in vectors]


@pytest.mark.parametrize("vector", VALID, ids=_ids(VALID))
def test_valid_vector_decodes_to_its_fields(vector):
    frame = decode_frame(bytes.fromhex(vector["hex"]))
    assert frame.opcode == vector["opcode"]
    assert frame.flags == vector["flags"]
    assert frame.stream_id == vector["stream_id"]
    assert frame.header_format == vector["header_format"]
    assert bytes(frame.header).hex() == vector["header_hex"]
    assert bytes(frame.payload).hex() == vector["payload_hex"]


@pytest.mark.parametrize("vector", VALID, ids=_ids(VALID))
def test_valid_vector_encodes_byte_for_byte(vector):
    encoded = frame_bytes(
        vector["opcode"], vector["flags"], vector["stream_id"],
        bytes.fromhex(vector["header_hex"]), bytes.fromhex(vector["payload_hex"]),
        vector["header_format"])
    assert encoded.hex() == vector["hex"]


@pytest.mark.parametrize("vector", VALID, ids=_ids(VALID))
def test_valid_vector_survives_any_chunking(vector):
    data = bytes.fromhex(vector["hex"]) * 3
    rng = random.Random(vector["name"])
    for chunking in ("bytewise", "random"):
        decoder = FrameDecoder()
        pos = 0
        while pos < len(data):
            step = 1 if chunking == "bytewise" else rng.randint(1, 64)
            decoder.feed(data[pos:pos + step])
            pos += step
        frames = list(decoder.events())
        assert len(frames) == 3
        assert all(isinstance(f, Frame) for f in frames)
        assert bytes(frames[2].payload).hex() == vector["payload_hex"]
        assert decoder.buffered == 0


EXPECTED_ERRORS = {
    "frame_length < 16": FrameError,
    "frame_length > 16 MiB": FrameError,
    "magic != 23": FrameError,
    "checksum": ChecksumError,
    "header_length exceeds frame": HeaderError,
}


@pytest.mark.parametrize("vector", INVALID, ids=_ids(INVALID))
def test_invalid_vector_is_rejected_with_a_named_error(vector):
    with pytest.raises(EXPECTED_ERRORS[vector["why"]]) as info:
        decode_frame(bytes.fromhex(vector["hex"]))
    assert str(info.value)


@pytest.mark.parametrize("vector", INVALID, ids=_ids(INVALID))
def test_streaming_decoder_reacts_to_invalid_vector_as_wire_md_says(vector):
    """Fatal framing errors raise; recoverable ones become events; the stream goes on."""
    data = bytes.fromhex(vector["hex"])
    follow_up = frame_bytes(1, 0, 99)
    decoder = FrameDecoder()
    why = vector["why"]
    if why.startswith("frame_length"):
        with pytest.raises(FrameError):
            decoder.feed(data + follow_up)
        with pytest.raises(FrameError):  # the decoder stays broken: framing is lost
            decoder.feed(follow_up)
        return
    decoder.feed(data + follow_up)
    events = list(decoder.events())
    if why == "magic != 23":
        assert decoder.discarded == 1
        assert [e.stream_id for e in events] == [99]
    else:
        assert isinstance(events[0], InvalidFrame)
        assert isinstance(events[0].error, EXPECTED_ERRORS[why])
        assert events[0].stream_id == int(data[8:12].hex(), 16)
        assert isinstance(events[1], Frame) and events[1].stream_id == 99


def test_repeated_wrong_magic_gives_up_on_the_peer():
    bad = bytearray(frame_bytes(1, 0, 1))
    bad[4] = 0x18
    decoder = FrameDecoder()
    with pytest.raises(FrameError, match="wrong magic"):
        for _ in range(20):
            decoder.feed(bytes(bad))


def test_large_frame_is_received_into_its_own_buffer_via_get_buffer():
    payload = bytes(range(256)) * 20_000  # ~5 MiB, bigger than the receive chunk
    data = frame_bytes(0x1002, 3, 5, b"hdr", payload)
    decoder = FrameDecoder()
    pos = 0
    while pos < len(data):
        buf = decoder.get_buffer()
        n = min(len(buf), len(data) - pos, 100_000)
        buf[:n] = data[pos:pos + n]
        decoder.buffer_updated(n)
        pos += n
    (frame,) = list(decoder.events())
    assert bytes(frame.header) == b"hdr"
    assert frame.payload == payload


def test_after_a_large_frame_only_the_next_fixed_header_goes_through_the_stage():
    """Like a socket that fills every view it is given: the second large frame's body must be
    received straight into its own buffer, not partly into the stage and copied over."""
    payloads = [bytes([i]) * (1 << 20) for i in range(3)]
    small = frame_bytes(0x1002, 3, 9, b"s", b"tiny")
    data = b"".join([frame_bytes(0x1002, 3, 5 + i, b"h", p) for i, p in enumerate(payloads)]
                    + [small, small])
    decoder = FrameDecoder()
    views, pos = [], 0
    while pos < len(data):
        buf = decoder.get_buffer()
        n = min(len(buf), len(data) - pos)
        views.append(len(buf))
        buf[:n] = data[pos:pos + n]
        decoder.buffer_updated(n)
        pos += n
    events = list(decoder.events())
    assert [bytes(e.payload) for e in events] == payloads + [b"tiny", b"tiny"]
    # The first large frame starts in the full stage; each later one is asked for its 16-byte
    # fixed header alone, then its whole body in one view.
    body = len(frame_bytes(0x1002, 3, 5, b"h", payloads[0])) - 16
    assert views.count(16) == 3  # two large frames and the small one after them
    assert views.count(body) == 2


def test_encode_frame_does_not_copy_payload_buffers():
    payload = bytearray(b"x" * 1000)
    pieces = encode_frame(0x1001, 0, 1, b"h", [memoryview(payload), b"tail"])
    assert any(isinstance(p, memoryview) and p.obj is payload for p in pieces)
    assert decode_frame(b"".join(pieces)).payload == bytes(payload) + b"tail"


def test_encode_rejects_frames_over_the_limit():
    with pytest.raises(ProtocolError, match="frame limit"):
        encode_frame(0x1001, 0, 1, b"", b"\0" * (16 * 1024 * 1024))


def test_max_frame_length_can_be_lowered_not_raised():
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_length=32 * 1024 * 1024)
    decoder = FrameDecoder(max_frame_length=64)
    with pytest.raises(FrameError):
        decoder.feed(frame_bytes(1, 0, 1, b"", b"\0" * 100))
