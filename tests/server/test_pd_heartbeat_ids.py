"""The PD takes heartbeats only from range server ids it issued, including after a restart."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.client.connection import Connection
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import ErrorCode, NotEnoughServersError
from sbp_spark.protocol.records import ENVELOPE_SIZE, encode_batch
from sbp_spark.server.pd import PdConfig, PlacementDriver
from sbp_spark.server.pd.meta import UNKNOWN_SERVER_ID
from sbp_spark.server.range_server import RangeServer, RangeServerConfig
from sbp_spark.server.storage import StorageConfig
from tests.polling import wait_until


def pd_config(tmp_path, port: int = 0) -> PdConfig:
    return PdConfig(data_dir=tmp_path / "pd", port=port, heartbeat_timeout_s=1.0, fsync=False)


@pytest.fixture
def pd(tmp_path) -> Iterator[PlacementDriver]:
    node = PlacementDriver(pd_config(tmp_path)).start()
    yield node
    node.stop()


def rs_config(tmp_path, pd_address: str, name: str = "rs", server_id: int = -1
              ) -> RangeServerConfig:
    return RangeServerConfig(data_dir=str(tmp_path / name), pd_addresses=[pd_address],
                             server_id=server_id, storage=StorageConfig(fsync="never"),
                             heartbeat_interval_s=0.1, metrics_interval_s=0.2)


def heartbeat(address: str, server_id: int, advertise: str = "127.0.0.1:9") -> m.Status:
    with Connection(address) as conn:
        response, _ = conn.call(m.HeartbeatRequest(
            client_id=f"rs-{server_id}", client_role=m.ClientRole.RANGE_SERVER,
            range_server=m.RangeServer(server_id, advertise)))
    return response.status


def test_a_heartbeat_with_an_id_never_issued_is_refused(pd):
    with Connection(pd.address) as conn:
        issued, _ = conn.call(m.AllocateIdRequest(host="test"))
    status = heartbeat(pd.address, issued.id + 41)
    assert status.code == ErrorCode.INVALID_REQUEST
    assert f"id {issued.id + 41} " in status.message and "never issued" in status.message
    assert bytes(status.detail) == UNKNOWN_SERVER_ID
    assert not pd.liveness.is_live(issued.id + 41)
    assert [s.server.server_id for s in pd.servers.states()] == []
    # It takes no ranges: no live server at all.
    with pytest.raises(NotEnoughServersError):
        pd.streams.create()
    # The id the PD did issue is welcome.
    assert heartbeat(pd.address, issued.id).ok
    assert pd.liveness.is_live(issued.id)


def test_a_range_server_with_a_foreign_id_is_told_what_to_do(tmp_path, pd, caplog):
    caplog.set_level(logging.ERROR, logger="sbp_spark.server.range_server.registration")
    with RangeServer(rs_config(tmp_path, pd.address, server_id=77)) as rs:
        link = rs.pd_link
        assert link is not None
        wait_until(lambda: link.refusal is not None, "the PD to refuse the id")
        # The refusal is for good: the link stops (no heartbeat every interval to be refused
        # again), and says once what to do.
        link._thread.join(5)
        assert not link._thread.is_alive()
        errors = [r.getMessage() for r in caplog.records if "never issued" in r.getMessage()]
        assert errors == [str(link.refusal)]
        assert "77" in errors[0] and "server.json" in errors[0] and str(tmp_path / "rs") in \
            errors[0] and "empty --data-dir" in errors[0]
        assert link.heartbeats == 0 and rs.server_id == 77
        assert not pd.liveness.is_live(77)


def test_issued_ids_still_work_after_a_pd_restart(tmp_path):
    first = PlacementDriver(pd_config(tmp_path)).start()
    port = int(first.bound_address.rsplit(":", 1)[1])
    address = first.address
    restarted: PlacementDriver | None = None
    try:
        with RangeServer(rs_config(tmp_path, address)) as rs, ConnectionPool() as pool:
            wait_until(lambda: rs.server_id >= 0 and first.liveness.is_live(rs.server_id),
                       "registration")
            server_id = rs.server_id
            client = SbpClient(address, pool=pool)
            (stream,) = client.create_streams()
            client.append(stream.stream_id, [encode_batch(b"before")])
            first.stop()
            restarted = PlacementDriver(pd_config(tmp_path, port)).start()
            node = restarted
            # The new PD process knows the id from its store: the same server is live again.
            beats = rs.pd_link.heartbeats
            wait_until(lambda: node.liveness.is_live(server_id) and
                       rs.pd_link.heartbeats > beats + 1, "heartbeats to the restarted PD")
            assert rs.pd_link.refusal is None and rs.server_id == server_id
            client.append(stream.stream_id, [encode_batch(b"after")])
            assert [bytes(b.data[ENVELOPE_SIZE:]) for b in client.read(stream.stream_id)] == [
                b"before", b"after"]
            # A second server registering now gets a fresh id, not the first one's.
            with RangeServer(rs_config(tmp_path, address, name="rs2")) as other:
                wait_until(lambda: other.server_id >= 0 and node.liveness.is_live(
                    other.server_id), "the second server's registration")
                assert other.server_id != server_id
    finally:
        first.stop()
        if restarted is not None:
            restarted.stop()
