"""A PD cluster on etcd enforces the same permissions on every node, before and after a leader
change (issue 44 item 6): the permissions live in etcd, not in a node."""

from __future__ import annotations

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import NotEnoughServersError, PermissionDeniedError
from sbp_spark.server.auth.principals import Principal
from sbp_spark.server.pd import PdConfig, PlacementDriver
from tests.polling import wait_until

from .keys import Keys

CONFIG = ClientConfig(connect_timeout_s=1.0, request_timeout_s=5.0, retry_backoff_ms=20,
                      retry_backoff_max_ms=200, retry_deadline_s=20)


@pytest.fixture
def nodes(etcd_endpoints, etcd_prefix, tmp_path):
    keys = Keys(tmp_path / "keys")
    auth = keys.settings()
    started = [PlacementDriver(PdConfig(None, name=f"pd-{i}", etcd=etcd_endpoints,
                                        etcd_prefix=etcd_prefix, lease_ttl_s=2,
                                        heartbeat_timeout_s=1.0, auth=auth)).start()
               for i in range(3)]
    yield keys, started
    for node in started:
        if node is not None:
            node.stop()


def _passes(client: SbpClient) -> None:
    """The create passes the permission check (and, with no range server here, goes no
    further: NOT_ENOUGH_SERVERS comes after the check)."""
    with pytest.raises(NotEnoughServersError):
        client.create_streams(1)


def _leader(nodes):
    wait_until(lambda: sum(n.office.is_leader() for n in nodes if n is not None) == 1,
               "exactly one PD node to lead", 15)
    return next(n for n in nodes if n is not None and n.office.is_leader())


def test_follower_and_leader_enforce_the_same_permissions_after_a_leader_change(nodes):
    keys, started = nodes
    leader = _leader(started)
    pd = ",".join(n.address for n in started)
    with ConnectionPool() as pool:
        root = SbpClient(pd, CONFIG, pool, token=keys.token("root"))
        root.pd.grant_permissions([m.Permission("maker", "create")])
        maker = SbpClient(pd, CONFIG, pool, token=keys.token("maker"))
        stranger = SbpClient(pd, CONFIG, pool, token=keys.token("stranger"))
        _passes(maker)
        # Every node, follower or leader, checks against what etcd holds.
        for node in started:
            authorizer = node._server.handler.authorizer
            wait_until(lambda a=authorizer: a.version >= 1, f"{node.config.name} to read it", 5)
            authorizer.authorize(Principal("maker"), m.CreateStreamsRequest.OPCODE,
                                 m.CreateStreamsRequest())
            with pytest.raises(PermissionDeniedError):
                authorizer.authorize(Principal("stranger"), m.CreateStreamsRequest.OPCODE,
                                     m.CreateStreamsRequest())
        # The leader goes; the new one enforces the old leader's grants from its first request.
        leader.stop()
        started[started.index(leader)] = None
        survivors = [n for n in started if n is not None]
        new_leader = _leader(survivors)
        assert new_leader is not leader
        _passes(maker)
        with pytest.raises(PermissionDeniedError, match="principal 'stranger' may not"):
            stranger.create_streams(1)
        # A revocation through the new leader holds on the follower too.
        root.pd.revoke_permissions([m.Permission("maker", "create")])
        with pytest.raises(PermissionDeniedError):
            maker.create_streams(1)
        follower = next(n for n in survivors if n is not new_leader)
        wait_until(lambda: not follower._server.handler.authorizer._acl().allows("maker",
                                                                                 "create"),
                   "the follower to see the revocation", 5)
