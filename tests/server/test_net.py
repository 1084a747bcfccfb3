"""The server network core: PING, bad frames (docs/wire.md, Bad frames), dispatch tables and
refusals of opcodes a role does not serve, errors from handlers, limits, backpressure, idle
timeout and graceful shutdown with GOAWAY."""

from __future__ import annotations

import os
import socket
import threading
import zlib

import pytest

from sbp_spark.protocol.constants import Flags, Opcode
from sbp_spark.protocol.errors import ErrorCode, RangeSealedError
from sbp_spark.protocol.frame import frame_bytes
from sbp_spark.protocol.messages import (
    AppendRequest,
    AppendResponse,
    DescribeRangesRequest,
    DescribeRangesResponse,
    FetchRequest,
    FetchResponse,
    GoAwayRequest,
    SystemError,
    TrimStreamsRequest,
    decode_response,
)
from sbp_spark.server.net import (
    FileRegion,
    FrameServer,
    NetConfig,
    RequestContext,
    RequestHandler,
    Route,
    Runs,
)
from tests.conftest import load_vectors
from tests.polling import stays_true, wait_until

from .wire import EOF, RawPeer

VECTORS = {v["name"]: v for v in load_vectors("frames.json")}
DESCRIBE = Opcode.DESCRIBE_RANGES



class Scripted(RequestHandler):
    """Answers DESCRIBE_RANGES according to the request's header bytes (a tiny script)."""

    opcodes = frozenset({DESCRIBE, Opcode.FETCH, Opcode.APPEND})
    long_opcodes = frozenset({Opcode.FETCH})

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running = 0
        self.max_running = 0
        self.lock = threading.Lock()
        self.region: FileRegion | None = None

    def handle(self, ctx) -> None:
        action = bytes(ctx.payload)
        if action.startswith(b"block\0"):
            action = b"block"
        if action == b"boom":
            raise ValueError("handler exploded")
        if action == b"sealed":
            raise RangeSealedError("range 1/0 is sealed")
        if action == b"silent":
            return
        if action == b"block":
            with self.lock:
                self.running += 1
                self.max_running = max(self.max_running, self.running)
            try:
                self.release.wait(30)
            finally:
                with self.lock:
                    self.running -= 1
        if action == b"defer":
            ctx.defer()
            threading.Timer(0.05, lambda: ctx.reply(DescribeRangesResponse())).start()
            return
        if action == b"keep":  # answered by the test, through self.kept
            ctx.defer()
            self.kept = ctx
            return
        if action == b"file":
            region = self.region
            data = os.pread(region.fd, region.length, region.offset)
            ctx.send_with_regions(DescribeRangesResponse().to_flatbuffers(),
                                  [b"head:", region], zlib.crc32(data, zlib.crc32(b"head:")))
            return
        if action.startswith(b"big"):
            ctx.reply(DescribeRangesResponse(), b"x" * int(action[3:]))
            return
        ctx.reply(DescribeRangesResponse(throttle_time_ms=len(action)))


@pytest.fixture
def handler():
    h = Scripted()
    yield h
    h.release.set()


def _server(handler, **kw) -> FrameServer:
    return FrameServer(handler, NetConfig(**kw)).start()


@pytest.fixture
def server(handler):
    srv = _server(handler)
    yield srv
    handler.release.set()
    srv.stop()


def _ask(peer: RawPeer, action: bytes, stream_id: int | None = None) -> int:
    return peer.request(DescribeRangesRequest(), action, stream_id)


def _status(frame):
    msg = decode_response(frame)
    assert isinstance(msg, SystemError), msg
    return msg.status


def test_binds_loopback_on_a_free_port(server):
    host, port = server.address
    assert host == "127.0.0.1" and port > 0
    assert server.address_str == f"127.0.0.1:{port}"


def test_ping_is_echoed_byte_for_byte(server):
    with RawPeer(server.address) as peer:
        peer.send_raw(bytes.fromhex(VECTORS["ping request, no header, no payload"]["hex"]))
        f = peer.next_frame()
        assert frame_bytes(f.opcode, f.flags, f.stream_id, f.header, f.payload) == bytes.fromhex(
            "0000001017000103000000010100000000000000")
        peer.send(frame_bytes(Opcode.PING, 0, 1, b"", bytes.fromhex("05060708")))
        f = peer.next_frame()
        echoed = frame_bytes(f.opcode, f.flags, f.stream_id, f.header, f.payload)
        assert echoed == bytes.fromhex(VECTORS["ping response echoing 4 payload bytes"]["hex"])


@pytest.mark.parametrize("name", ["frame_length below 16", "frame_length above 16 MiB"])
def test_lost_framing_closes_the_connection(server, name):
    with RawPeer(server.address) as peer:
        peer.send_raw(bytes.fromhex(VECTORS[name]["hex"]))
        assert peer.wait_eof()
    wait_until(lambda: server.connection_count == 0, "the server to drop the connection")


def test_wrong_magic_is_discarded_and_the_connection_lives_on(server):
    with RawPeer(server.address) as peer:
        peer.send_raw(bytes.fromhex(VECTORS["wrong magic"]["hex"]))
        peer.send_raw(frame_bytes(Opcode.PING, 0, 2, b"", b"alive"))
        f = peer.next_frame()
        assert f.stream_id == 2 and bytes(f.payload) == b"alive"


def test_checksum_mismatch_gets_a_system_error_on_its_stream(server):
    with RawPeer(server.address) as peer:
        peer.send_raw(bytes.fromhex(VECTORS["payload checksum mismatch"]["hex"]))
        f = peer.next_frame()
        assert f.stream_id == 3
        assert f.flags == Flags.RESPONSE | Flags.END | Flags.SYSTEM_ERROR
        assert _status(f).code == ErrorCode.CHECKSUM_MISMATCH


def test_header_longer_than_the_frame_gets_invalid_request(server):
    with RawPeer(server.address) as peer:
        peer.send_raw(bytes.fromhex(VECTORS["header_length larger than the frame"]["hex"]))
        f = peer.next_frame()
        assert f.stream_id == 1
        assert _status(f).code == ErrorCode.INVALID_REQUEST


def test_unknown_opcode_and_stray_responses_are_discarded(server):
    with RawPeer(server.address) as peer:
        peer.send(frame_bytes(0x7777, 0, 5, b"", b"?"))
        peer.send(frame_bytes(DESCRIBE, Flags.RESPONSE | Flags.END, 6, b"", b""))
        assert peer.next_frame(timeout=0.3) is None
        sid = _ask(peer, b"ok")
        assert peer.next_frame(sid).stream_id == sid


def test_handler_failures_become_system_errors_and_the_server_survives(server):
    with RawPeer(server.address) as peer:
        sid = _ask(peer, b"boom")
        status = _status(peer.next_frame(sid))
        assert status.code == ErrorCode.UNKNOWN and "handler exploded" in status.message
        sid = _ask(peer, b"sealed")
        assert _status(peer.next_frame(sid)).code == ErrorCode.RANGE_SEALED
        sid = _ask(peer, b"silent")
        assert "no response" in _status(peer.next_frame(sid)).message
        msg, _ = peer.call(DescribeRangesRequest(), b"fine")
        assert msg.throttle_time_ms == 4


def test_deferred_answer_from_another_thread(server):
    with RawPeer(server.address) as peer:
        msg, _ = peer.call(DescribeRangesRequest(), b"defer")
        assert isinstance(msg, DescribeRangesResponse)


def test_try_reply_answers_only_when_it_cannot_block(server, handler):
    with RawPeer(server.address) as peer:
        sid = _ask(peer, b"keep")
        wait_until(lambda: getattr(handler, "kept", None) is not None, "the request to arrive")
        ctx = handler.kept
        # Another sender holds the socket: nothing is sent, the request stays open.
        with ctx.conn._send_lock:
            assert not ctx.try_reply(DescribeRangesResponse(throttle_time_ms=7))
        assert not ctx.done
        assert ctx.try_reply(DescribeRangesResponse(throttle_time_ms=7))
        assert ctx.done
        frame = peer.next_frame(sid)
        assert frame.is_end and decode_response(frame).throttle_time_ms == 7


def test_try_reply_sends_nothing_while_the_socket_has_no_room(server, handler):
    # A peer that stops reading fills the server's socket: the flush thread's answers must
    # not wait on it (nor leave half a frame behind); the answer leaves once there is room.
    with RawPeer(server.address) as peer:
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
        sid = _ask(peer, b"keep")
        wait_until(lambda: getattr(handler, "kept", None) is not None, "the request to arrive")
        ctx = handler.kept
        sock = ctx.conn.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        filler = frame_bytes(Opcode.DESCRIBE_RANGES, Flags.RESPONSE | Flags.END, sid + 100,
                             DescribeRangesResponse().to_flatbuffers())
        sent = 0
        with ctx.conn._send_lock:  # whole frames only, as any sender writes them
            while True:
                try:
                    sent += sock.send(filler, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
        assert sent % len(filler) == 0
        assert not ctx.try_reply(DescribeRangesResponse(throttle_time_ms=7))
        assert not ctx.done
        assert len(peer.response(sid + 100)) == 1  # the peer reads again: room comes back
        wait_until(lambda: ctx.try_reply(DescribeRangesResponse(throttle_time_ms=7)),
                   "the answer to leave")
        frame = peer.next_frame(sid)
        assert frame.is_end and decode_response(frame).throttle_time_ms == 7
        assert all(f.stream_id == sid + 100 for f in peer.frames)


def test_try_reply_works_on_descriptors_past_1024(server, handler):
    # A range server holds a file per segment: its sockets' descriptors pass select()'s
    # limit, and an answer must still leave (it used to raise, and the request hung).
    null = os.open(os.devnull, os.O_RDONLY)
    held = [os.dup(null) for _ in range(1100)]
    try:
        with RawPeer(server.address) as peer:
            sid = _ask(peer, b"keep")
            wait_until(lambda: getattr(handler, "kept", None) is not None, "the request")
            assert handler.kept.conn.sock.fileno() >= 1024
            assert handler.kept.try_reply(DescribeRangesResponse(throttle_time_ms=3))
            assert peer.next_frame(sid).is_end
    finally:
        for fd in [null, *held]:
            os.close(fd)


def test_file_regions_are_sent_inside_a_frame(server, handler, tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"0123456789" * 50_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        handler.region = FileRegion(fd, 7, 300_001)
        with RawPeer(server.address) as peer:  # the decoder checks the CRC trailer
            _, payload = peer.call(DescribeRangesRequest(), b"file")
        assert payload == b"head:" + path.read_bytes()[7:300_008]
    finally:
        os.close(fd)


def test_inflight_limit_stops_reading_until_requests_finish(handler):
    srv = _server(handler, max_inflight_per_connection=2)
    try:
        with RawPeer(srv.address) as peer:
            # FETCH runs on the worker pool, so only the in-flight limit holds these back.
            sids = [peer.request(FetchRequest(), b"block") for _ in range(5)]
            wait_until(lambda: handler.running == 2, "two requests running")
            # A wrongly unlimited reader would start more meanwhile.
            stays_true(lambda: handler.max_running == 2, "at most two requests running", 0.2)
            handler.release.set()
            for sid in sids:
                assert peer.next_frame(sid).is_end
    finally:
        srv.stop()


def test_server_byte_budget_pauses_readers_and_is_released(handler):
    srv = _server(handler, max_inflight_bytes=500 * 1024)
    try:
        with RawPeer(srv.address) as peer:
            big = b"block" + b"\0" * (300 * 1024)  # more than one 256 KiB read each
            sids = [peer.request(FetchRequest(), big) for _ in range(4)]
            wait_until(lambda: handler.running == 2, "two requests running")
            # A reader ignoring the budget would start a third meanwhile.
            stays_true(lambda: handler.max_running == 2, "at most two requests running", 0.3)
            handler.release.set()
            for sid in sids:
                assert peer.next_frame(sid).is_end
        wait_until(lambda: srv.inflight_bytes == 0, "the byte budget to be released")
    finally:
        srv.stop()


def test_connection_limit_refuses_extra_peers(handler):
    srv = _server(handler, max_connections=1)
    try:
        with RawPeer(srv.address) as first:
            msg, _ = first.call(DescribeRangesRequest(), b"x")
            with RawPeer(srv.address) as second:
                f = second.next_frame()
                assert f.opcode == Opcode.GOAWAY
                assert second.wait_eof()
            msg, _ = first.call(DescribeRangesRequest(), b"still here")
            assert msg.throttle_time_ms == 10
    finally:
        srv.stop()


def test_idle_connections_get_goaway_and_are_closed(handler):
    srv = _server(handler, idle_timeout_s=0.3)
    try:
        with RawPeer(srv.address) as peer:
            f = peer.next_frame(timeout=10)
            assert f.opcode == Opcode.GOAWAY and f.stream_id == 0
            assert "idle" in GoAwayRequest.from_flatbuffers(f.header).message
            assert peer.wait_eof()
    finally:
        srv.stop()


def test_shutdown_sends_goaway_and_lets_inflight_requests_finish(handler):
    srv = _server(handler, shutdown_timeout_s=10)
    with RawPeer(srv.address) as peer:
        sid = peer.request(FetchRequest(), b"block")
        wait_until(lambda: handler.running == 1, "the request to start")
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        f = peer.next_frame()
        assert f.opcode == Opcode.GOAWAY
        handler.release.set()
        answer = peer.next_frame(sid)
        assert answer not in (None, EOF) and answer.is_end
        assert peer.wait_eof()
        stopper.join(10)
    assert not stopper.is_alive()


def test_peer_goaway_closes_after_inflight_work(server, handler):
    with RawPeer(server.address) as peer:
        sid = peer.request(FetchRequest(), b"block")
        wait_until(lambda: handler.running == 1, "the request to start")
        peer.request(GoAwayRequest(message="client leaving"))
        handler.release.set()
        assert peer.next_frame(sid).is_end
        assert peer.wait_eof()


def test_a_peer_that_stops_reading_is_dropped_without_wedging_the_server(handler):
    srv = _server(handler, send_timeout_s=0.5, max_outgoing_bytes_per_connection=1 << 20)
    try:
        with RawPeer(srv.address) as stuck:
            stuck.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            for _ in range(4):
                _ask(stuck, b"big8000000")  # never read
            wait_until(lambda: srv.connection_count == 0, "the stuck peer to be dropped",
                       timeout=20)
        with RawPeer(srv.address) as fine:
            msg, _ = fine.call(DescribeRangesRequest(), b"ok")
            assert msg.throttle_time_ms == 2
    finally:
        srv.stop()


def test_config_rejects_bad_limits():
    with pytest.raises(ValueError, match="max_inflight_per_connection"):
        NetConfig(max_inflight_per_connection=0)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        NetConfig(idle_timeout_s=-1)


class Routed(RequestHandler):
    """A role declared by its dispatch table alone."""

    role = "test server"
    routes = {
        Opcode.DESCRIBE_RANGES: Route(DescribeRangesRequest, "_describe"),
        Opcode.FETCH: Route(FetchRequest, "_fetch", Runs.POOL),
        Opcode.APPEND: Route(AppendRequest, "_append", Runs.ORDERED),
    }

    def handle(self, ctx: RequestContext) -> None:
        request_cls, serve = self.route(ctx)
        serve(ctx, request_cls.from_flatbuffers(ctx.header))

    def _describe(self, ctx: RequestContext, request: DescribeRangesRequest) -> None:
        ctx.reply(DescribeRangesResponse(throttle_time_ms=len(request.ranges)))

    def _fetch(self, ctx: RequestContext, request: FetchRequest) -> None:
        ctx.reply(FetchResponse(throttle_time_ms=request.max_wait_ms))

    def _append(self, ctx: RequestContext, request: AppendRequest) -> None:
        ctx.reply(AppendResponse(throttle_time_ms=request.timeout_ms))


def test_a_dispatch_table_sets_what_runs_where_and_what_is_refused():
    assert Routed.opcodes == {Opcode.DESCRIBE_RANGES, Opcode.FETCH, Opcode.APPEND}
    assert Routed.long_opcodes == {Opcode.FETCH}
    assert Routed.ordered_opcodes == {Opcode.APPEND}
    with FrameServer(Routed(), NetConfig(port=0)) as srv, RawPeer(srv.address) as peer:
        assert peer.call(FetchRequest(max_wait_ms=7))[0].throttle_time_ms == 7
        assert peer.call(AppendRequest(timeout_ms=9))[0].throttle_time_ms == 9
        msg, _ = peer.call(TrimStreamsRequest())
        assert isinstance(msg, SystemError) and msg.status.code == ErrorCode.INVALID_REQUEST
        assert msg.status.message == ("this test server does not serve TRIM_STREAMS (0x3005); "
                                      "it serves PING, AUTHENTICATE, APPEND, FETCH, "
                                      "DESCRIBE_RANGES")
        peer.send(frame_bytes(0x7777, 0, 40, b"", b""))  # unknown: still no answer at all
        assert peer.next_frame(40, timeout=0.3) is None
