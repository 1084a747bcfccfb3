"""Hostile input against a real PD and range server: broken frames and mutated headers.

Every request type starts as valid ``messages.XxxRequest(...).to_flatbuffers()`` bytes; the
tests then mutate the header (bit flips, byte and word overwrites with huge values, cuts,
insertions) and the frame around it (another opcode, flags, header format, checksum), send the
bytes over a raw socket, and follow with a PING on the same connection. They check that:

* nothing hangs: a request to a known opcode is answered (a status or a SYSTEM_ERROR; by a role
  that does not serve it, a SYSTEM_ERROR saying so) within a deadline, unknown opcodes and
  stray responses are dropped without an answer, and the PING is
  answered (the connection stays usable) unless the frame was a GOAWAY or broke the framing,
  in which case the server closes the connection cleanly;
* nothing crashes: no handler raised (the servers count unexpected exceptions), every frame the
  servers send decodes, and both still serve afterwards;
* nothing is stored from garbage: a reference stream reads back byte for byte, its ranges are
  unchanged, and everything the scratch stream holds is well-formed batches without holes.

Mutations that happen to form a *valid* request changing the reference stream (or claiming to
be the real range server) are not garbage and are left out (``assume``).
``test_fuzz_requests_long`` is the slow variant (many more examples).
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import KNOWN_OPCODES, MAX_FRAME_LENGTH, Flags, Opcode
from sbp_spark.protocol.errors import ErrorCode, FrameError, HeaderError, StreamNotFoundError
from sbp_spark.protocol.frame import Frame, FrameDecoder, InvalidFrame, encode_frame
from sbp_spark.protocol.records import batch_bytes, parse_header
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.server.pd.handler import PdHandler
from sbp_spark.server.range_server.requests import RangeServerHandler

ANSWER_TIMEOUT_S = 10.0
REQUEST_ID = 7
PING_ID = 0x7FFF0001
# A stream id no test creates: seeds aim here so that most mutations stay harmless.
FUZZ_STREAM = 0x5A3C5E91
READ_ONLY = {Opcode.FETCH, Opcode.DESCRIBE_RANGES, Opcode.LIST_RANGES, Opcode.DESCRIBE_STREAMS,
             Opcode.DESCRIBE_PD_CLUSTER, Opcode.REPORT_METRICS, Opcode.PING}
CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retries=3)


@dataclass(frozen=True)
class Seed:
    """A valid request to mutate, and which server gets it."""

    target: str  # "pd" or "rs"
    msg: object
    payload: bytes = b""

    @property
    def opcode(self) -> int:
        return int(self.msg.OPCODE)


class Env:
    """An embedded cluster with a reference stream (never to change) and a scratch stream."""

    def __init__(self, tmp_path) -> None:
        self.cluster = EmbeddedCluster(tmp_path, range_servers=1, fsync="never").start()
        self.pool = ConnectionPool(CONFIG)
        self.client = SbpClient(self.cluster.pd_address, CONFIG, self.pool)
        ref, scratch = self.client.create_streams(2)
        self.ref, self.scratch = ref.stream_id, scratch.stream_id
        self.client.open_stream(self.ref).append(
            [batch_bytes(b"reference %d" % i * 20) for i in range(10)])
        self.client.open_stream(self.scratch).append([batch_bytes(b"scratch")])
        self.ref_batches = self._read(self.ref)
        self.ref_ranges = self.client.list_ranges(self.ref)
        self.rs_id = self.cluster.server_id(0)
        self.addr = {"pd": self.cluster.pd_address, "rs": self.cluster.range_server_addresses[0]}
        self.served = {"pd": PdHandler.opcodes, "rs": RangeServerHandler.opcodes}
        self.outcomes: Counter[str] = Counter()  # what the sent frames got, for sanity checks

    def _read(self, stream_id: int) -> list[tuple[int, bytes]]:
        return [(b.header.base_offset, bytes(b.data)) for b in self.client.read(stream_id)]

    def seeds(self) -> list[Seed]:
        fz, sc, ref, me = FUZZ_STREAM, self.scratch, self.ref, self.rs_id
        batch = batch_bytes(b"fuzz")
        server = m.RangeServer(me, self.addr["rs"])
        fz_range = m.Range(fz, 0, 0, 0, -1, [m.RangeReplica(server, True)])
        return [
            Seed("pd", m.HeartbeatRequest(client_id="fuzz", client_role=m.ClientRole.CLIENT)),
            Seed("pd", m.AllocateIdRequest(timeout_ms=1000, host="fuzz")),
            Seed("pd", m.ReportMetricsRequest(range_server=m.RangeServer(me, ""),
                                              disk_free_space=1, range_active_cnt=2)),
            Seed("pd", m.DescribePdClusterRequest(timeout_ms=1000)),
            Seed("pd", m.ListRangesRequest(timeout_ms=1000, range_owners=[
                m.RangeOwner(stream_id=ref), m.RangeOwner(range_server=server)])),
            Seed("pd", m.SealRangesRequest(timeout_ms=2000, ranges=[m.RangeId(sc, 0)])),
            Seed("pd", m.CreateRangeRequest(timeout_ms=2000, ranges=[m.RangeId(fz, 1)])),
            Seed("pd", m.DescribeRangesRequest(timeout_ms=1000, ranges=[m.RangeId(ref, 0)])),
            Seed("pd", m.CreateStreamsRequest(timeout_ms=2000, streams=[
                m.Stream(replica_nums=1, retention_period_ms=-1)])),
            Seed("pd", m.DeleteStreamsRequest(timeout_ms=2000, streams=[m.Stream(stream_id=fz)])),
            Seed("pd", m.UpdateStreamsRequest(timeout_ms=2000, streams=[
                m.Stream(stream_id=sc, replica_nums=1, retention_period_ms=-1)])),
            Seed("pd", m.DescribeStreamsRequest(timeout_ms=1000, stream_ids=[ref, sc])),
            Seed("pd", m.TrimStreamsRequest(timeout_ms=2000, trimmed_streams=[
                m.TrimmedStream(sc, 0)])),
            Seed("rs", m.AppendRequest(timeout_ms=2000, append_requests=[
                m.AppendEntry(sc, 0, len(batch))]), batch),
            Seed("rs", m.FetchRequest(max_wait_ms=0, min_bytes=0, fetch_requests=[
                m.FetchEntry(ref, 0, 0, 1 << 20, -1)])),
            Seed("rs", m.SealRangesRequest(timeout_ms=2000, ranges=[m.RangeId(fz, 0)])),
            Seed("rs", m.SyncRangesRequest(timeout_ms=2000, stream_ranges=[
                m.StreamRanges(fz, [fz_range])])),
            Seed("rs", m.DescribeRangesRequest(timeout_ms=1000, ranges=[m.RangeId(ref, 0)])),
            Seed("rs", m.DeleteStreamsRequest(timeout_ms=2000, streams=[m.Stream(stream_id=fz)])),
            Seed("rs", m.TrimStreamsRequest(timeout_ms=2000, trimmed_streams=[
                m.TrimmedStream(fz, 0)])),
            Seed("rs", m.HeartbeatRequest(client_id="fuzz", client_role=m.ClientRole.CLIENT)),
            Seed("rs", m.PingRequest()),
        ]

    def handler_errors(self) -> int:
        rs = self.cluster.range_servers[0]
        return self.cluster.pd._server.stats.handler_errors + rs.net.stats.handler_errors

    def check_untouched(self) -> None:
        """The servers still serve, nothing crashed, no garbage was stored."""
        assert self.handler_errors() == 0, "a handler raised: see the captured log"
        assert self._read(self.ref) == self.ref_batches, "the reference stream changed"
        assert self.client.list_ranges(self.ref) == self.ref_ranges
        # Mutated requests may have trimmed, sealed or deleted the scratch stream (valid
        # requests); whatever it still holds must be whole batches without holes.
        try:
            batches = list(self.client.read(self.scratch))
        except StreamNotFoundError:
            [fresh] = self.client.create_streams(1)
            self.scratch, batches = fresh.stream_id, []
        expected = None
        for b in batches:
            header = parse_header(b.data)  # well-formed, or this raises
            assert expected is None or header.base_offset == expected, \
                f"hole at {expected} in the scratch stream"
            expected = header.end_offset
        [a] = self.client.open_stream(self.scratch).append([batch_bytes(b"still writable")])
        assert expected is None or a.base_offset == expected

    def close(self) -> None:
        self.pool.close()
        self.cluster.stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("hostile"))
    try:
        yield e
    finally:
        e.close()


# -- talking to a server over a raw socket --------------------------------------------------


@dataclass
class Exchange:
    """What came back for the bytes sent."""

    frames: list[Frame]
    eof: bool

    def answered(self, stream_id: int) -> bool:
        return any(f.stream_id == stream_id and f.is_end for f in self.frames)

    def answer(self, stream_id: int) -> list[Frame]:
        return [f for f in self.frames if f.stream_id == stream_id]


def exchange(address: str, data: bytes, done: Callable[[Exchange], bool],
             timeout: float = ANSWER_TIMEOUT_S, half_close: bool = False) -> Exchange:
    """Send ``data`` on a new connection and read until ``done(exchange)``, EOF or timeout.

    Every byte the server sends must decode as a valid frame."""
    host, port = address.rsplit(":", 1)
    result = Exchange([], False)
    decoder = FrameDecoder()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout
        while not done(result):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                break
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                result.eof = True
                break
            try:
                decoder.feed(chunk)
                for event in decoder.events():
                    assert not isinstance(event, InvalidFrame), f"server sent {event}"
                    result.frames.append(event)
            except FrameError as exc:
                raise AssertionError(f"the server sent an unreadable frame: {exc}") from exc
    return result


def ping_frame() -> bytes:
    return b"".join(bytes(b) for b in encode_frame(Opcode.PING, 0, PING_ID, b"", b"ping"))


def _mentions(obj: object, streams: set[int], servers: set[int]) -> bool:
    """Whether a decoded request names one of ``streams`` or ``servers`` anywhere."""
    if isinstance(obj, (list, tuple)):
        return any(_mentions(x, streams, servers) for x in obj)
    if not dataclasses.is_dataclass(obj):
        return False
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name == "stream_id" and value in streams:
            return True
        if f.name == "stream_ids" and any(v in streams for v in value):
            return True
        if f.name == "server_id" and value in servers:
            return True
        if _mentions(value, streams, servers):
            return True
    return False


@dataclass
class Expectation:
    """What a server must do with one (possibly mutated) frame."""

    answer: bool  # a response sequence on REQUEST_ID must arrive
    usable: bool  # the PING that follows must be answered
    harmful: bool  # a valid request that would change what the checks protect


def expect(env: Env, target: str, opcode: int, flags: int, header: bytes,
           frame_ok: bool) -> Expectation:
    """The server's duty for a frame with these fields (``frame_ok``: checksum and header
    format intact)."""
    if flags & Flags.RESPONSE or (opcode == Opcode.GOAWAY and not frame_ok):
        return Expectation(False, True, False)
    if opcode == Opcode.GOAWAY:  # "no more requests": the server finishes, then closes
        return Expectation(False, False, False)
    if opcode not in KNOWN_OPCODES:
        return Expectation(False, True, False)
    if not frame_ok or opcode not in env.served[target] | {Opcode.PING}:
        return Expectation(True, True, False)  # SYSTEM_ERROR: bad frame, or not this role's
    try:
        msg = m.REQUESTS[Opcode(opcode)].from_flatbuffers(header)
    except (HeaderError, KeyError, ValueError):
        return Expectation(True, True, False)  # answered with SYSTEM_ERROR INVALID_REQUEST
    harmful = opcode not in READ_ONLY and _mentions(msg, {env.ref}, {env.rs_id})
    long_poll = opcode == Opcode.FETCH and getattr(msg, "max_wait_ms", 0) > 0
    return Expectation(not long_poll, True, harmful)


def run_case(env: Env, target: str, opcode: int, flags: int, header: bytes, payload: bytes,
             header_format: int | None = None, bad_checksum: bool = False,
             in_hypothesis: bool = False) -> Exchange | None:
    """Send one frame then a PING; check the server did its duty; return what came back.

    A frame that forms a harmful valid request is not sent (None; Hypothesis is told to
    look for other examples)."""
    frame = bytearray(b"".join(bytes(b) for b in encode_frame(
        opcode, flags, REQUEST_ID, header, payload)))
    if header_format is not None:
        frame[12] = header_format
    if bad_checksum:
        frame[-1] ^= 0xFF
    frame_ok = header_format in (None, 1) and not bad_checksum
    duty = expect(env, target, opcode, flags, header, frame_ok)
    if duty.harmful:
        if in_hypothesis:
            assume(False)
        return None

    def done(x: Exchange) -> bool:
        if not duty.usable:
            return x.eof
        return x.answered(PING_ID) and (x.answered(REQUEST_ID) or not duty.answer)

    got = exchange(env.addr[target], bytes(frame) + ping_frame(), done)
    what = f"{target} opcode={opcode:#06x} flags={flags:#04x} header={bytes(header)[:64]!r}"
    if duty.answer:
        assert got.answered(REQUEST_ID), f"no answer to {what}; got {got.frames}"
        for f in got.answer(REQUEST_ID):
            assert f.is_response and f.opcode == opcode, f
    elif flags & Flags.RESPONSE or opcode not in KNOWN_OPCODES:
        assert not got.answer(REQUEST_ID), f"a dropped frame was answered: {what}"
    if duty.usable:
        assert got.answered(PING_ID), f"connection unusable after {what} (eof={got.eof})"
    else:
        assert got.eof, f"connection not closed after GOAWAY: {what}"
    answer = got.answer(REQUEST_ID)
    env.outcomes["closed" if got.eof else "system error" if answer and answer[-1].is_system_error
                 else "answered" if answer else "no answer"] += 1
    return got


# -- Hypothesis: mutated headers and frames ---------------------------------------------------

_BIG = st.sampled_from([0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, 0x00FFFFFF, 0xFFFF, 0, 1])
MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(st.just("word"), st.integers(0, 1 << 16), _BIG | st.integers(0, (1 << 32) - 1)),
    st.tuples(st.just("cut"), st.integers(0, 1 << 16)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=16)),
)
FRAMING = st.one_of(
    st.just(("keep",)),
    st.tuples(st.just("opcode"), st.sampled_from([int(o) for o in Opcode])),
    st.tuples(st.just("opcode"), st.integers(0, 0xFFFF)),
    st.tuples(st.just("flags"), st.integers(0, 0xFF)),
    st.tuples(st.just("format"), st.integers(0, 0xFF)),
    st.tuples(st.just("checksum"),),
    st.tuples(st.just("payload"), st.binary(max_size=256)),
)


def mutate(data: bytes, mutations: list[tuple]) -> bytes:
    buf = bytearray(data)
    for mut in mutations:
        kind, at = mut[0], mut[1]
        if kind == "insert":
            pos = at % (len(buf) + 1)
            buf[pos:pos] = mut[2]
            continue
        if not buf:
            continue
        pos = at % len(buf)
        if kind == "flip":
            buf[pos] ^= 1 << mut[2]
        elif kind == "set":
            buf[pos] = mut[2]
        elif kind == "word":
            pos -= pos % 4  # FlatBuffers offsets and lengths are aligned words
            buf[pos:pos + 4] = struct.pack("<I", mut[2])[:len(buf) - pos]
        else:  # cut
            del buf[pos:]
    return bytes(buf)


def fuzz(env: Env, examples: int) -> None:
    seeds = env.seeds()

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(seed=st.sampled_from(seeds), mutations=st.lists(MUTATION, min_size=0, max_size=4),
           framing=FRAMING)
    def one(seed: Seed, mutations: list[tuple], framing: tuple) -> None:
        header = mutate(seed.msg.to_flatbuffers(), mutations)
        opcode, flags, payload = seed.opcode, 0, seed.payload
        header_format, bad_checksum = None, False
        if framing[0] == "opcode":
            opcode = framing[1]
        elif framing[0] == "flags":
            flags = framing[1]
        elif framing[0] == "format":
            header_format = framing[1]
        elif framing[0] == "checksum":
            bad_checksum = True
            payload = payload or b"x"  # a checksum to get wrong
        elif framing[0] == "payload":
            payload = framing[1]
        run_case(env, seed.target, opcode, flags, header, payload, header_format, bad_checksum,
                 in_hypothesis=True)

    one()


def test_fuzz_requests(env):
    env.outcomes.clear()
    fuzz(env, 200)
    env.check_untouched()
    # The mutations reach both the request parsers and the handlers.
    assert env.outcomes["system error"] and env.outcomes["answered"], env.outcomes


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_requests_long(env):
    fuzz(env, 5000)
    env.check_untouched()


# -- deterministic hostile cases --------------------------------------------------------------


def test_every_word_of_every_header_set_to_huge_values(env):
    """Vector lengths, offsets and scalars declared huge (or negative as int32): each request
    is answered quickly, nothing is allocated for the declared sizes, nothing is stored."""
    began = time.monotonic()
    cases = 0
    for seed in env.seeds():
        data = seed.msg.to_flatbuffers()
        for pos in range(0, len(data) - 3, 4):
            for value in (0x7FFFFFFF, 0xFFFFFFFF, 0x80000000):
                header = data[:pos] + struct.pack("<I", value) + data[pos + 4:]
                if run_case(env, seed.target, seed.opcode, 0, header, seed.payload):
                    cases += 1
    assert cases > 500
    assert time.monotonic() - began < 120
    env.check_untouched()


@pytest.mark.parametrize("target", ["pd", "rs"])
@pytest.mark.parametrize("length", [0, 15, MAX_FRAME_LENGTH + 1, 0x80000000, 0xFFFFFFFF])
def test_frame_length_out_of_bounds_closes_the_connection(env, target, length):
    data = struct.pack(">I", length) + b"\x17" + b"\0" * 32
    got = exchange(env.addr[target], data, lambda x: x.eof, timeout=5)
    assert got.eof and not got.frames
    env.check_untouched()


@pytest.mark.parametrize("target", ["pd", "rs"])
def test_header_length_beyond_the_frame_is_an_invalid_request(env, target):
    frame = bytearray(b"".join(bytes(b) for b in encode_frame(
        Opcode.DESCRIBE_RANGES, 0, REQUEST_ID, m.DescribeRangesRequest().to_flatbuffers())))
    frame[13:16] = (0xFFFFFF).to_bytes(3, "big")
    got = exchange(env.addr[target], bytes(frame) + ping_frame(),
                   lambda x: x.answered(PING_ID) and x.answered(REQUEST_ID))
    [answer] = got.answer(REQUEST_ID)
    assert answer.is_system_error
    assert m.decode_response(answer).status.code == ErrorCode.INVALID_REQUEST
    assert got.answered(PING_ID)


def test_truncated_frame_then_close_stores_nothing(env):
    """A 1 MiB APPEND cut off half way: the server drops it when the peer goes."""
    body = b"y" * (1 << 20)
    batch = batch_bytes(body)
    request = m.AppendRequest(append_requests=[m.AppendEntry(env.scratch, 0, len(batch))])
    data = b"".join(bytes(b) for b in m.request_frame(REQUEST_ID, request, batch))
    got = exchange(env.addr["rs"], data[:len(data) // 2], lambda x: x.eof, timeout=5,
                   half_close=True)
    assert got.eof and not got.frames
    env.check_untouched()
    assert all(body not in bytes(b.data) for b in env.client.read(env.scratch))


def test_largest_frame_of_garbage_fails_its_entries_and_stores_nothing(env):
    """A frame of the maximum size whose one entry declares the whole payload as a batch of
    garbage, and one a byte too large: the first is refused per entry, the second closes."""
    # frame_length = 16 + header + payload; the header's size does not depend on the value.
    header_size = len(m.AppendRequest(append_requests=[
        m.AppendEntry(env.scratch, 0, 1 << 24)]).to_flatbuffers())
    payload = b"\xab" * (MAX_FRAME_LENGTH - 16 - header_size)
    request = m.AppendRequest(append_requests=[m.AppendEntry(env.scratch, 0, len(payload))])
    data = b"".join(bytes(b) for b in m.request_frame(REQUEST_ID, request, payload))
    assert len(data) - 4 == MAX_FRAME_LENGTH
    got = exchange(env.addr["rs"], data + ping_frame(),
                   lambda x: x.answered(REQUEST_ID) and x.answered(PING_ID))
    [answer] = got.answer(REQUEST_ID)
    response = m.decode_response(answer)
    assert [r.status.code for r in response.append_responses] != [0]
    too_big = bytearray(data)
    too_big[0:4] = struct.pack(">I", MAX_FRAME_LENGTH + 1)
    got = exchange(env.addr["rs"], bytes(too_big[:64]), lambda x: x.eof, timeout=5)
    assert got.eof and not got.frames
    env.check_untouched()
