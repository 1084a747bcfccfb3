"""Range servers enforce APPEND and FETCH themselves with the permissions they learn from the
PD (issue 44 items 2 and 3): a revocation stops new requests within seconds, and a FETCH
waiting at the tail too; only servers may act as servers."""

from __future__ import annotations

import threading
import time

import pytest

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import ErrorCode, PermissionDeniedError
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster
from tests.polling import wait_until

from ..wire import RawPeer


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, keys):
    auth = keys.settings()
    with EmbeddedCluster(tmp_path_factory.mktemp("rs-auth"), range_servers=2,
                         auth=auth) as c:
        yield c


def _enforced(cluster, version_before: int) -> None:
    """Wait until every range server holds permissions newer than ``version_before``."""
    def learned() -> bool:
        return all(rs.permissions is not None and rs.permissions.table().version > version_before
                   for rs in cluster.range_servers if rs is not None)
    wait_until(learned, "the range servers to learn the permissions", 10)


def _grant(as_, cluster, *permissions: m.Permission) -> None:
    version = as_("root").pd.grant_permissions(list(permissions))
    _enforced(cluster, version - 1)


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def _authenticated(address: str, token: str) -> RawPeer:
    peer = RawPeer(_address(address))
    answer, _ = peer.call(m.AuthenticateRequest("token", token.encode()))
    assert isinstance(answer, m.AuthenticateResponse), answer
    return peer


def test_range_servers_check_append_and_fetch_themselves(as_, cluster, keys):
    [stream] = as_("root").create_streams(1, replicas=2)
    sid = str(stream.stream_id)
    _grant(as_, cluster, m.Permission("writer", "write", sid),
           m.Permission("reader", "read", sid))
    as_("writer").append(stream.stream_id, [batch_bytes(b"one")])
    assert len(list(as_("reader").read(stream.stream_id))) == 1
    with pytest.raises(PermissionDeniedError, match="'writer' may not FETCH"):
        list(as_("writer").read(stream.stream_id))
    # Straight to the primary's port, skipping the client: refused there as well.
    [rng] = as_("root").list_ranges(stream.stream_id)
    with _authenticated(rng.primary.advertise_addr, keys.token("reader")) as peer:
        payload = batch_bytes(b"sneaky")
        request = m.AppendRequest(append_requests=[m.AppendEntry(stream.stream_id, 0,
                                                                 len(payload))])
        answer, _ = peer.call(request, payload)
        assert isinstance(answer, m.SystemError)
        assert answer.status.code == ErrorCode.PERMISSION_DENIED
        assert "principal 'reader' may not APPEND on stream" in answer.status.message
        assert "'write' permission" in answer.status.message


def test_a_revocation_ends_a_fetch_waiting_at_the_tail(as_, cluster):
    [stream] = as_("root").create_streams(1)
    _grant(as_, cluster, m.Permission("tailer", "read", str(stream.stream_id)))
    [rng] = as_("root").list_ranges(stream.stream_id)
    tailer = as_("tailer").range_server(rng.primary.advertise_addr)
    outcome: list[BaseException | None] = []
    waiting = threading.Event()

    def tail() -> None:
        waiting.set()
        try:
            tailer.wait_for_records([(stream.stream_id, 0)], max_wait_ms=30_000)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            outcome.append(exc)

    thread = threading.Thread(target=tail, daemon=True)
    thread.start()
    waiting.wait(5)
    time.sleep(0.3)  # the FETCH is in its long poll
    began = time.monotonic()
    as_("root").pd.revoke_permissions([m.Permission("tailer", "read", str(stream.stream_id))])
    thread.join(15)
    assert outcome and isinstance(outcome[0], PermissionDeniedError), outcome
    assert time.monotonic() - began < 5, "the revocation took too long to reach the tail"
    assert "may not FETCH" in str(outcome[0])


def test_a_client_cannot_pose_as_a_range_server(cluster, keys):
    rs_address = cluster.range_server_addresses[0]
    fake = m.RangeServer(99, "127.0.0.1:1")
    for address, request in (
            (cluster.pd_address, m.HeartbeatRequest("fake", m.ClientRole.RANGE_SERVER, fake)),
            (cluster.pd_address, m.AllocateIdRequest(host="fake")),
            (cluster.pd_address, m.ReportMetricsRequest(range_server=fake)),
            (cluster.pd_address, m.ListRangesRequest(range_owners=[
                m.RangeOwner(range_server=fake)])),
            (rs_address, m.SyncRangesRequest(stream_ranges=[m.StreamRanges(1, [])])),
            (rs_address, m.SealRangesRequest(ranges=[m.RangeId(1, 0)])),
            (rs_address, m.TrimStreamsRequest(trimmed_streams=[m.TrimmedStream(1, 0)])),
            (rs_address, m.DeleteStreamsRequest(streams=[m.Stream(1)])),
            (rs_address, m.AppendRequest(append_requests=[], range_index=0,
                                         cap_notice=m.RangeId(1, 0)))):
        with _authenticated(address, keys.token("mallory")) as peer:
            answer, _ = peer.call(request)
        assert isinstance(answer, m.SystemError), (request, answer)
        assert answer.status.code == ErrorCode.PERMISSION_DENIED, answer
        assert "only a principal with the server role may" in answer.status.message
    # A server token does what a range server does: its heartbeat is taken.
    with _authenticated(cluster.pd_address, keys.token("rs", role="server")) as peer:
        answer, _ = peer.call(m.HeartbeatRequest("c", m.ClientRole.CLIENT))
        assert answer.status.code == ErrorCode.NONE and answer.acl_version == -1


def test_a_grant_by_name_reaches_the_range_servers_when_the_stream_is_made(as_, cluster):
    root = as_("root")
    root.pd.grant_permissions([m.Permission("named", "read", "made-later")])
    stream = root.create_stream("made-later")  # after the grant: its id is new to everyone
    root.append(stream.stream_id, [batch_bytes(b"by name")])
    named = as_("named")

    def reads() -> bool:
        try:
            return len(list(named.read("made-later"))) == 1
        except PermissionDeniedError:
            return False

    # The PD's announced version changes with the stream the name names: the range server
    # fetches the permissions again and matches the grant by the id it learns with them.
    wait_until(reads, "the grant by name to reach the range server", 10)
