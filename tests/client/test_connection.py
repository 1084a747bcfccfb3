"""Connection behaviour against scripted loopback servers: multiplexing, ordering, failures."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from sbp_spark.client import ClientConfig, Connection, ConnectionPool
from sbp_spark.client.connection import parse_address
from sbp_spark.protocol.constants import Flags, Opcode
from sbp_spark.protocol.errors import (
    ChecksumError,
    ConnectTimeoutError,
    ReadTimeoutError,
    TransportError,
    WriteTimeoutError,
)
from sbp_spark.protocol.frame import encode_frame
from sbp_spark.transport.sockets import send_buffers
from tests.polling import wait_until

from .fakes import RESPONSE_END, FakeServer, Peer, echo_handler

FAST = ClientConfig(connect_timeout_s=2, request_timeout_s=5)
OP = Opcode.FETCH  # any request opcode: the scripted servers do not decode headers




@pytest.fixture
def echo_server():
    with FakeServer(echo_handler) as server:
        yield server


def test_parse_address():
    assert parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    for bad in ("nohost", "host:", ":80", "h:0", "h:x", 42):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_ping_and_request_roundtrip(echo_server):
    with Connection(echo_server.address, FAST) as conn:
        assert conn.ping() >= 0
        frames = list(conn.request(OP, b"hdr", b"payload"))
        assert len(frames) == 1
        assert bytes(frames[0].header) == b"hdr" and bytes(frames[0].payload) == b"payload"
        assert frames[0].flags == RESPONSE_END
        assert conn.outstanding == 0


def test_pipelines_1000_requests_on_one_connection(echo_server):
    with Connection(echo_server.address, FAST) as conn:
        streams = [conn.request(OP, b"", struct.pack(">I", i)) for i in range(1000)]
        assert len({s.stream_id for s in streams}) == 1000
        assert all(0 < s.stream_id < 2**31 for s in streams)
        assert conn.outstanding > 0
        for i, stream in enumerate(streams):
            (frame,) = list(stream)
            assert struct.unpack(">I", frame.payload)[0] == i
        assert conn.outstanding == 0
    assert echo_server.connections == 1


def test_out_of_order_answers_reach_their_requests():
    def reverse(peer: Peer) -> None:
        requests = [peer.read_frame() for _ in range(20)]
        for frame in reversed(requests):
            peer.reply(frame, b"", bytes(frame.payload))

    with FakeServer(reverse) as server, Connection(server.address, FAST) as conn:
        streams = [conn.request(OP, b"", b"req-%d" % i) for i in range(20)]
        for i, stream in enumerate(streams):
            assert [bytes(f.payload) for f in stream] == [b"req-%d" % i]
        assert not server.errors


def test_interleaved_streaming_responses_keep_their_order():
    def interleave(peer: Peer) -> None:
        requests = [peer.read_frame() for _ in range(3)]
        for part in range(5):
            for frame in requests:
                last = part == 4
                flags = RESPONSE_END if last else Flags.RESPONSE
                peer.reply(frame, b"", bytes(frame.payload) + b":%d" % part, flags)

    with FakeServer(interleave) as server, Connection(server.address, FAST) as conn:
        streams = [conn.request(OP, b"", b"s%d" % i) for i in range(3)]
        results = {}

        def consume(i):
            results[i] = [bytes(f.payload) for f in streams[i]]

        threads = [threading.Thread(target=consume, args=(i,)) for i in (2, 0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        for i in range(3):
            assert results[i] == [b"s%d:%d" % (i, p) for p in range(5)]
        assert conn.outstanding == 0


def _record_readers(conn: Connection) -> list[tuple[int, str]]:
    """(stream_id, name of the thread that read it) of every frame ``conn`` dispatches."""
    seen: list[tuple[int, str]] = []
    dispatch = conn._dispatch

    def recording(event):
        seen.append((event.stream_id, threading.current_thread().name))
        dispatch(event)

    conn._dispatch = recording  # type: ignore[method-assign]
    return seen


def test_a_waiting_caller_reads_its_own_answers(echo_server):
    # One thread asking and waiting, again and again: it reads every answer itself, so no
    # other thread has to be woken to hand them over (see client/read_turn.py).
    with Connection(echo_server.address, FAST) as conn:
        seen = _record_readers(conn)
        for i in range(200):
            (frame,) = list(conn.request(OP, b"", b"%d" % i))
            assert bytes(frame.payload) == b"%d" % i
        me = threading.current_thread().name
        assert len(seen) == 200 and {name for _, name in seen} == {me}


def test_answers_nobody_waits_for_are_read_in_the_background():
    # Each answer is as large as its request and the server writes it before reading the
    # next one: a writer that keeps sending without reading would leave the server blocked on
    # a full socket, and itself blocked behind it, if nothing read the answers meanwhile.
    def big_echo(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            peer.reply(frame, b"", bytes(frame.payload))

    payload = b"p" * (1 << 20)
    with FakeServer(big_echo) as server, Connection(server.address, FAST) as conn:
        seen = _record_readers(conn)
        streams = [conn.request(OP, b"", payload) for _ in range(48)]
        assert all([bytes(f.payload) for f in s] == [payload] for s in streams)
        assert conn.outstanding == 0
        assert any(name.startswith("sbp-reader-") for _, name in seen)
        assert not server.errors


def test_many_threads_share_one_connection(echo_server):
    with Connection(echo_server.address, FAST) as conn:
        failures: list[BaseException] = []

        def ask(worker: int) -> None:
            try:
                for i in range(300):
                    data = b"%d-%d" % (worker, i)
                    (frame,) = list(conn.request(OP, b"", data))
                    assert bytes(frame.payload) == data
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=ask, args=(w,)) for w in range(8)]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not failures and not any(t.is_alive() for t in threads)
        assert time.monotonic() - began < 30
        assert conn.outstanding == 0


def test_the_read_turn_passes_on_when_its_holder_has_its_answer():
    # Two callers wait; the one reading gets its answer first and leaves, and the other
    # must go on reading for its own (answered half a second later), not wait out its timeout.
    def staggered(peer: Peer) -> None:
        first, second = peer.read_frame(), peer.read_frame()
        peer.reply(first, b"", b"one")
        time.sleep(0.5)
        peer.reply(second, b"", b"two")
        echo_handler(peer)

    config = ClientConfig(connect_timeout_s=2, request_timeout_s=20)
    with FakeServer(staggered) as server, Connection(server.address, config) as conn:
        s1, s2 = conn.request(OP, b"", b"1"), conn.request(OP, b"", b"2")
        got: dict[str, tuple[bytes, float]] = {}
        began = time.monotonic()

        def consume(name, stream):
            got[name] = (bytes(next(stream).payload), time.monotonic() - began)

        threads = [threading.Thread(target=consume, args=a) for a in (("1", s1), ("2", s2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert got["1"][0] == b"one" and got["2"][0] == b"two"
        assert got["2"][1] < 5, "the second caller waited out its timeout for the turn"
        assert not server.errors


def test_a_caller_times_out_while_another_holds_the_read_turn():
    release = threading.Event()

    def hold(peer: Peer) -> None:
        first, second = peer.read_frame(), peer.read_frame()
        release.wait(5)
        peer.reply(first, b"", b"late")
        peer.reply(second, b"", b"dropped")
        echo_handler(peer)

    config = ClientConfig(connect_timeout_s=2, request_timeout_s=10)
    with FakeServer(hold) as server, Connection(server.address, config) as conn:
        slow = conn.request(OP, b"", b"a")
        reader = threading.Thread(target=lambda: got.append(bytes(next(slow).payload)))
        got: list[bytes] = []
        reader.start()
        wait_until(lambda: conn._turn._reading)
        hurried = conn.request(OP, b"", b"b", timeout=0.3)
        began = time.monotonic()
        with pytest.raises(ReadTimeoutError, match="within 0.3s"):
            next(hurried)
        assert time.monotonic() - began < 3
        release.set()
        reader.join(10)
        assert got == [b"late"]
        assert [bytes(f.payload) for f in conn.request(OP, b"", b"c")] == [b"c"]


def test_server_dying_mid_response_fails_every_waiter():
    got = threading.Event()

    def die(peer: Peer) -> None:
        requests = [peer.read_frame() for _ in range(10)]
        peer.reply(requests[0], b"", b"first part", Flags.RESPONSE)
        # Half a frame, then the connection drops.
        whole = b"".join(bytes(b) for b in encode_frame(OP, RESPONSE_END, requests[1].stream_id,
                                                        b"", b"x" * 1000))
        peer.sock.sendall(whole[:500])
        got.wait(5)

    with FakeServer(die) as server:
        conn = Connection(server.address, ClientConfig(request_timeout_s=30))
        streams = [conn.request(OP, b"", b"%d" % i) for i in range(10)]
        assert bytes(next(streams[0]).payload) == b"first part"
        errors = []

        def wait(stream):
            try:
                list(stream)
            except TransportError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait, args=(s,)) for s in streams]
        for t in threads:
            t.start()
        got.set()
        began = time.monotonic()
        for t in threads:
            t.join(10)
        assert time.monotonic() - began < 5, "waiters hung after the server died"
        assert len(errors) == 10
        assert all(server.address in str(e) for e in errors)
        assert conn.closed and not conn.usable
        with pytest.raises(TransportError, match=server.address):
            conn.request(OP)


def test_goaway_lets_inflight_finish_and_pool_reconnects():
    release = threading.Event()

    def drain(peer: Peer) -> None:
        first = peer.read_frame()
        if first is None:
            return
        if bytes(first.payload) == b"before":
            second = peer.read_frame()
            peer.goaway()
            release.wait(5)
            peer.reply(first, b"", b"answer-1")
            peer.reply(second, b"", b"answer-2")
            assert peer.read_frame() is None  # the client closes once both are answered
        else:
            echo_handler_rest(peer, first)

    def echo_handler_rest(peer, first):
        peer.reply(first, bytes(first.header), bytes(first.payload))
        echo_handler(peer)

    with FakeServer(drain) as server, ConnectionPool(FAST) as pool:
        conn = pool.get(server.address)
        s1 = conn.request(OP, b"", b"before")
        s2 = conn.request(OP, b"", b"also-before")
        wait_until(lambda: conn.goaway_received)
        assert not conn.usable
        with pytest.raises(TransportError, match="GOAWAY"):
            conn.request(OP, b"", b"after")
        replacement = pool.get(server.address)
        assert replacement is not conn
        assert [bytes(f.payload) for f in replacement.request(OP, b"", b"new")] == [b"new"]
        release.set()
        assert [bytes(f.payload) for f in s1] == [b"answer-1"]
        assert [bytes(f.payload) for f in s2] == [b"answer-2"]
        wait_until(lambda: conn.closed)
        assert server.connections == 2
    assert not server.errors


def test_request_timeout_then_late_answer_is_dropped():
    held = []
    release = threading.Event()

    def slow(peer: Peer) -> None:
        first = peer.read_frame()
        held.append(first)
        release.wait(5)
        peer.reply(first, b"", b"late")
        echo_handler(peer)

    with FakeServer(slow) as server, Connection(server.address, FAST) as conn:
        stream = conn.request(OP, b"", b"x", timeout=0.2)
        with pytest.raises(ReadTimeoutError, match="within 0.2s"):
            next(stream)
        assert conn.outstanding == 0
        release.set()
        assert [bytes(f.payload) for f in conn.request(OP, b"", b"next")] == [b"next"]
        assert conn.usable


def test_client_answers_server_ping():
    answers = []

    def pinger(peer: Peer) -> None:
        peer.send(encode_frame(Opcode.PING, 0, 7, b"", b"are you there"))
        answers.append(peer.read_frame())

    with FakeServer(pinger) as server, Connection(server.address, FAST):
        wait_until(lambda: answers)
    (pong,) = answers
    assert pong.opcode == Opcode.PING and pong.stream_id == 7
    assert pong.flags == RESPONSE_END and bytes(pong.payload) == b"are you there"


def test_bad_checksum_fails_only_that_request():
    def corrupt(peer: Peer) -> None:
        bad = peer.read_frame()
        frame = bytearray(b"".join(bytes(b) for b in encode_frame(
            OP, RESPONSE_END, bad.stream_id, b"", b"payload")))
        frame[-1] ^= 0xFF
        peer.sock.sendall(bytes(frame))
        echo_handler(peer)

    with FakeServer(corrupt) as server, Connection(server.address, FAST) as conn:
        with pytest.raises(ChecksumError, match=server.address):
            list(conn.request(OP, b"", b"payload"))
        assert [bytes(f.payload) for f in conn.request(OP, b"", b"ok")] == [b"ok"]


def test_idle_connection_closes_and_pool_replaces_it(echo_server):
    config = ClientConfig(idle_timeout_s=0.2)
    with ConnectionPool(config) as pool:
        conn = pool.get(echo_server.address)
        conn.ping()
        wait_until(lambda: conn.closed)
        again = pool.get(echo_server.address)
        assert again is not conn and again.ping() >= 0


def test_send_to_a_peer_that_stops_reading_times_out():
    # The kernel bounds the wait (SO_SNDTIMEO): a send that makes no progress for
    # request_timeout_s fails the connection with a timeout naming the server.
    release = threading.Event()

    def never_reads(peer: Peer) -> None:
        release.wait(30)

    config = ClientConfig(connect_timeout_s=2, request_timeout_s=0.5)
    with FakeServer(never_reads) as server, Connection(server.address, config) as conn:
        start = time.monotonic()
        with pytest.raises(WriteTimeoutError,
                           match=f"sending to {server.address} made no progress"):
            for _ in range(64):  # far more than the socket buffers hold
                conn.request(OP, b"", b"x" * (4 << 20))
        assert time.monotonic() - start < 10
        assert conn.closed
        release.set()


def test_quiet_connection_waits_past_its_receive_timeout_slices():
    # A request answered later than the reader's wait slice still gets its answer: the
    # reader's timeout only checks for idleness while a request is pending.
    def slow_echo(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            time.sleep(0.6)
            peer.reply(frame, b"", bytes(frame.payload))

    config = ClientConfig(connect_timeout_s=2, request_timeout_s=5, idle_timeout_s=0.2)
    with FakeServer(slow_echo) as server, Connection(server.address, config) as conn:
        (frame,) = list(conn.request(OP, b"", b"late"))
        assert bytes(frame.payload) == b"late"


def test_a_tls_handshake_that_never_answers_is_a_connect_timeout():
    # A listener that accepts and stays silent: TCP connects, the handshake waits for a
    # ServerHello that never comes, within the connect timeout.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        config = ClientConfig(connect_timeout_s=0.3, tls=True)
        with pytest.raises(ConnectTimeoutError, match=f"TLS handshake with {address} timed out"):
            Connection(address, config)


def test_connect_failure_names_the_address():
    with FakeServer(echo_handler) as server:
        address = server.address
    with pytest.raises(TransportError, match=address):
        Connection(address, FAST)


def test_partial_sends_and_many_buffers_arrive_intact(echo_server):
    pieces = [bytes([i % 251]) * (i % 97 + 1) for i in range(3000)]
    pieces.append(b"z" * (6 << 20))
    with Connection(echo_server.address, FAST) as conn:
        (frame,) = list(conn.request(OP, b"", pieces))
        assert bytes(frame.payload) == b"".join(pieces)


def test_send_buffers_resumes_partial_sends():
    class Trickle:
        def __init__(self):
            self.out = bytearray()

        def sendmsg(self, buffers):
            first = bytes(buffers[0])
            take = max(1, len(first) // 2)
            self.out += first[:take]
            return take

    sink = Trickle()
    send_buffers(sink, [b"abcdef", memoryview(b""), memoryview(b"ghij"), b"k"])
    assert bytes(sink.out) == b"abcdefghijk"


def test_closed_connection_rejects_requests(echo_server):
    conn = Connection(echo_server.address, FAST)
    stream = conn.request(OP, b"", b"x")
    list(stream)
    conn.close()
    with pytest.raises(TransportError, match="closed"):
        conn.request(OP)


def test_receive_buffers_reuse_only_unreferenced_buffers():
    from sbp_spark.client.connection import ReceiveBuffers

    buffers = ReceiveBuffers(budget=4 << 20)
    first = buffers(1 << 20)
    view = memoryview(first)[10:20]  # a frame's payload view keeps its buffer busy
    second = buffers(1 << 20)
    assert second is not first and len(second) == 1 << 20
    del view
    grown = buffers((1 << 20) + 100)  # free again: resized in place within its headroom
    assert grown is first and len(grown) == (1 << 20) + 100
    held = memoryview(grown)
    smaller = buffers(900_000)
    assert smaller is second and len(smaller) == 900_000
    assert buffers(100_000) is not second  # far smaller frames do not pin large buffers
    held.release()
    for _ in range(10):  # past the budget, the oldest buffers are forgotten
        buffers(1 << 20)
    assert sum(cap for _, cap in buffers._buffers) <= (4 << 20) + (2 << 20)


def test_large_frames_arrive_intact_through_recycled_buffers(echo_server):
    with Connection(echo_server.address, FAST) as conn:
        kept = []
        for i in range(12):
            payload = bytes([i]) * (700_000 + i * 1000)
            (frame,) = list(conn.request(OP, b"", payload))
            assert bytes(frame.payload) == payload
            if i % 3 == 0:
                kept.append((frame.payload, payload))  # held views must never be overwritten
        for view, payload in kept:
            assert bytes(view) == payload


def test_system_error_frame_raises_the_server_error():
    from sbp_spark.protocol import messages as m
    from sbp_spark.protocol.errors import InvalidRequestError

    def refuse(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            peer.send(m.system_error_frame(frame.stream_id, frame.opcode, m.Status(
                2, "header does not parse")))

    with FakeServer(refuse) as server, Connection(server.address, FAST) as conn:
        with pytest.raises(InvalidRequestError, match="header does not parse"):
            list(conn.request(OP, b"junk"))
        with pytest.raises(InvalidRequestError):
            conn.call(m.DescribeStreamsRequest(stream_ids=[1]))
        assert conn.outstanding == 0 and conn.usable


def test_call_rejects_answers_of_the_wrong_shape():
    from sbp_spark.protocol import messages as m
    from sbp_spark.protocol.errors import ProtocolError

    def odd(peer: Peer) -> None:
        first = peer.read_frame()  # answered with a different opcode
        peer.send(m.response_frame(first.stream_id, m.ListRangesResponse()))
        second = peer.read_frame()  # answered with two frames
        peer.send(m.response_frame(second.stream_id, m.DescribeStreamsResponse(), end=False))
        peer.send(m.response_frame(second.stream_id, m.DescribeStreamsResponse()))
        echo_handler(peer)

    with FakeServer(odd) as server, Connection(server.address, FAST) as conn:
        with pytest.raises(ProtocolError, match="LIST_RANGES"):
            conn.call(m.DescribeStreamsRequest(stream_ids=[1]))
        with pytest.raises(ProtocolError, match="more than one frame"):
            conn.call(m.DescribeStreamsRequest(stream_ids=[1]))
        assert conn.ping() >= 0 and conn.outstanding == 0
