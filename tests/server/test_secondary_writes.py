"""Client appends sent to a secondary of a replicated range, on a real cluster.

Only the range's primary gives out offsets. A secondary stores batches only from the primary's
forwards, which name their range; a client's APPEND reaching a secondary is refused with
NOT_PRIMARY, even when its batches already carry a base offset, or the secondary would hold
data at an offset the primary gives to other records.
"""

from __future__ import annotations

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, RangeServerClient, SbpClient
from sbp_spark.protocol.errors import ErrorCode
from sbp_spark.protocol.records import ENVELOPE_SIZE, batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster
from tests.polling import wait_until as poll

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retry_backoff_ms=5,
                      retry_backoff_max_ms=100, retry_deadline_s=20)


@pytest.fixture
def cluster(tmp_path):
    with EmbeddedCluster(tmp_path, range_servers=3) as c:
        yield c


@pytest.fixture
def pool():
    with ConnectionPool(CONFIG) as p:
        yield p


def stored_batches(pool: ConnectionPool, address: str, stream_id: int) -> list[bytes]:
    """Every batch of ``stream_id`` the range server at ``address`` lets readers see."""
    return [bytes(view) for _, view in
            RangeServerClient(address, CONFIG, pool).fetch(stream_id, 0)]


@pytest.mark.parametrize("base_offset", [0, 3, -1])
def test_a_client_append_to_a_secondary_is_refused_whatever_its_base_offset(
        cluster, pool, base_offset):
    client = SbpClient(cluster.pd_address, CONFIG, pool)
    sid = client.create_streams(1, replicas=3)[0].stream_id
    [rng] = client.list_ranges(sid)
    primary = next(r.server for r in rng.servers if r.is_primary)
    secondaries = [r.server for r in rng.servers if not r.is_primary]
    assert len(secondaries) == 2
    local = {cluster.server_id(i): cluster.range_servers[i] for i in range(3)}

    for secondary in secondaries:
        rogue = RangeServerClient(secondary.advertise_addr, CONFIG, pool)
        [result] = rogue.append([(sid, batch_bytes(b"rogue", base_offset=base_offset))])
        assert result.status.code == ErrorCode.NOT_PRIMARY, result.status
        assert primary.advertise_addr in result.status.message
        stored = local[secondary.server_id].storage.get_range(sid, 0)
        assert stored.written_offset == 0, "the secondary stored the refused batch"

    # The stream is unharmed: a writer going through the primary lands on every replica alike.
    appended = client.append(sid, [batch_bytes(b"one"), batch_bytes(b"two")])
    assert [a.base_offset for a in appended] == [0, 1]
    on_primary = stored_batches(pool, primary.advertise_addr, sid)
    assert [b[ENVELOPE_SIZE:] for b in on_primary] == [b"one", b"two"]
    for secondary in secondaries:
        poll(lambda s=secondary: stored_batches(pool, s.advertise_addr, sid) == on_primary,
             f"secondary {secondary.server_id} to serve what the primary holds")
