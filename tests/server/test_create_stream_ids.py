"""CREATE_STREAMS asking for an id that a stream has or had, on a real cluster.

Such an id is refused with STREAM_ALREADY_EXISTS at once, before the PD looks for servers to
place the stream on: neither too few live range servers nor a PD still waiting to hear from
its servers turns that refusal into NOT_ENOUGH_SERVERS.
"""

from __future__ import annotations

import time

import pytest

from sbp_spark.client.connection import Connection
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.server.cluster import EmbeddedCluster
from tests.polling import wait_until as poll

# Heartbeats every 2 s: a PD that just took office waits up to 3 intervals for its servers.
HEARTBEAT_S = 2.0
# A refusal that took less than this did not wait for servers.
PROMPT_S = 2.0


def create(pd: Connection, stream_id: int = -1, replicas: int = 1) -> m.CreateStreamsResult:
    response, _ = pd.call(m.CreateStreamsRequest(streams=[
        m.Stream(stream_id=stream_id, replica_nums=replicas)]))
    assert response.status.ok, response.status
    [result] = response.create_responses
    return result


def refused_at_once(pd: Connection, stream_id: int, replicas: int) -> m.Status:
    began = time.monotonic()
    result = create(pd, stream_id, replicas)
    took = time.monotonic() - began
    assert result.status.code == ErrorCode.STREAM_ALREADY_EXISTS, result.status
    assert took < PROMPT_S, f"the refusal waited {took:.1f} s for range servers"
    return result.status


@pytest.fixture
def cluster(tmp_path):
    with EmbeddedCluster(tmp_path, range_servers=2, heartbeat_interval_s=HEARTBEAT_S) as c:
        yield c


@pytest.fixture
def pd(cluster):
    with Connection(cluster.pd_address) as conn:
        yield conn


def test_a_used_id_is_refused_however_few_servers_are_live(cluster, pd):
    used = create(pd, replicas=2)
    assert used.status.ok, used.status
    sid = used.stream.stream_id
    # Three replicas on two servers could never be placed: the id is what is wrong.
    assert "exists" in refused_at_once(pd, sid, 3).message
    cluster.stop_range_server(1)
    assert "exists" in refused_at_once(pd, sid, 2).message
    cluster.stop_range_server(0)  # no range server left
    assert "exists" in refused_at_once(pd, sid, 1).message
    driver = cluster.pd
    assert driver is not None
    poll(lambda: not driver.liveness.live(), "the PD to count the stopped servers out",
         timeout=10 * HEARTBEAT_S)
    assert "exists" in refused_at_once(pd, sid, 1).message
    # A free id with too few servers is still NOT_ENOUGH_SERVERS.
    fresh = create(pd, sid + 100, 1)
    assert fresh.status.code == ErrorCode.NOT_ENOUGH_SERVERS, fresh.status


def test_a_deleted_id_is_refused_however_few_servers_are_live(cluster, pd):
    sid = create(pd).stream.stream_id
    response, _ = pd.call(m.DeleteStreamsRequest(streams=[m.Stream(stream_id=sid)]))
    assert response.delete_responses[0].status.ok
    assert "deleted" in refused_at_once(pd, sid, 3).message
    cluster.stop_range_server(0)
    cluster.stop_range_server(1)
    assert "deleted" in refused_at_once(pd, sid, 1).message


def test_a_pd_that_just_took_office_refuses_a_used_id_without_waiting(cluster, pd):
    sid = create(pd).stream.stream_id
    cluster.stop_range_server(1)
    driver = cluster.pd
    assert driver is not None
    # As after a PD failover: the new leader has heard from no server yet, and waits for
    # those it knows before it places replicas; server 1 will never come back.
    driver.liveness.clear()
    assert "exists" in refused_at_once(pd, sid, 2).message
    # Placement itself still waits for the servers it knows, and then counts them out.
    poll(lambda: driver.liveness.is_live(cluster.server_id(0)), "server 0's next heartbeat")
    fresh = create(pd, sid + 100, 2)
    assert fresh.status.code == ErrorCode.NOT_ENOUGH_SERVERS, fresh.status
