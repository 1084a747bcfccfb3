"""Every opcode against every kind of principal, on the PD and on a range server, in raw
frames that skip the client (issue 44 item 6). The expectations are written out here a second
time, from the issue's words, so that the rules table cannot drift from them unnoticed."""

from __future__ import annotations

import pytest

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.constants import Opcode
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.auth.authenticator import AuthSettings
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.server.pd.handler import PdHandler
from sbp_spark.server.range_server.requests import RangeServerHandler
from tests.polling import wait_until

from ..wire import RawPeer
from .keys import Keys

PRINCIPALS = ("none", "reader", "writer", "admin", "creator", "superuser", "server")
LOOKERS = {"reader", "writer", "admin", "superuser", "server"}
# Who may, per (role, opcode), besides the answer every authenticated principal gets for an
# opcode the role does not serve (INVALID_REQUEST) and the unauthenticated one (UNAUTHENTICATED).
ALLOWED: dict[tuple[str, Opcode], set[str]] = {
    ("pd", Opcode.HEARTBEAT): {"superuser", "server"},  # as a RANGE_SERVER
    ("rs", Opcode.HEARTBEAT): set(PRINCIPALS) - {"none"},
    ("pd", Opcode.ALLOCATE_ID): {"superuser", "server"},
    ("rs", Opcode.APPEND): {"writer", "superuser", "server"},
    ("rs", Opcode.FETCH): {"reader", "superuser", "server"},
    ("rs", Opcode.LOOKUP_SEQUENCES): {"writer", "superuser", "server"},
    ("pd", Opcode.LIST_RANGES): LOOKERS,
    ("pd", Opcode.SEAL_RANGES): {"writer", "admin", "superuser", "server"},
    ("rs", Opcode.SEAL_RANGES): {"superuser", "server"},
    ("rs", Opcode.SYNC_RANGES): {"superuser", "server"},
    ("pd", Opcode.CREATE_RANGE): {"writer", "admin", "superuser", "server"},
    ("pd", Opcode.DESCRIBE_RANGES): LOOKERS,
    ("rs", Opcode.DESCRIBE_RANGES): LOOKERS,
    ("pd", Opcode.CREATE_STREAMS): {"creator", "superuser"},
    ("pd", Opcode.DELETE_STREAMS): {"admin", "superuser"},
    ("rs", Opcode.DELETE_STREAMS): {"superuser", "server"},
    ("pd", Opcode.UPDATE_STREAMS): {"admin", "superuser"},
    ("pd", Opcode.DESCRIBE_STREAMS): LOOKERS,
    ("pd", Opcode.TRIM_STREAMS): {"admin", "superuser"},
    ("rs", Opcode.TRIM_STREAMS): {"superuser", "server"},
    ("pd", Opcode.REPORT_METRICS): {"superuser", "server"},
    ("pd", Opcode.DESCRIBE_PD_CLUSTER): set(PRINCIPALS) - {"none"},
    ("pd", Opcode.GRANT_PERMISSIONS): {"superuser"},
    ("pd", Opcode.REVOKE_PERMISSIONS): {"superuser"},
    ("pd", Opcode.DESCRIBE_PERMISSIONS): {"superuser", "server"},
    ("pd", Opcode.JOIN_CONSUMER): set(PRINCIPALS) - {"none"},
    ("pd", Opcode.COMMIT_CONSUMER): {"reader", "superuser", "server"},
    ("pd", Opcode.DESCRIBE_CONSUMERS): set(PRINCIPALS) - {"none"},
    ("pd", Opcode.DELETE_CONSUMERS): {"superuser"},
}
UNSEEN = 10**9  # a stream nobody has: requests the roles carry out must not change the test's


@pytest.fixture(scope="module")
def setup(tmp_path_factory, keys):
    from sbp_spark.client import ConnectionPool, SbpClient

    auth = AuthSettings(token_secret_file=str(keys.secret_file),
                        superusers=frozenset({"superuser"}))
    with EmbeddedCluster(tmp_path_factory.mktemp("matrix"), range_servers=1, auth=auth) as c, \
            ConnectionPool() as pool:
        root = SbpClient(c.pd_address, pool=pool, token=keys.token("superuser"))
        [stream, victim] = root.create_streams(2)
        root.append(stream.stream_id, [batch_bytes(b"x")])
        s, v = str(stream.stream_id), str(victim.stream_id)
        version = root.pd.grant_permissions([
            m.Permission("reader", "read", s), m.Permission("writer", "write", s),
            m.Permission("admin", "admin", s), m.Permission("admin", "admin", v),
            m.Permission("creator", "create")])
        wait_until(lambda: c.range_servers[0].permissions.table().version >= version,
                   "the range server to learn the grants", 10)
        yield c, stream.stream_id, victim.stream_id


def _token(keys: Keys, principal: str) -> str | None:
    if principal == "none":
        return None
    if principal == "server":
        return keys.token("rs-1", role="server")
    return keys.token(principal)


_FAKE = m.RangeServer(12345, "127.0.0.1:1")
_PAYLOAD = batch_bytes(b"matrix")
# One request per opcode: (on the PD?, the stream, the victim) -> (request, payload). Requests a
# role carries out touch only the victim or streams nobody has (``UNSEEN``, range index 999).
_BUILDERS = {
    Opcode.HEARTBEAT: lambda pd, s, v: (
        m.HeartbeatRequest("x", m.ClientRole.RANGE_SERVER, _FAKE) if pd
        else m.HeartbeatRequest("x", m.ClientRole.CLIENT)),
    Opcode.ALLOCATE_ID: lambda pd, s, v: m.AllocateIdRequest(host="matrix"),
    Opcode.APPEND: lambda pd, s, v: m.AppendRequest(
        append_requests=[m.AppendEntry(s, 0, len(_PAYLOAD))]),
    Opcode.FETCH: lambda pd, s, v: m.FetchRequest(fetch_requests=[m.FetchEntry(s, 0, 0, 1 << 20)]),
    Opcode.LOOKUP_SEQUENCES: lambda pd, s, v: m.LookupSequencesRequest(
        range=m.RangeId(s, 0), producer_id=1, sequences=[0]),
    Opcode.LIST_RANGES: lambda pd, s, v: m.ListRangesRequest(
        range_owners=[m.RangeOwner(stream_id=s)]),
    Opcode.SEAL_RANGES: lambda pd, s, v: m.SealRangesRequest(
        ranges=[m.RangeId(s if pd else UNSEEN, 999)]),
    Opcode.SYNC_RANGES: lambda pd, s, v: m.SyncRangesRequest(stream_ranges=[]),
    Opcode.CREATE_RANGE: lambda pd, s, v: m.CreateRangeRequest(ranges=[m.RangeId(s, 999)]),
    Opcode.DESCRIBE_RANGES: lambda pd, s, v: m.DescribeRangesRequest(ranges=[m.RangeId(s, 0)]),
    Opcode.CREATE_STREAMS: lambda pd, s, v: m.CreateStreamsRequest(streams=[m.Stream()]),
    Opcode.DELETE_STREAMS: lambda pd, s, v: m.DeleteStreamsRequest(
        streams=[m.Stream(v if pd else UNSEEN)]),
    Opcode.UPDATE_STREAMS: lambda pd, s, v: m.UpdateStreamsRequest(streams=[m.Stream(s, 1, -1)]),
    Opcode.DESCRIBE_STREAMS: lambda pd, s, v: m.DescribeStreamsRequest(stream_ids=[s]),
    Opcode.TRIM_STREAMS: lambda pd, s, v: m.TrimStreamsRequest(
        trimmed_streams=[m.TrimmedStream(s if pd else UNSEEN, 0)]),
    Opcode.REPORT_METRICS: lambda pd, s, v: m.ReportMetricsRequest(range_server=_FAKE),
    Opcode.GRANT_PERMISSIONS: lambda pd, s, v: m.GrantPermissionsRequest(
        [m.Permission("nobody", "read", "1")]),
    Opcode.REVOKE_PERMISSIONS: lambda pd, s, v: m.RevokePermissionsRequest(
        [m.Permission("nobody", "read", "1")]),
    Opcode.DESCRIBE_PERMISSIONS: lambda pd, s, v: m.DescribePermissionsRequest(""),
    Opcode.JOIN_CONSUMER: lambda pd, s, v: m.JoinConsumerRequest(name="matrix"),
    Opcode.COMMIT_CONSUMER: lambda pd, s, v: m.CommitConsumerRequest(
        name="matrix", generation=1, positions=[m.ConsumerPosition(s, 0)]),
    Opcode.DESCRIBE_CONSUMERS: lambda pd, s, v: m.DescribeConsumersRequest(
        consumers=[m.Consumer(name="matrix")]),
    Opcode.DELETE_CONSUMERS: lambda pd, s, v: m.DeleteConsumersRequest(
        consumers=[m.Consumer(name="matrix")]),
}


def _request(role: str, opcode: Opcode, stream: int, victim: int) -> tuple[m.Message, bytes]:
    build = _BUILDERS.get(opcode)
    if build is None:
        return m.REQUESTS[opcode](), b""
    return build(role == "pd", stream, victim), _PAYLOAD if opcode == Opcode.APPEND else b""


@pytest.mark.parametrize("principal", PRINCIPALS)
@pytest.mark.parametrize("role", ["pd", "rs"])
def test_every_opcode_against_every_principal(setup, keys, role, principal):
    cluster, stream, victim = setup
    address = cluster.pd_address if role == "pd" else cluster.range_server_addresses[0]
    served = (PdHandler if role == "pd" else RangeServerHandler).opcodes
    host, port = address.rsplit(":", 1)
    token = _token(keys, principal)
    with RawPeer((host, int(port))) as peer:
        if token is not None:
            answer, _ = peer.call(m.AuthenticateRequest("token", token.encode()))
            assert isinstance(answer, m.AuthenticateResponse), answer
        for opcode in Opcode:
            if opcode in (Opcode.GOAWAY, Opcode.AUTHENTICATE):
                continue  # a notice; authentication has tests of its own
            request, payload = _request(role, opcode, stream, victim)
            answer, _ = peer.call(request, payload)
            if opcode == Opcode.PING:
                assert isinstance(answer, m.PingResponse), principal
                continue
            code = answer.status.code
            where = f"{principal} -> {opcode.name} on the {role}: {answer.status.message}"
            if principal == "none":
                assert code == ErrorCode.UNAUTHENTICATED, where
            elif opcode not in served:
                assert code == ErrorCode.INVALID_REQUEST and "does not serve" in \
                    answer.status.message, where
            elif principal in ALLOWED[role, opcode]:
                assert code not in (ErrorCode.PERMISSION_DENIED, ErrorCode.UNAUTHENTICATED), \
                    where
            else:
                assert isinstance(answer, m.SystemError), where
                assert code == ErrorCode.PERMISSION_DENIED, where
                assert f"principal '{principal if principal != 'server' else 'rs-1'}'" in \
                    answer.status.message, where


def test_the_expectations_cover_every_served_opcode():
    for role, handler in (("pd", PdHandler), ("rs", RangeServerHandler)):
        assert {op for (r, op) in ALLOWED if r == role} == set(handler.opcodes), role
