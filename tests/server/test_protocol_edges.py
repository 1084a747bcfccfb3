"""Protocol edges independent peers found, against a real PD and range server (docs/wire.md).

Each test sends what such a peer sent, bytes built as the peer built them where that matters
(flatc's generated builders), and checks the answer the schemas now promise.
"""

from __future__ import annotations

import time

import flatbuffers
import pytest

from sbp_spark.client import SbpClient
from sbp_spark.client.connection import parse_address
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import Opcode
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.frame import encode_frame
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.server.pd.handler import PdHandler
from sbp_spark.server.range_server.requests import RangeServerHandler
from tests.flatc_classes import CreateStreamsRequest as GenCreateStreamsRequest
from tests.flatc_classes import HeartbeatRequest as GenHeartbeatRequest
from tests.flatc_classes import RangeServer as GenRangeServer
from tests.flatc_classes import Stream as GenStream
from tests.flatc_classes import SyncRangesResponse as GenSyncRangesResponse
from tests.protocol.test_messages import append_request_with_table_entries

from .wire import RawPeer

ROLES = {"pd": ("placement driver", PdHandler), "rs": ("range server", RangeServerHandler)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with EmbeddedCluster(str(tmp_path_factory.mktemp("edges")), range_servers=1,
                         fsync="never") as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with SbpClient(cluster.pd_address) as c:
        yield c


def _address(cluster, role: str) -> tuple[str, int]:
    text = cluster.pd_address if role == "pd" else cluster.range_server_addresses[0]
    return parse_address(text)


def _raw_call(peer: RawPeer, opcode: int, header: bytes, payload: bytes = b""):
    sid = peer._next_id
    peer._next_id += 1
    peer.send(encode_frame(opcode, 0, sid, header, payload))
    [frame] = peer.response(sid, timeout=5)
    return frame, m.decode_response(frame)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_known_opcode_is_answered_by_every_role(cluster, role):
    name, handler = ROLES[role]
    served = handler.opcodes
    with RawPeer(_address(cluster, role)) as peer:
        for opcode in Opcode:
            if opcode in (Opcode.GOAWAY, Opcode.PING, Opcode.AUTHENTICATE):
                # A notice, never answered; PING is echoed and AUTHENTICATE answered by every
                # role (tests/server/auth).
                continue
            began = time.monotonic()
            frame, answer = _raw_call(peer, opcode, m.REQUESTS[opcode]().to_flatbuffers())
            assert frame.opcode == opcode and time.monotonic() - began < 5
            if opcode in served:
                assert "does not serve" not in answer.status.message
                continue
            assert frame.is_system_error, f"{name} answered {opcode.name} as if it served it"
            status = answer.status
            assert status.code == ErrorCode.INVALID_REQUEST
            assert status.message.startswith(
                f"this {name} does not serve {opcode.name} ({opcode:#06x}); it serves ")
            listed = status.message.rpartition("it serves ")[2].split(", ")
            assert set(listed) == {Opcode(op).name
                                   for op in served | {Opcode.PING, Opcode.AUTHENTICATE}}


def test_sync_ranges_to_the_pd_is_refused_at_once(cluster):
    # The case an independent peer timed: 15 s of silence before, now an answer.
    with RawPeer(_address(cluster, "pd")) as peer:
        began = time.monotonic()
        frame, answer = _raw_call(peer, Opcode.SYNC_RANGES, m.SyncRangesRequest(
            stream_ranges=[m.StreamRanges(1, [])]).to_flatbuffers())
        assert time.monotonic() - began < 2
        assert answer.status.code == ErrorCode.INVALID_REQUEST
        assert "placement driver does not serve SYNC_RANGES" in answer.status.message


def test_append_entries_sent_as_tables_are_refused_and_nothing_is_stored(cluster, client):
    [stream] = client.create_streams(1)
    batch = batch_bytes(b"as a table")
    header = append_request_with_table_entries([(stream.stream_id, 0, len(batch))])
    with RawPeer(_address(cluster, "rs")) as peer:
        frame, answer = _raw_call(peer, Opcode.APPEND, header, batch)
    assert frame.is_system_error and answer.status.code == ErrorCode.INVALID_REQUEST
    assert "AppendEntry is a struct: each entry is 16 bytes inside the vector" in \
        answer.status.message
    assert list(client.read(stream.stream_id)) == []


def test_heartbeat_roles_follow_the_seeds_order(cluster):
    assert [(r.name, r.value) for r in m.ClientRole] == [("RANGE_SERVER", 0), ("CLIENT", 1)]
    # A heartbeat that leaves client_role out, as a peer's generated builder does for the
    # default: read as RANGE_SERVER (so the PD checks the server id it names, which it never
    # issued), not as an SDK client.
    b = flatbuffers.Builder(64)
    addr = b.CreateString("127.0.0.1:1")
    GenRangeServer.Start(b)
    GenRangeServer.AddServerId(b, 4242)
    GenRangeServer.AddAdvertiseAddr(b, addr)
    server = GenRangeServer.End(b)
    GenHeartbeatRequest.Start(b)
    GenHeartbeatRequest.AddRangeServer(b, server)
    b.Finish(GenHeartbeatRequest.End(b))
    with RawPeer(_address(cluster, "pd")) as peer:
        _, answer = _raw_call(peer, Opcode.HEARTBEAT, bytes(b.Output()))
        assert answer.client_role is m.ClientRole.RANGE_SERVER
        assert answer.status.code == ErrorCode.INVALID_REQUEST and "4242" in \
            answer.status.message
        sdk = m.HeartbeatRequest(client_id="sdk", client_role=m.ClientRole.CLIENT)
        _, answer = _raw_call(peer, Opcode.HEARTBEAT, sdk.to_flatbuffers())
        assert answer.status.ok and answer.client_role is m.ClientRole.CLIENT


def test_describe_ranges_says_which_next_offset_is_a_snapshot(cluster, client):
    [stream] = client.create_streams(1)
    client.append(stream.stream_id, [batch_bytes(b"record %d" % i) for i in range(5)])
    ask = m.DescribeRangesRequest(ranges=[m.RangeId(stream.stream_id, 0)])
    with RawPeer(_address(cluster, "pd")) as pd, RawPeer(_address(cluster, "rs")) as rs:
        [from_pd] = _raw_call(pd, Opcode.DESCRIBE_RANGES, ask.to_flatbuffers())[1] \
            .describe_responses
        [from_rs] = _raw_call(rs, Opcode.DESCRIBE_RANGES, ask.to_flatbuffers())[1] \
            .describe_responses
    assert from_pd.range.is_open and from_pd.next_offset_snapshot
    assert from_pd.range.next_offset <= 5  # the PD's record, which lags
    assert from_rs.range.next_offset == 5 and not from_rs.next_offset_snapshot


def test_create_streams_uses_a_stream_id_other_than_minus_one_as_asked(cluster):
    b = flatbuffers.Builder(64)
    GenStream.Start(b)  # stream_id left out: -1, the PD chooses
    GenStream.AddReplicaNums(b, 1)
    chosen = GenStream.End(b)
    GenStream.Start(b)
    GenStream.AddStreamId(b, 777)
    asked = GenStream.End(b)
    GenCreateStreamsRequest.StartStreamsVector(b, 2)
    b.PrependUOffsetTRelative(asked)
    b.PrependUOffsetTRelative(chosen)
    streams = b.EndVector()
    GenCreateStreamsRequest.Start(b)
    GenCreateStreamsRequest.AddStreams(b, streams)
    b.Finish(GenCreateStreamsRequest.End(b))
    with RawPeer(_address(cluster, "pd")) as peer:
        first, second = _raw_call(peer, Opcode.CREATE_STREAMS, bytes(b.Output()))[1] \
            .create_responses
        again = _raw_call(peer, Opcode.CREATE_STREAMS, m.CreateStreamsRequest(
            streams=[m.Stream(stream_id=777)]).to_flatbuffers())[1].create_responses[0]
    assert first.status.ok and first.stream.stream_id not in (-1, 777)
    assert second.status.ok and second.stream.stream_id == 777
    assert again.status.code == ErrorCode.STREAM_ALREADY_EXISTS


def test_successful_answers_carry_their_status(cluster):
    # What a C++ peer reads first: status()->code(). flatc's accessor must find the table.
    with RawPeer(_address(cluster, "rs")) as peer:
        frame, answer = _raw_call(peer, Opcode.SYNC_RANGES,
                                  m.SyncRangesRequest().to_flatbuffers())
    assert answer.status.ok
    status = GenSyncRangesResponse.SyncRangesResponse.GetRootAs(bytes(frame.header), 0).Status()
    assert status is not None and status.Code() == 0
