"""Client behaviour that needs a server misbehaving on demand: scripted PDs and range servers."""

from __future__ import annotations

import threading
import time

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, PdClient, RangeServerClient
from sbp_spark.client import pd as pd_module
from sbp_spark.client.range_server import plan_append_frames
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import MAX_FRAME_LENGTH, Opcode
from sbp_spark.protocol.errors import (
    ErrorCode,
    PayloadTooLargeError,
    StreamNotFoundError,
    TransportError,
)
from sbp_spark.protocol.records import batch_bytes, encode_batch, iter_batches

from .fakes import FakeServer, Peer

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=5, retry_backoff_ms=1,
                      retry_backoff_max_ms=5)


@pytest.fixture
def pool():
    with ConnectionPool(CONFIG) as p:
        yield p


def respond(peer: Peer, frame, msg, payload=b"", end=True) -> None:
    peer.send(m.response_frame(frame.stream_id, msg, payload, end=end))


# -- PD -----------------------------------------------------------------------------------


def stream_pd(seen: list) -> callable:
    """A PD that answers DESCRIBE_STREAMS: stream 404 is missing, others exist."""

    def handler(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            request = m.decode_request(frame)
            seen.append(type(request).__name__)
            results = []
            for sid in request.stream_ids:
                status = m.Status(ErrorCode.STREAM_NOT_FOUND, f"no stream {sid}") \
                    if sid == 404 else m.OK
                results.append(m.DescribeStreamsResult(m.Stream(stream_id=sid), status))
            respond(peer, frame, m.DescribeStreamsResponse(describe_responses=results))

    return handler


def test_pd_not_leader_redirects_to_the_named_leader(pool):
    leader_seen: list = []
    follower_seen: list = []
    with FakeServer(stream_pd(leader_seen)) as leader:
        cluster = m.PlacementDriverCluster([
            m.PlacementDriverNode("pd-a", "127.0.0.1:1", False),
            m.PlacementDriverNode("pd-b", leader.address, True),
        ])

        def follower_handler(peer: Peer) -> None:
            while (frame := peer.read_frame()) is not None:
                follower_seen.append(frame.opcode)
                status = m.Status(ErrorCode.PD_NOT_LEADER, "ask the leader",
                                  cluster.to_flatbuffers())
                respond(peer, frame, m.DescribeStreamsResponse(status=status))

        with FakeServer(follower_handler) as follower:
            pd = PdClient(follower.address, CONFIG, pool)
            results = pd.describe_streams([1, 404, 2])
            assert [r.ok for r in results] == [True, False, True]
            assert results[0].unwrap().stream_id == 1
            with pytest.raises(StreamNotFoundError, match="no stream 404"):
                results[1].unwrap()
            assert pd.leader == leader.address
            assert follower_seen == [Opcode.DESCRIBE_STREAMS]
            # Later calls go straight to the leader.
            pd.describe_streams([3])
            assert follower_seen == [Opcode.DESCRIBE_STREAMS]
            assert leader_seen == ["DescribeStreamsRequest"] * 2


def test_pd_client_skips_an_unreachable_address(pool):
    seen: list = []
    with FakeServer(stream_pd(seen)) as live:
        with FakeServer(stream_pd([])) as gone:
            dead = gone.address
        pd = PdClient(f"{dead},{live.address}", CONFIG, pool)
        assert pd.describe_streams([7])[0].unwrap().stream_id == 7
        assert seen == ["DescribeStreamsRequest"]


@pytest.fixture
def quick_probe(monkeypatch) -> float:
    """A PD node's PING must be answered within 0.2 s (instead of a second)."""
    monkeypatch.setattr(pd_module, "PD_PROBE_S", 0.2)
    return 0.2


def frozen_pd(answered: int, release: threading.Event) -> callable:
    """A PD node that answers ``answered`` requests, then stops reading and answering (as a
    stopped process: the kernel still takes connections and data) until ``release``."""

    def handler(peer: Peer) -> None:
        for _ in range(answered):
            frame = peer.read_frame()
            if frame is None:
                return
            respond(peer, frame, m.DescribeStreamsResponse(describe_responses=[
                m.DescribeStreamsResult(m.Stream(stream_id=s))
                for s in m.decode_request(frame).stream_ids]))
        release.wait(10)

    return handler


def test_a_pd_node_that_takes_connections_but_never_answers_is_passed_over(
        pool, quick_probe):
    seen: list = []
    release = threading.Event()
    with FakeServer(frozen_pd(0, release)) as frozen, FakeServer(stream_pd(seen)) as live:
        try:
            pd = PdClient(f"{frozen.address},{live.address}", CONFIG, pool)
            began = time.monotonic()
            assert pd.describe_streams([7])[0].unwrap().stream_id == 7
            took = time.monotonic() - began
        finally:
            release.set()
    # It used to wait out the request timeout (5 s here) on the frozen node first.
    assert took < 4 * quick_probe and pd.leader == live.address
    assert seen == ["DescribeStreamsRequest"]


def test_a_pd_node_that_freezes_after_answering_is_passed_over(pool, quick_probe):
    seen: list = []
    release = threading.Event()
    with FakeServer(frozen_pd(1, release)) as frozen, FakeServer(stream_pd(seen)) as live:
        try:
            pd = PdClient(f"{frozen.address},{live.address}", CONFIG, pool)
            assert pd.describe_streams([1])[0].ok and pd.leader == frozen.address
            began = time.monotonic()
            # Sent to the node that has just answered: its answer is late, and so is the
            # answer to a PING.
            assert pd.describe_streams([2])[0].unwrap().stream_id == 2
            took = time.monotonic() - began
        finally:
            release.set()
    assert took < 6 * quick_probe and pd.leader == live.address
    assert seen == ["DescribeStreamsRequest"]


def test_a_slow_answer_is_waited_for_while_the_pd_node_answers_pings(pool, quick_probe):
    requests: list = []

    def slow(peer: Peer) -> None:
        # Answers each request after 4 probe intervals (as a seal that takes a while), and
        # PINGs at once meanwhile (read_frame answers them).
        while (frame := peer.read_frame()) is not None:
            requests.append(frame)
            threading.Timer(4 * quick_probe, respond, (peer, frame, m.DescribeStreamsResponse(
                describe_responses=[m.DescribeStreamsResult(m.Stream(stream_id=3))]))).start()

    with FakeServer(slow) as server:
        began = time.monotonic()
        result = PdClient(server.address, CONFIG, pool).describe_streams([3])
        took = time.monotonic() - began
    assert result[0].unwrap().stream_id == 3
    assert len(requests) == 1 and took >= 4 * quick_probe


def test_throttled_answer_is_retried_after_the_throttle_time(pool):
    calls = []

    def throttling(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            calls.append(frame)
            if len(calls) == 1:
                respond(peer, frame, m.DescribeStreamsResponse(
                    throttle_time_ms=100, status=m.Status(ErrorCode.THROTTLED, "busy")))
            else:
                respond(peer, frame, m.DescribeStreamsResponse(describe_responses=[
                    m.DescribeStreamsResult(m.Stream(stream_id=5))]))

    with FakeServer(throttling) as server:
        began = time.monotonic()
        result = PdClient(server.address, CONFIG, pool).describe_streams([5])
        assert result[0].unwrap().stream_id == 5
        assert time.monotonic() - began >= 0.1
        assert len(calls) == 2


def test_missing_items_in_an_answer_become_errors(pool):
    def short(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            respond(peer, frame, m.DescribeStreamsResponse(describe_responses=[
                m.DescribeStreamsResult(m.Stream(stream_id=1))]))

    with FakeServer(short) as server:
        results = PdClient(server.address, CONFIG, pool).describe_streams([1, 2])
        assert results[0].ok and not results[1].ok
        with pytest.raises(Exception, match="item 1 got no answer"):
            results[1].unwrap()


# -- range server: APPEND -------------------------------------------------------------------


def test_plan_append_frames_respects_the_limit():
    frames, too_large = plan_append_frames([100] * 10, 16 + 64 + 3 * (16 + 100))
    assert frames == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert too_large == []
    frames, too_large = plan_append_frames([10, 10_000, 10], 1000)
    assert frames == [[0, 2]] and too_large == [1]
    frames, too_large = plan_append_frames([100] * 5, 10_000, 16 + 64 + 2 * (16 + 100))
    assert frames == [[0, 1], [2, 3], [4]] and too_large == []
    frames, _ = plan_append_frames([500, 5000, 500], 10_000, 1000)
    assert frames == [[0], [1], [2]]


def test_large_append_is_split_under_the_frame_limit_and_answers_match(pool):
    frame_lengths: list[int] = []
    entries_per_frame: list[int] = []

    def store(peer: Peer) -> None:
        next_offset = 0
        while (frame := peer.read_frame()) is not None:
            request = m.decode_request(frame)
            frame_lengths.append(16 + len(frame.header) + len(frame.payload))
            entries_per_frame.append(len(request.append_requests))
            results, pos = [], 0
            for entry in request.append_requests:
                batch = frame.payload[pos:pos + entry.batch_length]
                pos += entry.batch_length
                (header, _), = list(iter_batches(batch))
                results.append(m.AppendResult(entry.stream_id, entry.request_index, next_offset))
                next_offset += header.record_count
            respond(peer, frame, m.AppendResponse(append_responses=results))

    body = b"x" * (3 * 1024 * 1024)  # 3 MiB batches: five fit in one 16 MiB frame
    batches = [encode_batch(body) for _ in range(12)]
    # Frames as large as the protocol allows (no smaller target).
    config = ClientConfig(request_timeout_s=5, append_frame_bytes=MAX_FRAME_LENGTH)
    with FakeServer(store) as server:
        results = RangeServerClient(server.address, config, pool).append(
            [(9, b) for b in batches])
    assert [r.unwrap().base_offset for r in results] == list(range(12))
    assert all(length <= MAX_FRAME_LENGTH for length in frame_lengths)
    assert entries_per_frame == [5, 5, 2]
    assert len(frame_lengths) == 3
    # With the default target, frames close at about 1 MiB; a larger batch goes alone.
    frame_lengths.clear()
    entries_per_frame.clear()
    small = [batch_bytes(b"y" * (300 * 1024 - 28)) for _ in range(7)]
    with FakeServer(store) as server:
        client = RangeServerClient(server.address, CONFIG, pool)
        results = client.append([(9, b) for b in small + batches[:2]])
    assert all(r.ok for r in results)
    assert entries_per_frame == [3, 3, 1, 1, 1]


def test_append_answers_matched_by_request_index_across_frames(pool):
    def cross(peer: Peer) -> None:
        first, second = peer.read_frame(), peer.read_frame()
        entries = (m.decode_request(first).append_requests
                   + m.decode_request(second).append_requests)
        # Answer everything in reverse order, on the FIRST frame's stream, over two frames;
        # the second request just ends.
        answers = [m.AppendResult(e.stream_id, e.request_index, 1000 + e.request_index)
                   for e in reversed(entries)]
        respond(peer, first, m.AppendResponse(append_responses=answers[:3]), end=False)
        respond(peer, second, m.AppendResponse())
        respond(peer, first, m.AppendResponse(append_responses=answers[3:]))
        while peer.read_frame() is not None:
            pass

    config = ClientConfig(request_timeout_s=5, max_frame_bytes=16 + 64 + 3 * (16 + 29))
    with FakeServer(cross) as server:
        client = RangeServerClient(server.address, config, pool)
        results = client.append([(1, batch_bytes(b"%d" % i)) for i in range(6)])
    assert [r.unwrap().base_offset for r in results] == [1000 + i for i in range(6)]


def test_append_item_statuses_and_system_errors_stay_per_entry(pool):
    def mixed(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            request = m.decode_request(frame)
            if request.append_requests[0].request_index == 0:
                results = [m.AppendResult(e.stream_id, e.request_index, 0 if i == 0 else -1,
                                          status=m.OK if i == 0 else m.Status(
                                              ErrorCode.RANGE_SEALED, "sealed"))
                           for i, e in enumerate(request.append_requests)]
                respond(peer, frame, m.AppendResponse(append_responses=results))
            else:
                peer.send(m.system_error_frame(frame.stream_id, Opcode.APPEND, m.Status(
                    ErrorCode.STORAGE_FULL, "disk full")))

    config = ClientConfig(request_timeout_s=5, max_frame_bytes=16 + 64 + 2 * (16 + 29))
    with FakeServer(mixed) as server:
        results = RangeServerClient(server.address, config, pool).append(
            [(1, batch_bytes(b"%d" % i)) for i in range(4)])
    assert results[0].ok
    assert results[1].status.code == ErrorCode.RANGE_SEALED
    assert [r.status.code for r in results[2:]] == [ErrorCode.STORAGE_FULL] * 2
    assert "disk full" in str(results[3].exception())


def test_oversized_batch_fails_alone(pool):
    def ok(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            request = m.decode_request(frame)
            respond(peer, frame, m.AppendResponse(append_responses=[
                m.AppendResult(e.stream_id, e.request_index, 7) for e in request.append_requests]))

    config = ClientConfig(request_timeout_s=5, max_frame_bytes=4096)
    with FakeServer(ok) as server:
        results = RangeServerClient(server.address, config, pool).append(
            [(1, batch_bytes(b"a")), (1, batch_bytes(b"b" * 5000)), (1, batch_bytes(b"c"))])
    assert results[0].ok and results[2].ok
    with pytest.raises(PayloadTooLargeError, match="batch 1"):
        results[1].unwrap()


def test_append_connection_loss_fails_the_unanswered_entries(pool):
    def dies(peer: Peer) -> None:
        frame = peer.read_frame()
        request = m.decode_request(frame)
        first = request.append_requests[0]
        respond(peer, frame, m.AppendResponse(append_responses=[
            m.AppendResult(first.stream_id, first.request_index, 0)]), end=False)
        peer.close()

    with FakeServer(dies) as server:
        results = RangeServerClient(server.address, CONFIG, pool).append(
            [(1, batch_bytes(b"%d" % i)) for i in range(3)])
    assert results[0].ok
    for r in results[1:]:
        assert isinstance(r.exception(), TransportError)
        assert server.address in str(r.exception())


# -- range server: FETCH ------------------------------------------------------------------


def test_fetch_streams_batches_over_many_frames(pool):
    batches = [batch_bytes(b"r%d" % i, base_offset=i) for i in range(10)]
    got_request = []

    def streamer(peer: Peer) -> None:
        frame = peer.read_frame()
        got_request.append(m.decode_request(frame))
        for i in range(0, 10, 3):
            chunk = b"".join(batches[i:i + 3])
            respond(peer, frame, m.FetchResponse(fetch_responses=[
                m.FetchResult(3, 0, len(chunk))]), chunk, end=False)
        respond(peer, frame, m.FetchResponse())
        peer.read_frame()

    with FakeServer(streamer) as server:
        client = RangeServerClient(server.address, CONFIG, pool)
        seen = [(h.base_offset, bytes(v)) for h, v in client.fetch(3, 0, end_offset=10,
                                                                    batch_max_bytes=1 << 20)]
    assert seen == [(i, batches[i]) for i in range(10)]
    (request,) = got_request
    assert request.fetch_requests[0].end_offset == 10
    assert request.fetch_requests[0].batch_max_bytes == 1 << 20


def test_fetch_entry_error_raises_after_earlier_batches(pool):
    def fails(peer: Peer) -> None:
        frame = peer.read_frame()
        data = batch_bytes(b"one", base_offset=0)
        respond(peer, frame, m.FetchResponse(fetch_responses=[m.FetchResult(3, 0, len(data))]),
                data, end=False)
        respond(peer, frame, m.FetchResponse(fetch_responses=[m.FetchResult(
            3, 0, 0, m.Status(ErrorCode.OFFSET_OUT_OF_RANGE, "trimmed below 5"))]))
        peer.read_frame()

    from sbp_spark.protocol.errors import OffsetOutOfRangeError
    with FakeServer(fails) as server:
        got = []
        with pytest.raises(OffsetOutOfRangeError, match="trimmed below 5"):
            for header, _ in RangeServerClient(server.address, CONFIG, pool).fetch(3, 0):
                got.append(header.base_offset)
        assert got == [0]


def test_abandoned_fetch_frees_its_stream(pool):
    release = threading.Event()

    def endless(peer: Peer) -> None:
        frame = peer.read_frame()
        data = batch_bytes(b"x", base_offset=0)
        respond(peer, frame, m.FetchResponse(fetch_responses=[m.FetchResult(3, 0, len(data))]),
                data, end=False)
        release.wait(5)

    with FakeServer(endless) as server:
        client = RangeServerClient(server.address, CONFIG, pool)
        batches = client.fetch(3, 0)
        next(batches)
        conn = client.connection()
        assert conn.outstanding == 1
        batches.close()
        assert conn.outstanding == 0
        release.set()


def test_fetch_resumes_on_another_replica_after_a_mid_stream_failure(pool):
    from sbp_spark.client import SbpClient

    batches = [batch_bytes(b"r%d" % i, base_offset=i) for i in range(5)]
    asked_b = []

    def replica_a(peer: Peer) -> None:  # sends two batches, then the connection drops
        frame = peer.read_frame()
        data = b"".join(batches[:2])
        respond(peer, frame, m.FetchResponse(fetch_responses=[m.FetchResult(4, 0, len(data))]),
                data, end=False)

    def replica_b(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            entry = m.decode_request(frame).fetch_requests[0]
            asked_b.append(entry.fetch_offset)
            data = b"".join(batches[entry.fetch_offset:entry.end_offset])
            respond(peer, frame, m.FetchResponse(fetch_responses=[
                m.FetchResult(4, 0, len(data))]), data)

    with FakeServer(replica_a) as a, FakeServer(replica_b) as b:
        rng = m.Range(4, 0, 0, 5, 5, [m.RangeReplica(m.RangeServer(1, a.address), True),
                                      m.RangeReplica(m.RangeServer(2, b.address), False)])
        client = SbpClient("127.0.0.1:1", CONFIG, pool)  # the PD is not needed for a fetch
        got = [f.header.base_offset for f in client.fetch(rng, 0)]
    assert got == [0, 1, 2, 3, 4]
    assert asked_b == [2]


def test_a_read_longer_than_the_retry_deadline_still_fails_over(pool):
    # A consumer that takes its time (a Spark task working on each batch) keeps one FETCH
    # going for longer than retry_deadline_s; a replica failure after that used to be raised
    # at once, as if retries had run out, instead of moving to another replica.
    import dataclasses
    import time

    from sbp_spark.client import SbpClient

    config = dataclasses.replace(CONFIG, retry_deadline_s=0.5)
    batches = [batch_bytes(b"r%d" % i, base_offset=i) for i in range(5)]
    drop = threading.Event()

    def replica_a(peer: Peer) -> None:  # sends two batches, then drops when told to
        frame = peer.read_frame()
        data = b"".join(batches[:2])
        respond(peer, frame, m.FetchResponse(fetch_responses=[m.FetchResult(4, 0, len(data))]),
                data, end=False)
        drop.wait(10)

    def replica_b(peer: Peer) -> None:
        while (frame := peer.read_frame()) is not None:
            entry = m.decode_request(frame).fetch_requests[0]
            data = b"".join(batches[entry.fetch_offset:entry.end_offset])
            respond(peer, frame, m.FetchResponse(fetch_responses=[
                m.FetchResult(4, 0, len(data))]), data)

    with ConnectionPool(config) as own, FakeServer(replica_a) as a, FakeServer(replica_b) as b:
        rng = m.Range(4, 0, 0, 5, 5, [m.RangeReplica(m.RangeServer(1, a.address), True),
                                      m.RangeReplica(m.RangeServer(2, b.address), False)])
        fetched = SbpClient("127.0.0.1:1", config, own).fetch(rng, 0)
        got = [next(fetched).header.base_offset, next(fetched).header.base_offset]
        time.sleep(0.8)  # longer than the retry deadline
        drop.set()
        got += [f.header.base_offset for f in fetched]
    assert got == [0, 1, 2, 3, 4]
