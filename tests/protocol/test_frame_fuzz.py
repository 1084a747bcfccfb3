"""Property and fuzz tests of the frame codec: any framing of valid frames decodes identically,
and arbitrary bytes only ever raise the project's ProtocolError (never hang, never crash)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbp_spark.protocol.constants import KNOWN_OPCODES
from sbp_spark.protocol.errors import ProtocolError
from sbp_spark.protocol.frame import Frame, FrameDecoder, InvalidFrame, decode_frame, frame_bytes

frames_st = st.builds(
    lambda op, fl, sid, h, p: (op, fl, sid, h, p),
    st.sampled_from(sorted(KNOWN_OPCODES)),
    st.integers(0, 7),
    st.integers(0, 2**31 - 1),
    st.binary(max_size=300),
    st.binary(max_size=3000),
)


@given(st.lists(frames_st, min_size=1, max_size=6), st.data())
@settings(max_examples=200, deadline=None)
def test_frames_round_trip_under_random_chunking(frames, data):
    wire = b"".join(frame_bytes(*f) for f in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=20)))
    decoder = FrameDecoder()
    prev = 0
    for cut in [*cuts, len(wire)]:
        decoder.feed(wire[prev:cut])
        prev = cut
    got = list(decoder.events())
    assert [(f.opcode, f.flags, f.stream_id, bytes(f.header), bytes(f.payload)) for f in got] \
        == frames
    for single in frames:
        f = decode_frame(frame_bytes(*single))
        assert (f.opcode, f.flags, f.stream_id, bytes(f.header), bytes(f.payload)) == single


def _feed_only_protocol_errors(data: bytes) -> None:
    decoder = FrameDecoder()
    try:
        decoder.feed(data)
        for event in decoder.events():
            assert isinstance(event, (Frame, InvalidFrame))
    except ProtocolError:
        pass
    try:
        decode_frame(data)
    except ProtocolError:
        pass


def _mutations(rng: random.Random, count: int):
    seeds = [frame_bytes(0x1001, 0, 7, b"\x0c\0\0\0\x08\0\x0c\0", b"p" * 40),
             frame_bytes(1, 3, 1, b"", b"\x05\x06"), frame_bytes(0x2001, 3, 9, b"abcd", b"")]
    for _ in range(count):
        kind = rng.randrange(3)
        if kind == 0:
            yield rng.randbytes(rng.randint(0, 64))
        else:
            data = bytearray(rng.choice(seeds) * rng.randint(1, 3))
            for _ in range(rng.randint(1, 4)):
                if not data:
                    break
                pos = rng.randrange(len(data))
                if kind == 1:
                    data[pos] = rng.randrange(256)
                else:
                    del data[pos:pos + rng.randint(1, 8)]
            yield bytes(data)


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_random_bytes_only_raise_protocol_errors(data):
    _feed_only_protocol_errors(data)


def test_mutated_frames_only_raise_protocol_errors():
    for data in _mutations(random.Random(1), 5_000):
        _feed_only_protocol_errors(data)


@pytest.mark.slow
def test_mutated_frames_only_raise_protocol_errors_100k():
    for data in _mutations(random.Random(2), 100_000):
        _feed_only_protocol_errors(data)
