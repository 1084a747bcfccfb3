"""Authenticated connections (issue 44 item 1): a token or a client certificate before any
request but PING, refusals that say why, the timeout for connections that never authenticate,
and tokens that never reach a log or an error."""

from __future__ import annotations

import logging
import time

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.client.connection import Connection
from sbp_spark.protocol.constants import Opcode
from sbp_spark.protocol.errors import ErrorCode, UnauthenticatedError
from sbp_spark.protocol.messages import (
    AuthenticateRequest,
    AuthenticateResponse,
    DescribeStreamsRequest,
    FetchEntry,
    FetchRequest,
    PingRequest,
    SystemError,
)
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.auth.authenticator import AuthSettings
from sbp_spark.server.auth.tokens import create_token
from sbp_spark.server.cluster import EmbeddedCluster

from ..wire import EOF, RawPeer

AUTH_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, keys):
    auth = AuthSettings(token_secret_file=str(keys.secret_file), timeout_s=AUTH_TIMEOUT_S,
                        superusers=frozenset({"alice"}))
    with EmbeddedCluster(tmp_path_factory.mktemp("auth-cluster"), range_servers=2,
                         auth=auth) as c:
        yield c


def _address(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def _client(cluster, token: str | None, pool: ConnectionPool) -> SbpClient:
    return SbpClient(cluster.pd_address, ClientConfig(token=token, retry_deadline_s=2), pool)


def test_a_token_opens_the_pd_and_the_range_servers(cluster, keys):
    with ConnectionPool() as pool:
        client = _client(cluster, keys.token("alice"), pool)
        [stream] = client.create_streams(1, replicas=2)  # the PD calls both servers
        appended = client.append(stream.stream_id, [batch_bytes(b"%d" % i) for i in range(5)])
        assert [a.base_offset for a in appended] == list(range(5))  # forwarded as a server
        assert [bytes(b.data[28:]) for b in client.read(stream.stream_id)] == \
            [b"%d" % i for i in range(5)]
        conn = pool.get(cluster.pd_address, client.config)
        assert conn.principal == "alice"


@pytest.mark.parametrize("where", ["pd", "range server"])
def test_raw_frames_without_authenticating_are_refused_but_ping_is_answered(cluster, where):
    address = cluster.pd_address if where == "pd" else cluster.range_server_addresses[0]
    with RawPeer(_address(address)) as peer:
        sid = peer.request(PingRequest())
        [pong] = peer.response(sid)
        assert pong.opcode == Opcode.PING and pong.is_end
        request = (DescribeStreamsRequest(stream_ids=[1]) if where == "pd" else
                   FetchRequest(fetch_requests=[FetchEntry(1, 0, 0, 1024)]))
        answer, _ = peer.call(request)
        assert isinstance(answer, SystemError)
        assert answer.status.code == ErrorCode.UNAUTHENTICATED
        assert "AUTHENTICATE" in answer.status.message


def test_a_connection_that_never_authenticates_is_closed(cluster):
    with RawPeer(_address(cluster.pd_address)) as peer:
        started = time.monotonic()
        peer.request(PingRequest())
        goaway_or_eof = []
        while (frame := peer.next_frame(timeout=AUTH_TIMEOUT_S * 10)) not in (None, EOF):
            goaway_or_eof.append(frame.opcode)
        assert peer.eof, "the connection stayed open"
        assert time.monotonic() - started < AUTH_TIMEOUT_S * 8
        assert Opcode.GOAWAY in goaway_or_eof


def _authenticate_raw(address: str, method: str, data: bytes):
    with RawPeer(_address(address)) as peer:
        answer, _ = peer.call(AuthenticateRequest(method=method, data=data))
        return answer


@pytest.mark.parametrize("case,reason", [
    ("forged", "signature does not match"),
    ("expired", "expired"),
    ("malformed", "malformed"),
    ("no subject", "names no subject"),
    ("unknown method", "method 'password' is not known"),
])
def test_bad_credentials_are_refused_with_a_reason(cluster, keys, case, reason):
    import jwt

    method, token = "token", ""
    if case == "forged":
        token = create_token("mallory", secret=b"not the cluster's secret" * 2)
    elif case == "expired":
        token = jwt.encode({"sub": "alice", "exp": int(time.time()) - 60}, keys.secret)
    elif case == "malformed":
        token = "not-a-token"
    elif case == "no subject":
        token = jwt.encode({"exp": int(time.time()) + 60}, keys.secret)
    else:
        method, token = "password", "hunter2"
    for address in (cluster.pd_address, cluster.range_server_addresses[0]):
        answer = _authenticate_raw(address, method, token.encode())
        assert isinstance(answer, SystemError)
        assert answer.status.code == ErrorCode.UNAUTHENTICATED
        assert reason in answer.status.message
        assert token not in answer.status.message


def test_the_client_raises_the_refusal_at_once_without_retrying(cluster, keys):
    forged = create_token("mallory", secret=b"not the cluster's secret" * 2)
    with ConnectionPool() as pool:
        started = time.monotonic()
        with pytest.raises(UnauthenticatedError) as caught:
            _client(cluster, forged, pool).list_streams()
        assert not caught.value.retriable
        assert time.monotonic() - started < 1.5
        assert forged not in str(caught.value)
        with pytest.raises(UnauthenticatedError, match="has not authenticated"):
            _client(cluster, None, pool).list_streams()


def test_a_second_authenticate_is_refused(cluster, keys):
    with RawPeer(_address(cluster.pd_address)) as peer:
        first, _ = peer.call(AuthenticateRequest("token", keys.token("alice").encode()))
        assert isinstance(first, AuthenticateResponse) and first.principal == "alice"
        second, _ = peer.call(AuthenticateRequest("token", keys.token("bob").encode()))
        assert isinstance(second, SystemError)
        assert "authenticated already, as 'alice'" in second.status.message


def test_connections_of_different_principals_are_not_shared(cluster, keys):
    with ConnectionPool() as pool:
        _client(cluster, keys.token("alice"), pool).list_streams()
        with pytest.raises(UnauthenticatedError):
            _client(cluster, None, pool).list_streams()
        bob = _client(cluster, keys.token("bob"), pool)
        bob.list_streams()
        assert pool.get(cluster.pd_address, bob.config).principal == "bob"


def test_tokens_never_reach_the_logs(cluster, keys, caplog):
    forged = create_token("mallory", secret=b"not the cluster's secret" * 2)
    good = keys.token("carol")
    with caplog.at_level(logging.DEBUG), ConnectionPool() as pool:
        _client(cluster, good, pool).list_streams()
        with pytest.raises(UnauthenticatedError):
            _client(cluster, forged, pool).list_streams()
        assert good not in repr(ClientConfig(token=good))
    text = caplog.text
    assert "failed to authenticate" in text  # the refusal is logged, with its reason
    for secret in (good, forged, keys.secret.decode()):
        assert secret not in text


def test_an_open_server_answers_authenticate_with_no_principal(tmp_path):
    with EmbeddedCluster(tmp_path, range_servers=1) as cluster:
        answer = _authenticate_raw(cluster.pd_address, "token", b"anything")
        assert isinstance(answer, AuthenticateResponse) and answer.principal == ""
        conn = Connection(cluster.pd_address, ClientConfig(token="anything"))
        try:
            assert conn.principal == ""
        finally:
            conn.close()


def test_rs256_tokens(tmp_path, keys):
    server_token = tmp_path / "server.token"
    server_token.write_text(create_token("rs", private_key=keys.private_pem, role="server"))
    auth = AuthSettings(token_public_key_file=str(keys.public_file),
                        server_token_file=str(server_token), superusers=frozenset({"dave"}))
    with EmbeddedCluster(tmp_path / "c", range_servers=1, auth=auth) as cluster, \
            ConnectionPool() as pool:
        client = _client(cluster, keys.rs_token("dave"), pool)
        [stream] = client.create_streams(1)
        client.append(stream.stream_id, [batch_bytes(b"signed")])
        with pytest.raises(UnauthenticatedError, match="not signed with RS256"):
            _client(cluster, keys.token("eve"), pool).list_streams()


def test_a_public_key_cluster_needs_a_server_token(tmp_path, keys):
    with pytest.raises(ValueError, match="--server-token"):
        AuthSettings(token_public_key_file=str(keys.public_file)).server_token()


def test_client_certificates_authenticate_under_mutual_tls(tmp_path, certs, keys):
    # The servers' own certificate (CN node) is a superuser, so a server too.
    auth = AuthSettings(token_secret_file=str(keys.secret_file), certificates=True,
                        superusers=frozenset({"node", "client"}))
    config = ClientConfig(tls=True, tls_ca_file=certs.ca, tls_cert_file=certs.client_cert,
                          tls_key_file=certs.client_key)
    with EmbeddedCluster(tmp_path, range_servers=2, tls=certs.server_tls(), auth=auth) as c, \
            ConnectionPool(config) as pool:
        client = SbpClient(c.pd_address, config, pool)
        [stream] = client.create_streams(1, replicas=2)  # no AUTHENTICATE: the certificate
        client.append(stream.stream_id, [batch_bytes(b"by certificate")])
        names = {conn.principal.name for conn in c.pd._server.connections()
                 if conn.principal is not None}
        assert "client" in names  # the certificate's CN
