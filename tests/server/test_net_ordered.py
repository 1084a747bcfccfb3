"""Requests served on a connection's ordered handler thread (``RequestHandler.ordered_opcodes``)."""

from __future__ import annotations

import hashlib
import threading

import pytest

from sbp_spark.protocol.constants import Opcode
from sbp_spark.protocol.messages import DescribeRangesRequest, DescribeRangesResponse, PingRequest
from sbp_spark.server.net import FrameServer, NetConfig, RequestHandler, Route, Runs
from tests.polling import wait_until

from .wire import RawPeer

DESCRIBE = Opcode.DESCRIBE_RANGES



class Ordered(RequestHandler):
    """Serves DESCRIBE_RANGES on the ordered thread; records what it saw, in order."""

    opcodes = frozenset({DESCRIBE})
    ordered_opcodes = frozenset({DESCRIBE})

    def __init__(self) -> None:
        self.release = threading.Event()
        self.blocked = threading.Event()
        self.seen: list[tuple[int, str]] = []  # (stream_id, digest of the payload)
        self.threads: set[str] = set()

    def handle(self, ctx) -> None:
        self.threads.add(threading.current_thread().name)
        payload = bytes(ctx.payload)
        if payload.startswith(b"block"):
            self.blocked.set()
            self.release.wait(30)
        self.seen.append((ctx.stream_id, hashlib.sha256(payload).hexdigest()))
        ctx.reply(DescribeRangesResponse(throttle_time_ms=len(payload)))


@pytest.fixture
def ordered():
    handler = Ordered()
    server = FrameServer(handler, NetConfig(recycle_bytes_per_connection=2 << 20)).start()
    yield handler, server
    handler.release.set()
    server.stop()


def test_ordered_requests_leave_the_reader_free_and_keep_their_order(ordered):
    handler, server = ordered
    with RawPeer(server.address) as peer:
        first = peer.request(DescribeRangesRequest(), b"block")
        assert handler.blocked.wait(10)
        later = [peer.request(DescribeRangesRequest(), b"n%d" % i) for i in range(5)]
        # The handler thread is stuck, yet the reader still reads: PING is answered.
        ping = peer.request(PingRequest(), b"still reading")
        assert peer.next_frame(ping).payload == b"still reading"
        assert handler.seen == []
        handler.release.set()
        for sid in [first, *later]:
            assert peer.next_frame(sid).is_end
    assert [sid for sid, _ in handler.seen] == [first, *later]
    reader_names = {name for name in handler.threads if not name.endswith("-handler")}
    assert reader_names == set(), handler.threads


def test_large_frames_on_the_ordered_thread_arrive_intact_with_recycled_buffers(ordered):
    handler, server = ordered
    payloads = [bytes([i]) * (300_000 + 70_000 * (i % 4)) for i in range(16)]
    with RawPeer(server.address) as peer:
        first = peer.request(DescribeRangesRequest(), b"block")
        assert handler.blocked.wait(10)
        # Queued behind a blocked request: their buffers are all held at once, past the
        # recycling budget, so later frames must not be received into a buffer still in use.
        sids = [peer.request(DescribeRangesRequest(), p) for p in payloads]
        handler.release.set()
        for sid in [first, *sids]:
            assert peer.next_frame(sid).is_end
        # A second round, answered one at a time, reuses the freed buffers.
        for p in payloads:
            msg, _ = peer.call(DescribeRangesRequest(), p)
            assert msg.throttle_time_ms == len(p)
    expected = [hashlib.sha256(p).hexdigest() for p in payloads]
    assert [digest for _, digest in handler.seen[1:]] == expected * 2


def test_closing_the_connection_ends_the_handler_thread(ordered):
    handler, server = ordered
    with RawPeer(server.address) as peer:
        peer.call(DescribeRangesRequest(), b"x")
    wait_until(lambda: server.connection_count == 0, "the server to drop the connection")
    wait_until(lambda: not any(
        t.name.startswith("sbp-conn") and t.name.endswith("-handler") and t.is_alive()
        for t in threading.enumerate()), "the connection's handler thread to end")


class Inline(Ordered):
    """The same, declared by a route whose frames up to 1,000 bytes may run on the reader."""

    routes = {DESCRIBE: Route(DescribeRangesRequest, "handle", Runs.ORDERED, 1_000)}


def test_small_ordered_requests_run_on_the_reader_while_the_handler_thread_is_idle():
    handler = Inline()
    server = FrameServer(handler, NetConfig()).start()
    try:
        with RawPeer(server.address) as peer:
            for payload in (b"small", b"x" * 2_000, b"small again"):
                peer.call(DescribeRangesRequest(), payload)
            assert len(handler.threads) == 2  # the reader, and the handler for the large one
            # Something is queued before it (a blocked request): a small one waits its turn
            # on the handler thread, so the order holds.
            first = peer.request(DescribeRangesRequest(), b"block" + b"." * 2_000)
            assert handler.blocked.wait(10)
            small = peer.request(DescribeRangesRequest(), b"tiny")
            ping = peer.request(PingRequest(), b"still reading")
            assert peer.next_frame(ping).payload == b"still reading"
            handler.release.set()
            assert peer.next_frame(first).is_end and peer.next_frame(small).is_end
        threads = sorted(handler.threads)
        assert sum(name.endswith("-handler") for name in threads) == 1, threads
        assert [sid for sid, _ in handler.seen][-2:] == [first, small]
    finally:
        handler.release.set()
        server.stop()


def test_the_reader_stays_at_most_the_ordered_limit_ahead_of_a_stuck_handler_thread():
    handler = Ordered()
    limit = 1 << 20
    server = FrameServer(handler, NetConfig(max_ordered_ahead_bytes=limit)).start()
    try:
        payloads = [bytes([i]) * 300_000 for i in range(8)]
        with RawPeer(server.address) as peer:
            first = peer.request(DescribeRangesRequest(), b"block")
            assert handler.blocked.wait(10)
            sids = [peer.request(DescribeRangesRequest(), p) for p in payloads]
            (conn,) = server.connections()
            # Past the limit the reader waits: the rest stays in the socket, not in buffers.
            wait_until(lambda: conn._ordered_bytes >= limit, "the reader to reach the limit")
            handed = conn._ordered_given
            assert handed < 1 + len(payloads)
            assert conn._ordered_bytes < limit + 300_000 + 1_000  # one frame past it at most
            handler.release.set()
            for sid in [first, *sids]:
                assert peer.next_frame(sid).is_end
        expected = [hashlib.sha256(p).hexdigest() for p in payloads]
        assert [digest for _, digest in handler.seen[1:]] == expected  # all of them, in order
        # The handler thread uncounts a request once it has run, which is after its answer
        # went out: the last one may still be counted when the peer reads that answer.
        wait_until(lambda: conn._ordered_bytes == 0, "every served request to be uncounted")
    finally:
        handler.release.set()
        server.stop()


def test_the_ordered_limit_must_be_positive():
    with pytest.raises(ValueError, match="max_ordered_ahead_bytes"):
        NetConfig(max_ordered_ahead_bytes=0)


def test_a_released_frame_frees_the_buffer_it_was_received_into():
    from sbp_spark.protocol.frame import Frame
    from sbp_spark.server.net import RequestContext

    body = bytearray(b"h" * 16 + b"p" * 1000)
    view = memoryview(body)
    ctx = RequestContext(Frame(int(DESCRIBE), 0, 7, view[:16], view[16:], payload_crc=99), None)
    del view
    with pytest.raises(BufferError):  # the frame's views pin it: no reuse yet
        body += b"x"
    ctx.release_frame()
    body += b"x"  # nothing refers to it any more: the reader may receive into it again
    assert (ctx.stream_id, ctx.opcode, ctx.frame.payload_crc) == (7, int(DESCRIBE), 99)
    assert len(ctx.frame.header) == len(ctx.frame.payload) == 0
