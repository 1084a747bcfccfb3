"""The etcd client's way round its members (server/etcd_client.py), against small fake HTTP
gateways on loopback: members that are dead, that time out, or that answer they have no leader
while an election runs."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sbp_spark.server.etcd_client import EtcdClient, EtcdUnavailable

# What etcd's gateway answers while its member has no leader (gRPC UNAVAILABLE).
_LEADER_CHANGED = (503, {"code": 14, "message": "etcdserver: leader changed"})
_EMPTY_RANGE = (200, {"header": {"revision": "7"}, "count": "0"})


class FakeMember:
    """An etcd gateway whose answers come from ``answers`` in turn (the last one repeats)."""

    def __init__(self, answers: list[tuple[int, dict]]) -> None:
        self.answers = list(answers)
        self.requests: list[str] = []
        member = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server convention)
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                member.requests.append(self.path)
                status, body = (member.answers.pop(0) if len(member.answers) > 1
                                else member.answers[0])
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def members() -> Iterator[list[FakeMember]]:
    made: list[FakeMember] = []
    yield made
    for m in made:
        m.close()


def _dead_endpoint() -> str:
    """A loopback port nobody listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_request_rides_out_an_election_among_the_survivors(members):
    # The member the client used is dead; the two others say "leader changed" twice each
    # before one of them serves: one round would have failed, as a PD did in the fault suite.
    members += [FakeMember([_LEADER_CHANGED, _LEADER_CHANGED, _EMPTY_RANGE]) for _ in range(2)]
    client = EtcdClient([_dead_endpoint()] + [m.endpoint for m in members], timeout_s=1.0)
    try:
        kvs, revision = client.range(b"/sbp/")
        assert (kvs, revision) == ([], 7)
        assert sum(len(m.requests) for m in members) >= 3
    finally:
        client.close()


def test_a_request_gives_up_after_its_retry_budget(members):
    members.append(FakeMember([_LEADER_CHANGED]))
    client = EtcdClient([_dead_endpoint(), members[0].endpoint], timeout_s=1.0, retry_s=0.3)
    try:
        with pytest.raises(EtcdUnavailable, match="leader changed"):
            client.range(b"/sbp/")
        assert len(members[0].requests) >= 2  # went round more than once
    finally:
        client.close()


def test_a_request_with_its_own_timeout_is_bounded_by_it(members):
    # What a lease keep-alive does: its timeout bounds the whole request, not each try.
    members.append(FakeMember([_LEADER_CHANGED]))
    client = EtcdClient([members[0].endpoint], timeout_s=1.0, retry_s=3600)
    try:
        with pytest.raises(EtcdUnavailable):
            client.post("/v3/kv/range", {"key": ""}, timeout_s=0.2)
    finally:
        client.close()


def test_a_refusal_that_another_member_would_repeat_is_not_retried(members):
    members.append(FakeMember([(400, {"code": 3, "message": "etcdserver: key is not provided"})]))
    client = EtcdClient([members[0].endpoint], retry_s=3600)
    try:
        with pytest.raises(Exception, match="key is not provided"):
            client.range(b"/sbp/")
        assert len(members[0].requests) == 1
    finally:
        client.close()


def test_retry_budget_must_not_be_negative():
    with pytest.raises(ValueError, match="retry_s"):
        EtcdClient(["127.0.0.1:1"], retry_s=-1)
